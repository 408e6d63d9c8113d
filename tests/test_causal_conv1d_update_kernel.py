"""The CPU kernel of ai.mambafuse::CausalConv1dUpdate against fusion/reference/causal_conv1d_update.py
(docs/causal_conv1d_update.md), and the accuracy budget's power to reject wrong results."""

from __future__ import annotations

import numpy as np
import pytest

from fusion.reference.causal_conv1d_update import budget_bounds, budget_report, causal_conv1d_update
from tests._decode_step import DTYPE_IDS, DTYPES, FLOAT, FLOAT16, one_node_model, run, session

OP = "CausalConv1dUpdate"
NAMES = ("x", "conv_state", "weight", "bias")


def make_inputs(
    rng: np.random.Generator,
    *,
    t: np.dtype,
    batch: int = 2,
    channels: int = 70,
    new_columns: int = 1,
    state_len: int = 4,
    width: int = 4,
    bias: bool = True,
    weight_rank: int = 3,
) -> dict[str, np.ndarray | None]:
    """Return seeded inputs (weights of a trained conv's magnitude: |w| ~ 0.3)."""
    weight_shape = (channels, 1, width) if weight_rank == 3 else (channels, width)
    return {
        "x": rng.standard_normal((batch, channels, new_columns)).astype(t),
        "conv_state": rng.standard_normal((batch, channels, state_len)).astype(t),
        "weight": (0.3 * rng.standard_normal(weight_shape)).astype(t),
        "bias": (0.1 * rng.standard_normal(channels)).astype(t) if bias else None,
    }


def check(inputs: dict[str, np.ndarray | None], threads: int = 1, activation: str = "silu") -> list[np.ndarray]:
    """Run the kernel, assert y is within the budget and present_state exact, and return both."""
    t = inputs["x"].dtype
    y, state = run(
        OP, [(n, inputs[n]) for n in NAMES], [("y", t), ("present_state", t)], threads=threads, activation=activation
    )
    ok, msg = budget_report(y, state, *(inputs[n] for n in NAMES), activation=activation)
    assert ok, msg
    return [y, state]


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("weight_rank", [3, 2], ids=["w-C1K", "w-CK"])
def test_type_combinations(t: np.dtype, activation: str, bias: bool, weight_rank: int) -> None:
    rng = np.random.default_rng(1)
    check(make_inputs(rng, t=t, bias=bias, weight_rank=weight_rank), activation=activation)


@pytest.mark.parametrize(
    ("state_len", "width", "new_columns"),
    [(4, 4, 1), (3, 4, 1), (6, 4, 1), (4, 4, 3), (3, 4, 5), (0, 1, 1), (1, 2, 1), (4, 4, 70), (2, 3, 33)],
    ids=["S=K", "S=K-1", "S>K", "L=3", "L>S", "K=1", "K=2", "L=70", "L=33"],
)
def test_state_lengths_and_columns(state_len: int, width: int, new_columns: int) -> None:
    """transformers' S = K and mobius' S = K - 1, longer states, several new columns (a prefill spelling),
    more columns than a block of values holds (L = 70: the per-value path)."""
    rng = np.random.default_rng(2)
    for t in DTYPES:
        check(make_inputs(rng, t=t, state_len=state_len, width=width, new_columns=new_columns, channels=13))


@pytest.mark.parametrize("channels", [1, 7, 64, 65, 130, 10240])
def test_channel_counts_and_threads(channels: int) -> None:
    """Channel counts around the block of 64 values and Nemotron-H-8B's conv dim (10240, two chunks at two
    threads): within budget, the same bits at one and two threads."""
    rng = np.random.default_rng(3)
    inputs = make_inputs(rng, t=FLOAT16, channels=channels, batch=1)
    one = check(inputs, threads=1)
    two = check(inputs, threads=2)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_edge_values(t: np.dtype) -> None:
    """Zeros, sigmoid's saturation both ways (down to exp's underflow for float and bfloat16), huge values, a
    NaN confined to its channel's output (the state keeps it where it was copied)."""
    rng = np.random.default_rng(4)
    inputs = make_inputs(rng, t=t, channels=12, batch=2)
    x, state, w = (inputs[n].astype(np.float32) for n in ("x", "conv_state", "weight"))
    x[0, 0], state[0, 0], w[1] = 0, 0, 0
    for c, v in ((2, -30.0), (3, -95.0), (4, -110.0), (5, 30.0), (6, -8.0)):
        w[c] = 0
        w[c, 0, -1] = 1.0
        x[:, c] = v  # y = silu(v + bias)
    x[0, 7] = 3e4 if t == FLOAT16 else 1e30
    state[1, 8, -1] = np.nan  # the last state column is in output 0's window
    inputs.update(x=x.astype(t), conv_state=state.astype(t), weight=w.astype(t))
    y, present = check(inputs)
    nan = {(int(b), int(c)) for b, c, _ in zip(*np.nonzero(np.isnan(y.astype(np.float32))), strict=True)}
    assert nan == {(1, 8)}, sorted(nan)
    assert np.isnan(present[1, 8, -2].astype(np.float32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda i: i.update(conv_state=i["conv_state"][:, :, :2]),
            "conv_state holds S = 2 columns, fewer than K - 1 = 3",
        ),
        (lambda i: i.update(conv_state=i["conv_state"][:1]), "conv_state must have shape [2, 70, S]"),
        (lambda i: i.update(weight=i["weight"][:5]), "weight must have shape [70, 1, K] or [70, K]"),
        (lambda i: i.update(weight=i["weight"].reshape(70, 2, 2)), "weight must have shape"),
        (lambda i: i.update(bias=i["bias"][:3]), "bias must have shape [70]"),
        (lambda i: i.update(bias=i["bias"].astype(np.float16)), "bias must have x's type float"),
        (lambda i: i.update(x=i["x"][:, :, :0]), "at least one new column"),
        (lambda i: i.update(x=i["x"][0]), "x must be 3-D"),
    ],
)
def test_bad_inputs_are_errors(change, message: str) -> None:
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, t=FLOAT)
    change(inputs)
    with pytest.raises(Exception, match="CausalConv1dUpdate: ") as info:
        run(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT), ("present_state", FLOAT)])
    assert message in str(info.value)


