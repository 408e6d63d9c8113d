// GatedGroupRMSNorm CUDA kernels for Y = float: the 9 (Z, W) instantiations (see gated_group_rms_norm_kernels.cuh).
#define MAMBAFUSE_Y_TYPE float
#include "gated_group_rms_norm_kernels.cuh"
