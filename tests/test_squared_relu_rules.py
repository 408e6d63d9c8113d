"""SquaredRelu's reference, model-local function and rules (docs/squared_relu.md).

The function body against the reference (ONNX Runtime without the library, bit for bit); the rules on small graphs
of both forms (``Mul(r, r)``, ``Pow(r, 2)`` with a scalar, a 1-element or a Constant exponent) and their refusals,
each by its reason; every Nemotron-H fixture of every exporter (one squared ReLU an MLP layer, fused, with the
fused model's outputs equal to the original's bit for bit, through the library and through the function); the
mobius build's ``Mul`` form; and ``optimize``'s output, where the squares pass comes after the fusion.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import contrib_ops
from fusion import rewrite
from fusion.function import squared_relu as function
from fusion.reference import squared_relu as reference
from fusion.rules import squared_relu as rules
from fusion.rules._log import FusionLog
from fusion.rules.registry import FUSIONS, SQUARED_RELU, attach_functions
from models.runtime import feeds, load_manifest, load_references
from tests._decode_step import BFLOAT16

MANIFEST = load_manifest()
REFERENCES = load_references()

FIXTURES = Path(__file__).parent / "fixtures" / "models"
NEMOTRON = sorted(p.name for p in FIXTURES.glob("nemotron_h-*.onnx"))
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def _session(model: onnx.ModelProto, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if library:
        contrib_ops.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _graph(
    square: str,
    elem: int = TensorProto.FLOAT,
    *,
    opset: int = 21,
    extra_reader: bool = False,
    relu_output: bool = False,
    exponent: object = 2.0,
) -> onnx.ModelProto:
    """h = x + 0 (so x is not the ReLU's input itself), r = Relu(h), y = the square of r written as ``square``:
    "mul", "pow" (an initializer exponent), "pow-constant" (a Constant node's)."""
    nodes = [helper.make_node("Add", ["x", "zero"], ["h"]), helper.make_node("Relu", ["h"], ["r"])]
    inits = [helper.make_tensor("zero", elem, [], [0.0])]
    if square == "mul":
        nodes.append(helper.make_node("Mul", ["r", "r"], ["y"]))
    elif square == "pow":
        values = np.asarray(exponent, dtype=np.float32)
        inits.append(helper.make_tensor("e", TensorProto.FLOAT, list(values.shape), values.reshape(-1).tolist()))
        nodes.append(helper.make_node("Pow", ["r", "e"], ["y"]))
    elif square == "pow-computed":
        nodes.append(helper.make_node("Pow", ["r", "x"], ["y"]))
    else:
        nodes.append(helper.make_node("Constant", [], ["e"], value_float=float(exponent)))  # type: ignore[arg-type]
        nodes.append(helper.make_node("Pow", ["r", "e"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", elem, [2, 5])]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["r"], ["n"]))
        outputs.append(helper.make_tensor_value_info("n", elem, [2, 5]))
    if relu_output:
        outputs.append(helper.make_tensor_value_info("r", elem, [2, 5]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [2, 5])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _refusal(model: onnx.ModelProto) -> str:
    log = FusionLog()
    assert rules.fuse_squared_relu(ir.from_proto(model), log) == 0
    return " ".join(record.reason or "" for record in log.chains.values())


# --- the reference and the function --------------------------------------------------------------------------------


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["f32", "f16"])
def test_the_function_computes_the_reference(elem: int) -> None:
    """The body (Relu, Mul) run by ONNX Runtime's CPU kernels gives the reference's bits."""
    t = _NP[elem]
    node = helper.make_node("SquaredRelu", ["x"], ["y"], domain="ai.mambafuse")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem, [None])],
        [helper.make_tensor_value_info("y", elem, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.mambafuse", 1)],
        functions=[function.make_function(21)],
        ir_version=10,
    )
    if t == np.float16:
        x = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    else:
        rng = np.random.default_rng(2)
        x = rng.uniform(1, 2, 1 << 16) * np.exp2(rng.integers(-100, 100, 1 << 16)) * rng.choice([-1, 1], 1 << 16)
        x = np.concatenate([x.astype(np.float32), np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)])
    y = _session(model, library=False).run(None, {"x": x})[0]
    differ, detail = reference.count_differences(y, x)
    assert differ == 0, detail


def test_the_reference_is_the_float64_square_rounded_once() -> None:
    x = np.array([-2.0, -0.0, 0.5, 3.0, 1e20, 1.0000001], dtype=np.float32)
    expected = np.array([0.0, 0.0, 0.25, 9.0, np.inf, np.float32(np.float64(np.float32(1.0000001)) ** 2)], np.float32)
    assert reference.squared_relu(x).tobytes() == expected.tobytes()
    b = np.array([1.0078125, 300.0], dtype=np.float32).astype(BFLOAT16)  # 1 + 2^-7: its square needs 15 bits
    assert reference.squared_relu(b).astype(np.float32).tolist() == [1.015625, 90112.0]
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        reference.squared_relu(np.ones(3))


def test_the_function_needs_opset_14() -> None:
    with pytest.raises(ValueError, match="opset >= 14"):
        function.make_function(13)


# --- the rules on small graphs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("square", "exponent", "form"),
    [
        ("mul", None, rules.MUL_FORM),
        ("pow", 2.0, rules.POW_FORM),
        ("pow", [2.0], rules.POW_FORM),
        ("pow-constant", 2.0, rules.POW_FORM),
    ],
    ids=["mul", "pow-scalar", "pow-1-element", "pow-constant-node"],
)
@pytest.mark.parametrize("library", [False, True], ids=["function", "library"])
def test_each_form_is_fused_into_one_node_with_the_same_bits(square: str, exponent, form: str, library: bool) -> None:
    model = _graph(square, exponent=exponent if exponent is not None else 2.0)
    log = FusionLog()
    fused_ir = ir.from_proto(model)
    assert rules.fuse_squared_relu(fused_ir, log) == 1
    assert [record.form for record in log.chains.values()] == [form]
    fused, report = rewrite.rewrite_model(model)
    assert [n.op_type for n in fused.graph.node] == ["Add", "SquaredRelu"]
    assert "squared ReLUs" in report.summary(), report.summary()
    x = np.array([[-2, -0.0, 0.0, 0.5, 3], [np.nan, np.inf, -np.inf, 1e-30, 1e30]], np.float32)
    expected = _session(model, library=False).run(None, {"x": x})[0]
    actual = _session(fused, library=library).run(None, {"x": x})[0]
    assert np.array_equal(actual, expected, equal_nan=True)
    assert rules.find_anchors(ir.from_proto(fused).graph) == []


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"square": "pow", "exponent": 3.0}, "not proven to be a constant 2"),
        ({"square": "pow", "exponent": [2.0, 2.0]}, "not proven to be a constant 2"),
        ({"square": "pow", "exponent": [[[2.0]]]}, "not proven to be a constant 2"),
        ({"square": "pow-computed"}, "not proven to be a constant 2"),
        ({"square": "mul", "extra_reader": True}, "also read by"),
        ({"square": "mul", "relu_output": True}, "graph output"),
        ({"square": "mul", "opset": 13}, "opset 13 is below 14"),
    ],
    ids=[
        "exponent-3",
        "two-exponents",
        "rank-3-exponent",
        "computed-exponent",
        "relu-read-twice",
        "relu-output",
        "opset-13",
    ],
)
def test_refusals_name_the_reason(kwargs: dict, reason: str) -> None:
    model = _graph(**kwargs)
    assert reason in _refusal(model)
    fused, _ = rewrite.rewrite_model(model)
    assert "SquaredRelu" not in [n.op_type for n in fused.graph.node]
    assert [n.op_type for n in fused.graph.node] == [n.op_type for n in model.graph.node]


