"""The CPU kernel of ai.mambafuse::SelectiveStateUpdate against fusion/reference/selective_state_update.py
(docs/selective_state_update.md), and the accuracy budget's power to reject wrong results."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest

from fusion.reference._bounds import round_to
from fusion.reference.gated_group_rms_norm import ulp_of
from fusion.reference.selective_state_update import budget_bounds, budget_report, selective_state_update
from tests._decode_step import BFLOAT16, DTYPE_IDS, DTYPES, FLOAT, FLOAT16, run
from tests.test_selective_state_update_special import special_cases

OP = "SelectiveStateUpdate"
NAMES = ("state", "x", "dt", "dt_bias", "A", "B", "C", "D")


def make_inputs(
    rng: np.random.Generator,
    *,
    t: np.dtype,
    s: np.dtype,
    batch: int = 2,
    heads: int = 8,
    head_dim: int = 5,
    state_size: int = 19,
    groups: int = 2,
    d_type: np.dtype | None = FLOAT,
    dt_bias: bool = True,
) -> dict[str, np.ndarray | None]:
    """Return seeded inputs with the magnitudes of a Mamba-2 decode step (dt ~ softplus range, A < 0)."""
    return {
        "state": rng.standard_normal((batch, heads, head_dim, state_size)).astype(s),
        "x": rng.standard_normal((batch, heads, head_dim)).astype(t),
        "dt": (rng.standard_normal((batch, heads)) - 2).astype(t),
        "dt_bias": rng.standard_normal(heads).astype(t) if dt_bias else None,
        "A": -np.exp(rng.uniform(-1, 3, heads)).astype(np.float32),
        "B": rng.standard_normal((batch, groups, state_size)).astype(t),
        "C": rng.standard_normal((batch, groups, state_size)).astype(t),
        "D": rng.standard_normal(heads).astype(d_type) if d_type is not None else None,
    }


def run_kernel(inputs: dict[str, np.ndarray | None], threads: int = 1, **attrs: object) -> list[np.ndarray]:
    outputs = [("out", inputs["x"].dtype), ("present_state", inputs["state"].dtype)]
    return run(OP, [(n, inputs[n]) for n in NAMES], outputs, threads=threads, **attrs)


def check(inputs: dict[str, np.ndarray | None], threads: int = 1, dt_softplus: int = 1) -> list[np.ndarray]:
    """Run the kernel, assert both outputs are within the budget, and return them."""
    out, state = run_kernel(inputs, threads, dt_softplus=dt_softplus)
    ok, msg = budget_report(out, state, *(inputs[n] for n in NAMES), dt_softplus=dt_softplus)
    assert ok, msg
    return [out, state]


TYPE_COMBOS = [(t, s) for t in DTYPES for s in dict.fromkeys((FLOAT, t))]


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=[f"T{DTYPE_IDS[t]}-S{DTYPE_IDS[s]}" for t, s in TYPE_COMBOS])
@pytest.mark.parametrize("d_kind", ["D-f32", "D-T", "no-D"])
@pytest.mark.parametrize("dt_bias", [True, False], ids=["bias", "no-bias"])
def test_type_combinations(t: np.dtype, s: np.dtype, d_kind: str, dt_bias: bool) -> None:
    d_type = {"D-f32": FLOAT, "D-T": t, "no-D": None}[d_kind]
    rng = np.random.default_rng(1)
    check(make_inputs(rng, t=t, s=s, d_type=d_type, dt_bias=dt_bias))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_without_softplus(t: np.dtype) -> None:
    rng = np.random.default_rng(2)
    inputs = make_inputs(rng, t=t, s=FLOAT)
    inputs["dt"] = np.abs(inputs["dt"].astype(np.float32) / 4).astype(t)
    check(inputs, dt_softplus=0)


@pytest.mark.parametrize(("heads", "groups"), [(12, 1), (12, 3), (12, 12), (8, 8)])
def test_group_mapping(heads: int, groups: int) -> None:
    """G = 1, G = H and between: head h reads group h // (H / G)."""
    rng = np.random.default_rng(3)
    check(make_inputs(rng, t=FLOAT16, s=FLOAT, heads=heads, groups=groups))