def test_bad_activation_is_an_error_at_session_creation() -> None:
    inputs = make_inputs(np.random.default_rng(6), t=FLOAT)
    model = one_node_model(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT), ("p", FLOAT)], activation="relu")
    with pytest.raises(Exception, match='activation must be "silu" or "none", got "relu"'):
        session(model)


def test_shape_inference_with_unknown_dims() -> None:
    """Outputs typed from x and conv_state when the graph declares no shapes; the kernel still runs."""
    inputs = make_inputs(np.random.default_rng(7), t=FLOAT16)
    model = one_node_model(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT16), ("p", FLOAT16)], dynamic=True)
    sess = session(model)
    assert [o.type for o in sess.get_outputs()] == ["tensor(float16)", "tensor(float16)"]
    y, state = sess.run(None, {n: inputs[n] for n in NAMES})
    assert budget_report(y, state, *(inputs[n] for n in NAMES))[0]


# --- the budget ---------------------------------------------------------------------------------------


def _args(inputs: dict[str, np.ndarray | None]) -> list[np.ndarray | None]:
    return [inputs[n] for n in NAMES]


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_budget_accepts_the_float32_mirror(t: np.dtype) -> None:
    for seed in range(5):
        inputs = make_inputs(np.random.default_rng(100 + seed), t=t, new_columns=2)
        y, state = causal_conv1d_update(*_args(inputs))
        assert budget_report(y, state, *_args(inputs))[0]


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_budget_rejects_a_missing_bias_and_a_shifted_window(t: np.dtype) -> None:
    inputs = make_inputs(np.random.default_rng(8), t=t)
    y, state = causal_conv1d_update(*_args(dict(inputs, bias=None)))
    assert not budget_report(y, state, *_args(inputs))[0]
    # The window one column early: the taps over conv_state[-K:] instead of [1 - K:] + x.
    early = dict(inputs, x=inputs["conv_state"][:, :, -1:], conv_state=inputs["conv_state"])
    y_early, _ = causal_conv1d_update(*_args(dict(early, conv_state=np.roll(inputs["conv_state"], 1, axis=-1))))
    assert not budget_report(y_early, causal_conv1d_update(*_args(inputs))[1], *_args(inputs))[0]


def test_budget_present_state_is_exact() -> None:
    inputs = make_inputs(np.random.default_rng(9), t=FLOAT)
    y, state = causal_conv1d_update(*_args(inputs))
    state[0, 0, 0] = np.nextafter(state[0, 0, 0], np.float32(np.inf))
    ok, msg = budget_report(y, state, *_args(inputs))
    assert not ok and "present_state: 1 of" in msg, msg


@pytest.mark.parametrize("t", [FLOAT16], ids=DTYPE_IDS.get)
def test_budget_rejects_one_ulp_where_no_tie_is_near(t: np.dtype) -> None:
    inputs = make_inputs(np.random.default_rng(10), t=t)
    y, state = causal_conv1d_update(*_args(inputs))
    _, lo, hi = budget_bounds(*_args(inputs))["y"]
    i = tuple(np.argwhere((lo == hi) & (np.abs(hi) > 0.1))[0])
    off = y.copy()
    off[i] = (y[i].astype(np.float64) * (1 + 2.0**-10)).astype(t)
    assert off[i] != y[i]
    assert not budget_report(off, state, *_args(inputs))[0]
