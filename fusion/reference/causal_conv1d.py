"""Numpy reference of ``ai.mambafuse::CausalConv1d`` — the executable form of docs/causal_conv1d.md.

The causal depthwise convolution of a Mamba-2 mixer over a prompt, from an initial conv state (or zeros), with
its final state: causal-conv1d's ``causal_conv1d_fn`` with initial and final states. For every batch row b and
channel c, with T = x's type, round_T the rounding of a float32 value to T (a no-op for float), L the prompt's
length, K the kernel width and S = ``state_width``::

    window      = concat(initial_state[b,c,:] or S zeros, x[b,c,:])   # S + L columns (x read in its layout)
    final_state = window[L:]                                          # the last S columns
    for t in 0 .. L-1:
        v = round_T(sum_k f32(w[c,k]) * f32(window[S-K+1+t+k]) + f32(bias[c]))   # the Conv's one rounding
        y[t] = activation == "silu" ? round_T(v * round_T(sigmoid(v))) : v     # Sigmoid, then Mul

With ``round_once`` = 1 (ONNX Runtime's CausalConvWithState, as mobius builds use it) v and the sigmoid stay float32
and y alone is rounded: ``y[t] = round_T(a * sigmoid(a))`` (``round_T(a)`` without the activation), ``a`` the float32
sum.

This is ``CausalConv1dUpdate`` (fusion/reference/causal_conv1d_update.py) of the whole prompt from the initial
state, in the prompt's layout: the prefill exports' Conv (pads K-1, the first L columns kept) sees the same
windows with the state's zeros as its left padding. So this module checks its own inputs, lays them out as the
decode op takes them and evaluates that op's reference and budget, one implementation of the arithmetic.

``compute_dtype=np.float32`` mirrors the kernels; ``np.float64`` gives the float64 evaluation with the same
rounding points. ``budget_report`` checks a result against the accuracy budget (``budget_bounds``).
"""

from __future__ import annotations

import numpy as np

from fusion.reference import causal_conv1d_update as update
from fusion.reference._bounds import TRANSCENDENTAL_ERROR, check_dtype, report_within
from fusion.reference._common import DOMAIN, as_arrays, reference_op

OP_TYPE = "CausalConv1d"
ACTIVATIONS = update.ACTIVATIONS


