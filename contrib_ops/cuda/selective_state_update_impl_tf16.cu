// SelectiveStateUpdate CUDA kernels for T = __half: state float and __half (see selective_state_update_kernels.cuh).
#define MAMBAFUSE_SSU_T __half
#include "selective_state_update_kernels.cuh"
