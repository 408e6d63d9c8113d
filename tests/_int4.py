"""Random inputs of the int4 GEMV tests (DecodeMatMulNBits on a GPU, in the host emulation and under ThreadSanitizer),
and the emulated kernels' launch and check. Nothing here imports ONNX Runtime or starts threads of its own, so a
ThreadSanitizer subprocess can use it (its caller sets OPENBLAS_NUM_THREADS=1 for the float64 check's product)."""

from __future__ import annotations

import ctypes

import numpy as np

from fusion.reference.decode_matmul import blocks_of, check_within_budget, dequantize
from tests._cuda import ONNX_TYPE, host_pointer


def activations(rng: np.random.Generator, shape: tuple[int, ...], t: np.dtype) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(t)


def int4_weight(
    rng: np.random.Generator, k: int, n: int, block_size: int, t: np.dtype, zero_points: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Random packed nibbles (the last block's padding too), scales in [0.005, 0.05) of T, packed zero points."""
    blocks = blocks_of(k, block_size)
    b = rng.integers(0, 256, size=(n, blocks, block_size // 2), dtype=np.uint8)
    scales = (rng.random((n, blocks), dtype=np.float32) * 0.045 + 0.005).astype(t)
    zp = rng.integers(0, 256, size=(n * ((blocks + 1) // 2),), dtype=np.uint8) if zero_points else None
    return b, scales, zp


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (tools/cuda_gemv_bench_launch.cc's int4 entry points and the emulation's launch record) typed."""
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.mambafuse_decode_matmul_nbits_launch.argtypes = [i, i64, i64, i64, i64, p, p, p, p, p, p]
    lib.mambafuse_dequantize_int4_launch.argtypes = [i, i64, i64, i64, p, p, p, p, p]
    lib.mambafuse_emu_last_block_threads.restype = ctypes.c_uint
    return lib


def run_gemv(lib: ctypes.CDLL, t, m: int, k: int, n: int, block_size: int, zero_points: bool, seed: int) -> int:
    """A and an int4 weight drawn from ``seed``, the GEMV launched on them, Y within the budget of the weight it
    dequantizes to; returns the launch's block size."""
    rng = np.random.default_rng(seed)
    a = activations(rng, (m, k), t)
    b, scales, zp = int4_weight(rng, k, n, block_size, t, zero_points)
    y = np.full((m, n), np.nan, dtype=t)
    status = lib.mambafuse_decode_matmul_nbits_launch(
        ONNX_TYPE[np.dtype(t)], m, k, n, block_size, host_pointer(a), host_pointer(b), host_pointer(scales),
        host_pointer(zp), host_pointer(y), None,
    )  # fmt: skip
    case = f"T={np.dtype(t).name} M={m} K={k} N={n} bs={block_size} zp={zero_points}"
    assert status == 0, f"{case}: launch returned {status}"
    outside, detail = check_within_budget(y, a, dequantize(b, scales, zp, k=k, n=n, block_size=block_size))
    assert outside == 0, f"{case}: {outside} of {y.size} outputs outside the budget; {detail}"
    return int(lib.mambafuse_emu_last_block_threads())
