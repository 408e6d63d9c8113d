"""SelectiveStateUpdate's special values (docs/selective_state_update.md, Math): the float32 evaluation's, as the
exported graph's stock ops compute them, in the CPU kernel, the model-local function body run by stock ONNX
Runtime, the numpy reference (float32 and float64) and the accuracy budget alike.

The sweep (``special_cases``): dt * A past float32's exp overflow (88.72) and underflow (-103.97) in both
directions, with dt_softplus 0 and 1, over state rows of zeros, subnormals, huge values and an Inf; a readout
whose float32 sum overflows in some orders; NaN, +Inf and -Inf in each input; every (T, S) pair. The CPU kernel
runs it at every instruction-set level in test_selective_state_update_kernel.py, the CUDA kernel and its host
emulation in test_kernel_cuda_decode.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
import pytest

from fusion.function import selective_state_update as ssu_function
from fusion.reference._bounds import OVERFLOW32, Outcomes, float32_range
from fusion.reference.selective_state_update import budget_bounds, budget_report, selective_state_update
from tests._decode_step import BFLOAT16, DTYPE_IDS, DTYPES, FLOAT, FLOAT16, one_node_model, run

OP = "SelectiveStateUpdate"
NAMES = ("state", "x", "dt", "dt_bias", "A", "B", "C", "D")
TYPE_COMBOS = [(t, s) for t in DTYPES for s in dict.fromkeys((FLOAT, t))]
TYPE_IDS = [f"T{DTYPE_IDS[t]}-S{DTYPE_IDS[s]}" for t, s in TYPE_COMBOS]

#: d * A of head h at d = 40 (A = target / 40): just below and past exp's float32 overflow (88.72), far past it,
#: past float32's range in the product itself (1e39); exp in float32's subnormals (-87.5), at its underflow to 0
#: (-104.5, where the budget admits the smallest subnormals too) and past it. Batch row 1 has d = -40
#: (dt_softplus 0: the opposite products) or 25 (dt_softplus 1: d > 20 is dt itself).
DECAY_TARGETS = (88.5, 88.75, 100.0, 1e39, -87.5, -104.5, -110.0, -1e4)
#: Where each input gets its special value: one element, in head 2 or group 0/1 (B: heads 0-3, C: heads 4-7).
SPECIAL_AT = {
    "state": (1, 2, 3, 4),
    "x": (1, 2, 3),
    "dt": (1, 2),
    "dt_bias": (2,),
    "A": (2,),
    "B": (1, 0, 4),
    "C": (1, 1, 4),
    "D": (2,),
}


def base_inputs(rng: np.random.Generator, t: np.dtype, s: np.dtype, state_size: int) -> dict[str, np.ndarray | None]:
    """Seeded ordinary inputs: batch 2, 8 heads of 5 rows in 2 groups; D of type T with a half state, else float."""
    batch, heads, head_dim, groups = 2, 8, 5, 2
    return {
        "state": rng.standard_normal((batch, heads, head_dim, state_size)).astype(s),
        "x": rng.standard_normal((batch, heads, head_dim)).astype(t),
        "dt": (rng.standard_normal((batch, heads)) - 2).astype(t),
        "dt_bias": rng.standard_normal(heads).astype(t),
        "A": -np.exp(rng.uniform(-1, 3, heads)).astype(np.float32),
        "B": rng.standard_normal((batch, groups, state_size)).astype(t),
        "C": rng.standard_normal((batch, groups, state_size)).astype(t),
        "D": rng.standard_normal(heads).astype(FLOAT if s == FLOAT else t),
    }


def _state_rows(rng: np.random.Generator, s: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """State rows p = 0..4 of every head: zeros (0 * Inf), subnormals of S, ordinary, huge for S, one +Inf."""
    sign = np.where(rng.random(shape[:-2] + (shape[-1],)) < 0.5, -1.0, 1.0)
    tiny, huge = (6e-8, 6e4) if s == FLOAT16 else (1e-40, 1e30)
    rows = np.empty(shape, np.float64)
    rows[..., 0, :] = 0.0
    rows[..., 1, :] = tiny * sign
    rows[..., 2, :] = rng.standard_normal(shape[:-2] + (shape[-1],))
    rows[..., 3, :] = huge * sign
    rows[..., 4, :] = rng.standard_normal(shape[:-2] + (shape[-1],))
    rows[..., 4, 0] = np.inf
    return rows.astype(np.float32).astype(s)


def special_cases(
    t: np.dtype, s: np.dtype, dt_softplus: int, state_size: int = 19
) -> Iterator[tuple[str, dict[str, np.ndarray | None]]]:
    """Yield (case name, inputs) of the special-value sweep for x's type ``t``, the state's ``s`` (seeded)."""
    rng = np.random.default_rng([DTYPES.index(t), DTYPES.index(s), dt_softplus, state_size])

    decay = base_inputs(rng, t, s, state_size)
    decay["A"] = (np.array(DECAY_TARGETS) / 40).astype(np.float32)
    decay["dt"] = np.stack([np.full(8, 40.0), np.full(8, 25.0 if dt_softplus else -40.0)]).astype(t)
    decay["dt_bias"] = np.zeros(8, t)
    decay["state"] = _state_rows(rng, s, decay["state"].shape)
    yield "decay", decay

    # dA about 1, the state near float32's largest value (float16: its own), C up to ~4: terms past float32's
    # range, partial sums that overflow in some orders and not in others.
    readout = base_inputs(rng, t, s, state_size)
    readout["dt"] = np.full((2, 8), -8.0, t)
    readout["dt_bias"] = None
    readout["A"] = np.full(8, -1e-3, np.float32)
    big = 65504.0 if s == FLOAT16 else 3e38
    readout["state"] = (np.clip(rng.standard_normal(readout["state"].shape), -1, 1) * big).astype(np.float32).astype(s)
    readout["C"] = (rng.standard_normal(readout["C"].shape) * 4).astype(t)
    yield "readout", readout

    for name, at in SPECIAL_AT.items():
        for value in (np.nan, np.inf, -np.inf):
            inputs = base_inputs(rng, t, s, state_size)
            inputs["dt"][0, 2] = 0  # with dt_softplus 0, d = 0: 0 * Inf where A is infinite
            inputs[name][at] = value
            yield f"{name}={value}", inputs


def run_function(inputs: dict[str, np.ndarray | None], dt_softplus: int) -> list[np.ndarray]:
    """The op's model-local function body on stock ONNX Runtime's CPU (no library). The body needs every input:
    an absent dt_bias is -0.0s, as the rewriter writes it."""
    if inputs["dt_bias"] is None:
        inputs = dict(inputs, dt_bias=np.full(inputs["A"].shape, -0.0, inputs["x"].dtype))
    outputs = [("out", inputs["x"].dtype), ("present_state", inputs["state"].dtype)]
    model = one_node_model(OP, [(n, inputs[n]) for n in NAMES], outputs, dt_softplus=dt_softplus)
    model.functions.append(ssu_function.make_function(18))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    results = sess.run(None, {n: v for n, v in inputs.items() if v is not None})
    return [r.astype(dtype) for r, (_, dtype) in zip(results, outputs, strict=True)]


def run_kernel(inputs: dict[str, np.ndarray | None], dt_softplus: int) -> list[np.ndarray]:
    """The library's CPU kernel."""
    outputs = [("out", inputs["x"].dtype), ("present_state", inputs["state"].dtype)]
    return run(OP, [(n, inputs[n]) for n in NAMES], outputs, dt_softplus=dt_softplus)


