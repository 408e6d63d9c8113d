"""DecodeMatMul and DecodeMatMulNBits: the reference against ONNX Runtime's MatMulNBits, the functions against the
nodes they replace, and the rules (opt-in) on exported and int4-quantized decode steps.

The two ops are the weight products the model had (docs/decode_matmul.md), so the checks here are exact where
they can be: a fused model run through the functions is the original's computation node for node, so its outputs
equal, bit for bit, those of the same model fused without these two rules.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import contrib_ops
from fusion import rewrite
from fusion.function import decode_matmul as functions
from fusion.optimize import optimize_model
from fusion.reference import decode_matmul as reference
from fusion.rules import decode_matmul as rules
from fusion.rules._log import FusionLog
from models.fixtures import FIXTURE_DIR, TF525_FIXTURE_DIR
from models.runtime import feeds
from tests.test_int4_decode import _quantized, _record, _references

OPT_IN = ["decode_matmul", "decode_matmul_nbits"]
MAMBA_OPS = ("GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate")
REPO = Path(__file__).resolve().parents[1]
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def _session(model: onnx.ModelProto, library: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if library:
        contrib_ops.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _nbits_weights(rng: np.random.Generator, k: int, n: int, block: int, elem: int, zero_points: bool | str):
    """Packed blocks, scales and zero points: packed uint8 ones (True), none (False) or one of A's type a block
    ("float", HQQ's)."""
    blocks = reference.blocks_of(k, block)
    b = rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8)
    scales = (rng.standard_normal(n * blocks) * 0.1).astype(_NP[elem])
    zp = rng.integers(0, 256, n * -(-blocks // 2), dtype=np.uint8) if zero_points else None
    if zero_points == "float":
        zp = (rng.standard_normal(n * blocks) * 3 + 8).astype(_NP[elem])
    return b, scales, zp


def _one_node(op_type: str, domain: str, inputs, a_shape, elem: int, attributes: dict) -> onnx.ModelProto:
    """A model of one product node: A a graph input, the rest initializers (None: an absent optional input)."""
    initializers = [numpy_helper.from_array(value, name) for name, value in inputs if value is not None]
    names = ["A", *(name if value is not None else "" for name, value in inputs)]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op_type, names, ["Y"], domain=domain, **attributes)
    graph = helper.make_graph(
        [node],
        "product",
        [helper.make_tensor_value_info("A", elem, a_shape)],
        [helper.make_tensor_value_info("Y", elem, None)],
        initializers,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    if domain == "ai.mambafuse":
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=opsets)


# --- the reference ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "n", "block", "zero_points"),
    [(100, 7, 32, True), (64, 5, 16, False), (4100, 3, 128, True), (100, 7, 32, "float")],
)
def test_dequantize_is_ort_matmulnbits_layout(k: int, n: int, block: int, zero_points: bool | str) -> None:
    """ORT's CPU MatMulNBits of the identity gives its weight: the reference's nibble and block order must be it."""
    rng = np.random.default_rng(k)
    b, scales, zp = _nbits_weights(rng, k, n, block, TensorProto.FLOAT, zero_points)
    model = _one_node(
        "MatMulNBits",
        "com.microsoft",
        [("B", b), ("scales", scales), ("zero_points", zp)],
        [None, k],
        TensorProto.FLOAT,
        {"K": k, "N": n, "bits": 4, "block_size": block},
    )
    weight = _session(model).run(None, {"A": np.eye(k, dtype=np.float32)})[0]
    expected = reference.dequantize(b, scales, zp, k=k, n=n, block_size=block)
    # float zero points: ORT rounds q - zp to float32 before the scale (an error of 16 ulps of the scale at most)
    slack = 2**-20 * float(np.abs(scales).max()) if zero_points == "float" else 0.0
    np.testing.assert_allclose(weight, expected, rtol=2**-22, atol=slack)


