// AVX-512 (F, BW, VL, DQ) plus VNNI (vpdpbusd) for the int8-activation kernels; the rest as isa_avx512.cpp.
// A separate unit because AVX-512 CPUs without VNNI exist (Skylake-SP): ops.cpp picks it at run time.
#if defined(__x86_64__) || defined(__i386__)  // x86 only: elsewhere this unit is empty
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2,prefer-vector-width=512")
#define KVLM_ISA_FN kvlm_kernels_avx512_vnni
#define KVLM_AVX512 1  // GCC does not define __AVX512F__ for a target pragma
#define KVLM_VNNI 1
#include "kernels_impl.h"
#endif
