"""The reference and the model-local function of ``CausalConv1d`` (fusion/reference/causal_conv1d.py,
fusion/function/causal_conv1d.py, docs/causal_conv1d.md): the prompt's causal depthwise conv with its conv state.

transformers' torch computation (the conv over the prompt, from the cache's state or zeros, and the exports' SiLU
spelling) is within the budget in every type; the stock-op body in ONNX Runtime is too, at every prompt length
from one token up, both layouts, with and without bias and initial state; one token is the decode step's
``CausalConv1dUpdate``; a prompt in pieces with the state carried is the prompt at once; the budget rejects a
perturbed output or a wrong state, and bad inputs are refused with a message that names them.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusion.function import causal_conv1d as conv_function
from fusion.reference import causal_conv1d_update as update_reference
from fusion.reference._common import DOMAIN, bfloat16
from fusion.reference.causal_conv1d import CausalConv1d, budget_report, causal_conv1d, check_inputs

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), bfloat16]
ONNX_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    bfloat16: TensorProto.BFLOAT16,
}
WIDTH = 4  # every Mamba-2 family's conv_kernel
LENGTHS = [1, 2, WIDTH - 1, WIDTH, WIDTH + 1, 100]


def _inputs(
    rng: np.random.Generator,
    t: np.dtype = DTYPES[0],
    *,
    batch: int = 2,
    length: int = 37,
    channels: int = 24,
    width: int = WIDTH,
    state_width: int = WIDTH,
    bias: bool = True,
    initial: bool = True,
    channels_last: int = 1,
) -> dict[str, np.ndarray | None]:
    shape = (batch, length, channels) if channels_last else (batch, channels, length)
    return {
        "x": rng.standard_normal(shape).astype(t),
        "weight": (rng.standard_normal((channels, 1, width)) / 2).astype(t),
        "bias": rng.standard_normal(channels).astype(t) if bias else None,
        "initial_state": rng.standard_normal((batch, channels, state_width)).astype(t) if initial else None,
    }


def _attributes(state_width: int = WIDTH, activation: str = "silu", channels_last: int = 1) -> dict[str, object]:
    return {"state_width": state_width, "activation": activation, "channels_last": channels_last}


# --- the reference against transformers' torch computation ---------------------------------------------------


def _transformers_prefill(
    inputs: dict[str, np.ndarray | None], activation: str, state_width: int
) -> tuple[np.ndarray, np.ndarray]:
    """Return (y (B, L, C), final state (B, C, S)) as transformers 5.25 computes a prefill in torch: the prompt
    transposed to (B, C, L), after the cache's state (a chunked prefill) or left-padded with zeros to the state's
    width, ``causal_conv1d_fn`` (F.conv1d, groups = C, padding K - 1, the first columns kept), the last L columns;
    the state is the last S columns. SiLU as the exports spell it: sigmoid, then the product, each in T."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    conv_fn = getattr(modeling.causal_conv1d_fn, "__wrapped__", modeling.causal_conv1d_fn)

    def to_torch(a: np.ndarray | None):
        if a is None:
            return None
        if a.dtype == bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    x = to_torch(inputs["x"]).transpose(1, 2)
    length = x.shape[-1]
    if inputs["initial_state"] is not None:
        full = torch.cat([to_torch(inputs["initial_state"]), x], dim=-1)
    else:
        full = torch.nn.functional.pad(x, (max(state_width - length, 0), 0))  # the cache's zeros
    weight = to_torch(inputs["weight"])[:, 0, :]
    out = conv_fn(full, weight, to_torch(inputs["bias"]), activation=None)[:, :, -length:]
    if activation == "silu":
        out = out * torch.sigmoid(out)
    state = full[:, :, -state_width:]

    def to_numpy(v) -> np.ndarray:
        if v.dtype == torch.bfloat16:
            return v.contiguous().view(torch.uint16).numpy().view(bfloat16)
        return v.contiguous().numpy()

    return to_numpy(out.transpose(1, 2)), to_numpy(state)


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize("length", [2, WIDTH, 37])
@pytest.mark.parametrize("initial", [False, True], ids=["no-state", "state"])
@pytest.mark.parametrize("activation", ["silu", "none"])
def test_transformers_torch_computation_is_within_the_budget(
    t: np.dtype, length: int, initial: bool, activation: str
) -> None:
    inputs = _inputs(np.random.default_rng(3), t, length=length, initial=initial)
    y, state = _transformers_prefill(inputs, activation, WIDTH)
    ok, summary = budget_report(y, state, **inputs, **_attributes(activation=activation))
    assert ok, summary
    _, ref_state = causal_conv1d(**inputs, **_attributes(activation=activation))
    assert np.array_equal(ref_state, state)  # the zeros from the left, then the prompt: a copy


