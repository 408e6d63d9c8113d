"""The CPU kernel of ai.mambafuse::CausalConv1d against fusion/reference/causal_conv1d.py (docs/causal_conv1d.md):
both layouts, every type, with and without bias and initial state, prompts around the kernel width and the
kernel's 64-token blocks, channel counts around the vector width, one and two threads, and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

from fusion.reference.causal_conv1d import budget_report
from tests._decode_step import DTYPE_IDS, DTYPES, FLOAT, FLOAT16, bfloat16, one_node_model, run, session

OP = "CausalConv1d"
NAMES = ("x", "weight", "bias", "initial_state")


def make_inputs(
    rng: np.random.Generator,
    *,
    t: np.dtype,
    batch: int = 2,
    channels: int = 37,
    length: int = 9,
    width: int = 4,
    state_width: int = 4,
    bias: bool = True,
    state: bool = True,
    channels_last: int = 1,
) -> dict[str, np.ndarray | None]:
    x_shape = (batch, length, channels) if channels_last else (batch, channels, length)
    return {
        "x": rng.standard_normal(x_shape).astype(t),
        "weight": (0.3 * rng.standard_normal((channels, 1, width))).astype(t),
        "bias": (0.1 * rng.standard_normal(channels)).astype(t) if bias else None,
        "initial_state": rng.standard_normal((batch, channels, state_width)).astype(t) if state else None,
    }


def check(
    inputs,
    *,
    state_width: int = 4,
    channels_last: int = 1,
    activation: str = "silu",
    threads: int = 1,
    round_once: int | None = None,
):
    """Run the kernel, assert its outputs are within the budget (the state exact), and return them.
    ``round_once``: the attribute's value (None: absent, its default 0)."""
    t = inputs["x"].dtype
    extra = {} if round_once is None else {"round_once": round_once}
    y, final_state = run(
        OP,
        [(n, inputs[n]) for n in NAMES],
        [("y", t), ("final_state", t)],
        threads=threads,
        state_width=state_width,
        channels_last=channels_last,
        activation=activation,
        **extra,
    )
    ok, message = budget_report(
        y,
        final_state,
        *(inputs[n] for n in NAMES),
        activation=activation,
        channels_last=channels_last,
        state_width=state_width,
        round_once=round_once or 0,
    )
    assert ok, message
    return y, final_state


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize(
    ("bias", "state"), [(True, True), (False, False), (True, False)], ids=["all", "bare", "no-state"]
)
def test_types_layouts_and_optional_inputs(t, channels_last, activation, bias, state):
    rng = np.random.default_rng(1)
    inputs = make_inputs(rng, t=t, bias=bias, state=state, channels_last=channels_last)
    check(inputs, channels_last=channels_last, activation=activation)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("length", [1, 65])
def test_rounded_once(t, channels_last, activation, length):
    """``round_once = 1`` (ONNX Runtime's CausalConvWithState): within the budget of y rounded once; the float16 and
    bfloat16 SiLU outputs are not all within the per-step budget (they differ from the default rounding), float32's
    and the plain conv's are the same bits as the default's."""
    rng = np.random.default_rng(length)
    inputs = make_inputs(rng, t=t, length=length, channels_last=channels_last)
    once = check(inputs, channels_last=channels_last, activation=activation, round_once=1)
    each = check(inputs, channels_last=channels_last, activation=activation, round_once=0)
    np.testing.assert_array_equal(once[1], each[1])
    if t == FLOAT or activation == "none":
        np.testing.assert_array_equal(once[0], each[0])
    elif length > 1:
        ok, _ = budget_report(
            once[0], once[1], *(inputs[n] for n in NAMES), activation=activation, channels_last=channels_last,
            state_width=4,
        )  # fmt: skip
        assert not ok, "y rounded once is within the per-step budget everywhere: the test would show nothing"


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 63, 64, 65, 200])
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
def test_prompt_lengths(length, channels_last):
    """Prompts shorter than the state (the final state keeps part of the initial one), around the kernel width,
    and around the channels-last kernel's 64-token blocks."""
    rng = np.random.default_rng(length)
    for t in DTYPES:
        check(make_inputs(rng, t=t, length=length, channels_last=channels_last), channels_last=channels_last)


@pytest.mark.parametrize(("width", "state_width"), [(4, 3), (4, 4), (4, 6), (2, 1), (1, 0)])
def test_widths_and_state_widths(width, state_width):
    """causal-conv1d's S = K - 1, transformers' S = K, wider states, other kernel widths."""
    rng = np.random.default_rng(width * 10 + state_width)
    for channels_last in (1, 0):
        inputs = make_inputs(rng, t=FLOAT, width=width, state_width=state_width, length=11, channels_last=channels_last)
        check(inputs, state_width=state_width, channels_last=channels_last)


