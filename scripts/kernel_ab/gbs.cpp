// Decode kernel A/B in GB/s: two trees' int8 `gemv_i8` at M rows of x (decode: M = 1), in one process,
// alternating which tree runs first each round, so a shared machine's load hits both alike. Built and driven
// by gbs.sh; prints, per case, one line per round and side:
//   old|new FMT NxK M=.. th=.. cold|hot: MS ms  GB/s (wall)  GB/s per core (process CPU time)
// and the machine's read and copy bandwidth at this thread count (copy counts each byte read and written,
// as `kvlm bench latency` does). GB/s are weight bytes over the call's time. cold rotates over >= 512 MiB of
// weight copies (decode reads weights from memory); hot reuses one matrix. Threads split the output columns
// in 16-column panels, as ops.cpp does. Exits 1 (MISMATCH) if the trees' outputs differ in any bit.
// KVLM_AB_PAGES=huge: the new side reads copies of the weights in 2 MiB pages (the old side 4 KiB ones), and the
// bandwidth passes run in 2 MiB pages; with OLD = this tree's revision it measures the pages alone.
// FMT Q4_K/P: the new tree reads the weights packed in 16-row panels (kvlm/kernels/panels.py's bytes, the
// type's PANELS16 flag), the old one the file's layout: the same bits are expected. Q4_K/PP: both on panels.
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <random>
#include <vector>

#include "formats.h"  // the weight formats, both trees' tables, cpu_s()

static bool g_huge = false;  // KVLM_AB_PAGES=huge: the new side's weights and the bandwidth passes in 2 MiB pages