# --- the reference's budget -----------------------------------------------------------------------------------


def test_the_budget_rejects_wrong_math() -> None:
    inputs = _inputs(np.random.default_rng(11))
    attributes = _attributes()
    y, state = causal_conv1d(**inputs, **attributes)
    assert budget_report(y, state, **inputs, **attributes)[0]
    perturbed = y.copy()
    perturbed[:, 20] *= 1 + 1e-3
    assert not budget_report(perturbed, state, **inputs, **attributes)[0]
    one_off = state.copy()
    one_off[1, 3, 2] = np.nextafter(one_off[1, 3, 2], np.float32(np.inf))
    assert not budget_report(y, one_off, **inputs, **attributes)[0]
    assert not budget_report(y, np.zeros_like(state), **inputs, **attributes)[0]
    # the initial state ignored, no bias, the window one column late
    for wrong in (dict(inputs, initial_state=None), dict(inputs, bias=None)):
        assert not budget_report(*causal_conv1d(**wrong, **attributes), **inputs, **attributes)[0]
    late = np.concatenate([inputs["initial_state"][:, :, -1:].transpose(0, 2, 1), inputs["x"][:, :-1]], axis=1)
    assert not budget_report(causal_conv1d(**dict(inputs, x=late), **attributes)[0], state, **inputs, **attributes)[0]
    nan = y.copy()
    nan[0, 0, 0] = np.nan
    assert not budget_report(nan, state, **inputs, **attributes)[0]


def test_short_prompts_keep_zeros_from_the_left() -> None:
    """A prompt shorter than the state: the final state is the initial state's (or zeros') tail, then the prompt."""
    rng = np.random.default_rng(2)
    inputs = _inputs(rng, length=2, state_width=WIDTH)
    _, state = causal_conv1d(**inputs, **_attributes())
    x_cf = inputs["x"].transpose(0, 2, 1)
    np.testing.assert_array_equal(state, np.concatenate([inputs["initial_state"][:, :, 2:], x_cf], axis=-1))
    _, state = causal_conv1d(**dict(inputs, initial_state=None), **_attributes())
    np.testing.assert_array_equal(state[:, :, :2], 0)
    np.testing.assert_array_equal(state[:, :, 2:], x_cf)


def test_the_layouts_are_one_computation() -> None:
    inputs = _inputs(np.random.default_rng(4), DTYPES[1])
    y, state = causal_conv1d(**inputs, **_attributes())
    channels_first = dict(inputs, x=np.ascontiguousarray(inputs["x"].transpose(0, 2, 1)))
    y_cf, state_cf = causal_conv1d(**channels_first, **_attributes(channels_last=0))
    np.testing.assert_array_equal(y_cf.transpose(0, 2, 1), y)
    np.testing.assert_array_equal(state_cf, state)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i, a: i.update(x=i["x"][0]), "x must be (B, L, C)"),
        (lambda i, a: i.update(x=i["x"][:, :0]), "at least one token"),
        (lambda i, a: i.update(x=i["x"].astype(np.float64)), "x must be float, float16 or bfloat16"),
        (lambda i, a: i.update(weight=i["weight"][:5]), "weight must have shape [24, 1, K] or [24, K]"),
        (lambda i, a: i.update(weight=i["weight"].astype(np.float16)), "weight must have x's type"),
        (lambda i, a: i.update(bias=i["bias"][:3]), "bias must have shape [24]"),
        (lambda i, a: i.update(initial_state=i["initial_state"][..., :3]), "initial_state must have shape [2, 24, 4]"),
        (lambda i, a: i.update(initial_state=i["initial_state"][:1]), "initial_state must have shape [2, 24, 4]"),
        (lambda i, a: i.update(initial_state=i["initial_state"].astype(np.float16)), "initial_state must have x's"),
        (lambda i, a: a.update(state_width=None), "state_width is required"),
        (lambda i, a: a.update(state_width=2), "state_width must be an integer of at least K - 1 = 3"),
        (lambda i, a: a.update(activation="gelu"), "activation must be 'silu' or 'none'"),
        (lambda i, a: a.update(channels_last=2), "channels_last must be 0 or 1"),
        (lambda i, a: a.update(channels_last=0), "weight must have shape [37, 1, K]"),  # x read as (B, C, L)
    ],
)
def test_bad_inputs_are_named(change, message: str) -> None:
    inputs = _inputs(np.random.default_rng(0))
    attributes = _attributes()
    change(inputs, attributes)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_inputs(**inputs, **attributes)
    with pytest.raises(ValueError, match="CausalConv1d: "):
        causal_conv1d(**inputs, **attributes)


