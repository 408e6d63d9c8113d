"""The DecodeMatMul / DecodeMatMulNBits GEMVs and the int4 dequantization on a list of cases, for
compute-sanitizer: memcheck (out-of-range global and shared accesses, distributed shared memory included),
racecheck (the block and cluster reductions) and synccheck. Launched through libmambafuse_cuda_gemv_bench.so on
PyTorch's buffers; tests/test_decode_matmul_cuda.py checks the results: this only runs the kernels.

    compute-sanitizer --tool racecheck python3 contrib_ops/cuda/tools/sanitize_gemv.py <gemv bench lib> [--quick]
"""

from __future__ import annotations

import ctypes
import itertools
import sys

import torch

TYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}


def main() -> int:
    lib = ctypes.CDLL(sys.argv[1])
    quick = "--quick" in sys.argv
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dense = lib.mambafuse_decode_matmul_launch
    dense.argtypes = [ctypes.c_int, i64, i64, i64, p, p, p, p]
    nbits = lib.mambafuse_decode_matmul_nbits_launch
    nbits.argtypes = [ctypes.c_int, i64, i64, i64, i64, p, p, p, p, p, p]
    dequant = lib.mambafuse_dequantize_int4_launch
    dequant.argtypes = [ctypes.c_int, i64, i64, i64, p, p, p, p, p]
    stream = torch.cuda.current_stream().cuda_stream
    rows = (1, 3, 8) if quick else (1, 2, 3, 4, 5, 6, 7, 8)
    cases = 0
    # (K, N): K off 8 and a split of several cluster ranks, N off the vector width, a wide N (no split).
    for (k, n), type_id, m in itertools.product([(100, 37), (1000, 256), (4100, 72), (256, 20000)], TYPES, rows):
        t = TYPES[type_id]
        a = torch.randn(m, k, device="cuda").to(t)
        b = torch.randn(k, n, device="cuda").to(t)
        y = torch.empty(m, n, device="cuda", dtype=t)
        rc = dense(type_id, m, k, n, a.data_ptr(), b.data_ptr(), y.data_ptr(), stream)
        torch.cuda.synchronize()
        if rc != 0:
            print(f"dense launch failed ({rc}): M={m} K={k} N={n} type {type_id}")
            return 1
        cases += 1
    for (k, n, bs), type_id, m, zp in itertools.product(
        [(100, 40, 32), (4112, 33, 16), (4100, 72, 128), (512, 300, 64)], TYPES, rows, (False, True)
    ):
        t = TYPES[type_id]
        blocks = -(-k // bs)
        a = torch.randn(m, k, device="cuda").to(t)
        b = torch.randint(0, 256, (n, blocks, bs // 2), dtype=torch.uint8, device="cuda")
        scales = torch.rand(n, blocks, device="cuda").to(t)
        zero_points = torch.randint(0, 256, (n * ((blocks + 1) // 2),), dtype=torch.uint8, device="cuda")
        zp_ptr = zero_points.data_ptr() if zp else None
        y = torch.empty(m, n, device="cuda", dtype=t)
        rc = nbits(type_id, m, k, n, bs, a.data_ptr(), b.data_ptr(), scales.data_ptr(), zp_ptr, y.data_ptr(), stream)
        w = torch.empty(n, blocks * bs, device="cuda", dtype=t)
        rc = rc or dequant(type_id, k, n, bs, b.data_ptr(), scales.data_ptr(), zp_ptr, w.data_ptr(), stream)
        torch.cuda.synchronize()
        if rc != 0:
            print(f"int4 launch failed ({rc}): M={m} K={k} N={n} bs={bs} type {type_id}")
            return 1
        cases += 2
    print(f"{cases} launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
