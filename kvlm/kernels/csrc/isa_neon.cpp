// ARM NEON (every aarch64 CPU has it): the int8-activation kernels' integer sums on smull + sadalp
// (kernels_int8_portable.h); the rest as the portable unit. Empty elsewhere.
#if defined(__aarch64__)
#define KVLM_ISA_FN kvlm_kernels_neon
#define KVLM_NEON 1
#include "kernels_impl.h"
#endif