# --- the function body in ONNX Runtime ------------------------------------------------------------------------


def _function_model(t: np.dtype, attributes: dict[str, object], opset: int = 18) -> onnx.ModelProto:
    """Return a one-node model of CausalConv1d with its function, every dim symbolic. A bfloat16 output leaves
    the model as float32 (an exact Cast): numpy has no bfloat16 that ONNX Runtime returns."""
    elem = ONNX_TYPES[t]
    ranks = {"x": 3, "weight": 3, "bias": 1, "initial_state": 3}
    node_outputs = ["y_t", "final_state_t"] if t == bfloat16 else list(conv_function.OUTPUTS)
    nodes = [helper.make_node("CausalConv1d", list(conv_function.INPUTS), node_outputs, domain=DOMAIN, **attributes)]
    out_elem = elem
    if t == bfloat16:
        out_elem = TensorProto.FLOAT
        nodes += [helper.make_node("Cast", [f"{name}_t"], [name], to=out_elem) for name in conv_function.OUTPUTS]
    graph = helper.make_graph(
        nodes,
        "causal_conv1d",
        [helper.make_tensor_value_info(name, elem, [None] * ranks[name]) for name in conv_function.INPUTS],
        [helper.make_tensor_value_info(name, out_elem, [None] * 3) for name in conv_function.OUTPUTS],
    )
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", opset),
            helper.make_opsetid(DOMAIN, 1),
            helper.make_opsetid("ai.onnx.ml", conv_function.ML_OPSET),
        ],
        functions=[conv_function.make_function(opset)],
    )
    onnx.checker.check_model(model, full_check=True)
    return model


