"""The onnxscript entry point: ``fusion.rules.rewrite_rules()`` through onnxscript's own ``rewrite``.

Used the way an onnxscript user would — ``onnxscript.rewriter.rewrite(model, pattern_rewrite_rules=...)``
alone, concatenated with onnxscript's own rules, or as a ``RewritePass`` — not through our CLI; then
``fusion.rules.attach_function`` and ONNX Runtime with and without the library.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx_ir.passes.common import ShapeInferencePass
from onnxscript import rewriter
from onnxscript.rewriter.ort_fusions import rms_normalization

import contrib_ops
from fusion import rewrite
from fusion.rules import GatedGroupRMSNormRuleSet, attach_function, gated_group_rms_norm_rule_sets, rewrite_rules
from models.fixtures import FIXTURE_DIR
from models.runtime import feeds, load_manifest, load_references

MANIFEST = load_manifest()["fixtures"]
REFERENCES = load_references()
DOMAIN, OP_TYPE = "ai.mambafuse", "GatedGroupRMSNorm"


def _load(stem: str) -> onnx.ModelProto:
    return onnx.load(FIXTURE_DIR / f"{stem}.onnx")


def _fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if (node.domain, node.op_type) == (DOMAIN, OP_TYPE)]


def _run(model: onnx.ModelProto, stem: str, *, library: bool) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if library:
        contrib_ops.register(options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds(MANIFEST[stem], REFERENCES[stem]))


def _max_rel_diff(actual: list[np.ndarray], expected: list[np.ndarray]) -> float:
    worst = 0.0
    for a, e in zip(actual, expected, strict=True):
        scale = max(float(np.max(np.abs(e.astype(np.float64)))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)))) / scale)
    return worst


@pytest.mark.parametrize(
    ("stem", "tolerance"),
    [("nemotron_h-dynamo-fp32-decode", 1e-5), ("nemotron_h-dynamo-fp16-prefill", 4e-3)],
)
def test_rewrite_with_onnxscript_alone(stem: str, tolerance: float, library: str) -> None:
    """rewrite(model, pattern_rewrite_rules=rewrite_rules()) fuses every chain, like the CLI, and runs."""
    original = _load(stem)
    rules = rewrite_rules()
    fused = rewriter.rewrite(original, pattern_rewrite_rules=rules)
    mamba_layers = MANIFEST[stem]["num_mamba_layers"]

    assert isinstance(fused, onnx.ModelProto)
    assert len(_fused_nodes(fused)) == mamba_layers
    assert [record.fused for record in rules.log.chains.values()] == [True] * mamba_layers
    reductions = Counter(n.op_type for n in original.graph.node)["ReduceMean"]
    assert Counter(n.op_type for n in fused.graph.node)["ReduceMean"] == reductions - mamba_layers
    # The same graph as our own rewriter's (trailing Casts absorbed the same way).
    ours, _ = rewrite.rewrite_model(original, function=False, decode_steps=False)  # rewrite_rules(): the norm's
    assert Counter(n.op_type for n in fused.graph.node) == Counter(n.op_type for n in ours.graph.node)
    assert [dict((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute) for n in _fused_nodes(fused)] == [
        dict((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute) for n in _fused_nodes(ours)
    ]

    # Without the function stock ONNX Runtime cannot run it; attach_function is the documented fix.
    with pytest.raises(Exception, match="GatedGroupRMSNorm|ai.mambafuse"):
        _run(fused, stem, library=False)
    assert attach_function(fused) is fused
    assert [(f.domain, f.name) for f in fused.functions] == [(DOMAIN, OP_TYPE)]
    onnx.checker.check_model(fused)

    expected = _run(original, stem, library=False)
    assert _max_rel_diff(_run(fused, stem, library=False), expected) <= tolerance  # the function body
    assert _max_rel_diff(_run(fused, stem, library=True), expected) <= tolerance  # the kernel


def test_concatenated_with_onnxscript_rules(library: str) -> None:
    """[*rewrite_rules(), *onnxscript's rules] in one rewrite: both fire; a trailing Cast stays separate."""
    stem = "nemotron_h-dynamo-fp16-prefill"  # form B: a Cast(to f16) after the fp32 weight Mul
    original = _load(stem)
    fused = rewriter.rewrite(
        original, pattern_rewrite_rules=[*rewrite_rules(), *rms_normalization.rms_normalization_rules]
    )
    nodes = _fused_nodes(fused)
    assert len(nodes) == MANIFEST[stem]["num_mamba_layers"]
    # onnxscript's own RMSNorm fusion ran on the model's other (non-gated) RMSNorms.
    assert any(node.op_type == "SimplifiedLayerNormalization" for node in fused.graph.node)
    # Flat list: fused at the weight Mul first, so the fp32 output keeps its Cast (same values).
    for node in nodes:
        assert onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "output_dtype")) == 1
        (reader,) = [n for n in fused.graph.node if node.output[0] in n.input]
        assert reader.op_type == "Cast"
    attach_function(fused)
    expected = _run(original, stem, library=False)
    assert _max_rel_diff(_run(fused, stem, library=True), expected) <= 4e-3


