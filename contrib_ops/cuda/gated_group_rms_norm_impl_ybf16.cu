// GatedGroupRMSNorm CUDA kernels for Y = __nv_bfloat16: the 9 (Z, W) instantiations (see gated_group_rms_norm_kernels.cuh).
#define MAMBAFUSE_Y_TYPE __nv_bfloat16
#include "gated_group_rms_norm_kernels.cuh"
