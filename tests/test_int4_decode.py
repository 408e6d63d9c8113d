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
    if fmt == "QDQ":
        # ONNX Runtime turns DequantizeLinear -> MatMul into its MatMulNBits when it creates the session, at accuracy
        # level 4 (int8 activations) by default; it leaves the MLP's down-projection behind a Pow(r, 2) in float32
        # but not behind SquaredRelu's Mul or the op, so at level 4 the two models differ by that layer's int8
        # rounding (3e-3 of the logits). At level 0 (float32 activations) both run every product alike.
        expected = _run_level(quantized, inputs, level=0)
        actual = _run_level(_fused(directory, stem, bits, fmt)[0], inputs, level=0, library=library)
    else:
        expected = _run(quantized, inputs)
        actual = _run(_fused(directory, stem, bits, fmt)[0], inputs, library)
    for output, a, e in zip([o.name for o in quantized.graph.output], actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, output
        error, floor = scaled_error(np.asarray(a), np.asarray(e))
        assert error <= TOLERANCE[record["dtype"]] + floor, f"{output}: max error {error:.3g} of the output's scale"


def _run_level(model: onnx.ModelProto, inputs: dict[str, np.ndarray], *, level: int, library: bool = False):
    """The model's outputs on ONNX Runtime's CPU with the session's int4 QDQ products at accuracy level ``level``."""
    import onnxruntime as ort

    import contrib_ops

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    if library:
        return contrib_ops.session(model, session_options=options, use_library=True).run(None, inputs)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, inputs
    )


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
    _, optimized = optimize_model(quantized)
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


def _run_cpu(model: onnx.ModelProto, directory: Path, stem: str) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds(_record(directory, stem), _references(directory)[stem]))


def test_int4_accuracy_level_sets_the_level_and_computes_what_the_requantized_model_does() -> None:
    """``int4_accuracy_level=4`` on a model quantized at the default level sets the level on every 4-bit product
    (the weights untouched) after fusing every op: the result runs exactly as the same model quantized at level 4
    and fused (the quantizer writes the same blocks at either level), and no hint is left."""
    directory, stem = TF525_FIXTURE_DIR, "zamba2-dynamo-fp32-decode"
    quantized = _quantized(directory, stem, 4, "QOperator")
    fused, report = rewrite.rewrite_model(quantized, int4_accuracy_level=4)
    products = [n for n in fused.graph.node if n.op_type == "MatMulNBits"]
    assert products and report.accuracy_level_set == len(products) and report.hints == []
    assert all(onnx.helper.get_node_attr_value(n, "accuracy_level") == 4 for n in products)
    assert f"int4 accuracy_level 4 set on {len(products)} MatMulNBits" in report.summary()
    counts = {op: sum(n.op_type == op for n in fused.graph.node) for op in OPS}
    assert set(counts.values()) == {_record(directory, stem)["num_mamba_layers"]}, counts
    requantized, _ = rewrite.rewrite_model(_with_accuracy_level(quantized, 4))
    ours, theirs = _run_cpu(fused, directory, stem), _run_cpu(requantized, directory, stem)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    # the level changes the numbers (int8 activations): the check above is not comparing two equal models
    plain = _run_cpu(rewrite.rewrite_model(quantized)[0], directory, stem)
    assert any(not np.array_equal(a, b) for a, b in zip(ours, plain, strict=True))
    # optimize sets it in its last pass
    _, optimized = optimize_model(quantized, int4_accuracy_level=4)
    assert optimized.rewrite.accuracy_level_set == len(products) and optimized.rewrite.hints == []


def test_int4_accuracy_level_alone_still_writes_the_model_and_refuses_bad_levels() -> None:
    """A model with nothing to fuse but 4-bit products is returned with the level set (not the unchanged copy a
    rewrite that fused nothing returns); a level MatMulNBits does not have is a ValueError naming the levels."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.integers(0, 255, (8, 2, 16), dtype=np.uint8), "B"),
        numpy_helper.from_array(np.full(16, 0.1, np.float32), "S"),
    ]
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=64, N=8, bits=4,
                            block_size=32)  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [1, 8])], initializer=weights,
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    out, report = rewrite.rewrite_model(model, int4_accuracy_level=4)
    assert report.fused == 0 and report.accuracy_level_set == 1
    assert helper.get_node_attr_value(out.graph.node[0], "accuracy_level") == 4
    assert not any(a.name == "accuracy_level" for a in model.graph.node[0].attribute)  # the input untouched
    with pytest.raises(ValueError, match=r"int4_accuracy_level is 7; MatMulNBits takes \[0, 1, 2, 3, 4\]"):
        rewrite.rewrite_model(model, int4_accuracy_level=7)


def test_optimize_with_int4_accuracy_level_verifies_against_the_original_at_that_level(tmp_path, capsys) -> None:
    """``mambafuse optimize --int4-accuracy-level 4 --verify`` on a model quantized at the default level: the level is
    set and --verify compares with the original run at the same level (the fusions' check, which the precision the
    user asked for would otherwise fail), so the output is kept. ``genai --config-only`` refuses the option."""
    from fusion import cli

    source = tmp_path / "int4.onnx"
    onnx.save(_quantized(TF525_FIXTURE_DIR, "zamba2-dynamo-fp32-decode", 4, "QOperator"), source)
    before = source.read_bytes()
    status = cli.main(["optimize", str(source), str(tmp_path / "out.onnx"), "--int4-accuracy-level", "4", "--verify"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert (
        "int4 accuracy_level 4 set on 16 MatMulNBits" in out
        and "verified against the original at the same level" in out
    )
    assert "hint:" not in out and (tmp_path / "out.onnx").is_file() and source.read_bytes() == before
    written = onnx.load(tmp_path / "out.onnx")
    levels = {
        onnx.helper.get_node_attr_value(n, "accuracy_level") for n in written.graph.node if n.op_type == "MatMulNBits"
    }
    assert levels == {4}
    status = cli.main(["genai", str(tmp_path), str(tmp_path / "folder"), "--config-only", "--int4-accuracy-level", "4"])
    err = capsys.readouterr().err
    assert status == 2 and "--config-only: not allowed with --int4-accuracy-level" in err
