"""Decode exports quantized the way onnxruntime-genai users deploy them, then fused.

ONNX Runtime's ``MatMulNBitsQuantizer`` (block 32, symmetric; 4 bits, and 8 once) turns the projections'
MatMuls into ``com.microsoft::MatMulNBits``, or with ``QuantFormat.QDQ`` into ``DequantizeLinear`` + MatMul.
The rules prove the decode step's shapes through those ops (their output dims from their attributes), so a
quantized model must still get every op in every Mamba-2 layer and compute what the quantized original
computes, through the functions and through the library. Fixtures of transformers 5.24 and 5.25, every family.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from fusion import rewrite
from fusion.optimize import optimize_model
from models.fixtures import FAMILY_FIXTURE_DIR, FIXTURE_DIR, TF525_FIXTURE_DIR
from models.runtime import feeds, load_manifest, load_references
from tests.test_decode_step_rules import TOLERANCE, _library_has_decode_ops, _run, scaled_error

OPS = ("GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate")
#: (fixture directory, stem, bits, format): 5.24's Nemotron-H and Zamba2 (dynamo and transformers' exporter),
#: the other families of 5.24 in fp16, and every family of 5.25.
CASES = [
    (FIXTURE_DIR, "nemotron_h-dynamo-fp32-decode", 4, "QOperator"),
    (FIXTURE_DIR, "nemotron_h-dynamo-fp16-decode", 4, "QOperator"),
    (FIXTURE_DIR, "nemotron_h-transformers-fp32-decode", 4, "QOperator"),
    (FIXTURE_DIR, "zamba2-dynamo-fp32-decode", 4, "QOperator"),
    (FIXTURE_DIR, "zamba2-dynamo-fp32-decode", 8, "QOperator"),
    (FIXTURE_DIR, "nemotron_h-dynamo-fp32-decode", 4, "QDQ"),
    (FAMILY_FIXTURE_DIR, "mamba2-dynamo-fp16-decode", 4, "QOperator"),
    (FAMILY_FIXTURE_DIR, "bamba-dynamo-fp16-decode", 4, "QOperator"),
    (FAMILY_FIXTURE_DIR, "granitemoehybrid-dynamo-fp16-decode", 4, "QOperator"),
    (FAMILY_FIXTURE_DIR, "falcon_h1-dynamo-fp32-decode", 4, "QOperator"),
    *(
        (TF525_FIXTURE_DIR, f"{family}-dynamo-fp32-decode", 4, "QOperator")
        for family in ("nemotron_h", "zamba2", "mamba2", "bamba", "granitemoehybrid", "falcon_h1")
    ),
    (TF525_FIXTURE_DIR, "nemotron_h-transformers-fp32-decode", 4, "QOperator"),
]
IDS = [f"{d.name}-{stem}-int{bits}-{fmt}" for d, stem, bits, fmt in CASES]


@cache
def _record(directory: Path, stem: str) -> dict:
    return load_manifest(directory)["fixtures"][stem]


@cache
def _references(directory: Path) -> dict:
    return load_references(directory)


@cache
def _quantized(directory: Path, stem: str, bits: int, fmt: str) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(directory / _record(directory, stem)["file"])
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=32, is_symmetric=True, quant_format=getattr(QuantFormat, fmt)
    )
    quantizer.process()
    return quantizer.model.model


@cache
def _fused(directory: Path, stem: str, bits: int, fmt: str):
    return rewrite.rewrite_model(_quantized(directory, stem, bits, fmt))


@pytest.mark.parametrize(("directory", "stem", "bits", "fmt"), CASES, ids=IDS)
def test_quantized_decode_gets_every_op(directory: Path, stem: str, bits: int, fmt: str) -> None:
    quantized = _quantized(directory, stem, bits, fmt)
    quantized_ops = {n.op_type for n in quantized.graph.node}
    assert ("MatMulNBits" if fmt == "QOperator" else "DequantizeLinear") in quantized_ops
    fused, report = _fused(directory, stem, bits, fmt)
    layers = _record(directory, stem)["num_mamba_layers"]
    counts = {op: sum(1 for n in fused.graph.node if n.op_type == op) for op in OPS}
    assert counts == dict.fromkeys(OPS, layers), report.summary()


@pytest.mark.parametrize("library", [False, True], ids=["function", "library"])
@pytest.mark.parametrize(("directory", "stem", "bits", "fmt"), CASES, ids=IDS)
def test_quantized_fused_matches_quantized_original(
    directory: Path, stem: str, bits: int, fmt: str, library: bool
) -> None:
    if library and (reason := _library_has_decode_ops()):
        pytest.skip(reason)
    record = _record(directory, stem)
    inputs = feeds(record, _references(directory)[stem])
    quantized = _quantized(directory, stem, bits, fmt)
    expected = _run(quantized, inputs)
    actual = _run(_fused(directory, stem, bits, fmt)[0], inputs, library)
    for output, a, e in zip([o.name for o in quantized.graph.output], actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, output
        error, floor = scaled_error(np.asarray(a), np.asarray(e))
        assert error <= TOLERANCE[record["dtype"]] + floor, f"{output}: max error {error:.3g} of the output's scale"


@pytest.mark.parametrize("family", ["nemotron_h", "zamba2"])
def test_the_documented_policy_keeps_the_head_and_fuses_every_op(family: str) -> None:
    """docs/models.md's int4 policy: every projection in int4 but the LM head (``nodes_to_exclude``)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    stem = f"{family}-dynamo-fp32-decode"
    record = _record(TF525_FIXTURE_DIR, stem)
    model = onnx.load(TF525_FIXTURE_DIR / record["file"])
    head = [n.name for n in model.graph.node if n.op_type == "MatMul" and "logits" in n.output]
    assert len(head) == 1
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True, nodes_to_exclude=head)
    quantizer.process()
    quantized = quantizer.model.model
    assert any(n.op_type == "MatMulNBits" for n in quantized.graph.node)
    assert [n.op_type for n in quantized.graph.node if "logits" in n.output] == ["MatMul"]
    fused, report = rewrite.rewrite_model(quantized)
    counts = {op: sum(1 for n in fused.graph.node if n.op_type == op) for op in OPS}
    assert counts == dict.fromkeys(OPS, record["num_mamba_layers"]), report.summary()
    inputs = feeds(record, _references(TF525_FIXTURE_DIR)[stem])
    for a, e in zip(_run(fused, inputs), _run(quantized, inputs), strict=True):
        error, floor = scaled_error(np.asarray(a), np.asarray(e))
        assert error <= TOLERANCE[record["dtype"]] + floor


