// AVX2 + FMA plus AVX-VNNI (vpdpbusd on ymm: Intel client CPUs since Alder Lake, AMD Zen 5) for the int8
// kernels (kernels_int8_avx2.h's dot8); the rest as isa_avx2.cpp. A separate unit because most AVX2 CPUs
// lack AVX-VNNI, and AVX-512 CPUs may lack it too (Zen 4, Ice Lake): ops.cpp checks the flag itself.
#if defined(__x86_64__) || defined(__i386__)  // x86 only: elsewhere this unit is empty
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")
#define KVLM_ISA_FN kvlm_kernels_avx2_vnni
#define KVLM_AVX2 1      // GCC does not define __AVX2__ for a target pragma
#define KVLM_AVX_VNNI 1  // nor __AVXVNNI__
#include "kernels_impl.h"
#endif