def check_inputs(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    initial_state: np.ndarray | None,
    activation: str = "silu",
    channels_last: int = 1,
    state_width: int | None = None,
) -> tuple[int, int, int, int, int]:
    """Return (batch, channels, length L, state width S, kernel width K), or raise ValueError naming the input.

    x (B, L, C) with ``channels_last`` = 1, (B, C, L) with 0, L >= 1; weight (C, 1, K) or (C, K), K >= 1;
    bias (C); initial_state (B, C, S); all of one type T. ``state_width`` S >= K - 1 is required, and an
    initial_state holds S columns. activation "silu" or "none".
    """
    t = check_dtype("x", x, OP_TYPE)
    if channels_last not in (0, 1):
        raise ValueError(f"{OP_TYPE}: channels_last must be 0 or 1, got {channels_last!r}")
    layout = "(B, L, C)" if channels_last else "(B, C, L)"
    if x.ndim != 3:
        raise ValueError(f"{OP_TYPE}: x must be {layout}, got shape {list(x.shape)}")
    batch, length, channels = x.shape if channels_last else (x.shape[0], x.shape[2], x.shape[1])
    if length < 1:
        raise ValueError(f"{OP_TYPE}: x must hold at least one token (L >= 1), got L = {length}")
    if weight.ndim == 3 and weight.shape[1] == 1:
        weight = weight[:, 0, :]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(
            f"{OP_TYPE}: weight must have shape [{channels}, 1, K] or [{channels}, K] (C = {channels} from x), "
            f"got {list(weight.shape)}"
        )
    width = weight.shape[1]
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"{OP_TYPE}: bias must have shape [{channels}], got {list(bias.shape)}")
    if state_width is None:
        raise ValueError(f"{OP_TYPE}: the attribute state_width is required (K - 1 = {width - 1} or more)")
    if isinstance(state_width, bool) or not isinstance(state_width, (int, np.integer)) or state_width < width - 1:
        raise ValueError(
            f"{OP_TYPE}: state_width must be an integer of at least K - 1 = {width - 1} (the kernel width K = {width} "
            f"comes from weight), got {state_width!r}"
        )
    state_width = int(state_width)
    if initial_state is not None and initial_state.shape != (batch, channels, state_width):
        raise ValueError(
            f"{OP_TYPE}: initial_state must have shape [{batch}, {channels}, {state_width}] (B, C, state_width), "
            f"got {list(initial_state.shape)}"
        )
    for name, arr in (("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if arr is not None and arr.dtype != t:
            raise ValueError(f"{OP_TYPE}: {name} must have x's type {t}, got {arr.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP_TYPE}: activation must be 'silu' or 'none', got {activation!r}")
    return batch, channels, length, state_width, width


def _check_round_once(round_once: int) -> None:
    if round_once not in (0, 1):
        raise ValueError(f"{OP_TYPE}: round_once must be 0 or 1, got {round_once!r}")


def _as_update(
    x: np.ndarray,
    initial_state: np.ndarray | None,
    channels_last: int,
    batch: int,
    channels: int,
    state_width: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (x as (B, C, L), the initial state or zeros (B, C, S)): CausalConv1dUpdate's inputs."""
    x_cf = np.ascontiguousarray(x.transpose(0, 2, 1)) if channels_last else x
    state = np.zeros((batch, channels, state_width), x.dtype) if initial_state is None else initial_state
    return x_cf, state


def _in_layout(y_cf: np.ndarray, channels_last: int) -> np.ndarray:
    """Return (B, C, L) ``y_cf`` in the op's layout."""
    return np.ascontiguousarray(y_cf.transpose(0, 2, 1)) if channels_last else y_cf


def causal_conv1d(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    initial_state: np.ndarray | None = None,
    *,
    activation: str = "silu",
    channels_last: int = 1,
    state_width: int | None = None,
    compute_dtype: np.dtype | type = np.float32,
    round_once: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(y, final_state)`` of ``CausalConv1d`` as the module docstring defines it: y in x's layout and
    type, final_state (B, C, S).

    Raises ValueError for any input the op rejects (``check_inputs``). NaN and Inf propagate.
    """
    x, weight, bias, initial_state = as_arrays(x, weight, bias, initial_state)
    batch, channels, _, state_width, _ = check_inputs(
        x, weight, bias, initial_state, activation, channels_last, state_width
    )
    _check_round_once(round_once)
    x_cf, state = _as_update(x, initial_state, channels_last, batch, channels, state_width)
    y_cf, final_state = update.causal_conv1d_update(
        x_cf, state, weight, bias, activation=activation, compute_dtype=compute_dtype, round_once=bool(round_once)
    )
    return _in_layout(y_cf, channels_last), final_state


def budget_bounds(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    initial_state: np.ndarray | None = None,
    *,
    activation: str = "silu",
    channels_last: int = 1,
    state_width: int | None = None,
    transcendental_error: float = TRANSCENDENTAL_ERROR,
    sigmoid_abs_error: float = 0.0,
    round_once: int = 0,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Return ``{"y": (reference, lo, hi), "final_state": (reference, lo, hi)}``, float64 arrays, y in x's layout.

    CausalConv1dUpdate's budget on the same windows: the convolution's sum (K products and the bias, any order,
    FMA or not) may err by (K + 1) float32 unit roundoffs times the sum of its terms' magnitudes; the sigmoid by
    ``transcendental_error`` (relative) plus ``sigmoid_abs_error`` (absolute); roundings to T map the interval's
    ends. final_state is a copy: lo = hi = the reference.
    """
    x, weight, bias, initial_state = as_arrays(x, weight, bias, initial_state)
    batch, channels, _, state_width, _ = check_inputs(
        x, weight, bias, initial_state, activation, channels_last, state_width
    )
    _check_round_once(round_once)
    x_cf, state = _as_update(x, initial_state, channels_last, batch, channels, state_width)
    bounds = update.budget_bounds(
        x_cf,
        state,
        weight,
        bias,
        activation=activation,
        transcendental_error=transcendental_error,
        sigmoid_abs_error=sigmoid_abs_error,
        round_once=bool(round_once),
    )
    y = tuple(_in_layout(a, channels_last) for a in bounds["y"])
    return {"y": y, "final_state": bounds["present_state"]}  # type: ignore[dict-item]


def budget_report(
    y: np.ndarray,
    final_state: np.ndarray,
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    initial_state: np.ndarray | None = None,
    *,
    activation: str = "silu",
    channels_last: int = 1,
    state_width: int | None = None,
    transcendental_error: float = TRANSCENDENTAL_ERROR,
    sigmoid_abs_error: float = 0.0,
    round_once: int = 0,
) -> tuple[bool, str]:
    """Return (within budget, message) for a kernel's ``y`` and ``final_state`` on these inputs.

    y must lie element by element in the intervals of ``budget_bounds`` (NaN exactly where the float64
    reference has NaN, infinities equal); final_state must equal the reference bit for bit.
    """
    bounds = budget_bounds(
        x,
        weight,
        bias,
        initial_state,
        activation=activation,
        channels_last=channels_last,
        state_width=state_width,
        transcendental_error=transcendental_error,
        sigmoid_abs_error=sigmoid_abs_error,
        round_once=round_once,
    )
    t = np.asarray(x).dtype
    return report_within(bounds, {"y": (y, t), "final_state": (final_state, t)})


def _evaluate_node(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    initial_state: np.ndarray | None = None,
    activation: str | bytes | None = None,
    channels_last: int | None = None,
    state_width: int | None = None,
    round_once: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``causal_conv1d`` of a node's inputs and attributes (a string attribute may come as bytes; a node
    without ``state_width`` is rejected, as the kernels reject it)."""
    if isinstance(activation, bytes):
        activation = activation.decode()
    return causal_conv1d(
        x,
        weight,
        bias,
        initial_state,
        activation=activation or "silu",
        channels_last=1 if channels_last is None else channels_last,
        state_width=state_width,
        round_once=round_once or 0,
    )


#: ``onnx.reference`` implementation, so ``ReferenceEvaluator`` runs fused models.
CausalConv1d = reference_op(DOMAIN, OP_TYPE, _evaluate_node)