def _with_accuracy_level(model: onnx.ModelProto, level: int | None) -> onnx.ModelProto:
    """``model`` with every MatMulNBits at accuracy_level ``level`` (None: the attribute absent, as the quantizer
    writes it by default)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        kept = [a for a in node.attribute if a.name != "accuracy_level"]
        del node.attribute[:]
        node.attribute.extend(kept)
        if level is not None:
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", level))
    return copy


@pytest.mark.parametrize(("level", "hinted"), [(None, True), (0, True), (3, True), (4, False)])
def test_int4_below_accuracy_level_4_gets_the_cpu_hint(level: int | None, hinted: bool) -> None:
    """A 4-bit model whose MatMulNBits multiply float activations on the CPU (accuracy_level below 4, the
    quantizer's default) gets one hint naming their count and --accuracy_level 4, in rewrite's and optimize's
    reports and their JSON; at level 4 (what onnxruntime-genai's builder writes for the CPU) there is none."""
    quantized = _with_accuracy_level(_quantized(TF525_FIXTURE_DIR, "zamba2-dynamo-fp32-decode", 4, "QOperator"), level)
    count = sum(n.op_type == "MatMulNBits" for n in quantized.graph.node)
    _, report = rewrite.rewrite_model(quantized)
    _, optimized = optimize_model(ir.from_proto(quantized))
    for hints, summary in ((report.hints, report.summary()), (optimized.rewrite.hints, optimized.summary())):
        if hinted:
            assert len(hints) == 1 and hints[0].startswith(f"{count} int4 MatMulNBits at accuracy_level < 4")
            assert "--accuracy_level 4" in hints[0] and f"hint: {hints[0]}" in summary
        else:
            assert hints == [] and "hint:" not in summary
    assert optimized.to_dict()["rewrite"]["hints"] == optimized.rewrite.hints


def test_8_bit_and_unquantized_models_get_no_accuracy_hint() -> None:
    """The hint is about 4-bit weights: an 8-bit MatMulNBits model and a float one get none."""
    for model in (
        _quantized(FIXTURE_DIR, "zamba2-dynamo-fp32-decode", 8, "QOperator"),
        onnx.load(TF525_FIXTURE_DIR / _record(TF525_FIXTURE_DIR, "zamba2-dynamo-fp32-decode")["file"]),
    ):
        assert rewrite.rewrite_model(model)[1].hints == []
