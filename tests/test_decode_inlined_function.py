"""The decode ops survive the optimizers users run after mambafuse: inlined, they fuse again to the same nodes.

onnx-ir's ``InlinePass`` and onnxscript's ``optimize_for_ort`` (which inlines every model-local function and
then folds constants) replace each CausalConv1dUpdate / SelectiveStateUpdate node by its model-local body.
The decode rules prove that body as they prove the exporters' spellings, so fusing the inlined model gives
back the same nodes with the same attributes: one-node models over what the rewriter writes (dtypes, the
state's type, bias or its -0.0s, activation, dt_softplus, groups, a static or symbolic batch), and every
decode fixture. A body with a changed constant or rounding point is refused.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import InlinePass

from fusion.function import causal_conv1d_update as conv_function
from fusion.function import selective_state_update as state_function
from fusion.rewrite import rewrite_model
from models.fixtures import BATCH_FIXTURE_DIR
from models.runtime import feeds, load_manifest, load_references
from tests.test_decode_batch import _batch_feeds
from tests.test_decode_step_rules import DECODE, MANIFESTS, SETS

optimize_for_ort = pytest.importorskip("onnxscript.rewriter.ort_fusions").optimize_for_ort

F, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
OPS = ("CausalConv1dUpdate", "SelectiveStateUpdate")
NAMES = {F: "f32", F16: "f16", BF16: "bf16"}


def _copy(model: onnx.ModelProto) -> ir.Model:
    """An IR model of a copy: optimize_for_ort changes the proto it was read from (seen: a fused fixture then
    referred to a value it no longer had)."""
    return ir.from_proto(onnx.ModelProto.FromString(model.SerializeToString()))


def _inline(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = _copy(model)
    InlinePass()(ir_model)
    return ir.to_proto(ir_model)


def _optimize_for_ort(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model, _ = optimize_for_ort(_copy(model))
    return ir.to_proto(ir_model)


INLINERS = {"InlinePass": _inline, "optimize_for_ort": _optimize_for_ort}


def _fused(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type in OPS]


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _computation(model: onnx.ModelProto) -> list[object]:
    """Return each graph output as the tree of ops that computes it: graph inputs by name, constants by
    content (a rewrite names its initializers after the chain), nodes by op, attributes and operands."""
    graph = model.graph
    producers = {o: (n, i) for n in graph.node for i, o in enumerate(n.output)}
    constants = {t.name: t for t in graph.initializer}

    @cache
    def tree(name: str) -> object:
        if name in constants:
            array = numpy_helper.to_array(constants[name])
            return ("constant", constants[name].data_type, array.shape, array.tobytes())
        if name not in producers:
            return ("input", name)
        node, index = producers[name]
        attributes = tuple(sorted((k, repr(v)) for k, v in _attributes(node).items()))
        return (node.domain, node.op_type, attributes, index, tuple(tree(i) if i else None for i in node.input))

    return [tree(o.name) for o in graph.output]


def _check_refuses(original: onnx.ModelProto, inline, count: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Inline ``original`` (fused, ``count`` decode nodes), fuse again, and check the nodes come back."""
    inlined = inline(original)
    assert not _fused(inlined), "the inliner kept a fused node: this test no longer shows the inlining"
    refused, report = rewrite_model(inlined)
    assert len(_fused(refused)) == count, report.summary()
    assert all(not record["refused"] for record in report.decode.values()), report.summary()
    assert [(n.op_type, _attributes(n)) for n in _fused(refused)] == [
        (n.op_type, _attributes(n)) for n in _fused(original)
    ]
    return inlined, refused


# one-node models, as the rewriter writes them ------------------------------------------------------------


def _model(nodes, inputs, outputs, initializers, functions) -> onnx.ModelProto:
    model = helper.make_model(
        helper.make_graph(nodes, "fused", inputs, outputs, initializers),
        opset_imports=[
            helper.make_opsetid("", 18),
            helper.make_opsetid("ai.mambafuse", 1),
            helper.make_opsetid("ai.onnx.ml", conv_function.ML_OPSET),
        ],
        functions=functions,
    )
    onnx.checker.check_model(model)
    return model