def class_of(values: np.ndarray) -> np.ndarray:
    """Per element: 0 NaN, 1 +Inf, 2 -Inf, 3 finite."""
    v = np.asarray(values).astype(np.float64)
    return np.select([np.isnan(v), v == np.inf, v == -np.inf], [0, 1, 2], 3)


def class_allowed(values: np.ndarray, allowed: Outcomes) -> np.ndarray:
    """Where the element's class (NaN, +Inf, -Inf, finite) is among its outcomes, whatever its finite value."""
    v = np.asarray(values).astype(np.float64)
    return np.choose(class_of(v), [allowed.nan, allowed.pos_inf, allowed.neg_inf, allowed.interval])


def single_class(allowed: Outcomes) -> np.ndarray:
    """Where the outcomes are of one class only (the special value, or finiteness, is decided)."""
    return (allowed.nan.astype(int) + allowed.pos_inf + allowed.neg_inf + allowed.interval) == 1


# --- every implementation against the budget, over the sweep ---------------------------------------------------


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=TYPE_IDS)
@pytest.mark.parametrize("dt_softplus", [0, 1])
def test_kernel_function_and_reference_agree(t: np.dtype, s: np.dtype, dt_softplus: int) -> None:
    """On every case: the CPU kernel, the float32 reference and (for float) the function body within the budget;
    the special values of those and of the float64 reference among the outcomes, and where the outcomes leave
    one class (NaN, +Inf, -Inf or finite), all of them that class. For float16 only the function body's special
    values are checked: ONNX Runtime's CPU runs fp16 Softplus and Mul in float32 and drops the Casts between
    them, 1 fp16 ulp off in places (test_decode_step_functions.py); it has no bfloat16 Softplus at all."""
    failures = []
    decided = ambiguous = 0
    for case, inputs in special_cases(t, s, dt_softplus):
        args = [inputs[n] for n in NAMES]
        results = {
            "kernel": run_kernel(inputs, dt_softplus),
            "float32 reference": selective_state_update(*args, dt_softplus=dt_softplus),
            "float64 reference": selective_state_update(*args, dt_softplus=dt_softplus, compute_dtype=np.float64),
        }
        if t != BFLOAT16:
            results["function"] = run_function(inputs, dt_softplus)
        for label in ("kernel", "float32 reference") + (("function",) if t == FLOAT else ()):
            ok, msg = budget_report(*results[label], *args, dt_softplus=dt_softplus)
            if not ok:
                failures.append(f"{case}: {label}: {msg}")
        bounds = budget_bounds(*args, dt_softplus=dt_softplus)
        for i, name in enumerate(("out", "present_state")):
            allowed = bounds[name][1]
            one = single_class(allowed)
            decided, ambiguous = decided + int(one.sum()), ambiguous + int((~one).sum())
            for label, result in results.items():
                bad = ~class_allowed(result[i], allowed)
                if bad.any():
                    at = tuple(int(j) for j in np.argwhere(bad)[0])
                    failures.append(f"{case}: {label} {name}: {int(bad.sum())} special values outside, e.g. at {at}")
            classes = {label: class_of(result[i])[one] for label, result in results.items()}
            if len({c.tobytes() for c in classes.values()}) > 1:
                failures.append(f"{case} {name}: the decided classes differ between {sorted(classes)}")
    assert not failures, "\n".join(failures[:20])
    # The sweep decides most elements' special values; only the readout's overflowing sums and exp's own threshold
    # leave a choice.
    assert ambiguous < 0.05 * (decided + ambiguous), (decided, ambiguous)


