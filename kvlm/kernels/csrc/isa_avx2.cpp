// AVX2 + FMA. The target pragma precedes every include so all code in this unit may use these
// instructions; ops.cpp calls into it only when the CPU reports them.
#if defined(__x86_64__) || defined(__i386__)  // x86 only: elsewhere this unit is empty
#pragma GCC target("avx2,fma,f16c,bmi2")
#define KVLM_ISA_FN kvlm_kernels_avx2
#define KVLM_AVX2 1  // GCC does not define __AVX2__ for a target pragma
#include "kernels_impl.h"
#endif