def test_budget_catches_a_swapped_nibble_order() -> None:
    rng = np.random.default_rng(3)
    k, n, block = 256, 16, 32
    b, scales, zp = _nbits_weights(rng, k, n, block, TensorProto.FLOAT16, True)
    a = rng.standard_normal((2, k)).astype(np.float16)
    w = reference.dequantize(b, scales, zp, k=k, n=n, block_size=block)
    right = reference.decode_matmul(a, w).astype(np.float32).astype(np.float16)
    assert reference.check_within_budget(right, a, w)[0] == 0
    swapped = ((b & 0x0F) << 4) | (b >> 4)
    wrong = reference.decode_matmul(a, reference.dequantize(swapped, scales, zp, k=k, n=n, block_size=block))
    assert reference.check_within_budget(wrong.astype(np.float16), a, w)[0] > n


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 8}, "4-bit"),
        ({"block_size": 24}, "power of two"),
        ({"a": np.zeros((1, 99), np.float16)}, "not K"),
        ({"scales": np.zeros(3, np.float16)}, "scales"),
        ({"zero_points": np.zeros(1, np.float16)}, "zero_points"),
    ],
)
def test_reference_names_the_broken_input(change: dict, message: str) -> None:
    rng = np.random.default_rng(0)
    b, scales, zp = _nbits_weights(rng, 100, 4, 32, TensorProto.FLOAT16, True)
    args = {"a": np.zeros((1, 100), np.float16), "b": b, "scales": scales, "zero_points": zp, "bits": 4}
    args.update({"block_size": 32, **change})
    with pytest.raises((ValueError, TypeError), match=message):
        reference.check_nbits_inputs(
            args["a"],
            args["b"],
            args["scales"],
            args["zero_points"],
            k=100,
            n=4,
            block_size=args["block_size"],
            bits=args["bits"],
        )


# --- the functions ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("library", [False, True], ids=["stock", "library"])
@pytest.mark.parametrize("zero_points", [False, True], ids=["no-zp", "zp"])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["f32", "f16"])
@pytest.mark.parametrize("a_shape", [[100], [3, 100], [2, 1, 100]], ids=["1d", "2d", "3d"])
def test_functions_compute_the_nodes_they_replace(a_shape, elem: int, zero_points: bool, library: bool) -> None:
    """Each fused node, run through its function (this machine's library has no CPU kernel for them), gives the
    replaced node's output bit for bit; and it is within the reference's budget."""
    rng = np.random.default_rng(len(a_shape))
    k, n, block = 100, 9, 32
    b, scales, zp = _nbits_weights(rng, k, n, block, elem, zero_points)
    weight = (rng.standard_normal((k, n)) * 0.1).astype(_NP[elem])
    a = rng.standard_normal(a_shape).astype(_NP[elem])
    attrs = {"K": k, "N": n, "bits": 4, "block_size": block}
    for original, w in (
        (_one_node("MatMul", "", [("B", weight)], a_shape, elem, {}), weight),
        (
            _one_node(
                "MatMulNBits",
                "com.microsoft",
                [("B", b), ("scales", scales), ("zero_points", zp)],
                a_shape,
                elem,
                attrs,
            ),
            reference.dequantize(b, scales, zp, k=k, n=n, block_size=block),
        ),
    ):
        fused, report = rewrite.rewrite_model(original, opt_in=OPT_IN)
        assert [node.domain for node in fused.graph.node] == ["ai.mambafuse"], report.summary()
        assert {f.name for f in fused.functions} == {fused.graph.node[0].op_type}
        expected = _session(original).run(None, {"A": a})[0]
        actual = _session(fused, library).run(None, {"A": a})[0]
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        np.testing.assert_array_equal(actual, expected)
        assert reference.check_within_budget(actual, a, w)[0] == 0


def test_reference_evaluator_runs_the_ops() -> None:
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(5)
    k, n, block = 64, 6, 16
    b, scales, zp = _nbits_weights(rng, k, n, block, TensorProto.FLOAT, True)
    inputs = [("B", b), ("scales", scales), ("zero_points", zp)]
    attributes = {"K": k, "N": n, "bits": 4, "block_size": block}
    fused, original = (
        _one_node(op_type, domain, inputs, [2, k], TensorProto.FLOAT, attributes)
        for op_type, domain in (("DecodeMatMulNBits", "ai.mambafuse"), ("MatMulNBits", "com.microsoft"))
    )
    a = rng.standard_normal((2, k)).astype(np.float32)
    y = ReferenceEvaluator(fused, new_ops=[reference.DecodeMatMulNBits]).run(None, {"A": a})[0]
    expected = _session(original)
    np.testing.assert_allclose(y, expected.run(None, {"A": a})[0], rtol=1e-5, atol=1e-5)