@pytest.mark.parametrize(
    ("batch", "head_dim", "state_size"),
    [(1, 1, 1), (3, 7, 3), (1, 4, 16), (2, 3, 17), (1, 64, 128), (2, 1, 33)],
)
def test_odd_shapes(batch: int, head_dim: int, state_size: int) -> None:
    """State sizes below, at and past every vector width (tails), one-element heads."""
    rng = np.random.default_rng(4)
    for t in DTYPES:
        check(make_inputs(rng, t=t, s=FLOAT, batch=batch, head_dim=head_dim, state_size=state_size, heads=4))


@pytest.mark.parametrize("t", [FLOAT, FLOAT16], ids=DTYPE_IDS.get)
def test_real_width_threads(t: np.dtype) -> None:
    """Nemotron-H-8B's head shape (P = 64, N = 128, 16 heads a group) over 16 heads and 2 threads: the same bits
    as one thread (the split is over whole heads) and within the budget."""
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, t=t, s=FLOAT, batch=2, heads=16, head_dim=64, state_size=128, groups=1)
    one = check(inputs, threads=1)
    two = check(inputs, threads=2)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=[f"T{DTYPE_IDS[t]}-S{DTYPE_IDS[s]}" for t, s in TYPE_COMBOS])
@pytest.mark.parametrize("state_size", [16, 48, 128, 20])
def test_streaming_stores_write_the_same_bits(
    t: np.dtype, s: np.dtype, state_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 present state of a real model's size is written past the caches (streaming stores, where the
    rows are whole aligned vectors: N a multiple of every level's width but 20); MAMBAFUSE_SSU_STORES forces
    either path at any size. Both write the same bits, at every level (tests/test_kernel_isa.py runs this file
    at each), over two threads."""
    rng = np.random.default_rng(11)
    inputs = make_inputs(rng, t=t, s=s, batch=2, heads=4, head_dim=7, state_size=state_size)
    results = {}
    for stores in ("cached", "stream"):
        monkeypatch.setenv("MAMBAFUSE_SSU_STORES", stores)
        results[stores] = check(inputs, threads=2)
    for cached, streamed in zip(results["cached"], results["stream"], strict=True):
        np.testing.assert_array_equal(streamed.view(np.uint8), cached.view(np.uint8))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_edge_values(t: np.dtype) -> None:
    """Zeros, dt past softplus' threshold (20), huge and tiny states, a NaN confined to its head."""
    rng = np.random.default_rng(6)
    inputs = make_inputs(rng, t=t, s=FLOAT, batch=2, heads=8, groups=4, state_size=24)
    state = inputs["state"]
    state[0, 0] = 0.0
    inputs["x"][0, 0] = 0
    dt = inputs["dt"].astype(np.float32)
    dt[0, 1], dt[0, 2], dt[1, 3] = 25.0, 20.0, 19.5  # identity above 20, softplus at and below
    # large: finite in float32; for a float16 readout past 65504 (Inf, not Inf - Inf = NaN in the sum)
    state[0, 3] = np.abs(state[0, 3]) * (1e30 if t != FLOAT16 else 1e4)
    state[0, 4] *= 1e-40  # float32 subnormals
    dt[1, 5] = np.nan  # NaN in one head: only that head's outputs
    inputs["dt"] = dt.astype(t)
    out, present = check(inputs)
    nan_heads = {(b, h) for b, h in zip(*np.nonzero(np.isnan(out.astype(np.float32)).any(axis=-1)), strict=True)}
    assert nan_heads == {(1, 5)}, f"NaN outside head (1, 5): {sorted(nan_heads)}"
    assert np.isnan(present[1, 5].astype(np.float32)).all()
    assert not np.isnan(np.delete(present.reshape(-1, *present.shape[2:]), 8 + 5, axis=0).astype(np.float32)).any()


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=[f"T{DTYPE_IDS[t]}-S{DTYPE_IDS[s]}" for t, s in TYPE_COMBOS])
@pytest.mark.parametrize("dt_softplus", [0, 1])
@pytest.mark.parametrize("state_size", [19, 32])
def test_special_values_within_budget(t: np.dtype, s: np.dtype, dt_softplus: int, state_size: int) -> None:
    """The special-value sweep of tests/test_selective_state_update_special.py (float32 overflow of dA = exp(d * A)
    in both directions, readouts that overflow, NaN and +-Inf in every input) at this process's instruction-set
    level, over two threads: N = 19 has a scalar tail at every level's width, 32 none."""
    failures = []
    for case, inputs in special_cases(t, s, dt_softplus, state_size):
        out, state = run_kernel(inputs, threads=2, dt_softplus=dt_softplus)
        ok, msg = budget_report(out, state, *(inputs[n] for n in NAMES), dt_softplus=dt_softplus)
        if not ok:
            failures.append(f"{case}: {msg}")
    assert not failures, "\n".join(failures)