def test_rewrite_pass_on_ir_model_after_shape_inference(library: str) -> None:
    """RewritePass(rewrite_rules()) on an ir.Model of a TorchScript export, as it is and after onnx-ir's shape
    inference: fusion.shapes follows TorchScript's shape arithmetic from the graph's inputs, so the chain fuses
    either way (it once needed the inferred value_info), and the fused model computes what the export does."""
    stem = "zamba2-torchscript-fp32-prefill"
    expected = _run(_load(stem), stem, library=False)
    for infer in (False, True):
        model = ir.from_proto(_load(stem))
        if infer:
            ShapeInferencePass(strict_mode=False)(model)
        rules = rewrite_rules()
        result = rewriter.RewritePass(rules)(model)
        assert result.modified, f"shape inference {infer}"
        assert [(c.form, c.fused) for c in rules.log.chains.values()] == [("E", True)]
        attached = attach_function(result.model)
        assert attached is result.model and (DOMAIN, OP_TYPE, "") in attached.functions
        proto = ir.to_proto(attached)
        assert len(_fused_nodes(proto)) == 1
        assert _max_rel_diff(_run(proto, stem, library=False), expected) <= 1e-5


def test_rule_set_is_an_onnxscript_rule_set() -> None:
    """rewrite_rules() is a RewriteRuleSet whose rules iterate in phase order (Cast-absorbing phases first)."""
    from onnxscript.rewriter import pattern

    rules = rewrite_rules()
    assert isinstance(rules, pattern.RewriteRuleSet) and isinstance(rules, GatedGroupRMSNormRuleSet)
    names = [rule.name for rule in rules]
    assert len(set(names)) == len(names)
    phases = [[rule.name for rule in rule_set] for rule_set in gated_group_rms_norm_rule_sets]
    assert len(phases) >= 2 and all(phases)
    assert names == [name for phase in phases for name in phase]  # phase by phase, as fuse_* applies them
    # the Cast-absorbing phases first: the two-Cast spelling, then the one-Cast one; none after them
    assert all("float32 Cast, trailing Cast" in name for name in phases[0])
    assert all("trailing Cast" in name and "float32 Cast" not in name for name in phases[1])
    assert not any("trailing Cast" in name for phase in phases[2:] for name in phase)


def test_attach_function_leaves_unfused_models_alone() -> None:
    model = _load("nemotron_h-dynamo-fp32-decode")
    before = model.SerializeToString()
    assert attach_function(model).SerializeToString() == before


@pytest.mark.parametrize(
    "path",
    [
        "tests/fixtures/models/nemotron_h-dynamo-fp16-decode.onnx",
        "tests/fixtures/models/batch/zamba2-dynamo-fp32-batch-decode.onnx",
        "tests/fixtures/models/transformers-5.25/mamba2-dynamo-fp32-decode.onnx",
        "tests/fixtures/models/transformers-5.25/bamba-dynamo-noopt-fp32-decode.onnx",
        "tests/fixtures/models/transformers-5.25/zamba2-dynamo-fp16-decode.onnx",
    ],
)
def test_all_rewrite_rules_fuse_every_op_through_onnxscript(path: str) -> None:
    """``all_rewrite_rules()`` through ``onnxscript.rewriter.rewrite``: every op in every Mamba-2 layer, also where
    a chain is proven only through ops fused before it (transformers 5.25's decode step), and the fused model
    computes what the original does on stock ONNX Runtime (through the attached functions)."""
    from fusion.rules import all_rewrite_rules
    from tests.test_decode_step_rules import TOLERANCE, scaled_error

    fixture = FIXTURE_DIR.parent.parent.parent / path
    record = load_manifest(fixture.parent)["fixtures"][fixture.stem]
    original = onnx.load(fixture)
    fused = rewriter.rewrite(original, pattern_rewrite_rules=all_rewrite_rules())
    attach_function(fused)
    counts = Counter(n.op_type for n in fused.graph.node if n.domain == DOMAIN)
    ops = ("GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate")
    mlp = {"SquaredRelu": 1} if fixture.stem.startswith("nemotron_h") else {}  # its MLP layer's activation
    assert counts == {**dict.fromkeys(ops, record["num_mamba_layers"]), **mlp}, counts
    assert len(list(all_rewrite_rules())) > len(ops)  # still iterable as a flat list of rules
    inputs = feeds(record, load_references(fixture.parent)[fixture.stem])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    expected, actual = (
        ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, inputs)
        for m in (original, fused)
    )
    for output, a, e in zip([o.name for o in original.graph.output], actual, expected, strict=True):
        error, floor = scaled_error(a, e)
        assert error <= TOLERANCE[record["dtype"]] + floor, f"{output}: {error:.3g}"
