// The weight formats the kernel A/B programs (ab.cpp, rows.cpp) build random matrices in: block
// elements, bytes, and where each block keeps its float16 scale (and min), set to small values.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <random>
#include <vector>

#include "kernels.h"

struct Fmt { const char* name; int qt, be, bb; std::vector<int> halves; };
static Fmt FMTS[] = {
  {"Q4_0", T_Q4_0, 32, 18, {0}}, {"Q4_1", T_Q4_1, 32, 20, {0, 2}}, {"Q8_0", T_Q8_0, 32, 34, {0}},
  {"Q5_0", T_Q5_0, 32, 22, {0}}, {"Q5_1", T_Q5_1, 32, 24, {0, 2}}, {"Q4_K", T_Q4_K, 256, 144, {0, 2}},
  {"Q5_K", T_Q5_K, 256, 176, {0, 2}}, {"Q6_K", T_Q6_K, 256, 210, {208}}};
static std::mt19937 rng(1);

// The two trees' kernel tables (run.sh / rows.sh / gbs.sh compile them as kvlm_old and kvlm_new).
extern "C" const KvlmKernels* kvlm_old(void);
extern "C" const KvlmKernels* kvlm_new(void);

// Seconds of the process's CPU time (all threads): on a shared machine the scheduler's slices count less.
static double cpu_s() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
__attribute__((target("f16c"))) static uint16_t half(float f) { return _cvtss_sh(f, 0); }
static std::vector<uint8_t> make_w(const Fmt& f, int64_t N, int64_t K) {
  int64_t rs = K / f.be * f.bb; std::vector<uint8_t> w(N * rs + 64);
  for (auto& b : w) b = rng();
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (int64_t n = 0; n < N; n++) for (int64_t b = 0; b < K / f.be; b++) for (int h : f.halves) {
    uint16_t v = half(u(rng)); memcpy(&w[n * rs + b * f.bb + h], &v, 2); }
  return w;
}