def test_nan_in_a_group_reaches_its_heads_only() -> None:
    """A NaN in B of group g: exactly the heads h // (H / G) == g of that batch row."""
    rng = np.random.default_rng(7)
    inputs = make_inputs(rng, t=FLOAT, s=FLOAT, heads=12, groups=3)
    inputs["B"][1, 2, 5] = np.nan
    out, _ = check(inputs)
    nan_heads = sorted({(int(b), int(h)) for b, h, _ in zip(*np.nonzero(np.isnan(out)), strict=True)})
    assert nan_heads == [(1, h) for h in range(8, 12)]


def test_float16_overflow_and_subnormals() -> None:
    """A float16 state that overflows to Inf, and products that land in float16's subnormals."""
    rng = np.random.default_rng(8)
    inputs = make_inputs(rng, t=FLOAT16, s=FLOAT16, heads=4, groups=1)
    inputs["state"][0, 0] = 60000.0
    inputs["x"][1, 1] = 1e-4
    inputs["B"][1] *= np.float16(1e-3)
    check(inputs)


def test_empty_batch() -> None:
    rng = np.random.default_rng(9)
    out, state = run_kernel(make_inputs(rng, t=FLOAT, s=FLOAT, batch=0))
    assert out.shape == (0, 8, 5) and state.shape == (0, 8, 5, 19)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.update(x=i["x"][:, :, :-1]), "x must have shape [2, 8, 5]"),
        (lambda i: i.update(dt=i["dt"][:, :4]), "dt must have shape [2, 8]"),
        (lambda i: i.update(B=i["B"][:, :, :-1], C=i["C"][:, :, :-1]), "B must have shape [2, G, 19]"),
        (lambda i: i.update(B=i["B"][:, :1]), "B and C must have the same shape"),
        (lambda i: i.update(B=np.zeros((2, 3, 19), np.float32), C=np.zeros((2, 3, 19), np.float32)), "multiple of"),
        (lambda i: i.update(A=i["A"].astype(np.float16)), "A must be float"),
        (lambda i: i.update(C=i["C"].astype(np.float16)), "C must have x's type"),
        (lambda i: i.update(state=i["state"][0]), "state must be 4-D"),
        (lambda i: i.update(D=i["D"][:3]), "D must have shape [8]"),
    ],
)
def test_bad_inputs_are_errors(change, message: str) -> None:
    rng = np.random.default_rng(10)
    inputs = make_inputs(rng, t=FLOAT, s=FLOAT)
    change(inputs)
    outputs = [("out", inputs["x"].dtype), ("present_state", inputs["state"].dtype)]
    with pytest.raises(Exception, match=r"SelectiveStateUpdate: .*") as info:
        run(OP, [(n, inputs[n]) for n in NAMES], outputs)
    assert message in str(info.value)


def test_state_type_other_than_float_or_t_is_an_error() -> None:
    rng = np.random.default_rng(11)
    inputs = make_inputs(rng, t=FLOAT16, s=FLOAT)
    inputs["state"] = inputs["state"].astype(BFLOAT16)
    outputs = [("out", FLOAT16), ("present_state", BFLOAT16)]
    with pytest.raises(Exception, match="state must be float or x's type float16"):
        run(OP, [(n, inputs[n]) for n in NAMES], outputs)


def test_bad_attribute_is_an_error_at_session_creation() -> None:
    rng = np.random.default_rng(12)
    inputs = make_inputs(rng, t=FLOAT, s=FLOAT)
    with pytest.raises(Exception, match="dt_softplus must be 0 or 1, got 2"):
        run_kernel(inputs, dt_softplus=2)