@pytest.mark.parametrize("channels", [1, 7, 16, 17, 10240])
def test_channel_counts_and_threads(channels):
    """Channel counts around every vector width and the real conv dim: within budget, the same bits at one and two
    threads (every output is computed by one thread in one order)."""
    rng = np.random.default_rng(channels)
    for channels_last in (1, 0):
        inputs = make_inputs(rng, t=FLOAT16, channels=channels, batch=1, length=150, channels_last=channels_last)
        one = check(inputs, channels_last=channels_last, threads=1)
        two = check(inputs, channels_last=channels_last, threads=2)
        for a, b in zip(one, two, strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_prompt_in_pieces_equals_the_prompt():
    """Two pieces, the second starting from the first's final state: the outputs of the whole prompt, bit for bit
    (each output's sum reads the same K values in the same order)."""
    rng = np.random.default_rng(7)
    inputs = make_inputs(rng, t=FLOAT, length=100)
    whole_y, whole_state = check(inputs)
    first = dict(inputs, x=inputs["x"][:, :37])
    y1, state1 = check(first)
    second = dict(inputs, x=inputs["x"][:, 37:], initial_state=state1)
    y2, state2 = check(second)
    np.testing.assert_array_equal(np.concatenate([y1, y2], axis=1), whole_y)
    np.testing.assert_array_equal(state2, whole_state)


BAD = {
    "x rank": (lambda i: i.update(x=i["x"][0]), "x must be 3-D"),
    "weight channels": (lambda i: i.update(weight=i["weight"][:5]), "weight must have shape"),
    "bias shape": (lambda i: i.update(bias=i["bias"][:3]), "bias must have shape"),
    "state shape": (lambda i: i.update(initial_state=i["initial_state"][..., :2]), "initial_state must have shape"),
    "weight type": (lambda i: i.update(weight=i["weight"].astype(np.float16)), "weight must have x's type"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_are_errors(case):
    change, message = BAD[case]
    inputs = make_inputs(np.random.default_rng(0), t=FLOAT)
    change(inputs)
    with pytest.raises(Exception, match=f"CausalConv1d: .*{message}"):
        run(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT), ("final_state", FLOAT)], state_width=4)


def test_state_width_below_the_kernel_is_an_error():
    inputs = make_inputs(np.random.default_rng(0), t=FLOAT, state_width=2, state=False)
    with pytest.raises(Exception, match="state_width must be at least K - 1 = 3"):
        run(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT), ("final_state", FLOAT)], state_width=2)


def test_missing_state_width_is_an_error_at_session_creation():
    inputs = make_inputs(np.random.default_rng(0), t=FLOAT, state=False)
    with pytest.raises(Exception, match="the attribute state_width .* is required"):
        run(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT), ("final_state", FLOAT)])


def test_a_bad_round_once_is_an_error_at_session_creation():
    inputs = make_inputs(np.random.default_rng(0), t=FLOAT)
    with pytest.raises(Exception, match="round_once must be 0 or 1, got 2"):
        run(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT), ("final_state", FLOAT)], state_width=4, round_once=2)


# --- a constant weight and bias, laid out once when the kernel is created -----------------------------------------


def _with_constants(model, inputs: dict, names: tuple[str, ...]):
    """``model`` with the graph inputs ``names`` made initializers holding ``inputs``' values (a bfloat16 value
    enters through its Cast, which ONNX Runtime folds into a constant)."""
    from onnx import numpy_helper

    for name in names:
        value = inputs[name]
        if value.dtype == bfloat16:
            value = value.astype(np.float32)
        model.graph.initializer.append(numpy_helper.from_array(value, name))
        kept = [v for v in model.graph.input if v.name != name]
        del model.graph.input[:]
        model.graph.input.extend(kept)
    return model


def _run_model(model, inputs: dict) -> list[np.ndarray]:
    names = {v.name for v in model.graph.input}
    feeds = {
        n: (v.astype(np.float32) if v.dtype == bfloat16 else v)
        for n, v in inputs.items()
        if v is not None and n in names
    }
    return session(model).run(None, feeds)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    "constants", [("weight", "bias"), ("weight",), ("weight", "no bias")], ids=["w+b", "w", "w-only"]
)
@pytest.mark.parametrize("length", [1, 65])
def test_constant_weight_and_bias(t, constants, length):
    """A channels-last node whose weight (and bias) are initializers computes what it does with them as inputs: the
    kernel lays them out once at creation (a bias computed in the graph, or absent, is handled as well)."""
    rng = np.random.default_rng(length)
    inputs = make_inputs(rng, t=t, length=length, channels=45, bias="no bias" not in constants)
    outputs = [("y", t), ("final_state", t)]
    attrs = {"state_width": 4, "channels_last": 1, "activation": "silu"}
    as_inputs = one_node_model(OP, [(n, inputs[n]) for n in NAMES], outputs, **attrs)
    want = _run_model(as_inputs, inputs)
    folded = tuple(n for n in constants if n != "no bias")
    constant = _with_constants(one_node_model(OP, [(n, inputs[n]) for n in NAMES], outputs, **attrs), inputs, folded)
    got = _run_model(constant, inputs)
    for w, g in zip(want, got, strict=True):
        assert np.array_equal(w, g, equal_nan=True)
    ok, message = budget_report(
        got[0].astype(t),
        got[1].astype(t),
        *(inputs[n] for n in NAMES),
        activation="silu",
        channels_last=1,
        state_width=4,
    )
    assert ok, message


def test_a_constant_weight_of_other_channels_is_an_error():
    """The weight laid out at creation does not hide a call whose x has other channels: the call's check names it."""
    rng = np.random.default_rng(3)
    inputs = make_inputs(rng, t=FLOAT, channels=12)
    model = one_node_model(
        OP,
        [(n, inputs[n]) for n in NAMES],
        [("y", FLOAT), ("final_state", FLOAT)],
        dynamic=True,
        state_width=4,
        channels_last=1,
    )
    model = _with_constants(model, inputs, ("weight", "bias"))
    other = make_inputs(rng, t=FLOAT, channels=13)
    with pytest.raises(Exception, match="weight must have shape"):
        _run_model(model, {"x": other["x"], "initial_state": other["initial_state"]})
