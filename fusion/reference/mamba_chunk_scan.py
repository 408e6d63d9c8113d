"""Numpy reference of ``ai.mambafuse::MambaChunkScan`` — the executable form of docs/mamba_chunk_scan.md.

The Mamba-2 selective scan over a prompt: the recurrence of ``SelectiveStateUpdate`` applied token by token,
with the rounding points of transformers' ``mamba2_chunk_scan`` torch fallback (5.24 and 5.25, every Mamba-2
family) as the exporters trace it. For every batch row b, head h (group g = h // (H / G)), token t, head channel
p and state index n, with T = x's type (B's and C's), round_T the rounding of a float32 value to dt's type (T, or
float: no rounding; a graph that computes the time step in float32 and widens x, B and C from T passes dt so)::

    d1  = round_T(dt[b,t,h] + dt_bias[h])                 # dt_bias optional: d1 = dt[b,t,h]
    d2  = dt_softplus ? (d1 > 20 ? d1 : round_T(log1p(exp(d1)))) : d1
    d   = min(max(d2, round_T(dt_min)), round_T(dt_max))  # the model's time_step_limit, in T
    a   = f32(A[h]) * f32(d)                              # float32, one rounding
    u   = f32(x[b,t,h,p]) * f32(d)                        # float32, one rounding
    S_t = exp(a) * S_{t-1} + u * f32(B[b,t,g,n])          # S_0 = initial_state (float32) or 0
    y   = sum_n f32(C[b,t,g,n]) * S_t + f32(D[h]) * f32(x[b,t,h,p])     # D optional
    out = y (float32);  final_state = S_T (float32)

``state_layout`` 1 passes both states transposed, (B, H, N, P) (ORT's LinearAttention and mobius builds keep
their state so); the math is the same.

Everything after ``d`` is float32 in the fallback, but summed in the chunked order of the SSD algorithm (exp of
segment sums of ``a`` within chunks of Q tokens, C·Bᵀ products, chunk states, a pass over chunks). The contract
is the recurrence, not that order: ``mamba_chunk_scan(..., chunk_size=None, compute_dtype=np.float64)`` is the
token-by-token evaluation in float64 after the rounding points of ``d``, ``a`` and ``u``, and ``budget_report``
accepts a result within a bound that every chunking of a float32 evaluation meets (``budget_bounds``).
``chunk_size=Q`` evaluates the chunked algorithm (float32 by default, as the graph and the kernels do).
"""

from __future__ import annotations

import numpy as np

from fusion.reference._bounds import F32, F64, check_dtype, round_to
from fusion.reference._common import DOMAIN, as_arrays, reference_op

OP_TYPE = "MambaChunkScan"
#: torch's softplus threshold: above it, softplus(v) is v.
SOFTPLUS_THRESHOLD = 20.0
#: float32's unit roundoff (half an ulp of 1).
U32 = 2.0**-24
#: The budget's relative bound per contribution, in units of U32: a fixed part (the discretization products, exp's
#: error — under 4 ulp in ORT's MLAS and the kernels' expf — the skip's product) ...
BUDGET_FIXED = 16.0
#: ... plus this many U32 per term of the longest float32 sum a chunking forms (the readout's N state terms and up
#: to t positions of the prompt) ...
BUDGET_PER_TERM = 2.0
#: ... plus this many U32 per unit of the decay exponents' span: a chunked evaluation forms exp(cumsum(a)) and
#: differences of float32 cumulative sums, whose absolute error grows with sum |a| over the positions summed.
BUDGET_PER_DECAY = 4.0


