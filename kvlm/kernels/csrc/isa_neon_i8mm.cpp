// ARM NEON with the int8 matrix-multiply extension (smmla: ARMv8.6+, Apple M2+, Graviton 3+, Neoverse
// N2/V1+): the int8 kernels' prefill tiles (2 rows of x times 2 weight rows per smmla) on top of the
// dotprod unit (sdot for single rows of x). ops.cpp picks it where Linux reports HWCAP2_I8MM (macOS:
// sysctl hw.optional.arm.FEAT_I8MM). Empty elsewhere.
#if defined(__aarch64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod,i8mm"))), apply_to = function)
#else
#pragma GCC target("+dotprod+i8mm")
#endif
#define KVLM_ISA_FN kvlm_kernels_neon_i8mm
#define KVLM_NEON 1
#define KVLM_DOTPROD 1  // a target pragma need not define __ARM_FEATURE_DOTPROD / __ARM_FEATURE_MATMUL_INT8
#define KVLM_I8MM 1
#include "kernels_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
