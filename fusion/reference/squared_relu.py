"""Numpy reference of ``ai.mambafuse::SquaredRelu`` — the executable form of docs/squared_relu.md.

Nemotron-H's MLP activation (transformers' ``relu2``, Primer's squared ReLU). With T = X's type::

    Y = round_T(max(X, 0)^2)

one rounding of the exact square to T (round to nearest even; overflow to +Inf; an underflow to T's subnormals or
zero). The square of a T value is exact in float32 for float16 and bfloat16 (twice 11 or 8 significand bits) and
in float64 for float32, so a kernel that squares in float32 (float64 is not needed: IEEE's product of two floats is
the correctly rounded one) and rounds once gives these bits: the op's budget is 0 ulp. It is the value of the
stock ``Mul(Relu(X), Relu(X))`` and ``Pow(Relu(X), 2)`` that exporters write, wherever those square exactly
(ONNX Runtime's CPU kernels and its CUDA ``Mul``; see docs/squared_relu.md for its CUDA ``Pow`` in float32).

Special values: NaN gives NaN (``max`` propagates NaN, as ONNX's reference ``Relu``, ``torch.relu`` and ONNX
Runtime's CPU and CUDA ``Relu`` do);
+Inf gives +Inf; -Inf, -0 and every negative value give +0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fusion.reference._common import DOMAIN, SUPPORTED_TYPES, reference_op

OP_TYPE = "SquaredRelu"


def check_input(x: np.ndarray) -> np.dtype:
    """Return X's dtype; raise TypeError when it is not one the op takes (float32, float16, bfloat16)."""
    if x.dtype not in SUPPORTED_TYPES.values():
        raise TypeError(f"X is {x.dtype}; SquaredRelu takes float32, float16 or bfloat16")
    return x.dtype


def squared_relu64(x: np.ndarray) -> np.ndarray:
    """Return max(X, 0)^2 in float64, exact for every X of the op's types (NaN where X is NaN)."""
    with np.errstate(invalid="ignore"):  # NaN in, NaN out
        r = np.maximum(np.asarray(x).astype(np.float64), 0.0)
        return r * r


def squared_relu(x: np.ndarray) -> np.ndarray:
    """Return SquaredRelu(X) in X's type: the exact square rounded once (through float32, where it is exact for
    the 16-bit types and rounded once for float32)."""
    t = check_input(np.asarray(x))
    with np.errstate(over="ignore", invalid="ignore"):  # a square past T's range is +Inf, as the op's
        return squared_relu64(x).astype(np.float32).astype(t)


def count_differences(y: np.ndarray, x: np.ndarray) -> tuple[int, str]:
    """Return (how many elements of a result ``y`` differ from ``squared_relu(x)``, a description of the first);
    NaN matches NaN. The op's budget is exact, so any difference is outside it."""
    expected = squared_relu(x)
    y = np.asarray(y)
    if y.shape != expected.shape or y.dtype != expected.dtype:
        return max(int(expected.size), 1), f"Y is {y.dtype} {y.shape}, expected {expected.dtype} {expected.shape}"
    wide_y, wide_expected = y.astype(np.float64), expected.astype(np.float64)
    same = (wide_y == wide_expected) | (np.isnan(wide_y) & np.isnan(wide_expected))
    differ = int(np.count_nonzero(~same))
    if not differ:
        return 0, f"{y.size} outputs, all equal to the once-rounded square"
    first = np.unravel_index(int(np.argmin(same.reshape(-1))), y.shape)
    index = tuple(int(i) for i in first)
    x_value = float(np.asarray(x)[first])
    return differ, f"first at {index}: X = {x_value!r}, Y = {float(y[first])!r}, expected {float(expected[first])!r}"


def _evaluate(x: np.ndarray) -> tuple[np.ndarray]:
    return (squared_relu(np.asarray(x)),)


#: The ``onnx.reference`` implementation, so ``ReferenceEvaluator`` runs fused models.
SquaredRelu = reference_op(DOMAIN, OP_TYPE, _evaluate)

__all__: list[Any] = ["OP_TYPE", "SquaredRelu", "check_input", "count_differences", "squared_relu", "squared_relu64"]
