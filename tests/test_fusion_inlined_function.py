"""A fused model survives the optimizers users run after mambafuse: inlined, it fuses again to the same graph.

ONNX Runtime without the library, onnx-ir's ``InlinePass`` and onnxscript's ``optimize_for_ort`` (which
inlines every model-local function first) replace each fused node by the model-local function's body.
That body spells silu ``z / (1 + exp(-z))`` (no ORT Sigmoid, docs/op.md) and rounds with Cast pairs
(round to the type, widen back to float32); the rules accept that spelling, so fusing the inlined model
gives back the same nodes with the same attributes — one-node models over the type combinations and
attributes the rewriter writes (``gated_dtype`` included), every fixture after either inliner, and mobius
builds after ``optimize_for_ort``. Also: a subgraph (Scan, If) between two chains does not leave the first chain
behind, and the CLI loads, fuses and verifies what ``optimize_for_ort`` saved with external data (ORT's
``SimplifiedLayerNormalization`` in the ONNX domain, data files beside the model).
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes.common import InlinePass

from fusion.rewrite import rewrite_model
from fusion.shapes.symbolic import constants_as_tensors
from models.fixtures import FIXTURE_DIR
from models.runtime import feeds, load_references
from tests.test_decode_inlined_function import INLINERS
from tests.test_decode_step_rules import MANIFESTS, SETS, _run
from tests.test_function import _model

optimize_for_ort = pytest.importorskip("onnxscript.rewriter.ort_fusions").optimize_for_ort

F, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
OP_TYPE = "GatedGroupRMSNorm"

#: (Y/Z type, W type, norm_dtype, output_dtype, gated_dtype or None): the forms' attribute sets (A, B, C,
#: mixed widths, mobius' I with gated_dtype in f16 and bf16) and a few more combinations. Not the all-float
#: inputs with a half output_dtype: the rewriter never writes that node (docs/op.md, Type rules).
CASES = [
    (F, F, F, F, None),
    (F16, F16, F16, F16, None),
    (BF16, BF16, BF16, BF16, None),
    (F, F16, F16, F16, None),
    (F16, F, F, F16, None),
    (F16, F16, F, F16, F16),
    (BF16, BF16, F, BF16, BF16),
    (F, F, F, F, F16),
    (F, F, F, F, BF16),
    (F16, F16, BF16, F16, None),
    (BF16, F, F16, F, None),
    (F16, BF16, F, BF16, F16),
]


def _case_id(case: tuple) -> str:
    names = {F: "f32", F16: "f16", BF16: "bf16", None: "-"}
    return "y{}-w{}-norm{}-out{}-gated{}".format(*(names[t] for t in case))


def _inline(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = ir.from_proto(model)
    InlinePass()(ir_model)
    return ir.to_proto(ir_model)


def _optimize_for_ort(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model, _ = optimize_for_ort(ir.from_proto(model))
    return ir.to_proto(ir_model)


def _fused(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_TYPE]


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _graph(model: onnx.ModelProto | onnx.GraphProto) -> list[tuple]:
    """Return the nodes as (domain, op, inputs, outputs, attributes): the graph without node names."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    return [
        (
            n.domain,
            n.op_type,
            list(n.input),
            list(n.output),
            sorted((k, _graph(v) if isinstance(v, onnx.GraphProto) else v) for k, v in _attributes(n).items()),
        )
        for n in graph.node
    ]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("opset", [17, 18])
def test_inlined_function_fuses_to_the_same_graph(case: tuple, opset: int) -> None:
    y_type, w_type, norm_dtype, output_dtype, gated_dtype = case
    original = _model(y_type, w_type, norm_dtype, output_dtype, gated_dtype=gated_dtype, opset=opset)
    inlined = _inline(original)
    assert not _fused(inlined) and "Exp" in {n.op_type for n in inlined.graph.node}

    refused, report = rewrite_model(inlined)
    assert report.fused == 1, report.summary()
    assert _graph(refused) == _graph(original)
    assert [f.name for f in refused.functions] == [OP_TYPE]


@pytest.mark.parametrize("case", CASES[:3], ids=_case_id)
def test_an_inlined_body_is_a_gated_product(case: tuple) -> None:
    """The body spells silu as z / (1 + exp(-z)): the chain finder (the report's found / refused counts, and the
    reason for a chain no rule fused, for the forms without a group Reshape) sees y * that as a gated product, as
    the rules do."""
    from fusion.rules.gated_group_rms_norm import _is_gated_product

    y_type, w_type, norm_dtype, output_dtype, gated_dtype = case
    inlined = ir.from_proto(_inline(_model(y_type, w_type, norm_dtype, output_dtype, gated_dtype=gated_dtype)))
    # the function body names silu's value "silu" (the inliner keeps a name it does not clash with)
    products = [node for node in inlined.graph if node.op_type == "Mul" and any(v.name == "silu" for v in node.inputs)]
    assert products[0].inputs[1].producer().op_type == "Div"
    assert len(products) == 1
    assert _is_gated_product(products[0].outputs[0])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_optimize_for_ort_output_fuses_to_the_same_graph(case: tuple) -> None:
    """onnxscript's optimize_for_ort inlines the fused node (and drops the no-op Casts); fusing its output
    gives back the node with the same inputs and attributes."""
    y_type, w_type, norm_dtype, output_dtype, gated_dtype = case
    original = _model(y_type, w_type, norm_dtype, output_dtype, gated_dtype=gated_dtype)
    optimized = _optimize_for_ort(original)
    assert not _fused(optimized)

    refused, report = rewrite_model(optimized)
    assert report.fused == 1, report.summary()
    assert _graph(refused) == _graph(original)