@functools.cache
def _session(t: np.dtype, activation: str, channels_last: int, round_once: int = 0) -> ort.InferenceSession:
    # state_width is not read by the body (the initial state's width is S); the kernels check the two agree
    attributes = _attributes(WIDTH, activation, channels_last)
    if round_once:
        attributes["round_once"] = round_once
    model = _function_model(t, attributes)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run_function(
    inputs: dict[str, np.ndarray | None],
    activation: str = "silu",
    channels_last: int = 1,
    state_width: int = WIDTH,
    round_once: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (y, final_state) of the function body, the absent inputs passed as a rule passes them: a -0.0 bias,
    a zero initial state (B, C, state_width)."""
    x = inputs["x"]
    t = x.dtype
    batch, channels = x.shape[0], x.shape[2] if channels_last else x.shape[1]
    feeds = {
        "x": x,
        "weight": inputs["weight"],
        "bias": np.full(channels, -0.0, t) if inputs["bias"] is None else inputs["bias"],
        "initial_state": np.zeros((batch, channels, state_width), t)
        if inputs["initial_state"] is None
        else inputs["initial_state"],
    }
    # contiguous: an OrtValue reads a numpy array's buffer as it is, strides ignored (a piece of a prompt is a view)
    feeds = {name: np.ascontiguousarray(a) for name, a in feeds.items()}
    values = {
        # numpy has no bfloat16 ONNX Runtime takes: its bits, typed as BFLOAT16
        name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), TensorProto.BFLOAT16)
        if a.dtype == bfloat16
        else ort.OrtValue.ortvalue_from_numpy(a)
        for name, a in feeds.items()
    }
    session = _session(t, activation, channels_last, round_once)
    y, state = (value.numpy() for value in session.run_with_ort_values(None, values))
    return y.astype(t), state.astype(t)


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    ("bias", "initial", "activation"),
    [(True, True, "silu"), (False, False, "silu"), (True, False, "none"), (False, True, "none")],
    ids=["bias-state-silu", "silu", "bias-none", "state-none"],
)
def test_the_function_body_in_onnx_runtime_is_within_the_budget(
    t: np.dtype, length: int, batch: int, bias: bool, initial: bool, activation: str
) -> None:
    rng = np.random.default_rng(length * 10 + batch)
    inputs = _inputs(rng, t, batch=batch, length=length, channels=40, bias=bias, initial=initial)
    y, state = _run_function(inputs, activation)
    ok, summary = budget_report(y, state, **inputs, **_attributes(activation=activation))
    assert ok, summary


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "none"])
def test_rounded_once_in_the_reference_and_the_function_body(t: np.dtype, activation: str) -> None:
    """``round_once = 1``: the reference and the function body in ONNX Runtime within the budget of y rounded once.
    In float16 and bfloat16 the SiLU outputs rounded once are not all within the per-step budget, nor the per-step
    ones within the rounded-once budget (each budget tells the two apart); float32's, and the plain conv's, are one
    computation."""
    rng = np.random.default_rng(5)
    inputs = _inputs(rng, t, batch=2, length=37, channels=40)
    attributes = _attributes(activation=activation)
    once = causal_conv1d(**inputs, **attributes, round_once=1)
    each = causal_conv1d(**inputs, **attributes)
    assert budget_report(*once, **inputs, **attributes, round_once=1)[0]
    body = _run_function(inputs, activation, round_once=1)
    ok, summary = budget_report(*body, **inputs, **attributes, round_once=1)
    assert ok, summary
    distinct = t != np.float32 and activation == "silu"
    assert budget_report(*once, **inputs, **attributes)[0] != distinct
    assert budget_report(*each, **inputs, **attributes, round_once=1)[0] != distinct
    with pytest.raises(ValueError, match="round_once must be 0 or 1, got 2"):
        causal_conv1d(**inputs, **attributes, round_once=2)


@pytest.mark.parametrize("t", DTYPES, ids=str)
def test_the_function_body_keeps_special_values_where_the_reference_has_them(t: np.dtype) -> None:
    """A NaN in one channel stays in that channel's next K outputs and goes nowhere else; sums past
    float16's range give its infinities (+Inf stays +Inf through SiLU, -Inf gives NaN: -Inf * sigmoid(-Inf) =
    -Inf * 0); inputs subnormal in float16 give tiny values, not zeros or NaN."""
    inputs = _inputs(np.random.default_rng(23), t, batch=3, length=9, channels=16)
    x, weight, bias = inputs["x"], inputs["weight"], inputs["bias"]
    x[0, 3, 5] = np.nan
    x[1, :, 7], x[1, :, 8] = 60000.0, -60000.0
    weight[[2, 7, 8]] = np.abs(weight[[2, 7, 8]]) + t.type(0.25)  # every tap positive: no cancellation
    x[2, :, 2], bias[2], inputs["initial_state"][2, 2] = 1e-6, 0, 0
    for activation in ("silu", "none"):
        y, state = _run_function(inputs, activation)
        ok, summary = budget_report(y, state, **inputs, **_attributes(activation=activation))
        assert ok, f"{activation}: {summary}"
        y = y.astype(np.float64)
        assert np.isnan(y[0, 3 : 3 + WIDTH, 5]).all()
        assert not np.isnan(np.delete(y[0], 5, axis=1)).any()
        if t == np.float16:
            assert (y[1, WIDTH - 1 :, 7] == np.inf).all()
            negative = y[1, WIDTH - 1 :, 8]
            assert np.isnan(negative).all() if activation == "silu" else (negative == -np.inf).all()
        tiny = np.abs(y[2, :, 2])
        assert ((tiny > 0) & (tiny < 1e-4)).all()


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize("state_width", [WIDTH - 1, WIDTH + 2])
def test_the_function_body_channels_first_and_other_state_widths(t: np.dtype, state_width: int) -> None:
    """(B, C, L) in and out, and causal-conv1d's state of K - 1 columns (or a wider one)."""
    for length in (1, 5, 64):
        inputs = _inputs(
            np.random.default_rng(length), t, batch=3, length=length, state_width=state_width, channels_last=0
        )
        y, state = _run_function(inputs, "silu", channels_last=0, state_width=state_width)
        ok, summary = budget_report(y, state, **inputs, **_attributes(state_width, "silu", channels_last=0))
        assert ok, f"L = {length}: {summary}"


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize(("state_width", "channels_last"), [(WIDTH, 1), (WIDTH - 1, 0), (WIDTH + 2, 1)])
def test_the_function_body_over_several_chunks(t: np.dtype, state_width: int, channels_last: int) -> None:
    """A prompt of several chunks a batch row (L = 300, C = 1024: R = 64 rows, the last chunk 44 rows and
    padding): the chunks' windows meet at their K - 1 shared rows, the state feeds only the first chunk of each
    batch row, the padding rows leave no trace."""
    length, channels = 300, 1024
    rows = conv_function.CHUNK_ELEMENTS // channels
    assert 2 * rows < length and length % rows, "the prompt must span several chunks, the last one partial"
    inputs = _inputs(
        np.random.default_rng(300),
        t,
        batch=3,
        length=length,
        channels=channels,
        state_width=state_width,
        channels_last=channels_last,
    )
    for activation in ("silu", "none"):
        y, state = _run_function(inputs, activation, channels_last=channels_last, state_width=state_width)
        ok, summary = budget_report(y, state, **inputs, **_attributes(state_width, activation, channels_last))
        assert ok, f"{activation}: {summary}"


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "none"])
def test_one_token_is_the_decode_step(t: np.dtype, activation: str) -> None:
    """L = 1 with a state: CausalConv1dUpdate's reference step, the function body and this op's reference agree
    within the budget (the decode op's and this op's, one the other's)."""
    inputs = _inputs(np.random.default_rng(17), t, batch=3, length=1, channels=40)
    x_cf = np.ascontiguousarray(inputs["x"].transpose(0, 2, 1))
    step_y, step_state = update_reference.causal_conv1d_update(
        x_cf, inputs["initial_state"], inputs["weight"], inputs["bias"], activation=activation
    )
    attributes = _attributes(activation=activation)
    ok, summary = budget_report(step_y.transpose(0, 2, 1), step_state, **inputs, **attributes)
    assert ok, summary
    for y, state in (_run_function(inputs, activation), causal_conv1d(**inputs, **attributes)):
        ok, summary = update_reference.budget_report(
            y.transpose(0, 2, 1),
            state,
            x_cf,
            inputs["initial_state"],
            inputs["weight"],
            inputs["bias"],
            activation=activation,
        )
        assert ok, summary


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize("pieces", [(10, 1, 26), (2, 1, 1, 33)], ids=["10+1+26", "2+1+1+33"])
def test_a_prompt_in_pieces_equals_the_prompt_at_once(t: np.dtype, pieces: tuple[int, ...]) -> None:
    """Chunked prefill: each piece from the state the last one left (pieces shorter than the state included), in
    the reference and in the function body, is within the budget of the prompt at once, the state bit for bit."""
    inputs = _inputs(np.random.default_rng(5), t, length=sum(pieces), initial=False)
    for run in (
        lambda piece: causal_conv1d(**piece, **_attributes()),
        lambda piece: _run_function(piece),
    ):
        state, outs, start = None, [], 0
        for size in pieces:
            piece = dict(inputs, x=inputs["x"][:, start : start + size], initial_state=state)
            y, state = run(piece)
            outs.append(y)
            start += size
        ok, summary = budget_report(np.concatenate(outs, axis=1), state, **inputs, **_attributes())
        assert ok, summary


