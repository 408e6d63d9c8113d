// SelectiveStateUpdate CUDA kernels for T = float: state float (see selective_state_update_kernels.cuh).
#define MAMBAFUSE_SSU_T float
#define MAMBAFUSE_SSU_T_IS_FLOAT 1
#include "selective_state_update_kernels.cuh"