#: Real exports (forms A, B, C, E, F) and mobius builds (form I, gated_dtype) after optimize_for_ort.
EXPORTS = [
    "nemotron_h-dynamo-fp32-decode",
    "nemotron_h-dynamo-fp16-decode",
    "nemotron_h-dynamo-bf16-prefill",
    "nemotron_h-torchscript-fp16-prefill",
    "zamba2-transformers-ort-fp16-decode",
    "zamba2-dynamo-noopt-fp32-prefill",
]
MOBIUS_BUILDS = ["nemotron_h-g4-f16-default-cpu", "zamba2-g2-bf16-default-cpu", "mamba2-g4-f32-default-cpu"]


@pytest.fixture(scope="module")
def mobius_builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.mobius import extract_builds

    return extract_builds(tmp_path_factory.mktemp("mobius"))


def _model_of(source: str, mobius_builds: Path | None) -> onnx.ModelProto:
    if mobius_builds is None:
        return onnx.load(FIXTURE_DIR / f"{source}.onnx")
    return onnx.load(mobius_builds / source / "model.onnx")


def _check_refused(original: onnx.ModelProto) -> None:
    fused, report = rewrite_model(original)
    assert report.fused > 0 and not report.refused, report.summary()
    optimized = _optimize_for_ort(fused)
    assert not _fused(optimized), "optimize_for_ort kept a fused node: this test no longer shows the inlining"
    refused, again = rewrite_model(optimized)
    assert again.fused == report.fused and not again.refused, again.summary()
    # The same attributes, node by node (input names differ: optimize_for_ort also renames and merges
    # values elsewhere, and folds a Cast of a constant weight into a float32 initializer).
    assert [_attributes(n) for n in _fused(refused)] == [_attributes(n) for n in _fused(fused)]
    # Nothing of the inlined bodies is left: no silu of the norm function's spelling outside a fused node, and
    # no exp(dt * A) of an inlined SelectiveStateUpdate body (decode exports: those re-fuse too,
    # tests/test_decode_inlined_function.py; the conv body's silu is a Sigmoid).
    state_updates = again.decode.get("SelectiveStateUpdate", {}).get("fused", 0)
    assert state_updates == report.decode.get("SelectiveStateUpdate", {}).get("fused", 0), again.summary()
    assert (
        Counter(n.op_type for n in refused.graph.node)["Exp"]
        == Counter(n.op_type for n in optimized.graph.node)["Exp"] - again.fused - state_updates
    )


@pytest.mark.parametrize("stem", EXPORTS)
def test_exports_after_optimize_for_ort_fuse_again(stem: str) -> None:
    _check_refused(_model_of(stem, None))


#: Every fixture of both sets (tests/fixtures/models and families/).
FIXTURES = sorted((name, stem) for name, manifest in MANIFESTS.items() for stem in manifest["fixtures"])


@pytest.mark.parametrize("inline", INLINERS)
@pytest.mark.parametrize(("name", "stem"), FIXTURES)
def test_every_fixture_fuses_its_norms_again(name: str, stem: str, inline: str) -> None:
    """Inlined by onnx-ir's InlinePass (which leaves the bodies untyped: they are typed from their producers'
    schemas, the weight's width proven through its Casts), every fixture fuses again node for node. The body's
    Constants then hold value_int / value_float (the group size and epsilon come from the node's attributes),
    on which ONNX Runtime's symbolic shape inference raises; the rewriter hands it a copy with those as tensors.
    The TorchScript bf16 prefills' norms fuse again too, now that their scans fuse: their y is the scan node's
    output, whose width is proven through its inlined body, where the exported scan's width was derived only by that
    tool (which does not see through the inlined prompt conv's Loop)."""
    record = MANIFESTS[name]["fixtures"][stem]
    fused, report = rewrite_model(onnx.load(SETS[name] / record["file"]))
    inlined = INLINERS[inline](fused)
    assert not _fused(inlined), "the inliner kept a fused node: this test no longer shows the inlining"
    again, second = rewrite_model(inlined)
    first_nodes, second_nodes = [_attributes(n) for n in _fused(fused)], [_attributes(n) for n in _fused(again)]
    if inline == "InlinePass":
        assert second_nodes == first_nodes, second.summary()
        return
    # optimize_for_ort also folds other ops: a Cast of the weight to float32 folded into the weight lets the
    # second fusion take the Cast after the norm into output_dtype, where the first one kept it (the Falcon-H1
    # TorchScript fp16 prefill). The same values: the product is rounded to float32, then to the half type, in
    # both. Everything else is the same, and the outputs are compared where ONNX Runtime's CPU runs them.
    assert len(second_nodes) == len(first_nodes), second.summary()
    assert [_without(a, "output_dtype") for a in second_nodes] == [_without(a, "output_dtype") for a in first_nodes]
    if second_nodes != first_nodes and record["dtype"] != "bf16":
        inputs = feeds(record, load_references(SETS[name])[stem])
        for output, a, e in zip(fused.graph.output, _run(again, inputs), _run(fused, inputs), strict=True):
            differ = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
            assert a.dtype == e.dtype and differ == 0, f"{output.name}: {differ} of {a.size} elements differ"


