"""The int4 GEMV kernels against a float64 product, fast enough to run on every bench library a sweep compares
(~10 s): 13 shapes (the projections, K off the block and off 8, N off 16, a K of one tile and of many, more groups
than a block takes), block sizes 16-128, with and without zero points, M = 1, 3, 8, float16 and bfloat16, under each
kernel named (``default``: the bulk kernel where its layout fits; ``mma``: the register-load kernel). The reference
dequantizes the weight as the kernels do (W = (q - zp) * scale rounded to T) and multiplies in float64; the budget
is 2e-3 of |A| |W| plus 1e-3 of the largest output. Launched through libmambafuse_cuda_gemv_bench.so on PyTorch's
buffers; the output starts as NaN, so a value never written fails. tests/test_decode_matmul_cuda.py is the full
suite (through ORT); this is the check to run before timing a build.

    python3 contrib_ops/cuda/tools/check_int4_gemv.py <gemv bench lib> [default,mma]
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys

import torch

TYPES = {10: torch.float16, 16: torch.bfloat16}
# (K, N, block size)
SHAPES = [
    (4096, 18560, 32), (8192, 4096, 32), (21504, 4096, 32), (4096, 4096, 16), (4096, 6144, 64), (1000, 40, 32),
    (4096, 33, 16), (12288, 1040, 32), (256, 40000, 32), (128, 7, 16), (4096, 250, 32), (512, 70001, 64),
    (4000, 1000, 128),
]  # fmt: skip


def dequantized(b, scales, zero_points, *, k: int, block_size: int, dtype):
    """W (N, K) as the kernels see it: (q - zp) * scale rounded once to ``dtype``, from MatMulNBits' packed blocks
    (N, blocks, block_size / 2), scales (N, blocks) and packed zero points (N, ceil(blocks / 2)) or None (8)."""
    n, blocks = scales.shape
    q = torch.stack([b & 15, b >> 4], dim=-1).reshape(n, blocks, block_size).double()
    if zero_points is not None:
        z = torch.stack([zero_points & 15, zero_points >> 4], dim=-1).reshape(n, -1)[:, :blocks].double()
    else:
        z = torch.full((n, blocks), 8.0, device=b.device, dtype=torch.float64)
    return ((q - z[:, :, None]) * scales.double()[:, :, None]).to(dtype).reshape(n, -1)[:, :k]


def check(nbits, kernel: str, k: int, n: int, block_size: int, type_id: int, m: int, zero_points: bool) -> float:
    """Largest error over the budget of one case (> 1 fails; inf where the launch failed or wrote a non-finite)."""
    t = TYPES[type_id]
    blocks = -(-k // block_size)
    a = torch.randn(m, k, device="cuda").to(t)
    b = torch.randint(0, 256, (n, blocks, block_size // 2), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, blocks, device="cuda") * 0.045 + 0.005).to(t)
    zp = torch.randint(0, 256, (n, (blocks + 1) // 2), dtype=torch.uint8, device="cuda") if zero_points else None
    y = torch.full((m, n), float("nan"), device="cuda", dtype=t)
    zp_ptr = zp.data_ptr() if zp is not None else None
    stream = torch.cuda.current_stream().cuda_stream
    rc = nbits(
        type_id, m, k, n, block_size, a.data_ptr(), b.data_ptr(), scales.data_ptr(), zp_ptr, y.data_ptr(), stream
    )
    torch.cuda.synchronize()
    if rc != 0:
        print(f"launch failed ({rc}): {kernel} K={k} N={n} bs={block_size} M={m} zp={zero_points}")
        return float("inf")
    w = dequantized(b, scales, zp, k=k, block_size=block_size, dtype=t).double()
    ref = a.double() @ w.T
    budget = (a.double().abs() @ w.abs().T) * 2e-3 + 1e-3 * ref.abs().max()
    if not torch.isfinite(y).all():
        return float("inf")
    return float(((y.double() - ref).abs() / budget).max())


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    lib = ctypes.CDLL(sys.argv[1])
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    nbits = lib.mambafuse_decode_matmul_nbits_launch
    nbits.argtypes = [ctypes.c_int, i64, i64, i64, i64, p, p, p, p, p, p]
    kernels = (sys.argv[2] if len(sys.argv) > 2 else "default,mma").split(",")
    torch.manual_seed(0)
    cases = bad = 0
    worst = 0.0
    for kernel in kernels:
        os.environ.pop("MAMBAFUSE_NBITS_KERNEL", None)
        if kernel != "default":
            os.environ["MAMBAFUSE_NBITS_KERNEL"] = kernel
        for (k, n, bs), type_id, m, zp in itertools.product(SHAPES, TYPES, (1, 3, 8), (False, True)):
            ratio = check(nbits, kernel, k, n, bs, type_id, m, zp)
            cases += 1
            if not ratio <= 1.0:
                print(f"MISMATCH {kernel} K={k} N={n} bs={bs} M={m} zp={zp} type {type_id}: {ratio:.3g} of budget")
                bad += 1
            else:
                worst = max(worst, ratio)
    os.environ.pop("MAMBAFUSE_NBITS_KERNEL", None)
    print(f"{cases} cases, {bad} bad, worst error {worst:.3f} of the budget")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
