// Kernel A/B: two trees' AVX2 int8 `gemv_i8` in one process, timed alternately (3 x 0.5 s each), so a
// shared machine's load hits both alike. Built and driven by run.sh; prints one line per run:
//   old|new FMT N=.. K=.. M=.. th=.. cold|hot: MS ms  GB/s
// cold rotates over ~400 MB of weight copies (decode reads weights from memory); hot reuses one matrix.
// Threads split the output columns in 16-column panels, as ops.cpp does. Both trees are called through this
// tree's `KvlmKernels` table (kernels.h): an OLD_REV whose table differs needs its own header here.
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <vector>
#include <chrono>
#include <random>
#include <omp.h>
#include <math.h>
#include <algorithm>
#include <immintrin.h>
#include "kernels.h"  // the current tree's (run.sh puts its csrc on the include path)
#include "formats.h"

struct Act { std::vector<int8_t> q; std::vector<float> d, s; std::vector<int32_t> i; };
static Act quant(const KvlmKernels* t, const std::vector<float>& x, int64_t M, int64_t K) {
  Act a; int64_t nb = K / 32; a.q.resize(M * K); a.d.resize(8 * M * nb); a.s.resize(M * nb); a.i.resize(M * nb);
  t->quantize_act(x.data(), M, K, a.q.data(), a.d.data(), a.s.data(), a.i.data()); return a;
}
static void run(const KvlmKernels* t, const Fmt& f, const uint8_t* w, int64_t K, int64_t N, const Act& a, int64_t M, float* y, int mode) {
  int64_t rs = K / f.be * f.bb;
  if (mode == 0) { t->gemv_i8(f.qt, w, rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y, N, 0, N); return; }
  for (int64_t p = 0; p < N; p += 16) t->gemv_i8(f.qt, w, rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y, N, p, std::min(N, p + 16));
}
int main(int argc, char** argv) {
  if (argc < 6) { fprintf(stderr, "usage: ab FMT N K M THREADS [HOT]\n"); return 2; }
  const KvlmKernels *O = kvlm_old(), *Nw = kvlm_new();
  const char* fn = argv[1]; int64_t N = atol(argv[2]), K = atol(argv[3]), M = atol(argv[4]); int th = atoi(argv[5]); int hot = argc > 6 && atoi(argv[6]);
  Fmt* f = nullptr; for (auto& g : FMTS) if (!strcmp(g.name, fn)) f = &g;
  if (!f) { fprintf(stderr, "unknown format %s\n", fn); return 2; }
  int64_t rs = K / f->be * f->bb, bytes = N * rs;
  int copies = hot ? 1 : std::max<int64_t>(2, (400ll << 20) / bytes);
  std::vector<std::vector<uint8_t>> ws; for (int c = 0; c < copies; c++) ws.push_back(make_w(*f, N, K));
  std::vector<float> x(M * K); std::normal_distribution<float> nd(0, 1); for (auto& v : x) v = nd(rng);
  Act a = quant(O, x, M, K);
  std::vector<float> y(M * N);
  omp_set_num_threads(th);
  for (int rep = 0; rep < 3; rep++) for (int which = 0; which < 2; which++) {
    const KvlmKernels* t = which ? Nw : O;
    int iters = 0; double t0 = omp_get_wtime(), el;
    do {
      const uint8_t* w = ws[iters % copies].data();
      int64_t panels = (N + 15) / 16;
      #pragma omp parallel for schedule(static)
      for (int p = 0; p < th; p++) {
        int64_t p0 = panels * p / th, p1 = panels * (p + 1) / th;
        t->gemv_i8(f->qt, w, rs, K, a.q.data(), a.d.data(), a.s.data(), a.i.data(), M, y.data(), N, 16 * p0, std::min(N, 16 * p1));
      }
      iters++; el = omp_get_wtime() - t0;
    } while (el < 0.5);
    double per = el / iters;
    printf("%s %s N=%ld K=%ld M=%ld th=%d %s: %.3f ms  %.2f GB/s\n", which == 2 ? "panel" : which ? "new" : "old", f->name, N, K, M, th, hot ? "hot" : "cold", per * 1e3, bytes / per / 1e9);
  }
}
