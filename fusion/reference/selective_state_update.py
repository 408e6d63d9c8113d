"""Numpy reference of ``ai.mambafuse::SelectiveStateUpdate`` — the executable form of
docs/selective_state_update.md.

One decode step of the Mamba-2 recurrence, for every batch row b, head h (group g = h // (H / G)),
head channel p and state index n, with T = x's type, S = the state's type and round_T the rounding of a
float32 value to T (a no-op for float)::

    d1  = round_T(dt[b,h] + dt_bias[h])                     # dt_bias optional: d1 = dt[b,h]
    d   = d1 > 20 ? d1 : round_T(log1p(exp(d1)))            # dt_softplus = 1 (torch's threshold)
    dA  = exp(f32(d) * A[h])                                # float32, once per (b, h)
    dB  = round_T(d * B[b,g,n])
    dBx = round_T(dB * x[b,h,p])
    s   = round_S(f32(state[b,h,p,n]) * dA + f32(dBx))      # present_state
    y   = round_T(sum_n f32(round_T(s)) * f32(C[b,g,n]))
    out = D ? round_T(y + round_T(x[b,h,p] * D[h])) : y

These are the rounding points of transformers' ``mamba2_selective_state_update`` torch fallback as the
exporters trace it (mamba_ssm's Triton ``selective_state_update`` computes the same step in float32).

``compute_dtype=np.float32`` mirrors the kernels; ``np.float64`` gives the float64 evaluation with the same
rounding points. ``budget_report`` checks a result against the accuracy budget (an interval per element,
see ``budget_bounds``).
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
from fusion.reference._common import DOMAIN, as_arrays, reference_op

OP_TYPE = "SelectiveStateUpdate"
#: torch's softplus threshold: above it, softplus(v) is v.
SOFTPLUS_THRESHOLD = 20.0


def check_inputs(
    state: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None,
    dt_softplus: int = 1,
) -> tuple[int, int, int, int, int]:
    """Return (batch, heads, head_dim, state_size, groups), or raise ValueError naming the bad input.

    The same conditions as the kernels: state (B, H, P, N) of type S in {float, T}; x (B, H, P), dt (B, H),
    dt_bias (H), B and C (B, G, N) of one type T; A (H) float; D (H) of type T or float; G >= 1, H % G == 0.
    """
    t = check_dtype("x", x, OP_TYPE)
    if state.ndim != 4:
        raise ValueError(f"{OP_TYPE}: state must be (B, H, P, N), got shape {list(state.shape)}")
    batch, heads, head_dim, state_size = state.shape
    expect = {
        "x": (x, (batch, heads, head_dim)),
        "dt": (dt, (batch, heads)),
        "dt_bias": (dt_bias, (heads,)),
        "A": (A, (heads,)),
        "D": (D, (heads,)),
    }
    for name, (arr, shape) in expect.items():
        if arr is not None and arr.shape != shape:
            raise ValueError(f"{OP_TYPE}: {name} must have shape {list(shape)}, got {list(arr.shape)}")
    for name, arr in (("B", B), ("C", C)):
        if arr.ndim != 3 or arr.shape[0] != batch or arr.shape[2] != state_size:
            raise ValueError(
                f"{OP_TYPE}: {name} must have shape [{batch}, G, {state_size}] (B, G, N), got {list(arr.shape)}"
            )
    if B.shape != C.shape:
        raise ValueError(f"{OP_TYPE}: B and C must have the same shape, got {list(B.shape)} and {list(C.shape)}")
    groups = B.shape[1]
    if groups < 1 or heads % groups != 0:
        raise ValueError(f"{OP_TYPE}: the number of heads H = {heads} must be a multiple of the groups G = {groups}")
    for name, arr in (("dt", dt), ("dt_bias", dt_bias), ("B", B), ("C", C)):
        if arr is not None and arr.dtype != t:
            raise ValueError(f"{OP_TYPE}: {name} must have x's type {t}, got {arr.dtype}")
    s = check_dtype("state", state, OP_TYPE)
    if s not in (F32, t):
        raise ValueError(f"{OP_TYPE}: state must be float or x's type {t}, got {s}")
    if A.dtype != F32:
        raise ValueError(f"{OP_TYPE}: A must be float, got {A.dtype}")
    if D is not None and D.dtype not in (F32, t):
        raise ValueError(f"{OP_TYPE}: D must be float or x's type {t}, got {D.dtype}")
    if dt_softplus not in (0, 1):
        raise ValueError(f"{OP_TYPE}: dt_softplus must be 0 or 1, got {dt_softplus}")
    return batch, heads, head_dim, state_size, groups


def _by_head(arr: np.ndarray, heads: int) -> np.ndarray:
    """Return (B, G, N) expanded to (B, H, N): head h reads group h // (H / G)."""
    return np.repeat(arr, heads // arr.shape[1], axis=1)


def selective_state_update(
    state: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None = None,
    *,
    dt_softplus: int = 1,
    compute_dtype: np.dtype | type = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(out, present_state)`` of ``SelectiveStateUpdate`` as the module docstring defines it.

    Raises ValueError for any input the op rejects (``check_inputs``). NaN and Inf propagate.
    """
    state, x, dt, dt_bias, A, B, C, D = as_arrays(state, x, dt, dt_bias, A, B, C, D)
    _, heads, _, _, _ = check_inputs(state, x, dt, dt_bias, A, B, C, D, dt_softplus)
    t, s_type, cd = x.dtype, state.dtype, compute_dtype_of(compute_dtype)
    r_t = functools.partial(round_in, dtype=t, compute_dtype=cd)  # round_T, back in the compute type

    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        d = dt.astype(cd)
        if dt_bias is not None:
            d = r_t(d + dt_bias.astype(cd))
        if dt_softplus:
            d = np.where(d > SOFTPLUS_THRESHOLD, d, r_t(np.log1p(np.exp(d))))
        dA = np.exp(d * A.astype(cd))  # (B, H)
        b_h, c_h = _by_head(B, heads).astype(cd), _by_head(C, heads).astype(cd)  # (B, H, N)
        dB = r_t(d[..., None] * b_h)
        dBx = r_t(dB[:, :, None, :] * x.astype(cd)[..., None])  # (B, H, P, N)
        s = state.astype(cd) * dA[..., None, None] + dBx  # two roundings in float32, as the graph does
        s = round_in(s, s_type, cd)
        y = r_t(np.sum(r_t(s) * c_h[:, :, None, :], axis=-1, dtype=cd))
        if D is not None:
            y = r_t(y + r_t(x.astype(cd) * D.astype(cd)[:, None]))
    return y.astype(t), s.astype(s_type)


def budget_bounds(
    state: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None = None,
    *,
    dt_softplus: int = 1,
    transcendental_error: float = TRANSCENDENTAL_ERROR,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Return ``{"out": (reference, lo, hi), "present_state": (reference, lo, hi)}``, float64 arrays.

    [lo, hi] holds every value a correct kernel may produce (docs/selective_state_update.md, accuracy
    budget): the formula followed with intervals, widened only where the contract leaves the last bits
    free — exp and log1p (``transcendental_error`` relative, plus the float32 subnormal spacing), FMA or
    not in the state update (and in out = y + x * D for a float output), and the order of the readout's
    sum (N + 1 unit roundoffs of float32 times sum_n |round_T(s) * C|). Every rounding to T or S maps the
    interval's ends, so values near a rounding tie may land on either neighbour. ``reference`` is the
    float64 evaluation (``compute_dtype=np.float64``), which decides where NaN and Inf must be.
    """
    state, x, dt, dt_bias, A, B, C, D = as_arrays(state, x, dt, dt_bias, A, B, C, D)
    _, heads, _, state_size, _ = check_inputs(state, x, dt, dt_bias, A, B, C, D, dt_softplus)
    point_out, point_state = selective_state_update(
        state, x, dt, dt_bias, A, B, C, D, dt_softplus=dt_softplus, compute_dtype=np.float64
    )
    t, s_type = x.dtype, state.dtype
    e, abs_e = transcendental_error, 4 * TINY32

    def f64(a: np.ndarray) -> np.ndarray:
        return np.asarray(a).astype(np.float64)

    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        d_lo = d_hi = f64(dt)
        if dt_bias is not None:
            d_lo, d_hi = round_interval(d_lo + f64(dt_bias), d_hi + f64(dt_bias), F32, t)
        if dt_softplus:
            # softplus is increasing; the kernel's float32 exp and log1p each err by up to e (relative).
            def softplus(v: np.ndarray, sign: float) -> np.ndarray:
                sp = np.log1p(np.exp(v)) * (1 + sign * 2 * e) + sign * abs_e
                return np.where(v > SOFTPLUS_THRESHOLD, v, round_interval(sp, sp, F32, t)[0])

            d_lo, d_hi = softplus(d_lo, -1.0), softplus(d_hi, 1.0)
        a = f64(A)
        p_lo, p_hi = round_interval(*mul_interval(d_lo, d_hi, a, a), F32)
        dA_lo = np.maximum(np.exp(p_lo) * (1 - e) - abs_e, 0.0)
        dA_hi = np.exp(p_hi) * (1 + e) + abs_e
        dA_lo, dA_hi = round_interval(dA_lo, dA_hi, F32)

        b_h, c_h = f64(_by_head(B, heads)), f64(_by_head(C, heads))
        dB = round_interval(*mul_interval(d_lo[..., None], d_hi[..., None], b_h, b_h), F32, t)
        xv = f64(x)[..., None]
        dBx_lo, dBx_hi = round_interval(*mul_interval(dB[0][:, :, None, :], dB[1][:, :, None, :], xv, xv), F32, t)
        sv = f64(state)
        prod_lo, prod_hi = mul_interval(sv, sv, dA_lo[..., None, None], dA_hi[..., None, None])
        # Mul then Add (two float32 roundings, the graph's) or one FMA: the budget accepts both.
        q_lo, q_hi = round_interval(prod_lo, prod_hi, F32)
        two_lo, two_hi = round_interval(q_lo + dBx_lo, q_hi + dBx_hi, F32)
        one_lo, one_hi = round_interval(prod_lo + dBx_lo, prod_hi + dBx_hi, F32)
        s_lo, s_hi = round_interval(np.minimum(two_lo, one_lo), np.maximum(two_hi, one_hi), s_type)

        st_lo, st_hi = round_interval(s_lo, s_hi, t)
        cv = c_h[:, :, None, :]
        term_lo, term_hi = mul_interval(st_lo, st_hi, cv, cv)
        magnitude = np.sum(np.maximum(np.abs(term_lo), np.abs(term_hi)), axis=-1)
        slack = (state_size + 1) * (U32 * magnitude + 2 * TINY32)
        y_lo, y_hi = round_interval(np.sum(term_lo, axis=-1) - slack, np.sum(term_hi, axis=-1) + slack, F32, t)
        if D is not None:
            xd_exact = f64(x) * f64(D)[:, None]
            xd = round_interval(xd_exact, xd_exact, F32, t)[0]
            out_lo, out_hi = round_interval(y_lo + xd, y_hi + xd, F32, t)
            if t == F32:  # a float32 kernel may fuse y + x * D into one FMA
                fma_lo, fma_hi = round_interval(y_lo + xd_exact, y_hi + xd_exact, F32)
                out_lo, out_hi = np.minimum(out_lo, fma_lo), np.maximum(out_hi, fma_hi)
        else:
            out_lo, out_hi = y_lo, y_hi
    return {"out": (f64(point_out), out_lo, out_hi), "present_state": (f64(point_state), s_lo, s_hi)}


def budget_report(
    out: np.ndarray,
    present_state: np.ndarray,
    state: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None = None,
    *,
    dt_softplus: int = 1,
    transcendental_error: float = TRANSCENDENTAL_ERROR,
) -> tuple[bool, str]:
    """Return (within budget, message) for a kernel's ``out`` and ``present_state`` on these inputs.

    Both outputs must have the reference's shapes and dtypes and lie, element by element, in the
    intervals of ``budget_bounds``; NaN exactly where the float64 reference has NaN, infinities equal.
    """
    bounds = budget_bounds(
        state, x, dt, dt_bias, A, B, C, D, dt_softplus=dt_softplus, transcendental_error=transcendental_error
    )
    return report_within(
        bounds, {"out": (out, np.asarray(x).dtype), "present_state": (present_state, np.asarray(state).dtype)}
    )


def _evaluate_node(
    state: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None = None,
    A: np.ndarray | None = None,
    B: np.ndarray | None = None,
    C: np.ndarray | None = None,
    D: np.ndarray | None = None,
    dt_softplus: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``selective_state_update`` of a node's inputs and attributes."""
    if A is None or B is None or C is None:
        raise ValueError(f"{OP_TYPE} needs the inputs A, B and C")
    return selective_state_update(
        state, x, dt, dt_bias, A, B, C, D, dt_softplus=1 if dt_softplus is None else int(dt_softplus)
    )


#: ``onnx.reference`` implementation, so ``ReferenceEvaluator`` runs fused models.
SelectiveStateUpdate = reference_op(DOMAIN, OP_TYPE, _evaluate_node)