def test_function_needs_opset_13() -> None:
    with pytest.raises(ValueError, match="opset >= 13"):
        functions.make_function(12)


# --- the rules: refusals ----------------------------------------------------------------------------------------


def _refusal(model: onnx.ModelProto, name: str) -> str:
    ir_model = ir.from_proto(model)
    log = FusionLog()
    fused = (rules.fuse_decode_matmul if name == "decode_matmul" else rules.fuse_decode_matmul_nbits)(ir_model, log)
    assert fused == 0
    return " ".join(record.reason or "" for record in log.chains.values())


@pytest.mark.parametrize(
    ("attributes", "extra", "reason"),
    [
        ({"bits": 8, "block_size": 32}, {}, "8-bit"),
        ({"bits": 4, "block_size": 32, "weight_layout": 1}, {}, "weight_layout"),
        ({"bits": 4, "block_size": 32}, {"g_idx": np.zeros(100, np.int32)}, "g_idx"),
        ({"bits": 4, "block_size": 32}, {"bias": np.zeros(8, np.float32)}, "bias"),
        ({"bits": 4, "block_size": 32}, {"zp_float": np.zeros(32, np.float32)}, "zero points are float"),
    ],
)
def test_nbits_refusals_name_the_reason(attributes: dict, extra: dict, reason: str) -> None:
    rng = np.random.default_rng(1)
    k, n = 100, 8
    blocks = reference.blocks_of(k, 32)
    b = rng.integers(0, 256, (n, blocks, 16 if attributes["bits"] == 4 else 32), dtype=np.uint8)
    scales = np.ones(n * blocks, np.float32)
    inputs = [("B", b), ("scales", scales)]
    if "zp_float" in extra:
        inputs.append(("zero_points", extra["zp_float"]))
    else:
        inputs.append(("zero_points", None))
    inputs.append(("g_idx", extra.get("g_idx")))
    inputs.append(("bias", extra.get("bias")))
    model = _one_node("MatMulNBits", "com.microsoft", inputs, [1, k], TensorProto.FLOAT, {"K": k, "N": n, **attributes})
    assert reason in _refusal(model, "decode_matmul_nbits")


