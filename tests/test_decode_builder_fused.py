"""A build that already runs the decode step as ONNX Runtime's contrib ops (mobius: CausalConvWithState,
LinearAttention with update_rule "gated") has no chain to fuse: the report says so once per op, counted apart
from the chains found, and never as a refusal."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import helper

from fusion import rewrite
from models.fixtures import FIXTURE_DIR

BUILD = "nemotron_h-g1-f32-default-cpu"
CONTRIB = {
    "CausalConv1dUpdate": "com.microsoft::CausalConvWithState",
    "SelectiveStateUpdate": "com.microsoft::LinearAttention",
}


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    from models.mobius import extract_builds

    return onnx.load(extract_builds(tmp_path_factory.mktemp("mobius")) / BUILD / "model.onnx")


def _count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(n.domain == "com.microsoft" and n.op_type == op_type for n in model.graph.node)


def test_builder_fused_layers_reported_once_not_found(build: onnx.ModelProto) -> None:
    _, report = rewrite.rewrite_model(build)
    layers = _count(build, "CausalConvWithState")
    assert layers > 0 and _count(build, "LinearAttention") == layers
    for op, contrib in CONTRIB.items():
        entry = report.decode[op]
        assert (entry["found"], entry["fused"], entry["refused"]) == (0, 0, []), entry
        assert entry["builder_fused"] == {contrib: layers}
    summary = report.summary()
    assert f"conv updates: already fused by the builder as {CONTRIB['CausalConv1dUpdate']} ({layers})" in summary
    assert f"state updates: already fused by the builder as {CONTRIB['SelectiveStateUpdate']} ({layers})" in summary
    assert "found: 0" not in summary and "does not match" not in summary
    assert report.to_dict()["decode"]["CausalConv1dUpdate"]["builder_fused"] == {CONTRIB["CausalConv1dUpdate"]: layers}


def test_other_linear_attention_rules_are_not_counted(build: onnx.ModelProto) -> None:
    model = onnx.ModelProto()
    model.CopyFrom(build)
    for node in model.graph.node:
        if node.op_type == "LinearAttention":
            kept = [a for a in node.attribute if a.name != "update_rule"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("update_rule", "delta")])
    _, report = rewrite.rewrite_model(model)
    assert "SelectiveStateUpdate" not in report.decode
    assert "CausalConv1dUpdate" in report.decode


def test_exported_chains_report_as_before() -> None:
    model = onnx.load(Path(FIXTURE_DIR) / "nemotron_h-dynamo-fp32-decode.onnx")
    _, report = rewrite.rewrite_model(model)
    assert all(entry["builder_fused"] == {} for entry in report.decode.values())
    assert "conv updates found: 2 (ai.mambafuse::CausalConv1dUpdate), fused: 2, refused: 0" in report.summary()
    assert "already fused by the builder" not in report.summary()


def test_onnx_standard_ops_are_counted_as_the_builders(build: onnx.ModelProto) -> None:
    """The same build written with ONNX's own CausalConvWithState and LinearAttention (default domain, opset 27):
    reported as already fused by the builder under their ai.onnx names, not as chains found."""
    model = onnx.ModelProto()
    model.CopyFrom(build)
    for node in model.graph.node:
        if node.domain == "com.microsoft" and node.op_type in ("CausalConvWithState", "LinearAttention"):
            node.domain = ""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, 27)
    layers = _count(build, "CausalConvWithState")
    _, report = rewrite.rewrite_model(model)
    for op, contrib in CONTRIB.items():
        entry = report.decode[op]
        assert (entry["found"], entry["fused"]) == (0, 0), entry
        assert entry["builder_fused"] == {contrib.replace("com.microsoft", "ai.onnx"): layers}
    assert f"already fused by the builder as ai.onnx::LinearAttention ({layers})" in report.summary()
