// ARM NEON with the dot-product extension (sdot: ARMv8.2+, Apple M1+, Graviton 2+, Ampere Altra):
// the int8 kernels' integer sums on sdot. ops.cpp picks it when the CPU reports asimddp. Empty elsewhere.
#if defined(__aarch64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC target("+dotprod")
#endif
#define KVLM_ISA_FN kvlm_kernels_neon_dotprod
#define KVLM_NEON 1
#define KVLM_DOTPROD 1  // a target pragma need not define __ARM_FEATURE_DOTPROD
#include "kernels_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