// bytes of anonymous memory on a 2 MiB boundary, advised for transparent huge pages (Linux); not touched.
static uint8_t* huge_alloc(size_t bytes) {
  const size_t H = 2u << 20, n = (bytes + H - 1) / H * H;
  void* p = mmap(nullptr, n + H, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  uint8_t* q = (uint8_t*)(((uintptr_t)p + H - 1) / H * H);
  madvise(q, n, MADV_HUGEPAGE);
  return q;
}

static const uint8_t* huge_copy(const std::vector<uint8_t>& w) {
  uint8_t* q = huge_alloc(w.size());
  memcpy(q, w.data(), w.size());
  return q;
}

struct Act { std::vector<int8_t> q; std::vector<float> d, s; std::vector<int32_t> i; };

// Bytes/s of reading (sum of 32-byte loads) or copying 512 MiB with th threads, best of 5.
__attribute__((target("avx2"))) static double bandwidth(int th, bool copy) {
  const size_t n = (512ull << 20) / 32;
  static __m256i *src = nullptr, *dst = nullptr;
  if (src == nullptr) {  // once: 2 x 512 MiB, every page touched (page faults are not bandwidth)
    src = (__m256i*)(g_huge ? huge_alloc(n * 32) : aligned_alloc(64, n * 32));
    dst = (__m256i*)(g_huge ? huge_alloc(n * 32) : aligned_alloc(64, n * 32));
    memset(src, 1, n * 32), memset(dst, 0, n * 32);
  }
  double best = 1e9;
  long long sink = 0;
  for (int r = 0; r < 5; r++) {
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(th) reduction(+ : sink)
    {
      const size_t a = n * omp_get_thread_num() / th, b = n * (omp_get_thread_num() + 1) / th;
      __m256i s = _mm256_setzero_si256();
      if (copy)
        for (size_t i = a; i < b; i++) _mm256_store_si256(&dst[i], _mm256_load_si256(&src[i]));
      else
        for (size_t i = a; i < b; i++) s = _mm256_add_epi64(s, _mm256_load_si256(&src[i]));
      sink += _mm256_extract_epi64(s, 0);
    }
    best = std::min(best, omp_get_wtime() - t0);
  }
  if (sink == 42) puts("");
  return (copy ? 2.0 : 1.0) * n * 32 / best / 1e9;
}

int main(int argc, char** argv) {
  if (argc < 8) {
    fprintf(stderr, "usage: gbs ROUNDS THREADS HOT FMT N K M [FMT N K M ...]\n");
    return 2;
  }
  const KvlmKernels* T[2] = {kvlm_old(), kvlm_new()};
  const int rounds = atoi(argv[1]), th = atoi(argv[2]), hot = atoi(argv[3]);
  const char* pages = getenv("KVLM_AB_PAGES");  // "huge": the new side reads copies in 2 MiB pages
  const bool huge = g_huge = pages && !strcmp(pages, "huge");
  omp_set_num_threads(th);
  printf("bandwidth th=%d: read %.2f GB/s  copy %.2f GB/s\n", th, bandwidth(th, false), bandwidth(th, true));
  fflush(stdout);
  for (int c = 4; c + 3 < argc; c += 4) {
    const char* fn = argv[c];
    const int64_t N = atol(argv[c + 1]), K = atol(argv[c + 2]), M = atol(argv[c + 3]);
    const Fmt* f = nullptr;
    const bool both = !strcmp(fn, "Q4_K/PP"), packed = both || !strcmp(fn, "Q4_K/P");  // N a multiple of 16
    for (auto& g : FMTS)
      if (!strcmp(g.name, packed ? "Q4_K" : fn)) f = &g;
    if (!f) { fprintf(stderr, "unknown format %s\n", fn); return 2; }
    const int64_t rs = K / f->be * f->bb, bytes = N * rs, nb = K / 32;
    const int copies = hot ? 1 : (int)std::max<int64_t>(2, (512ll << 20) / bytes + 1);
    std::vector<std::vector<uint8_t>> ws;
    ws.push_back(make_w(*f, N, K));
    for (int i = 1; i < copies; i++) ws.push_back(ws[0]);  // same bytes, other addresses: still from memory
    std::vector<std::vector<uint8_t>> wp;  // Q4_K/P: each copy packed, (panel, row c, block, dword i) ->
    if (packed)                            // (panel, block, dword i, row c), 36 dwords a block
      for (auto& w : ws) {
        std::vector<uint8_t> o(w.size());
        const int64_t nbk = rs / 144;
        for (int64_t n = 0; n < N; n++)
          for (int64_t b = 0; b < nbk; b++)
            for (int i = 0; i < 36; i++)
              memcpy(&o[(n / 16 * 16) * rs + (b * 36 + i) * 64 + 4 * (n % 16)], &w[n * rs + b * 144 + 4 * i], 4);
        wp.push_back(std::move(o));
      }
    std::vector<const uint8_t*> wh;  // KVLM_AB_PAGES=huge: the new side's copies
    if (huge)
      for (auto& w : (packed ? wp : ws)) wh.push_back(huge_copy(w));
    std::vector<float> x(M * K);
    std::normal_distribution<float> nd(0, 1);
    for (auto& v : x) v = nd(rng);
    Act a;
    a.q.resize(M * K), a.d.resize(8 * M * nb), a.s.resize(M * nb), a.i.resize(M * nb);
    T[0]->quantize_act(x.data(), M, K, a.q.data(), a.d.data(), a.s.data(), a.i.data());
    std::vector<float> y[2] = {std::vector<float>(M * N), std::vector<float>(M * N)};
    const int64_t panels = (N + 15) / 16;
    for (int r = 0; r < rounds; r++)
      for (int k = 0; k < 2; k++) {
        const int side = (r + k) % 2;
        const KvlmKernels* t = T[side];
        int iters = 0;
        const double t0 = omp_get_wtime(), c0 = cpu_s();
        double el;
        do {
          const bool p16 = packed && (side == 1 || both);
          const uint8_t* w = huge && side == 1 ? wh[iters % copies] : (p16 ? wp : ws)[iters % copies].data();
#pragma omp parallel for schedule(static)
          for (int p = 0; p < th; p++) {
            const int64_t p0 = panels * p / th, p1 = panels * (p + 1) / th;
            t->gemv_i8(p16 ? f->qt | 0x100 : f->qt, w, rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y[side].data(), N,
                       16 * p0, std::min(N, 16 * p1));
          }
          iters++;
          el = omp_get_wtime() - t0;
        } while (el < 0.3);
        const double per = el / iters, cpu = (cpu_s() - c0) / iters;
        printf("%s %s %ldx%ld M=%ld th=%d %s: %.4f ms  %.2f GB/s  %.2f GB/s/core\n", side ? "new" : "old", fn,
               N, K, M, th, hot ? "hot" : "cold", per * 1e3, bytes / per / 1e9, bytes / cpu / 1e9);
        fflush(stdout);
      }
    if (memcmp(y[0].data(), y[1].data(), 4 * M * N) != 0) {
      printf("MISMATCH %s %ldx%ld M=%ld\n", f->name, N, K, M);
      return 1;
    }
  }
  return 0;
}
