"""Random inputs of the int4 GEMV tests (DecodeMatMulNBits on a GPU, in the host emulation and under ThreadSanitizer):
numpy only, so that a ThreadSanitizer subprocess imports no library with threads of its own."""

from __future__ import annotations

import numpy as np

from fusion.reference.decode_matmul import blocks_of


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
