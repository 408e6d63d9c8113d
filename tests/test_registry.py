"""The fusion registry (fusion/rules/registry.py): an op added as one entry is fused, counted, explained and given
its model-local function by ``rewrite_model`` and the command line, with no change to the orchestration.

The op here is a toy, ``ai.mambafuse::ToySilu`` (x * sigmoid(x)), registered for the test only.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusion.rewrite import main as rewrite_main
from fusion.rewrite import rewrite_model
from fusion.rules import registry
from fusion.rules._log import FusionLog

DOMAIN = "ai.mambafuse"


def _silu_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Every Sigmoid whose output a Mul multiplies by something."""
    return [
        node
        for node in graph
        if node.op_type == "Sigmoid" and any(user.op_type == "Mul" for user, _ in node.outputs[0].uses())
    ]


def _fuse_toy_silu(model: ir.Model, log: FusionLog) -> int:
    fused = 0
    for sigmoid in _silu_anchors(model.graph):
        x = sigmoid.inputs[0]
        mul = next(user for user, _ in sigmoid.outputs[0].uses() if user.op_type == "Mul")
        if x not in mul.inputs:
            log.record(sigmoid, "", reason="the Mul's other input is not the Sigmoid's")
            continue
        node = ir.node("ToySilu", [x], domain=DOMAIN, name=f"{mul.name}_toy")
        model.graph.insert_before(mul, node)
        ir.convenience.replace_all_uses_with(mul.outputs[0], node.outputs[0])
        model.graph.remove([mul, sigmoid], safe=True)
        log.record(node, "")
        fused += 1
    return fused


def _toy_function(onnx_opset: int) -> onnx.FunctionProto:
    return helper.make_function(
        DOMAIN,
        "ToySilu",
        ["X"],
        ["Y"],
        [helper.make_node("Sigmoid", ["X"], ["s"]), helper.make_node("Mul", ["X", "s"], ["Y"])],
        [helper.make_opsetid("", onnx_opset)],
    )


TOY = registry.Fusion(
    name="toy_silu",
    op_type="ToySilu",
    counts="toy silus",
    rules=(),
    fuse=_fuse_toy_silu,
    find_anchors=_silu_anchors,
    make_function=_toy_function,
    min_opset=13,
)


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "FUSIONS", (*registry.FUSIONS, TOY))


def _model() -> onnx.ModelProto:
    """y = x * sigmoid(x) (fusable), z = x * sigmoid(w) (refused: another input)."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["sx"], name="sig_x"),
        helper.make_node("Mul", ["x", "sx"], ["xsx"], name="mul_y"),
        helper.make_node("Identity", ["xsx"], ["y"], name="out_y"),
        helper.make_node("Sigmoid", ["w"], ["sw"], name="sig_w"),
        helper.make_node("Mul", ["x", "sw"], ["z"], name="mul_z"),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "w")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("y", "z")]
    return helper.make_model(
        helper.make_graph(nodes, "toy", inputs, outputs), opset_imports=[helper.make_opsetid("", 18)]
    )


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_an_op_added_as_one_entry_is_fused_counted_explained_and_runs(toy_registered: None) -> None:
    original = _model()
    fused, report = rewrite_model(original)
    toy = report.decode["ToySilu"]
    assert (toy["found"], toy["fused"]) == (2, 1)
    assert toy["refused"] == [("sig_w", "the Mul's other input is not the Sigmoid's")]
    assert report.refused_of("ToySilu") == toy["refused"]
    assert "toy silus found: 2 (ai.mambafuse::ToySilu), fused: 1, refused: 1" in report.summary()
    assert [n.op_type for n in fused.graph.node].count("ToySilu") == 1
    assert [f.name for f in fused.functions] == ["ToySilu"]  # only the functions of the ops the model uses
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, 3)).astype(np.float32) for n in ("x", "w")}
    for before, after in zip(_run(original, feeds), _run(fused, feeds), strict=True):
        np.testing.assert_allclose(after, before, rtol=1e-6)


def test_the_command_line_counts_the_added_op(toy_registered: None, tmp_path, capsys) -> None:
    source = tmp_path / "toy.onnx"
    onnx.save(_model(), source)
    assert rewrite_main([str(source), "-o", str(tmp_path / "out.onnx")]) == 0
    assert "toy silus found: 2 (ai.mambafuse::ToySilu), fused: 1, refused: 1" in capsys.readouterr().out


def test_without_the_entry_nothing_is_fused() -> None:
    fused, report = rewrite_model(_model())
    assert "ToySilu" not in report.decode and report.decode_fused == 0
    assert [n.op_type for n in fused.graph.node] == ["Sigmoid", "Mul", "Identity", "Sigmoid", "Mul"]
