"""The gated norm survives the optimizers users run after mambafuse: inlined, it fuses again to the same nodes.

onnx-ir's ``InlinePass`` and onnxscript's ``optimize_for_ort`` replace each GatedGroupRMSNorm node by its
model-local body, whose Constants take the group size and epsilon from the node's attributes and so hold
``value_int`` / ``value_float`` once inlined. ONNX Runtime's symbolic shape inference, which the rewriter asks for
the shapes of y and the gate, raises on such a Constant; the TorchScript bf16 prefill exports, whose y width only
that tool derives, then could not be fused again ("the shapes of y and the gate are unknown"). The rewriter now
hands the tool a copy with those Constants as tensors. Every fixture of both sets is checked, for both inliners.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import InlinePass

from fusion.rewrite import _constants_as_tensors, rewrite_model
from models.runtime import feeds, load_references
from tests.test_decode_step_rules import MANIFESTS, SETS

optimize_for_ort = pytest.importorskip("onnxscript.rewriter.ort_fusions").optimize_for_ort

FIXTURES = sorted((name, stem) for name, manifest in MANIFESTS.items() for stem in manifest["fixtures"])


def _inline(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = ir.serde.deserialize_model(onnx.load_from_string(model.SerializeToString()))
    InlinePass()(ir_model)
    return ir.serde.serialize_model(ir_model)


def _optimize_for_ort(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model, _ = optimize_for_ort(ir.serde.deserialize_model(onnx.load_from_string(model.SerializeToString())))
    return ir.serde.serialize_model(ir_model)


def _norms(model: onnx.ModelProto) -> list[dict[str, object]]:
    return sorted(
        (
            {a.name: helper.get_attribute_value(a) for a in node.attribute}
            for node in model.graph.node
            if node.domain == "ai.mambafuse" and node.op_type == "GatedGroupRMSNorm"
        ),
        key=repr,
    )


@pytest.mark.parametrize("inline", [_inline, _optimize_for_ort], ids=["InlinePass", "optimize_for_ort"])
@pytest.mark.parametrize(("name", "stem"), FIXTURES)
def test_every_fixture_fuses_its_norms_again(name: str, stem: str, inline) -> None:
    record = MANIFESTS[name]["fixtures"][stem]
    fused, report = rewrite_model(onnx.load(SETS[name] / record["file"]))
    inlined = inline(fused)
    assert not _norms(inlined), "the inliner kept a fused node: this test no longer shows the inlining"
    refused, again = rewrite_model(inlined)
    if inline is _inline:
        assert _norms(refused) == _norms(fused), again.summary()
        return
    # optimize_for_ort also folds other ops: a Cast of the weight to float32 folded into the weight lets the
    # second fusion take the Cast after the norm into output_dtype, where the first one kept it (measured: the
    # Falcon-H1 TorchScript fp16 prefill). The same values: the product is rounded to float32, then to the half
    # type, in both. Everything else is the same, and the outputs are compared where ONNX Runtime's CPU runs it.
    first, second = _norms(fused), _norms(refused)
    assert len(first) == len(second), again.summary()
    assert [_without(a, "output_dtype") for a in first] == [_without(a, "output_dtype") for a in second]
    if first != second and record["dtype"] != "bf16":
        inputs = feeds(record, load_references(SETS[name])[stem])
        for output, a, e in zip(fused.graph.output, _run(refused, inputs), _run(fused, inputs), strict=True):
            differ = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
            assert a.dtype == e.dtype and differ == 0, f"{output.name}: {differ} of {a.size} elements differ"


def _without(attributes: dict[str, object], name: str) -> dict[str, object]:
    return {k: v for k, v in attributes.items() if k != name}


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def test_constants_become_tensors_in_subgraphs_too() -> None:
    """value_int / value_ints / value_float / value_floats become ``value`` tensors of the same type, shape and
    values, in If branches as well; other Constants and other ops are left alone."""

    def constant(output: str, **attribute) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [output], **attribute)

    branch = helper.make_graph(
        [constant("b", value_floats=[0.5, -2.0])],
        "branch",
        [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
    )
    kept = numpy_helper.from_array(np.array([7], dtype=np.int32), "kept")
    nodes = [
        constant("i", value_int=16),
        constant("f", value_float=1e-5),
        constant("ii", value_ints=[1, -1]),
        constant("t", value=kept),
        helper.make_node("If", ["cond"], ["b"], then_branch=branch, else_branch=branch),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])], [])
    _constants_as_tensors(graph)
    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node if n.op_type == "Constant"}
    assert all(n.attribute[0].name == "value" for n in graph.node if n.op_type == "Constant")
    assert values["i"].dtype == np.int64 and values["i"].shape == () and values["i"] == 16
    assert values["f"].dtype == np.float32 and values["f"].shape == () and values["f"] == np.float32(1e-5)
    assert values["ii"].dtype == np.int64 and values["ii"].tolist() == [1, -1]
    assert values["t"].dtype == np.int32 and values["t"].tolist() == [7]
    for branch_graph in (graph.node[4].attribute[0].g, graph.node[4].attribute[1].g):
        (node,) = branch_graph.node
        assert node.attribute[0].name == "value"
        assert numpy_helper.to_array(node.attribute[0].t).tolist() == [0.5, -2.0]