def test_reference_evaluator_runs_the_op() -> None:
    """The OpRun runs a fused node in onnx's ReferenceEvaluator, its attributes from the node."""
    from onnx.reference import ReferenceEvaluator

    inputs = _inputs(np.random.default_rng(8), length=6, state_width=WIDTH - 1, channels_last=0)
    model = _function_model(DTYPES[0], _attributes(WIDTH - 1, "none", 0))
    y, state = ReferenceEvaluator(model, new_ops=[CausalConv1d]).run(None, inputs)
    expected = causal_conv1d(**inputs, **_attributes(WIDTH - 1, "none", 0))
    np.testing.assert_array_equal(y, expected[0])
    np.testing.assert_array_equal(state, expected[1])


# --- the exported spelling the op replaces --------------------------------------------------------------------


def _exported_prefill_model(channels: int, width: int) -> onnx.ModelProto:
    """Return the dynamo / transformers' exporter prefill chain (float32): the prompt (B, L, C) transposed, the
    depthwise Conv with pads K - 1 on both sides, its first L columns, Sigmoid and Mul, transposed back; the
    present state the transposed prompt's last K columns."""

    def ints(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [1], values))

    nodes = [
        ints("zero", [0]),
        ints("two", [2]),
        ints("minus_k", [-width]),
        ints("end", [2**62]),
        helper.make_node("Transpose", ["x"], ["x_cf"], perm=[0, 2, 1]),
        helper.make_node("Shape", ["x"], ["length"], start=1, end=2),
        helper.make_node(
            "Conv",
            ["x_cf", "weight", "bias"],
            ["conv"],
            group=channels,
            pads=[width - 1, width - 1],
            kernel_shape=[width],
        ),
        helper.make_node("Slice", ["conv", "zero", "length", "two"], ["v"]),
        helper.make_node("Sigmoid", ["v"], ["gate"]),
        helper.make_node("Mul", ["v", "gate"], ["silu"]),
        helper.make_node("Transpose", ["silu"], ["y"], perm=[0, 2, 1]),
        helper.make_node("Slice", ["x_cf", "minus_k", "end", "two"], ["final_state"]),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "exported_prefill",
        [
            helper.make_tensor_value_info("x", f, [None, None, channels]),
            helper.make_tensor_value_info("weight", f, [channels, 1, width]),
            helper.make_tensor_value_info("bias", f, [channels]),
        ],
        [
            helper.make_tensor_value_info("y", f, [None, None, channels]),
            helper.make_tensor_value_info("final_state", f, None),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_exported_chain_is_the_op_where_the_prompt_fills_the_state() -> None:
    """ONNX Runtime's run of the exported float32 chain is within the budget (allowing its Sigmoid's absolute
    error, MLAS) for prompts of K tokens or more; shorter, its state Slice returns L columns, where the op (and
    transformers' eager cache) holds K, zeros from the left."""
    channels = 40
    session = ort.InferenceSession(
        _exported_prefill_model(channels, WIDTH).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    for length in (WIDTH, WIDTH + 1, 100):
        inputs = _inputs(np.random.default_rng(length), batch=3, length=length, channels=channels, initial=False)
        y, state = session.run(None, {k: v for k, v in inputs.items() if v is not None})
        ok, summary = budget_report(y, state, **inputs, **_attributes(), sigmoid_abs_error=1e-6)
        assert ok, f"L = {length}: {summary}"
    inputs = _inputs(np.random.default_rng(1), batch=3, length=2, channels=channels, initial=False)
    _, state = session.run(None, {k: v for k, v in inputs.items() if v is not None})
    assert state.shape == (3, channels, 2)
    assert causal_conv1d(**inputs, **_attributes())[1].shape == (3, channels, WIDTH)


@pytest.mark.parametrize("opset", [conv_function.MIN_OPSET, 18, 23])
def test_the_function_serves_every_opset_from_its_lowest(opset: int) -> None:
    inputs = _inputs(np.random.default_rng(opset), DTYPES[1], batch=3, length=9)
    model = _function_model(DTYPES[1], _attributes(), opset)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, state = session.run(None, inputs)
    ok, summary = budget_report(y, state, **inputs, **_attributes())
    assert ok, summary
    with pytest.raises(ValueError, match="needs ONNX opset >= 15"):
        conv_function.make_function(conv_function.MIN_OPSET - 1)