def _without(attributes: dict[str, object], name: str) -> dict[str, object]:
    return {k: v for k, v in attributes.items() if k != name}


def test_constants_become_tensors_for_symbolic_shape_inference() -> None:
    """value_int / value_ints / value_float / value_floats become ``value`` tensors of the same type, shape and
    values, in If branches as well; other Constants are left alone."""

    def constant(output: str, **attribute) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [output], **attribute)

    branch_output = [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])]
    branch = helper.make_graph([constant("b", value_floats=[0.5, -2.0])], "branch", [], branch_output)
    kept = numpy_helper.from_array(np.array([7], dtype=np.int32), "kept")
    nodes = [
        constant("i", value_int=16),
        constant("f", value_float=1e-5),
        constant("ii", value_ints=[1, -1]),
        constant("t", value=kept),
        helper.make_node("If", ["cond"], ["b"], then_branch=branch, else_branch=branch),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])], [])
    constants_as_tensors(graph)
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


@pytest.mark.parametrize("build", MOBIUS_BUILDS)
def test_mobius_builds_after_optimize_for_ort_fuse_again(build: str, mobius_builds: Path) -> None:
    """mobius builds carry local functions with Scan bodies: the inlined graph has subgraphs between chains."""
    _check_refused(_model_of(build, mobius_builds))


def test_a_subgraph_between_two_chains_leaves_no_chain_behind() -> None:
    """The rule's per-graph state survives onnxscript visiting a subgraph in the middle of the graph.

    Before, the If's branch reset the list of replaced chains, so the first chain stayed in the graph as
    dead nodes (and a later rule fused that dead copy a second time).
    """
    first = _model(F16, F16, F, F16, gated_dtype=F16)
    second = _model(F16, F16, F, F16, gated_dtype=F16)
    graph = first.graph
    for name in ("y", "z", "out"):
        for value in [*second.graph.input, *second.graph.output]:
            if value.name == name:
                value.name = f"{name}2"
    node = second.graph.node[0]
    node.input[0], node.input[1], node.output[0] = "y2", "z2", "out2"
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", F, [1], [1.0]))],
        "branch",
        [],
        [helper.make_tensor_value_info("c", F, [1])],
    )
    condition = helper.make_tensor_value_info("condition", TensorProto.BOOL, [])
    choice = helper.make_node("If", ["condition"], ["chosen"], then_branch=branch, else_branch=branch)
    graph.node.extend([choice, node])
    graph.input.extend([condition, *(v for v in second.graph.input if v.name in ("y2", "z2"))])
    graph.output.extend([second.graph.output[0], helper.make_tensor_value_info("chosen", F, [1])])
    onnx.checker.check_model(first)

    refused, report = rewrite_model(_inline(first))
    assert report.fused == 2, report.summary()
    assert _graph(refused) == _graph(first)


def test_cli_fuses_and_verifies_what_optimize_for_ort_saved_with_external_data(tmp_path: Path) -> None:
    """optimize_for_ort writes ORT's SimplifiedLayerNormalization in the ONNX domain; saved with its weights
    in a data file, that model must load (onnx's checker refused its linked data before), fuse, verify."""
    fused, report = rewrite_model(onnx.load(FIXTURE_DIR / "nemotron_h-dynamo-fp32-prefill.onnx"))
    optimized, _ = optimize_for_ort(ir.from_proto(fused))
    assert ("", "SimplifiedLayerNormalization") in {(n.domain, n.op_type) for n in optimized.graph}
    ir.save(optimized, tmp_path / "model.onnx", external_data="model.onnx.data", size_threshold_bytes=1024)
    assert (tmp_path / "model.onnx.data").stat().st_size > 0
    command = [sys.executable, "-m", "fusion.rewrite", str(tmp_path / "model.onnx"), "-o", str(tmp_path / "out.onnx")]
    done = subprocess.run([*command, "--verify"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "verify (mambafuse library): PASS" in done.stdout and f"fused: {report.fused}," in done.stdout
    assert (tmp_path / "out.onnx").is_file()