# --- what the budget's outcomes accept and reject -------------------------------------------------------------


def _decay_case(t: np.dtype, s: np.dtype) -> dict[str, np.ndarray | None]:
    return next(inputs for case, inputs in special_cases(t, s, 0) if case == "decay")


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=TYPE_IDS)
def test_float32_overflow_of_the_decay_is_the_contract(t: np.dtype, s: np.dtype) -> None:
    """d * A = 100: dA = exp(100) is Inf in float32 (finite in float64), so a zero state gives NaN (0 * Inf) in
    present_state and out, a nonzero one Inf. The budget requires exactly that, and rejects the float64
    evaluation without float32's range (the finite state * dA + dBx)."""
    inputs = _decay_case(t, s)
    args = [inputs[n] for n in NAMES]
    _, allowed = budget_bounds(*args, dt_softplus=0)["present_state"]
    head = 2  # d * A = 100 in batch row 0
    assert allowed.nan_only[0, head, 0].all()  # zeros: 0 * Inf
    assert (allowed.pos_inf | allowed.neg_inf)[0, head, 2].all() and not allowed.interval[0, head, 2].any()
    out_allowed = budget_bounds(*args, dt_softplus=0)["out"][1]
    assert out_allowed.nan_only[0, head, 0]
    # float64 without float32's range: dA = exp(100) = 2.7e43, so 0 * dA + dBx is finite
    with np.errstate(all="ignore"):
        d = inputs["dt"].astype(np.float64)
        dA = np.exp(d * inputs["A"].astype(np.float64))
        assert np.isfinite(dA[0, head])
        b = np.repeat(inputs["B"].astype(np.float64), 4, axis=1)
        dbx = (d[..., None] * b)[:, :, None, :] * inputs["x"].astype(np.float64)[..., None]
        finite_state = inputs["state"].astype(np.float64) * dA[..., None, None] + dbx
    wrong = selective_state_update(*args, dt_softplus=0)[1].copy()
    wrong[0, head, 0] = finite_state[0, head, 0].astype(np.float32).astype(s)
    ok, msg = budget_report(selective_state_update(*args, dt_softplus=0)[0], wrong, *args, dt_softplus=0)
    assert (
        not ok
        and f"present_state: {wrong.shape[-1]} of {wrong.size} elements outside the budget ({wrong.shape[-1]} NaN"
        in msg
    ), msg