def _tensor(name: str, elem: int, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array.astype(helper.tensor_dtype_to_np_dtype(elem)), name)


def _conv_model(elem: int, batch, bias: bool, activation: str, channels=12, width=4, state_len=4) -> onnx.ModelProto:
    rng = np.random.default_rng(channels * 10 + width)
    weight = _tensor("weight", elem, rng.standard_normal((channels, 1, width)))
    bias_values = rng.standard_normal(channels) if bias else np.full(channels, -0.0)
    # the rewriter writes -0.0s where the Conv has no bias
    bias_tensor = _tensor("bias" if bias else "present_bias", elem, bias_values)
    node = helper.make_node(
        "CausalConv1dUpdate",
        ["x", "conv_state", weight.name, bias_tensor.name],
        ["y", "present"],
        domain="ai.mambafuse",
        activation=activation,
    )
    inputs = [
        helper.make_tensor_value_info("x", elem, [batch, channels, 1]),
        helper.make_tensor_value_info("conv_state", elem, [batch, channels, state_len]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", elem, [batch, channels, 1]),
        helper.make_tensor_value_info("present", elem, [batch, channels, state_len]),
    ]
    return _model([node], inputs, outputs, [weight, bias_tensor], [conv_function.make_function(18)])


CONV_CASES = [
    (elem, batch, bias, activation)
    for elem in (F, F16, BF16)
    for batch in (1, "batch")
    for bias in (True, False)
    for activation in ("silu", "none")
]


@pytest.mark.parametrize("inline", INLINERS.values(), ids=INLINERS.keys())
@pytest.mark.parametrize(
    "case", CONV_CASES, ids=lambda c: f"{NAMES[c[0]]}-batch{c[1]}-{'bias' if c[2] else 'nobias'}-{c[3]}"
)
def test_conv_update_body_fuses_to_the_same_graph(case, inline) -> None:
    elem, batch, bias, activation = case
    original = _conv_model(elem, batch, bias, activation)
    _, refused = _check_refuses(original, inline, 1)
    assert _computation(refused) == _computation(original)
    assert len(refused.graph.node) == len(original.graph.node)


def test_conv_update_body_with_a_symbolic_state_length_fuses() -> None:
    """The Gather's columns (S - K + 1) + t + k are proven for every S: the state's length is a symbol."""
    original = _conv_model(F, "batch", True, "silu", state_len="S")
    _, refused = _check_refuses(original, _inline, 1)
    assert _computation(refused) == _computation(original)


def _state_model(elem: int, state_elem: int, batch, dt_softplus: int, groups: int) -> onnx.ModelProto:
    heads, head_dim, state_size = 4, 6, 8
    rng = np.random.default_rng(groups * 100 + dt_softplus)
    initializers = [
        _tensor("dt_bias", elem, rng.standard_normal(heads)),
        _tensor("A", F, -np.exp(rng.standard_normal(heads))),
        _tensor("D", elem, rng.standard_normal(heads)),
    ]
    nodes = [
        helper.make_node("Constant", [], ["heads_shape"], value_ints=[-1, heads]),
        helper.make_node("Reshape", ["dt_src", "heads_shape"], ["dt"]),
        helper.make_node("Constant", [], ["rows_shape"], value_ints=[-1, groups, state_size]),
        helper.make_node("Reshape", ["B_src", "rows_shape"], ["B"]),
        helper.make_node("Reshape", ["C_src", "rows_shape"], ["C"]),
        helper.make_node(
            "SelectiveStateUpdate",
            ["state", "x", "dt", "dt_bias", "A", "B", "C", "D"],
            ["out", "present"],
            domain="ai.mambafuse",
            dt_softplus=dt_softplus,
        ),
    ]
    inputs = [
        helper.make_tensor_value_info("state", state_elem, [batch, heads, head_dim, state_size]),
        helper.make_tensor_value_info("x", elem, [batch, heads, head_dim]),
        helper.make_tensor_value_info("dt_src", elem, [batch, 1, heads]),
        helper.make_tensor_value_info("B_src", elem, [batch, 1, groups * state_size]),
        helper.make_tensor_value_info("C_src", elem, [batch, 1, groups * state_size]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", elem, [batch, heads, head_dim]),
        helper.make_tensor_value_info("present", state_elem, [batch, heads, head_dim, state_size]),
    ]
    return _model(nodes, inputs, outputs, initializers, [state_function.make_function(18)])


STATE_CASES = [
    (elem, state, batch, softplus, groups)
    for elem in (F, F16, BF16)
    for state in ({F, elem})
    for batch in (1, 2, "batch")
    for softplus in (1, 0)
    for groups in (1, 2, 4)
    if batch != 2 or groups == 2
]


@pytest.mark.parametrize("inline", INLINERS.values(), ids=INLINERS.keys())
@pytest.mark.parametrize(
    "case",
    sorted(STATE_CASES, key=str),
    ids=lambda c: f"{NAMES[c[0]]}-state{NAMES[c[1]]}-batch{c[2]}-softplus{c[3]}-groups{c[4]}",
)
def test_state_update_body_fuses_to_the_same_graph(case, inline) -> None:
    original = _state_model(*case)
    _, refused = _check_refuses(original, inline, 1)
    assert _computation(refused) == _computation(original)
    assert len(refused.graph.node) == len(original.graph.node)


# a changed body is not the op --------------------------------------------------------------------------


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    if node.op_type != "Constant" or not node.attribute or node.attribute[0].name != "value":
        return None
    return numpy_helper.to_array(node.attribute[0].t)


def _set_constant(node: onnx.NodeProto, array: np.ndarray) -> None:
    node.attribute[0].t.CopyFrom(numpy_helper.from_array(array, node.attribute[0].t.name))


def _softplus_threshold_21(model: onnx.ModelProto) -> None:
    (node,) = [n for n in model.graph.node if (v := _constant_value(n)) is not None and v.dtype == np.float32]
    _set_constant(node, np.array(21.0, np.float32))


def _conv_columns_shifted(model: onnx.ModelProto) -> None:
    """first = S - K + 2: the Gather reads one column further (the state's first column is never read)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    (add,) = [n for n in model.graph.node if n.op_type == "Add" and producers[n.input[0]].op_type == "Sub"]
    two = helper.make_node("Constant", [], ["shifted_two"], value=numpy_helper.from_array(np.array([2], np.int64)))
    model.graph.node.insert(list(model.graph.node).index(add), two)
    add.input[1] = two.output[0]  # its own constant: the body's "one" is shared with the bias' Unsqueeze


def _dbx_rounded_to_fp16(model: onnx.ModelProto) -> None:
    """A float32 body whose dBx is rounded to float16 before the state update: a rounding point the op lacks."""
    producers = {o: n for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        if node.op_type == "Add" and all(i in producers for i in node.input):
            casts = [producers[i] for i in node.input if producers[i].op_type == "Cast"]
            if casts and producers[casts[0].input[0]].op_type == "Mul":
                widen = casts[0]
                rounded = helper.make_node("Cast", [widen.input[0]], [widen.input[0] + "_f16"], to=F16)
                widen.input[0] = rounded.output[0]
                model.graph.node.insert(list(model.graph.node).index(widen), rounded)
                return
    raise AssertionError("no dBx Cast found")


def _conv_where_swapped(model: onnx.ModelProto) -> None:
    """Where(is_silu, v, silu(v)): silu where the attribute says none."""
    (where,) = [n for n in model.graph.node if n.op_type == "Where"]
    where.input[1], where.input[2] = where.input[2], where.input[1]


MUTATIONS = [
    (lambda: _state_model(F, F, 1, 1, 2), _softplus_threshold_21, "softplus threshold"),
    (lambda: _conv_model(F, 1, True, "silu"), _conv_columns_shifted, "does not read the window's last L + K - 1"),
    (lambda: _conv_model(F, "b", True, "silu", state_len="S"), _conv_columns_shifted, "Gather is not proven"),
    (lambda: _state_model(F, F, 1, 1, 2), _dbx_rounded_to_fp16, "rounded through"),
    (lambda: _conv_model(F, 1, True, "silu"), _conv_where_swapped, "does not match"),
]


@pytest.mark.parametrize(("make", "mutate", "reason"), MUTATIONS, ids=lambda m: getattr(m, "__name__", None))
def test_a_changed_body_is_refused(make, mutate, reason: str) -> None:
    inlined = _inline(make())
    refused, report = rewrite_model(inlined)
    assert len(_fused(refused)) == 1, "the unchanged body must fuse: the mutation is what is refused"
    mutate(inlined)
    refused, report = rewrite_model(inlined)
    assert not _fused(refused), report.summary()
    assert reason in report.summary()


# every decode fixture ----------------------------------------------------------------------------------

BATCH_MANIFEST = load_manifest(BATCH_FIXTURE_DIR)
#: test_decode_step_rules.py's budget: the whole-model difference relative to the largest |output|.
TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3}


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


@pytest.mark.parametrize("inline", INLINERS.keys())
@pytest.mark.parametrize(("name", "stem"), DECODE)
def test_every_decode_fixture_fuses_again(name: str, stem: str, inline: str) -> None:
    record = MANIFESTS[name]["fixtures"][stem]
    original = onnx.load(SETS[name] / record["file"])
    fused, report = rewrite_model(original)
    assert len(_fused(fused)) == 2 * record["num_mamba_layers"], report.summary()
    inlined, refused = _check_refuses(fused, INLINERS[inline], 2 * record["num_mamba_layers"])
    if record["dtype"] == "bf16":
        return  # ONNX Runtime's CPU has no bf16 kernels for these ops
    _compare(fused, inlined, refused, feeds(record, load_references(SETS[name])[stem]), inline, record["dtype"])


@pytest.mark.parametrize("inline", INLINERS.keys())
@pytest.mark.parametrize("stem", sorted(BATCH_MANIFEST["fixtures"]))
def test_every_batch_fixture_fuses_again(stem: str, inline: str) -> None:
    """A symbolic batch: the body's shape arithmetic (Shape of x, B, the state) is proven at batch 1, 2, 3."""
    record = BATCH_MANIFEST["fixtures"][stem]
    fused, report = rewrite_model(onnx.load(BATCH_FIXTURE_DIR / record["file"]))
    assert len(_fused(fused)) == 2 * record["num_mamba_layers"], report.summary()
    inlined, refused = _check_refuses(fused, INLINERS[inline], 2 * record["num_mamba_layers"])
    if record["dtype"] != "bf16":
        _compare(fused, inlined, refused, _batch_feeds(stem, 3), inline, record["dtype"])


def _compare(fused, inlined, refused, inputs, inline: str, dtype: str) -> None:
    """The re-fused model's outputs against the first fusion's: bit for bit after InlinePass, within the
    budget after optimize_for_ort (which also fuses other ops)."""
    expected = _run(fused, inputs)
    try:
        actual = _run(refused, inputs)
    except ort.capi.onnxruntime_pybind11_state.Fail as error:
        # optimize_for_ort's own output does not load either (measured on the three fp16 Nemotron-H decode
        # exports: its SkipSimplifiedLayerNormalization binds T to float16 and float); nothing to compare
        assert inline == "optimize_for_ort" and "SkipSimplifiedLayerNormalization" in str(error), error
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="SkipSimplifiedLayerNormalization"):
            _run(inlined, inputs)
        return
    for output, a, e in zip([o.name for o in fused.graph.output], actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, output
        if inline == "InlinePass":
            # ONNX Runtime without the library runs the first fusion's nodes through the same bodies
            differ = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
            assert differ == 0, f"{output}: {differ} of {a.size} elements differ from the first fusion's"
            continue
        scale = max(float(np.abs(e.astype(np.float64)).max()), 1e-30)
        error = float(np.abs(a.astype(np.float64) - e.astype(np.float64)).max()) / scale
        floor = float(np.finfo(a.dtype).smallest_subnormal) / scale
        assert error <= TOLERANCE[dtype] + floor, f"{output}: max error {error:.3g} of the output's scale"
