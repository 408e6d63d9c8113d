"""The int4 and float16 decode GEMVs of benchmarks/bench_cuda_gemv.py launched once each inside an NVTX range, for
Nsight Compute, at one projection shape and M, after a warm-up outside the range (ncu flushes the caches between
kernels by default, so each launch reads a cold weight, as in the benchmark):

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python benchmarks/ncu_cuda_gemv.py --bench-lib build/cuda/cuda/libmambafuse_cuda_gemv_bench.so \\
        --shape in_proj --rows 1
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_cuda_gemv import ONNX_FLOAT16, SHAPES, Int4Weights  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-lib", required=True, help="libmambafuse_cuda_gemv_bench.so")
    parser.add_argument("--shape", default="in_proj", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--zero-points", action="store_true", help="with MatMulNBits' zero points (default: none)")
    args = parser.parse_args()
    lib = ctypes.CDLL(args.bench_lib)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dense = lib.mambafuse_decode_matmul_launch
    dense.argtypes = [ctypes.c_int, i64, i64, i64, p, p, p, p]
    nbits = lib.mambafuse_decode_matmul_nbits_launch
    nbits.argtypes = [ctypes.c_int, i64, i64, i64, i64, p, p, p, p, p, p]
    k, n = SHAPES[args.shape]
    m = args.rows
    q = Int4Weights(torch, k, n, args.block_size, copies=1)
    w = torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    y = torch.empty(m, n, device="cuda", dtype=torch.float16)
    stream = torch.cuda.current_stream().cuda_stream
    zp = q.zp[0].data_ptr() if args.zero_points else None

    def int4() -> None:
        rc = nbits(ONNX_FLOAT16, m, k, n, args.block_size, a.data_ptr(), q.b[0].data_ptr(), q.scales[0].data_ptr(),
                   zp, y.data_ptr(), stream)  # fmt: skip
        assert rc == 0, rc

    def fp16() -> None:
        rc = dense(ONNX_FLOAT16, m, k, n, a.data_ptr(), w.data_ptr(), y.data_ptr(), stream)
        assert rc == 0, rc

    for fn in (int4, fp16):
        fn()  # warm-up outside the range
    torch.cuda.synchronize()
    for name, fn in (("int4", int4), ("fp16", fp16), ("cublas", lambda: torch.matmul(a, w, out=y))):
        torch.cuda.nvtx.range_push(f"profile/{name}")
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
