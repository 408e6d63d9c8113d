"""Numpy references of ``ai.mambafuse::DecodeMatMul`` and ``DecodeMatMulNBits`` — the executable form of
docs/decode_matmul.md.

Both are a model's weight product, unchanged: ``DecodeMatMul(A, B)`` is ONNX ``MatMul`` with a constant (K, N)
weight, ``DecodeMatMulNBits(A, B, scales, zero_points)`` is ONNX Runtime's ``com.microsoft::MatMulNBits`` with
4-bit blocks. The ops exist so that a kernel can pick how to run them by the number of rows M of A (a decode step's
M = batch is a GEMV that must stream the weight at copy speed; a prompt's is a GEMM). With T = A's type and W the
weight as real numbers::

    W[k, n] = B[k, n]                                                   # DecodeMatMul
    W[k, n] = (q[n, k] - zp[n, k // block_size]) * scales[n, k // block_size]   # DecodeMatMulNBits
    Y[m, n] = round_T(sum_k f32(A[m, k]) * f32(W[k, n]))                # float32 accumulation, one rounding

where q[n, k] is the 4-bit value of element j = k % block_size of row n's block b = k // block_size: the low
nibble of byte ``B[n, b, j // 2]`` for even j, the high nibble for odd j; zp the same nibble of the packed
``zero_points[n, b // 2]`` for block b (8 when the input is absent), or, where the zero points have A's type
(ORT's other form, HQQ's), ``zero_points[n, b]`` itself. A kernel may round W to T first (ORT's
CUDA MatMulNBits does) and may sum in any order: the budget allows both.

``dequantize`` gives W in float64, ``decode_matmul`` the float64 product, ``budget`` the allowed error of a T
result, ``check_within_budget`` the check itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fusion.reference._common import DOMAIN, MANTISSA_BITS, MIN_EXPONENT, SUPPORTED_TYPES, reference_op

OP_TYPE = "DecodeMatMul"
NBITS_OP_TYPE = "DecodeMatMulNBits"
#: The bit width DecodeMatMulNBits takes (MatMulNBits also has 2 and 8; a rule refuses those).
BITS = 4
#: The zero point of a block when ``zero_points`` is absent: 2^(bits - 1).
DEFAULT_ZERO_POINT = 1 << (BITS - 1)
#: The float32 accumulation's error per term of the sum, any order (a sum of K products: K * 2^-24 of their
#: magnitudes, Higham's bound for recursive summation, which also covers pairwise and split-K orders).
U32 = 2.0**-24


def _float_type(name: str, value: np.ndarray) -> np.dtype:
    if value.dtype not in SUPPORTED_TYPES.values():
        raise TypeError(f"{name} is {value.dtype}; the op takes float32, float16 or bfloat16")
    return value.dtype


def blocks_of(k: int, block_size: int) -> int:
    """Return the number of blocks a row of K elements takes (the last one padded)."""
    return -(-k // block_size)


def check_nbits_inputs(
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    k: int,
    n: int,
    block_size: int,
    bits: int = BITS,
) -> None:
    """Raise ValueError or TypeError naming the input that breaks DecodeMatMulNBits' contract."""
    t = _float_type("A", a)
    if bits != BITS:
        raise ValueError(f"bits is {bits}; DecodeMatMulNBits takes 4-bit weights")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size is {block_size}; it must be a power of two >= 16")
    if k < 1 or n < 1:
        raise ValueError(f"K = {k} and N = {n} must be positive")
    if a.ndim < 1 or a.shape[-1] != k:
        raise ValueError(f"A's last dim is {a.shape[-1] if a.ndim else None}, not K = {k}")
    blocks = blocks_of(k, block_size)
    if b.dtype != np.uint8 or b.size != n * blocks * block_size // 2:
        raise ValueError(f"B must hold N * blocks * block_size / 2 = {n * blocks * block_size // 2} uint8 bytes")
    if scales.dtype != t or scales.size != n * blocks:
        raise ValueError(f"scales must hold N * blocks = {n * blocks} values of A's type {t}")
    if zero_points is None:
        return
    if zero_points.dtype == t:  # one unpacked zero point a block (HQQ's), A's type
        if zero_points.size != n * blocks:
            raise ValueError(f"zero_points of A's type must hold N * blocks = {n * blocks} values")
    elif zero_points.dtype != np.uint8 or zero_points.size != n * -(-blocks // 2):
        raise ValueError(f"zero_points must hold N * ceil(blocks / 2) = {n * -(-blocks // 2)} uint8 bytes")


def dequantize(
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None = None,
    *,
    k: int,
    n: int,
    block_size: int,
) -> np.ndarray:
    """Return DecodeMatMulNBits' weight W as float64 (K, N) from its packed blocks, scales and zero points."""
    blocks = blocks_of(k, block_size)
    packed = np.asarray(b, dtype=np.uint8).reshape(n, blocks, block_size // 2)
    q = np.empty((n, blocks, block_size), dtype=np.float64)
    q[:, :, 0::2] = packed & 0x0F
    q[:, :, 1::2] = packed >> 4
    if zero_points is None:
        zp = np.full((n, blocks), DEFAULT_ZERO_POINT, dtype=np.float64)
    elif np.asarray(zero_points).dtype != np.uint8:  # unpacked, one a block in A's type
        zp = np.asarray(zero_points).astype(np.float64).reshape(n, blocks)
    else:
        zp_packed = np.asarray(zero_points, dtype=np.uint8).reshape(n, -(-blocks // 2))
        both = np.stack([zp_packed & 0x0F, zp_packed >> 4], axis=-1).reshape(n, -1)
        zp = both[:, :blocks].astype(np.float64)
    scale = np.asarray(scales).astype(np.float64).reshape(n, blocks)
    w = (q - zp[:, :, None]) * scale[:, :, None]
    return w.reshape(n, blocks * block_size)[:, :k].T.copy()


def decode_matmul(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Return A @ W in float64 (W as float64 (K, N), e.g. ``dequantize``'s or a DecodeMatMul weight's)."""
    return np.matmul(np.asarray(a).astype(np.float64), np.asarray(w).astype(np.float64))


def budget(a: np.ndarray, w: np.ndarray, dtype: np.dtype | type, exact: np.ndarray | None = None) -> np.ndarray:
    """Return the largest error a T result of A @ W may have against ``decode_matmul`` (per output).

    u_T = 2^-(mantissa bits + 1) is T's unit roundoff; S = |A| @ |W| the sum of the products' magnitudes::

        |Y - Y64| <= u_T * |Y64| + (u_T + K * 2^-24) * S + the smallest subnormal of T

    the output's one rounding, W rounded to T before the product (allowed, not required), the float32 sum in any
    order, and an underflow to T's subnormals. ``exact``: ``decode_matmul(a, w)`` where the caller has it.
    """
    t = np.dtype(dtype)
    u = 2.0 ** -(MANTISSA_BITS[t] + 1)
    tiny = 2.0 ** (MIN_EXPONENT[t] - MANTISSA_BITS[t])
    k = np.asarray(w).shape[0]
    exact = decode_matmul(a, w) if exact is None else exact
    magnitude = decode_matmul(np.abs(np.asarray(a).astype(np.float64)), np.abs(np.asarray(w).astype(np.float64)))
    return u * np.abs(exact) + (u + k * U32) * magnitude + tiny


def check_within_budget(y: np.ndarray, a: np.ndarray, w: np.ndarray) -> tuple[int, str]:
    """Return (the number of outputs outside the budget, a description of the worst one) for a result ``y`` of
    A @ W in A's type; (0, ...) when every output is within it. NaN where the float64 product is finite counts as
    outside."""
    exact = decode_matmul(a, w)
    allowed = budget(a, w, np.asarray(a).dtype, exact)
    error = np.abs(np.asarray(y).astype(np.float64) - exact)
    error = np.where(np.isnan(error), np.inf, error)
    ratio = error / allowed
    outside = int(np.count_nonzero(ratio > 1))
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else ()
    detail = (
        f"worst at {tuple(int(i) for i in worst)}: {float(np.asarray(y)[worst])} vs {float(exact[worst])}, "
        f"{float(ratio[worst]):.3g} of the budget"
        if ratio.size
        else "empty"
    )
    return outside, detail


def _round_to(y64: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return y64.astype(np.float32).astype(dtype)


def _evaluate_matmul(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray]:
    t = _float_type("A", np.asarray(a))
    if np.asarray(b).dtype != t or np.asarray(b).ndim != 2:
        raise ValueError(f"B must be a 2-D weight of A's type {t}")
    return (_round_to(decode_matmul(a, b), t),)


def _evaluate_nbits(
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None = None,
    K: int | None = None,  # noqa: N803 (MatMulNBits' attribute names)
    N: int | None = None,  # noqa: N803
    bits: int = BITS,
    block_size: int | None = None,
    accuracy_level: int = 0,
) -> tuple[np.ndarray]:
    """Return DecodeMatMulNBits of a node's inputs and attributes (``accuracy_level`` only reaches the function
    body's MatMulNBits; the reference is the float32-accumulated product)."""
    if K is None or N is None or block_size is None:
        raise ValueError("DecodeMatMulNBits needs its K, N and block_size attributes")
    a = np.asarray(a)
    check_nbits_inputs(a, np.asarray(b), np.asarray(scales), zero_points, k=K, n=N, block_size=block_size, bits=bits)
    w = dequantize(b, scales, zero_points, k=K, n=N, block_size=block_size)
    return (_round_to(decode_matmul(a, w), a.dtype),)


#: ``onnx.reference`` implementations, so ``ReferenceEvaluator`` runs fused models.
DecodeMatMul = reference_op(DOMAIN, OP_TYPE, _evaluate_matmul)
DecodeMatMulNBits = reference_op(DOMAIN, NBITS_OP_TYPE, _evaluate_nbits)

__all__: list[Any] = [
    "BITS",
    "DEFAULT_ZERO_POINT",
    "NBITS_OP_TYPE",
    "OP_TYPE",
    "DecodeMatMul",
    "DecodeMatMulNBits",
    "blocks_of",
    "budget",
    "check_nbits_inputs",
    "check_within_budget",
    "decode_matmul",
    "dequantize",
]
