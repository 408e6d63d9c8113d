"""Numpy reference of ``ai.mambafuse::CausalConv1dUpdate`` — the executable form of
docs/causal_conv1d_update.md.

The causal depthwise convolution of a Mamba-2 mixer, advanced by L new columns, for every batch row b and
channel c, with T = x's type and round_T the rounding of a float32 value to T (a no-op for float)::

    window  = concat(conv_state[b,c,:], x[b,c,:])          # S + L columns
    present = window[L:]                                   # present_state: the last S columns
    for t in 0 .. L-1:
        v = round_T(sum_k f32(w[c,k]) * f32(window[S-K+1+t+k]) + f32(bias[c]))   # the Conv's one rounding
        y[t] = activation == "silu" ? round_T(v * round_T(sigmoid(v))) : v     # Sigmoid, then Mul

These are the rounding points of transformers' ``causal_conv1d_update`` torch fallback as exported
(a Conv, then Sigmoid and Mul); causal-conv1d's CUDA kernel accumulates in float32 the same way.

``compute_dtype=np.float32`` mirrors the kernels; ``np.float64`` gives the float64 evaluation with the same
rounding points. ``budget_report`` checks a result against the accuracy budget (``budget_bounds``).
"""

from __future__ import annotations

import functools

import numpy as np

from fusion.reference._bounds import (
    F32,
    TINY32,
    TRANSCENDENTAL_ERROR,
    U32,
    check_dtype,
    compute_dtype_of,
    mul_interval,
    report_within,
    round_in,
    round_interval,
)
from fusion.reference._common import DOMAIN, as_arrays, reference_op, sigmoid

OP_TYPE = "CausalConv1dUpdate"
ACTIVATIONS = ("silu", "none")


def check_inputs(
    x: np.ndarray,
    conv_state: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    activation: str = "silu",
) -> tuple[int, int, int, int, int]:
    """Return (batch, channels, new columns L, state length S, kernel width K), or raise ValueError.

    The kernels' conditions: x (B, C, L) with L >= 1, conv_state (B, C, S), weight (C, 1, K) or (C, K)
    with K >= 1 and S >= K - 1, bias (C); all of one type T; activation "silu" or "none".
    """
    t = check_dtype("x", x, OP_TYPE)
    if x.ndim != 3:
        raise ValueError(f"{OP_TYPE}: x must be (B, C, L), got shape {list(x.shape)}")
    batch, channels, new = x.shape
    if new < 1:
        raise ValueError(f"{OP_TYPE}: x must have at least one new column (L >= 1), got L = {new}")
    if conv_state.ndim != 3 or conv_state.shape[:2] != (batch, channels):
        raise ValueError(
            f"{OP_TYPE}: conv_state must have shape [{batch}, {channels}, S], got {list(conv_state.shape)}"
        )
    if weight.ndim == 3 and weight.shape[1] == 1:
        weight = weight[:, 0, :]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(
            f"{OP_TYPE}: weight must have shape [{channels}, 1, K] or [{channels}, K], got {list(weight.shape)}"
        )
    width, state_len = weight.shape[1], conv_state.shape[2]
    if state_len < width - 1:
        raise ValueError(f"{OP_TYPE}: conv_state holds S = {state_len} columns, fewer than K - 1 = {width - 1}")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"{OP_TYPE}: bias must have shape [{channels}], got {list(bias.shape)}")
    for name, arr in (("conv_state", conv_state), ("weight", weight), ("bias", bias)):
        if arr is not None and arr.dtype != t:
            raise ValueError(f"{OP_TYPE}: {name} must have x's type {t}, got {arr.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP_TYPE}: activation must be 'silu' or 'none', got {activation!r}")
    return batch, channels, new, state_len, width


def _windows(window: np.ndarray, state_len: int, width: int, new: int) -> np.ndarray:
    """Return (B, C, L, K): for output column t, the K window columns S - K + 1 + t .. S + t."""
    start = state_len - width + 1
    return np.stack([window[:, :, start + t : start + t + width] for t in range(new)], axis=2)