def check_inputs(
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None,
    initial_state: np.ndarray | None,
    dt_softplus: int = 1,
    state_layout: int = 0,
) -> tuple[int, int, int, int, int, int]:
    """Return (batch, length, heads, head_dim, groups, state_size), or raise ValueError naming the bad input.

    x (B, T, H, P) of type T; dt (B, T, H) of type T or float and dt_bias (H) of dt's type; A (H) float; B and C
    (B, T, G, N) of type T with G >= 1 dividing H; D (H) float or T; initial_state (B, H, P, N) (state_layout 1:
    (B, H, N, P)) float or T. T >= 1.
    """
    t = check_dtype("x", x, OP_TYPE)
    if x.ndim != 4:
        raise ValueError(f"{OP_TYPE}: x must be (B, T, H, P), got shape {list(x.shape)}")
    batch, length, heads, head_dim = x.shape
    if length < 1:
        raise ValueError(f"{OP_TYPE}: the prompt must have at least one token, got T = {length}")
    for name, arr in (("B", B), ("C", C)):
        if arr.ndim != 4 or arr.shape[:2] != (batch, length):
            raise ValueError(f"{OP_TYPE}: {name} must have shape [{batch}, {length}, G, N], got {list(arr.shape)}")
    if B.shape != C.shape:
        raise ValueError(f"{OP_TYPE}: B and C must have the same shape, got {list(B.shape)} and {list(C.shape)}")
    groups, state_size = B.shape[2], B.shape[3]
    if groups < 1 or heads % groups != 0:
        raise ValueError(f"{OP_TYPE}: the number of heads H = {heads} must be a multiple of the groups G = {groups}")
    expect = {
        "dt": (dt, (batch, length, heads)),
        "dt_bias": (dt_bias, (heads,)),
        "A": (A, (heads,)),
        "D": (D, (heads,)),
        "initial_state": (
            initial_state,
            (batch, heads, state_size, head_dim) if state_layout == 1 else (batch, heads, head_dim, state_size),
        ),
    }
    for name, (arr, shape) in expect.items():
        if arr is not None and arr.shape != shape:
            raise ValueError(f"{OP_TYPE}: {name} must have shape {list(shape)}, got {list(arr.shape)}")
    for name, arr in (("B", B), ("C", C)):
        if arr.dtype != t:
            raise ValueError(f"{OP_TYPE}: {name} must have x's type {t}, got {arr.dtype}")
    if dt.dtype not in (t, F32):
        raise ValueError(f"{OP_TYPE}: dt must have x's type {t} or be float, got {dt.dtype}")
    if dt_bias is not None and dt_bias.dtype != dt.dtype:
        raise ValueError(f"{OP_TYPE}: dt_bias must have dt's type {dt.dtype}, got {dt_bias.dtype}")
    if A.dtype != F32:
        raise ValueError(f"{OP_TYPE}: A must be float, got {A.dtype}")
    for name, arr in (("D", D), ("initial_state", initial_state)):
        if arr is not None and arr.dtype not in (F32, t):
            raise ValueError(f"{OP_TYPE}: {name} must be float or x's type {t}, got {arr.dtype}")
    if dt_softplus not in (0, 1):
        raise ValueError(f"{OP_TYPE}: dt_softplus must be 0 or 1, got {dt_softplus}")
    if state_layout not in (0, 1):
        raise ValueError(f"{OP_TYPE}: state_layout must be 0 or 1, got {state_layout}")
    return batch, length, heads, head_dim, groups, state_size