def test_a_double_relu_is_left_with_the_reason() -> None:
    model = _graph("mul", TensorProto.DOUBLE)
    assert "x is double" in _refusal(model)


def test_a_relu_that_is_not_squared_is_no_anchor() -> None:
    model = _graph("mul")
    model.graph.node[2].op_type = "Add"  # r + r
    assert rules.find_anchors(ir.from_proto(model).graph) == []
    assert rules.fuse_squared_relu(ir.from_proto(model), FusionLog()) == 0


def test_the_registry_has_the_op_once_with_its_function() -> None:
    assert [f for f in FUSIONS if f.op_type == "SquaredRelu"] == [SQUARED_RELU]
    assert SQUARED_RELU.make_function(21).name == "SquaredRelu"


# --- the fixtures ----------------------------------------------------------------------------------------------------


def _mlp_layers(model: onnx.ModelProto) -> int:
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return sum(
        1
        for node in model.graph.node
        if node.op_type == "Relu" and any(r.op_type in ("Pow", "Mul") for r in readers.get(node.output[0], []))
    )


#: The Nemotron-H fixtures with an MLP layer (the torchscript ones export one mixer alone).
WITH_MLP = [stem for stem in NEMOTRON if _mlp_layers(onnx.load(str(FIXTURES / stem), load_external_data=False))]


def test_the_fixtures_with_an_mlp_are_the_whole_models() -> None:
    assert len(WITH_MLP) >= 15 and not any("torchscript" in stem for stem in WITH_MLP), WITH_MLP


@pytest.mark.parametrize("stem", WITH_MLP)
def test_every_nemotron_fixture_fuses_its_squared_relus(stem: str) -> None:
    original = onnx.load(str(FIXTURES / stem))
    layers = _mlp_layers(original)
    fused, report = rewrite.rewrite_model(original)
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("SquaredRelu") == layers
    assert "Relu" not in ops


@pytest.mark.parametrize("library", [True, False], ids=["library", "function"])
@pytest.mark.parametrize(
    "stem",
    [
        "nemotron_h-dynamo-fp32-prefill.onnx",
        "nemotron_h-dynamo-fp16-decode.onnx",
        "nemotron_h-transformers-fp32-decode.onnx",
    ],
)
def test_fused_fixture_outputs_are_the_original_bits(stem: str, library: bool) -> None:
    original = onnx.load(str(FIXTURES / stem))
    step = feeds(MANIFEST["fixtures"][stem.removesuffix(".onnx")], REFERENCES[stem.removesuffix(".onnx")])
    ir_model = ir.from_proto(original)  # only the squared ReLU fused: the rest of the graph is the original's
    assert rules.fuse_squared_relu(ir_model) == 1
    attach_functions(ir_model)
    fused = ir.to_proto(ir_model)
    expected = _session(original, library=False).run(None, step)
    actual = _session(fused, library=library).run(None, step)
    for name, a, e in zip([o.name for o in original.graph.output], actual, expected, strict=True):
        assert a.tobytes() == e.tobytes(), f"{name} differs"
