// GatedGroupRMSNorm CUDA kernels for Y = __half: the 9 (Z, W) instantiations (see gated_group_rms_norm_kernels.cuh).
#define MAMBAFUSE_Y_TYPE __half
#include "gated_group_rms_norm_kernels.cuh"