def test_a_product_of_computed_values_is_not_an_anchor() -> None:
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 4])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, [4, 3])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["Y"])], "g", [a, b], [helper.make_tensor_value_info("Y", 1, [2, 3])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    fused, report = rewrite.rewrite_model(model, opt_in=OPT_IN)
    assert [node.op_type for node in fused.graph.node] == ["MatMul"]
    assert "weight MatMuls" not in report.summary()
    assert rules.find_anchors(ir.from_proto(model).graph) == []


def test_a_three_d_weight_is_refused() -> None:
    weight = np.ones((1, 4, 3), np.float32)
    model = _one_node("MatMul", "", [("B", weight)], [2, 4], TensorProto.FLOAT, {})
    assert "is not (K, N)" in _refusal(model, "decode_matmul")


def test_integer_weights_are_refused() -> None:
    weight = np.ones((4, 3), np.int32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.INT32, [2, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.INT32, [2, 3])],
        [numpy_helper.from_array(weight, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert "int32" in _refusal(model, "decode_matmul")


# --- the rules on decode steps --------------------------------------------------------------------------------------

#: int4-quantized decode steps (ORT's MatMulNBitsQuantizer, block 32), and unquantized ones for DecodeMatMul.
INT4_CASES = [
    (FIXTURE_DIR, "nemotron_h-dynamo-fp16-decode"),
    (TF525_FIXTURE_DIR, "nemotron_h-dynamo-fp32-decode"),
    (TF525_FIXTURE_DIR, "zamba2-dynamo-fp32-decode"),
    (TF525_FIXTURE_DIR, "falcon_h1-dynamo-fp32-decode"),
]
DENSE_CASES = [(FIXTURE_DIR, "nemotron_h-dynamo-fp16-decode"), (TF525_FIXTURE_DIR, "bamba-dynamo-fp32-decode")]


def _counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _check_step(directory: Path, stem: str, original: onnx.ModelProto, replaced: str, op: str) -> None:
    plain, _ = rewrite.rewrite_model(original)
    fused, report = rewrite.rewrite_model(original, opt_in=OPT_IN)
    before, after = _counts(plain), _counts(fused)
    layers = _record(directory, stem)["num_mamba_layers"]
    assert all(after.get(mamba, 0) == layers for mamba in MAMBA_OPS), report.summary()
    # every weight product replaced; what stays a MatMul has no constant weight
    assert after.get(op, 0) == before[replaced] - after.get(replaced, 0) > 0, report.summary()
    assert (
        rules.find_anchors(ir.from_proto(fused).graph) == []
        and rules.find_nbits_anchors(ir.from_proto(fused).graph) == []
    )
    inputs = feeds(_record(directory, stem), _references(directory)[stem])
    for expected, actual in zip(_session(plain).run(None, inputs), _session(fused).run(None, inputs), strict=True):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize(("directory", "stem"), INT4_CASES, ids=[f"{d.name}-{s}" for d, s in INT4_CASES])
def test_int4_decode_step_fuses_every_product_and_op(directory: Path, stem: str) -> None:
    _check_step(directory, stem, _quantized(directory, stem, 4, "QOperator"), "MatMulNBits", "DecodeMatMulNBits")


@pytest.mark.parametrize(("directory", "stem"), DENSE_CASES, ids=[f"{d.name}-{s}" for d, s in DENSE_CASES])
def test_dense_decode_step_fuses_every_weight_matmul(directory: Path, stem: str) -> None:
    _check_step(directory, stem, onnx.load(directory / _record(directory, stem)["file"]), "MatMul", "DecodeMatMul")


def test_eight_bit_layers_stay_matmulnbits_with_the_reason() -> None:
    quantized = _quantized(FIXTURE_DIR, "zamba2-dynamo-fp32-decode", 8, "QOperator")
    fused, report = rewrite.rewrite_model(quantized, opt_in=["decode_matmul_nbits"])
    assert "DecodeMatMulNBits" not in _counts(fused)
    assert "8-bit weights" in report.summary()


def test_the_mamba_rules_prove_shapes_through_the_fused_products() -> None:
    """A model whose products were fused first (a model fused by an older run, then rewritten again): the decode
    rules prove their chains' shapes through DecodeMatMulNBits as through MatMulNBits."""
    directory, stem = TF525_FIXTURE_DIR, "nemotron_h-dynamo-fp32-decode"
    model = ir.from_proto(_quantized(directory, stem, 4, "QOperator"))
    assert rules.fuse_decode_matmul_nbits(model) > 0
    fused, report = rewrite.rewrite_model(ir.to_proto(model))
    layers = _record(directory, stem)["num_mamba_layers"]
    assert all(_counts(fused).get(mamba, 0) == layers for mamba in MAMBA_OPS), report.summary()


def test_optimize_replaces_the_products_after_its_other_passes() -> None:
    directory, stem = TF525_FIXTURE_DIR, "nemotron_h-dynamo-fp32-decode"
    quantized = _quantized(directory, stem, 4, "QOperator")
    plain, _ = optimize_model(quantized)
    fused, report = optimize_model(quantized, opt_in=OPT_IN)
    before, after = _counts(plain), _counts(fused)
    assert after["DecodeMatMulNBits"] == before["MatMulNBits"] and "MatMulNBits" not in after
    assert {op: n for op, n in after.items() if op not in ("DecodeMatMulNBits", "MatMulNBits")} == {
        op: n for op, n in before.items() if op not in ("DecodeMatMulNBits", "MatMulNBits")
    }
    first = report.passes[0]
    assert "DecodeMatMulNBits" not in first.fused  # the first mambafuse pass leaves them to the last
    inputs = feeds(_record(directory, stem), _references(directory)[stem])
    for expected, actual in zip(_session(plain).run(None, inputs), _session(fused).run(None, inputs), strict=True):
        np.testing.assert_array_equal(actual, expected)


def test_cli_optimize_opt_in_on_a_quantized_file(tmp_path: Path) -> None:
    directory, stem = TF525_FIXTURE_DIR, "zamba2-dynamo-fp32-decode"
    source = tmp_path / "int4.onnx"
    onnx.save(_quantized(directory, stem, 4, "QOperator"), source)
    out = tmp_path / "fused.onnx"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusion",
            "optimize",
            str(source),
            str(out),
            "--opt-in",
            "decode_matmul_nbits",
            "--verify",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "DecodeMatMulNBits" in _counts(onnx.load(out))
    assert "4-bit MatMulNBits" in done.stdout
