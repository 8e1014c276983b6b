// Kernel A/B per number of rows: two trees' int8 `gemv_i8` in one process, for M = each of a list, timed
// alternately (ROUNDS x 0.25 s of CPU time each, median), so a shared machine's load hits both alike.
// Time is the process's CPU time (CLOCK_PROCESS_CPUTIME_ID), not wall time: on a machine shared with other
// jobs the scheduler's slices then count less (caches shared with them still do). With THREADS > 1 it
// includes OpenMP's waits. Built and driven by rows.sh; prints one line per (M, tree, round):
//   old|new FMT N K M th cold|hot ms
// cold rotates over ~256 MB of weight copies (decode reads weights from memory); hot reuses one matrix.
// Threads split the output columns in 16-column panels, as ops.cpp does. Also checks that every M gives
// each row the bits of M = 1 (both trees), and that old and new agree bit for bit.
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <random>
#include <vector>

#include <immintrin.h>

#include "formats.h"

int main(int argc, char** argv) {
    if (argc < 7) { fprintf(stderr, "usage: rows FMT N K THREADS HOT ROUNDS M...\n"); return 2; }
    const KvlmKernels *O = kvlm_old(), *Nw = kvlm_new();
    const int64_t N = atol(argv[2]), K = atol(argv[3]);
    const int th = atoi(argv[4]), hot = atoi(argv[5]), rounds = atoi(argv[6]);
    std::vector<int64_t> Ms;
    for (int i = 7; i < argc; i++) Ms.push_back(atol(argv[i]));
    Fmt* f = nullptr;
    for (auto& g : FMTS) if (!strcmp(g.name, argv[1])) f = &g;
    if (!f || Ms.empty()) { fprintf(stderr, "unknown format %s or no M\n", argv[1]); return 2; }
    const int64_t rs = K / f->be * f->bb, bytes = N * rs, nb = K / 32;
    const std::vector<uint8_t> w0 = make_w(*f, N, K);
    const int copies = hot ? 1 : (int)std::max<int64_t>(2, (256ll << 20) / bytes);
    std::vector<std::vector<uint8_t>> ws(copies, w0);
    const int64_t MX = *std::max_element(Ms.begin(), Ms.end());
    std::vector<float> x(MX * K);
    std::normal_distribution<float> nd(0, 1);
    for (auto& v : x) v = nd(rng);
    std::vector<int8_t> q(MX * K);
    std::vector<float> d(8 * MX * nb), s(MX * nb);
    std::vector<int32_t> qi(MX * nb);
    O->quantize_act(x.data(), MX, K, q.data(), d.data(), s.data(), qi.data());
    omp_set_num_threads(th);
    const int64_t panels = (N + 15) / 16;
    auto call = [&](const KvlmKernels* t, const uint8_t* w, int64_t M, float* y) {
#pragma omp parallel for schedule(static)
        for (int p = 0; p < th; p++) {
            const int64_t p0 = panels * p / th, p1 = panels * (p + 1) / th;
            t->gemv_i8(f->qt, w, rs, K, q.data(), d.data(), s.data(), qi.data(), M, y, N, 16 * p0, std::min(N, 16 * p1));
        }
    };
    // Bits: each M's rows against M = 1 row by row, old and new.
    std::vector<float> y1(MX * N), ym(MX * N);
    for (int64_t m = 0; m < MX; m++)
        O->gemv_i8(f->qt, w0.data(), rs, K, q.data() + m * K, d.data() + 8 * m * nb, s.data() + m * nb, qi.data() + m * nb,
                   1, y1.data() + m * N, N, 0, N);
    for (int64_t M : Ms)
        for (const KvlmKernels* t : {O, Nw}) {
            call(t, w0.data(), M, ym.data());
            if (memcmp(y1.data(), ym.data(), 4 * M * N)) {
                printf("MISMATCH %s M=%ld\n", t == O ? "old" : "new", (long)M);
                return 1;
            }
        }
    std::vector<float> y(MX * N);
    for (int r = 0; r < rounds; r++)
        for (int64_t M : Ms)
            for (int which = 0; which < 2; which++) {
                const KvlmKernels* t = (which ^ (r & 1)) ? Nw : O;
                int iters = 0;
                double t0 = cpu_s(), el;
                do {
                    call(t, ws[iters % copies].data(), M, y.data());
                    iters++;
                    el = cpu_s() - t0;
                } while (el < 0.25);
                printf("%s %s %ld %ld %ld %d %s %.4f\n", t == Nw ? "new" : "old", f->name, (long)N, (long)K, (long)M, th,
                       hot ? "hot" : "cold", el / iters * 1e3 / th);
            }
}