def discretize(
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    dt_softplus: int = 1,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (d, a, u): the time step in dt's type (B, T, H), a = A·d (B, T, H) and u = x·d (B, T, H, P), both
    float32, at the contract's rounding points (in dt's type: x's T, or float)."""
    t = dt.dtype
    # round_to gives float64 holding values of T: exact in float32 (and back in T)
    d32 = dt.astype(F32) if dt_bias is None else round_to(dt.astype(F32) + dt_bias.astype(F32), t).astype(F32)
    if dt_softplus:
        with np.errstate(over="ignore"):
            soft = round_to(np.log1p(np.exp(d32)), t).astype(F32)  # float32 math, one rounding to T
        d32 = np.where(d32 > SOFTPLUS_THRESHOLD, d32, soft)
    lo, hi = round_to(np.float32(dt_min), t).astype(F32), round_to(np.float32(dt_max), t).astype(F32)
    d32 = np.minimum(np.maximum(d32, lo), hi)
    d = d32.astype(t)
    a = A.astype(F32)[None, None, :] * d32
    u = x.astype(F32) * d32[..., None]
    return d, a, u


def _by_head(arr: np.ndarray, heads: int) -> np.ndarray:
    """Return (B, T, G, N) expanded to (B, T, H, N): head h reads group h // (H / G)."""
    return np.repeat(arr, heads // arr.shape[2], axis=2)


def mamba_chunk_scan(
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None = None,
    initial_state: np.ndarray | None = None,
    dt_softplus: int = 1,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    state_layout: int = 0,
    *,
    chunk_size: int | None = None,
    compute_dtype: np.dtype | type = np.float32,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (out (B, T, H, P), final_state (B, H, P, N); state_layout 1: (B, H, N, P)), both float32 (float64
    with ``compute_dtype=np.float64``).

    ``chunk_size=None``: the recurrence token by token. ``chunk_size=Q``: the chunked SSD algorithm with chunks of
    Q tokens (the last one short where Q does not divide T), as transformers' fallback computes it.
    """
    x, dt, dt_bias, A, B, C, D, initial_state = as_arrays(x, dt, dt_bias, A, B, C, D, initial_state)
    batch, length, heads, head_dim, _, state_size = check_inputs(
        x, dt, dt_bias, A, B, C, D, initial_state, dt_softplus, state_layout
    )
    if state_layout == 1 and initial_state is not None:
        # computed as (B, H, P, N) in the same memory order as layout 0 (so the same sums), returned as given
        initial_state = np.ascontiguousarray(initial_state.transpose(0, 1, 3, 2))
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{OP_TYPE}: chunk_size must be at least 1, got {chunk_size}")
    c = np.dtype(compute_dtype)
    if c not in (F32, F64):
        raise ValueError(f"{OP_TYPE}: compute_dtype must be float32 or float64, got {c}")
    _, a, u = discretize(x, dt, dt_bias, A, dt_softplus, dt_min, dt_max)
    a, u = a.astype(c), u.astype(c)
    b_h = _by_head(B, heads).astype(c)  # (B, T, H, N)
    c_h = _by_head(C, heads).astype(c)
    state = np.zeros((batch, heads, head_dim, state_size), c) if initial_state is None else initial_state.astype(c)
    out = np.empty((batch, length, heads, head_dim), c)
    if chunk_size is None:
        for t in range(length):
            state = np.exp(a[:, t])[:, :, None, None] * state + u[:, t, :, :, None] * b_h[:, t, :, None, :]
            out[:, t] = np.einsum("bhpn,bhn->bhp", state, c_h[:, t])
    else:
        for start in range(0, length, chunk_size):
            end = min(start + chunk_size, length)
            out[:, start:end], state = _chunk(
                a[:, start:end], u[:, start:end], b_h[:, start:end], c_h[:, start:end], state
            )
    if D is not None:
        out = out + D.astype(F32).astype(c)[None, None, :, None] * x.astype(F32).astype(c)
    return out, np.ascontiguousarray(state.transpose(0, 1, 3, 2)) if state_layout == 1 else state


def _chunk(
    a: np.ndarray, u: np.ndarray, b: np.ndarray, c: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of the SSD algorithm: a (B, Q, H), u (B, Q, H, P), b and c (B, Q, H, N), state (B, H, P, N).

    Returns (y (B, Q, H, P) without the skip, the state after the chunk)."""
    cumsum = np.cumsum(a, axis=1)  # (B, Q, H)
    q = a.shape[1]
    # decay from position s to l (s <= l): exp(cumsum[l] - cumsum[s]); 0 above the diagonal
    diff = cumsum[:, :, None, :] - cumsum[:, None, :, :]  # (B, l, s, H)
    causal = np.tril(np.ones((q, q), bool))[None, :, :, None]
    with np.errstate(over="ignore"):
        decay = np.where(causal, np.exp(np.where(causal, diff, 0)), 0).astype(a.dtype)
    scores = np.einsum("blhn,bshn->blsh", c, b) * decay  # (B, l, s, H)
    y_diag = np.einsum("blsh,bshp->blhp", scores, u)
    y_off = np.einsum("blhn,bhpn->blhp", c, state) * np.exp(cumsum)[..., None]
    to_end = np.exp(cumsum[:, -1:, :] - cumsum)  # (B, Q, H)
    chunk_state = np.einsum("bshn,bshp->bhpn", b * to_end[..., None], u)
    state = np.exp(cumsum[:, -1])[:, :, None, None] * state + chunk_state
    return y_diag + y_off, state


def budget_bounds(
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None = None,
    initial_state: np.ndarray | None = None,
    dt_softplus: int = 1,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    state_layout: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (out, final_state, out_tolerance, state_tolerance): the float64 evaluation and, per element, the
    largest distance from it that the contract accepts.

    The tolerance is relative to the element's *magnitude*: the same recurrence evaluated on absolute values
    (|C|, |B|, |u|, |initial state|, the decays, |D·x|) — the size of the terms a float32 evaluation sums, whatever
    their order. Per token t it is U32 · (BUDGET_FIXED + BUDGET_PER_TERM · (N + t) + BUDGET_PER_DECAY · L_t) times
    that magnitude, with L_t = sum |a| over the tokens up to t: the bound of a float32 sum of N + t terms, of the
    products and exp that form them, and of the decays' exponents formed as differences of cumulative sums.
    """
    x, dt, dt_bias, A, B, C, D, initial_state = as_arrays(x, dt, dt_bias, A, B, C, D, initial_state)
    out, state = mamba_chunk_scan(
        x, dt, dt_bias, A, B, C, D, initial_state, dt_softplus, dt_min, dt_max, state_layout, compute_dtype=F64
    )  # checks the inputs
    length, state_size = x.shape[1], B.shape[3]
    abs_out, abs_state = mamba_chunk_scan(
        np.abs(x),
        dt,
        dt_bias,
        A,
        np.abs(B),
        np.abs(C),
        None if D is None else np.abs(D),
        None if initial_state is None else np.abs(initial_state),
        dt_softplus,
        dt_min,
        dt_max,
        state_layout,
        compute_dtype=F64,
    )
    # The magnitude evaluation reads |u| as |x|·d: it holds where d >= 0 (softplus, or a non-negative dt_min).
    d, a, _ = discretize(x, dt, dt_bias, A, dt_softplus, dt_min, dt_max)
    if np.any(d.astype(F32) < 0):
        raise ValueError(f"{OP_TYPE}: the budget is defined for a non-negative time step (softplus, or dt_min >= 0)")
    span = np.cumsum(np.abs(a.astype(F64)), axis=1)  # (B, T, H): L_t
    terms = state_size + np.arange(1, length + 1, dtype=F64)[None, :, None]
    relative = U32 * (BUDGET_FIXED + BUDGET_PER_TERM * terms + BUDGET_PER_DECAY * span)  # (B, T, H)
    out_tolerance = relative[..., None] * abs_out
    state_tolerance = (U32 * (BUDGET_FIXED + BUDGET_PER_TERM * length + BUDGET_PER_DECAY * span[:, -1]))[
        :, :, None, None
    ] * abs_state
    return out, state, out_tolerance, state_tolerance


def budget_report(
    out: np.ndarray,
    final_state: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    dt_bias: np.ndarray | None,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray | None = None,
    initial_state: np.ndarray | None = None,
    dt_softplus: int = 1,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    state_layout: int = 0,
) -> tuple[bool, str]:
    """Return (within the budget, a one-line summary): ``out`` and ``final_state`` against the float64 evaluation.

    Defined where every input and the float64 evaluation are finite; a non-finite result there is outside it. An
    empty output (B, P or N = 0) is within the budget when its shape is right ("0 of 0 outside").
    """
    ref_out, ref_state, tol_out, tol_state = budget_bounds(
        x, dt, dt_bias, A, B, C, D, initial_state, dt_softplus, dt_min, dt_max, state_layout
    )
    lines, ok = [], True
    for name, actual, ref, tol in (("out", out, ref_out, tol_out), ("final_state", final_state, ref_state, tol_state)):
        actual = np.asarray(actual, F64)
        if actual.shape != ref.shape:
            return False, f"{name}: shape {list(actual.shape)}, expected {list(ref.shape)}"
        error = np.abs(actual - ref)
        bad = ~(error <= tol)  # NaN counts as outside
        ratio = np.where(tol > 0, error / np.maximum(tol, np.finfo(F64).tiny), np.where(error > 0, np.inf, 0))
        worst = float(np.max(ratio, initial=0.0))  # initial: an empty output (B, P or N = 0) has no worst element
        ok &= not bad.any()
        lines.append(f"{name}: {int(bad.sum())} of {bad.size} outside the budget (worst {worst:.3g} of it)")
    return ok, "; ".join(lines)


def _evaluate(
    x,
    dt,
    dt_bias,
    A,
    B,
    C,
    D=None,
    initial_state=None,
    dt_softplus=1,
    dt_min=0.0,
    dt_max=float("inf"),
    state_layout=0,
) -> tuple[np.ndarray, np.ndarray]:
    return mamba_chunk_scan(x, dt, dt_bias, A, B, C, D, initial_state, dt_softplus, dt_min, dt_max, state_layout)


#: ``onnx.reference`` implementation of the op, for ReferenceEvaluator runs of fused models.
MambaChunkScan = reference_op(DOMAIN, OP_TYPE, _evaluate)