def test_shape_inference_declares_the_outputs() -> None:
    """Outputs typed and shaped from x and the state, also when the graph declares no output shapes."""
    from tests._decode_step import one_node_model, session

    rng = np.random.default_rng(13)
    inputs = make_inputs(rng, t=FLOAT16, s=FLOAT)
    model = one_node_model(OP, [(n, inputs[n]) for n in NAMES], [("out", FLOAT16), ("present_state", FLOAT)])
    sess = session(model)
    assert sess is not None
    types = {o.name: o.type for o in sess.get_outputs()}
    assert types == {"out": "tensor(float16)", "present_state": "tensor(float)"}
    assert isinstance(sess, ort.InferenceSession)


# --- the budget: accepts what every correct kernel computes, rejects wrong results --------------------


def _args(inputs: dict[str, np.ndarray | None]) -> list[np.ndarray | None]:
    return [inputs[n] for n in NAMES]


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=[f"T{DTYPE_IDS[t]}-S{DTYPE_IDS[s]}" for t, s in TYPE_COMBOS])
def test_budget_accepts_the_float32_mirror_and_fma(t: np.dtype, s: np.dtype) -> None:
    """The float32 reference (two roundings in state * dA + dBx) and an FMA version (one) are both in."""
    for seed in range(5):
        inputs = make_inputs(np.random.default_rng(100 + seed), t=t, s=s)
        out, state = selective_state_update(*_args(inputs))
        assert budget_report(out, state, *_args(inputs))[0]
        # FMA: the exact state * dA + dBx of the mirror's own dA and dBx, rounded once.
        _, allowed = budget_bounds(*_args(inputs))["present_state"]
        fused = state_with_fma(inputs)
        assert np.all((fused.astype(np.float64) >= allowed.lo) & (fused.astype(np.float64) <= allowed.hi))


def state_with_fma(inputs: dict[str, np.ndarray | None]) -> np.ndarray:
    """The present state of a kernel that computes state * dA + dBx with one rounding (float32 elsewhere)."""
    t = inputs["x"].dtype
    x, dt, dtb, a = (inputs[n].astype(np.float32) for n in ("x", "dt", "dt_bias", "A"))
    d = (dt + dtb).astype(t).astype(np.float32)
    d = np.where(d > 20, d, np.log1p(np.exp(d)).astype(t).astype(np.float32))
    dA = np.exp(d * a).astype(np.float64)
    heads, groups = x.shape[1], inputs["B"].shape[1]
    b = np.repeat(inputs["B"].astype(np.float32), heads // groups, axis=1)
    dB = (d[..., None] * b).astype(t).astype(np.float32)
    dBx = (dB[:, :, None, :] * x[..., None]).astype(t).astype(np.float64)
    exact = inputs["state"].astype(np.float64) * dA[..., None, None] + dBx
    return round_to(round_to(exact, np.float32), inputs["state"].dtype).astype(inputs["state"].dtype)


def test_budget_rejects_a_wrong_group_mapping() -> None:
    """h % G instead of h // (H / G) for the group of a head."""
    inputs = make_inputs(np.random.default_rng(14), t=FLOAT16, s=FLOAT, heads=8, groups=2)
    wrong = dict(inputs)
    heads, groups = 8, 2
    wrong["B"] = inputs["B"][:, np.arange(heads) % groups]
    wrong["C"] = inputs["C"][:, np.arange(heads) % groups]
    out, state = selective_state_update(*_args(wrong))
    ok, msg = budget_report(out, state, *_args(inputs))
    assert not ok, msg


def test_budget_rejects_a_missing_d() -> None:
    inputs = make_inputs(np.random.default_rng(15), t=FLOAT16, s=FLOAT)
    out, state = selective_state_update(*_args(dict(inputs, D=None)))
    ok, msg = budget_report(out, state, *_args(inputs))
    assert not ok and "out:" in msg and "present_state: 0 of" in msg, msg


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=[f"T{DTYPE_IDS[t]}-S{DTYPE_IDS[s]}" for t, s in TYPE_COMBOS])
def test_budget_rejects_a_state_a_few_ulp_past_the_bound(t: np.dtype, s: np.dtype) -> None:
    """One state element 2 ulps (of S) above the interval's top is out; at the top it is in."""
    inputs = make_inputs(np.random.default_rng(16), t=t, s=s)
    out, state = selective_state_update(*_args(inputs))
    hi = budget_bounds(*_args(inputs))["present_state"][1].hi
    at_top = state.copy()
    at_top[1, 2, 3, 4] = hi[1, 2, 3, 4]
    assert budget_report(out, at_top, *_args(inputs))[0]
    beyond = state.copy()
    top = hi[1, 2, 3, 4]
    beyond[1, 2, 3, 4] = round_to(top + 2 * ulp_of(top, s), s)
    ok, msg = budget_report(out, beyond, *_args(inputs))
    assert not ok and "present_state: 1 of" in msg, msg


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
def test_budget_rejects_an_output_one_ulp_off_where_no_tie_is_near(t: np.dtype) -> None:
    """A half output whose interval is one value (no tie within reach) must be that value exactly."""
    inputs = make_inputs(np.random.default_rng(17), t=t, s=FLOAT)
    out, state = selective_state_update(*_args(inputs))
    _, allowed = budget_bounds(*_args(inputs))["out"]
    exact = np.argwhere(allowed.lo == allowed.hi)
    assert len(exact) > 0
    i = tuple(exact[0])
    off = out.copy()
    off[i] = np.nextafter(out[i].astype(np.float32), np.float32(np.inf)).astype(t)
    if off[i] == out[i]:  # nextafter in float32 rounds back for a half: step by the half's ulp instead
        off[i] = (out[i].astype(np.float64) * (1 + 2.0**-6)).astype(t)
    assert not budget_report(off, state, *_args(inputs))[0]