def test_dA_underflow_times_an_infinite_state_is_nan() -> None:
    """d * A = -110: dA = exp(-110) is 0 in float32, so an infinite state gives NaN, not Inf. At -104.5 the exact
    exp is 0.3 of float32's smallest subnormal, which a float32 exp within the budget may return: NaN or Inf."""
    inputs = _decay_case(FLOAT, FLOAT)
    _, allowed = budget_bounds(*[inputs[n] for n in NAMES], dt_softplus=0)["present_state"]
    # batch row 0, head 6: d * A = -110; head 5: -104.5. Row 4 of the state starts with +Inf
    assert allowed.nan_only[0, 6, 4, 0]
    assert not allowed.nan[0, 6, 4, 1:].any()
    assert allowed.nan[0, 5, 4, 0] and allowed.pos_inf[0, 5, 4, 0] and not allowed.interval[0, 5, 4, 0]


def test_outcomes_follow_float32() -> None:
    """The budget's arithmetic: 0 * Inf and Inf - Inf are NaN, products past float32's range are Inf, a sum whose
    partial sums overflow in some orders admits Inf and NaN as well as the finite values."""
    of = Outcomes.of
    zero_inf = of(np.array([0.0, 2.0])).mul(of(np.array([np.inf, np.inf])))
    assert zero_inf.nan_only.tolist() == [True, False] and zero_inf.pos_inf.tolist() == [False, True]
    cancel = of(np.array([np.inf])).add(of(np.array([-np.inf])))
    assert cancel.nan_only.all()
    overflow = of(np.array([3e38])).mul(of(np.array([2.0]))).rounded(np.float32)
    assert overflow.pos_inf.all() and not overflow.interval.any()
    # 3e38 + 3e38 - 3e38: 3e38 in one order, Inf in another; never -Inf or NaN
    terms = of(np.array([[3e38, 3e38, -3e38]])).float32_sum().rounded(np.float32)
    assert terms.pos_inf.all() and not terms.neg_inf.any() and not terms.nan.any()
    assert terms.allows(np.array([3e38]).astype(np.float32).astype(np.float64)).all()
    assert not terms.allows(np.array([1e38])).any()
    # two terms past float32's range, of both signs: Inf - Inf (NaN) in one order, +-Inf with an FMA
    both = of(np.array([[2e38, 2e38, -2e38, -2e38]])).float32_sum()
    assert both.nan.all() and both.pos_inf.all() and both.neg_inf.all() and both.allows(np.array([0.0])).all()
    # far from float32's range: only the interval
    plain = of(np.array([[1.0, 2.0, -0.5]])).float32_sum()
    assert not (plain.nan | plain.pos_inf | plain.neg_inf).any() and plain.lo[0] < 2.5 < plain.hi[0]


def test_float32_range_is_where_float32_rounds_to_inf_and_zero() -> None:
    """float32_range (the float64 evaluation's float32 operations) overflows and underflows exactly where a float32
    rounding does, and keeps float64's value elsewhere."""
    edges = [OVERFLOW32, 2.0**-150, 1e-300, 1e300]
    v = np.array([x * sign for x in edges + [np.nextafter(x, 0.0) for x in edges[:2]] for sign in (1, -1)])
    v = np.concatenate([v, [np.nextafter(2.0**-150, 1.0), 1.0 + 2.0**-40, np.nan]])
    with np.errstate(over="ignore"):
        as_float32 = v.astype(np.float32).astype(np.float64)
    special = ~np.isfinite(as_float32) | (as_float32 == 0)
    np.testing.assert_array_equal(float32_range(v)[special], as_float32[special])
    np.testing.assert_array_equal(np.signbit(float32_range(v)[special]), np.signbit(as_float32[special]))
    np.testing.assert_array_equal(float32_range(v)[~special], v[~special])
