// Portable baseline (SSE2 on x86-64): the path for CPUs without AVX2.
#define KVLM_ISA_FN kvlm_kernels_scalar
#include "kernels_impl.h"
