// AVX-512 VNNI plus AMX (tile registers, tdpbssd / tdpbsud: Intel Xeon since Sapphire Rapids): the
// avx512-vnni unit with the int8 kernels' many-row tiles on AMX (kernels_int8_amx.h). A separate unit
// because the OS must grant the tile state first (ops.cpp asks Linux once) and most AVX-512 CPUs lack AMX.
#if defined(__x86_64__) || defined(__i386__)  // x86 only: elsewhere this unit is empty
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2,amx-tile,amx-int8,prefer-vector-width=512")
#define KVLM_ISA_FN kvlm_kernels_avx512_amx
#define KVLM_AVX512 1  // GCC does not define __AVX512F__ for a target pragma
#define KVLM_VNNI 1
#define KVLM_AMX 1
#include "kernels_impl.h"
#endif