def test_budget_tie_flips_are_in() -> None:
    """Where the exact d1 = dt + dt_bias lies within float32 noise of a float16 tie, both neighbours pass:
    the interval of every later value covers either rounding."""
    inputs = make_inputs(np.random.default_rng(18), t=FLOAT16, s=FLOAT, heads=4, groups=1, batch=1)
    # dt + dt_bias exactly halfway between two float16 values: 1 + 2^-11 = 1 + half an ulp of 1.
    inputs["dt"] = np.full((1, 4), 1.0, np.float16)
    inputs["dt_bias"] = np.full(4, 2.0**-11, np.float16)
    point, allowed = budget_bounds(*_args(inputs))["out"]
    assert np.all(allowed.lo <= point) and np.all(point <= allowed.hi)


def test_budget_float32_bound_is_relative_to_the_terms() -> None:
    """With float32 everything, the readout's interval scales with sum |s C| (not with |out|, which may
    cancel), and no wider: N + 1 unit roundoffs of it, plus what the state's interval carries."""
    inputs = make_inputs(np.random.default_rng(19), t=FLOAT, s=FLOAT, d_type=None)
    bounds = budget_bounds(*_args(inputs))
    lo, hi = bounds["out"][1].lo, bounds["out"][1].hi
    s_lo, s_hi = bounds["present_state"][1].lo, bounds["present_state"][1].hi
    heads, groups = 8, 2
    c = np.repeat(inputs["C"].astype(np.float64), heads // groups, axis=1)[:, :, None, :]
    terms = np.abs(np.maximum(np.abs(s_lo), np.abs(s_hi)) * c).sum(-1)
    n = inputs["C"].shape[-1]
    state_part = (np.abs(c) * (s_hi - s_lo)).sum(-1)
    assert np.all(
        hi - lo <= 2 * (n + 1) * 2.0**-24 * terms + state_part + 4 * np.spacing(np.abs(hi).astype(np.float32))
    )


@pytest.mark.parametrize("combo", list(itertools.islice(itertools.product(DTYPES, [0, 1]), 6)))
def test_reference_rejects_what_the_kernel_rejects(combo) -> None:
    t, _ = combo
    inputs = make_inputs(np.random.default_rng(20), t=t, s=FLOAT)
    with pytest.raises(ValueError, match="multiple of the groups"):
        selective_state_update(
            *_args(dict(inputs, B=inputs["B"][:, :1].repeat(3, 1), C=inputs["C"][:, :1].repeat(3, 1)))
        )
