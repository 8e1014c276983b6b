// AVX-512 (F, BW, VL, DQ) with 512-bit vectors preferred.
#if defined(__x86_64__) || defined(__i386__)  // x86 only: elsewhere this unit is empty
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,prefer-vector-width=512")
#define KVLM_ISA_FN kvlm_kernels_avx512
#define KVLM_AVX512 1  // GCC does not define __AVX512F__ for a target pragma
#include "kernels_impl.h"
#endif
