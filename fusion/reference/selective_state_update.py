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
Special values are the float32 evaluation's, as the graph's stock ops compute them: dA = exp(d * A) is Inf
past d * A = 88.72 and 0 below -103.97 (float64 would not overflow there), and then state * dA is NaN where
the state is 0 (or Inf).

``compute_dtype=np.float32`` mirrors the kernels; ``np.float64`` gives the float64 evaluation with the same
rounding points, each float32 operation's result taken to float32's range (``float32_range``: Inf where a
float32 result overflows, 0 where it underflows), so that its NaN and Inf are the float32 evaluation's.
``budget_report`` checks a result against the accuracy budget (the outcomes a correct evaluation may give,
per element, see ``budget_bounds``).
"""

from __future__ import annotations

import functools

import numpy as np

from fusion.reference._bounds import (
    F32,
    F64,
    TINY32,
    TRANSCENDENTAL_ERROR,
    Outcomes,
    check_dtype,
    compute_dtype_of,
    float32_range,
    report_within,
    round_in,
    round_to,
)
from fusion.reference._common import DOMAIN, as_arrays, reference_op

OP_TYPE = "SelectiveStateUpdate"
#: torch's softplus threshold: above it, softplus(v) is v.
SOFTPLUS_THRESHOLD = 20.0
#: An exact exp below this (an eighth of float32's smallest subnormal, 2^-149) is 0 in float32: the budget's
#: absolute slack for exp in the subnormals (2^-148) stops there, so that an underflow to 0 is decided.
UNDERFLOW_EXP = 2.0**-152


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

    Raises ValueError for any input the op rejects (``check_inputs``). NaN and Inf propagate, and overflow as
    float32 does (also with ``compute_dtype=np.float64``).
    """
    state, x, dt, dt_bias, A, B, C, D = as_arrays(state, x, dt, dt_bias, A, B, C, D)
    _, heads, _, _, _ = check_inputs(state, x, dt, dt_bias, A, B, C, D, dt_softplus)
    t, s_type, cd = x.dtype, state.dtype, compute_dtype_of(compute_dtype)
    r_t = functools.partial(round_in, dtype=t, compute_dtype=cd)  # round_T, back in the compute type
    # A float32 operation's result: in float64, taken to float32's range (a rounding to T or S is one already).
    f32 = float32_range if cd == F64 else np.asarray

    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        d = dt.astype(cd)
        if dt_bias is not None:
            d = r_t(d + dt_bias.astype(cd))
        if dt_softplus:
            d = np.where(d > SOFTPLUS_THRESHOLD, d, r_t(np.log1p(np.exp(d))))
        dA = f32(np.exp(f32(d * A.astype(cd))))  # (B, H); float32: Inf past d * A = 88.72, 0 below -103.97
        b_h, c_h = _by_head(B, heads).astype(cd), _by_head(C, heads).astype(cd)  # (B, H, N)
        dB = r_t(d[..., None] * b_h)
        dBx = r_t(dB[:, :, None, :] * x.astype(cd)[..., None])  # (B, H, P, N)
        s = f32(f32(state.astype(cd) * dA[..., None, None]) + dBx)  # two roundings in float32, as the graph does
        s = round_in(s, s_type, cd)
        y = r_t(f32(np.sum(f32(r_t(s) * c_h[:, :, None, :]), axis=-1, dtype=cd)))
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
) -> dict[str, tuple[np.ndarray, Outcomes]]:
    """Return ``{"out": (reference, outcomes), "present_state": (reference, outcomes)}``.

    ``outcomes`` holds, per element, every value a correct kernel may produce (docs/selective_state_update.md,
    accuracy budget): an interval, and +Inf, -Inf or NaN where some admissible float32 evaluation gives them.
    The formula is followed with ``Outcomes`` through every float32 operation, widened only where the contract
    leaves the last bits free — exp and log1p (``transcendental_error`` relative, plus the float32 subnormal
    spacing), FMA or not in the state update (and in out = y + x * D for a float output), and the order of the
    readout's sum (N + 1 unit roundoffs of float32 times sum_n |round_T(s) * C|, and Inf where a partial sum can
    overflow). Every rounding to T or S maps the interval's ends, so values near a rounding tie may land on
    either neighbour. ``reference`` is the float64 evaluation (``compute_dtype=np.float64``), float64 arrays.
    """
    state, x, dt, dt_bias, A, B, C, D = as_arrays(state, x, dt, dt_bias, A, B, C, D)
    _, heads, _, _, _ = check_inputs(state, x, dt, dt_bias, A, B, C, D, dt_softplus)
    point_out, point_state = selective_state_update(
        state, x, dt, dt_bias, A, B, C, D, dt_softplus=dt_softplus, compute_dtype=np.float64
    )
    t, s_type = x.dtype, state.dtype
    e, abs_e = transcendental_error, 4 * TINY32
    of = Outcomes.of

    d = of(dt)
    if dt_bias is not None:
        d = d.add(of(dt_bias)).rounded(F32, t)
    if dt_softplus:
        # softplus is increasing (at the threshold too); the kernel's float32 exp and log1p each err by up to e.
        def softplus(v: np.ndarray, sign: float) -> np.ndarray:
            sp = np.maximum(np.log1p(np.exp(v)) * (1 + sign * 2 * e) + sign * abs_e, 0.0)
            return np.where(v > SOFTPLUS_THRESHOLD, v, round_to(round_to(sp, F32), t))

        d = d.increasing(lambda v: softplus(v, -1.0), lambda v: softplus(v, 1.0))
    p = d.mul(of(A)).rounded(F32)  # (B, H)
    # exp's absolute error in float32's subnormals; an exact result below UNDERFLOW_EXP is 0 (exp(-inf) too)
    dA = p.increasing(
        lambda v: np.maximum(np.exp(v) * (1 - e) - abs_e, 0.0),
        lambda v: np.exp(v) * (1 + e) + np.where(np.exp(v) >= UNDERFLOW_EXP, abs_e, 0.0),
    ).rounded(F32)
    b_h, c_h = of(_by_head(B, heads)), of(_by_head(C, heads))  # (B, H, N)
    dB = d[..., None].mul(b_h).rounded(F32, t)
    dBx = dB[:, :, None, :].mul(of(x)[..., None]).rounded(F32, t)  # (B, H, P, N)
    product = of(state).mul(dA[..., None, None])
    # Mul then Add (two float32 roundings, the graph's) or one FMA: the budget accepts both.
    two = product.rounded(F32).add(dBx).rounded(F32)
    one = product.add(dBx).rounded(F32)
    s = two.union(one).rounded(s_type)

    terms = s.rounded(t).mul(c_h[:, :, None, :])
    y = terms.float32_sum(axis=-1).rounded(F32, t)
    out = y
    if D is not None:
        xd_exact = of(x).mul(of(D)[:, None])
        out = y.add(xd_exact.rounded(F32, t)).rounded(F32, t)
        if t == F32:  # a float32 kernel may fuse y + x * D into one FMA
            out = out.union(y.add(xd_exact).rounded(F32))
    return {"out": (point_out.astype(np.float64), out), "present_state": (point_state.astype(np.float64), s)}


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

    Both outputs must have the reference's shapes and dtypes and be, element by element, among the outcomes
    of ``budget_bounds``: inside the interval, or an Inf or NaN that some admissible float32 evaluation gives.
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
