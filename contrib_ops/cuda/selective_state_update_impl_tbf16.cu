// SelectiveStateUpdate CUDA kernels for T = __nv_bfloat16: state float and __nv_bfloat16 (see selective_state_update_kernels.cuh).
#define MAMBAFUSE_SSU_T __nv_bfloat16
#include "selective_state_update_kernels.cuh"