def causal_conv1d_update(
    x: np.ndarray,
    conv_state: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    *,
    activation: str = "silu",
    compute_dtype: np.dtype | type = np.float32,
    round_once: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(y, present_state)`` of ``CausalConv1dUpdate`` as the module docstring defines it.

    ``round_once`` (CausalConv1d's attribute): the sum, the sigmoid and the product stay in the compute type and only
    y is rounded to T (ONNX Runtime's CausalConvWithState), instead of v, sigmoid(v) and y each.

    Raises ValueError for any input the op rejects (``check_inputs``). NaN and Inf propagate.
    """
    x, conv_state, weight, bias = as_arrays(x, conv_state, weight, bias)
    _, channels, new, state_len, width = check_inputs(x, conv_state, weight, bias, activation)
    t, cd = x.dtype, compute_dtype_of(compute_dtype)
    r_t = functools.partial(round_in, dtype=t, compute_dtype=cd)  # round_T, back in the compute type

    window = np.concatenate([conv_state, x], axis=-1)
    w = weight.reshape(channels, width).astype(cd)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        acc = np.sum(_windows(window, state_len, width, new).astype(cd) * w[None, :, None, :], axis=-1, dtype=cd)
        if bias is not None:
            acc = acc + bias.astype(cd)[None, :, None]
        if round_once:
            y = r_t(acc * sigmoid(acc)) if activation == "silu" else r_t(acc)
        else:
            v = r_t(acc)
            y = r_t(v * r_t(sigmoid(v))) if activation == "silu" else v
    return y.astype(t), window[:, :, new:].copy()


def budget_bounds(
    x: np.ndarray,
    conv_state: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    *,
    activation: str = "silu",
    transcendental_error: float = TRANSCENDENTAL_ERROR,
    sigmoid_abs_error: float = 0.0,
    round_once: bool = False,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Return ``{"y": (reference, lo, hi), "present_state": (reference, lo, hi)}``, float64 arrays.
    (``round_once``: v and the sigmoid are float32 values, y the one rounding to T.)

    The convolution's sum (K products and the bias, any order, FMA or not) may err by (K + 1) float32 unit
    roundoffs times the sum of its terms' magnitudes; the sigmoid by ``transcendental_error`` (relative)
    plus ``sigmoid_abs_error`` (absolute; 0 for the kernels — an implementation whose sigmoid is accurate
    only in absolute terms states its own). Roundings to T map the interval's ends, so values near a tie
    may land on either neighbour. present_state is a copy: lo = hi = the reference.
    """
    x, conv_state, weight, bias = as_arrays(x, conv_state, weight, bias)
    _, channels, new, state_len, width = check_inputs(x, conv_state, weight, bias, activation)
    point_y, present = causal_conv1d_update(
        x, conv_state, weight, bias, activation=activation, compute_dtype=np.float64, round_once=round_once
    )
    t = x.dtype
    inner = F32 if round_once else t  # the type v and the sigmoid are rounded to
    window = np.concatenate([conv_state, x], axis=-1).astype(np.float64)
    w = weight.reshape(channels, width).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        terms = _windows(window, state_len, width, new) * w[None, :, None, :]
        acc = terms.sum(axis=-1)
        magnitude = np.abs(terms).sum(axis=-1)
        if bias is not None:
            b = bias.astype(np.float64)[None, :, None]
            acc, magnitude = acc + b, magnitude + np.abs(b)
        slack = (width + 1) * (U32 * magnitude + 2 * TINY32)
        v_lo, v_hi = round_interval(acc - slack, acc + slack, F32, inner)
        if activation == "silu":
            e, abs_e = transcendental_error, sigmoid_abs_error + 4 * TINY32
            sg_lo = np.maximum(sigmoid(v_lo) * (1 - e) - abs_e, 0.0)
            sg_hi = np.minimum(sigmoid(v_hi) * (1 + e) + abs_e, 1.0)
            sg_lo, sg_hi = round_interval(sg_lo, sg_hi, F32, inner)
            y_lo, y_hi = round_interval(*mul_interval(v_lo, v_hi, sg_lo, sg_hi), F32, t)  # the float32 product, T
        elif round_once:
            y_lo, y_hi = round_interval(v_lo, v_hi, F32, t)
        else:
            y_lo, y_hi = v_lo, v_hi
    state64 = present.astype(np.float64)
    return {"y": (point_y.astype(np.float64), y_lo, y_hi), "present_state": (state64, state64, state64)}


def budget_report(
    y: np.ndarray,
    present_state: np.ndarray,
    x: np.ndarray,
    conv_state: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    *,
    activation: str = "silu",
    transcendental_error: float = TRANSCENDENTAL_ERROR,
    sigmoid_abs_error: float = 0.0,
    round_once: bool = False,
) -> tuple[bool, str]:
    """Return (within budget, message) for a kernel's ``y`` and ``present_state`` on these inputs.

    y must lie element by element in the intervals of ``budget_bounds`` (NaN exactly where the float64
    reference has NaN, infinities equal); present_state must equal the reference bit for bit (NaN where
    it has NaN).
    """
    bounds = budget_bounds(
        x,
        conv_state,
        weight,
        bias,
        activation=activation,
        transcendental_error=transcendental_error,
        sigmoid_abs_error=sigmoid_abs_error,
        round_once=round_once,
    )
    t = np.asarray(x).dtype
    return report_within(bounds, {"y": (y, t), "present_state": (present_state, t)})


def _evaluate_node(
    x: np.ndarray,
    conv_state: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    activation: str | bytes | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``causal_conv1d_update`` of a node's inputs and attributes (a string attribute may come as bytes)."""
    if isinstance(activation, bytes):
        activation = activation.decode()
    return causal_conv1d_update(x, conv_state, weight, bias, activation=activation or "silu")


#: ``onnx.reference`` implementation, so ``ReferenceEvaluator`` runs fused models.
CausalConv1dUpdate = reference_op(DOMAIN, OP_TYPE, _evaluate_node)
