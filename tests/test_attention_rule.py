"""``mambafuse optimize``'s decode attention fusion (fusion/rules/attention.py) onto GroupQueryAttention.

On every fp16 decode fixture whose attention has the dynamo spelling without rotary (Nemotron-H,
GraniteMoeHybrid; single and symbolic-batch exports) each attention layer fuses, the graph's inputs and
outputs stay as they were, and ONNX Runtime CPU gives the original's outputs (logits and every cache within
the fp16 tolerance of tests/test_optimize.py, the past part of the attention caches exactly) at past
lengths 0, 1, 8 and 33, at batch 1 and (batch fixtures) 2 and 3, from seeded inputs; on a GPU machine the
same on ORT's CUDA provider, the node placed on CUDA. A mask that does mask, a tile head mapping and float32
stay refused, with the reason.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import contrib_ops
from fusion import rewrite
from fusion.optimize import _ort_fusions, optimize_model
from fusion.rules.attention import fuse_group_query_attention
from fusion.rules.gated_group_rms_norm import FusionLog
from models.fixtures import BATCH_FIXTURE_DIR, FAMILY_FIXTURE_DIR, FIXTURE_DIR
from models.runtime import load_references

#: Optimized vs original, max |difference| relative to the largest |output| (tests/test_optimize.py's fp16).
TOLERANCE = 4e-3
#: The suffix of a fixture quantized to int4 before the test (``_original``).
INT4 = "@int4"
#: fixture -> (directory, attention layers, batch sizes)
FUSED = {
    "nemotron_h-dynamo-fp16-decode": (FIXTURE_DIR, 1, (1,)),
    "nemotron_h-dynamo-noopt-fp16-decode": (FIXTURE_DIR, 1, (1,)),
    "granitemoehybrid-dynamo-fp16-decode": (FAMILY_FIXTURE_DIR, 1, (1,)),
    "nemotron_h-dynamo-fp16-batch-decode": (BATCH_FIXTURE_DIR, 1, (1, 2, 3)),
    "granitemoehybrid-dynamo-fp16-batch-decode": (BATCH_FIXTURE_DIR, 1, (1, 2, 3)),
    # int4-quantized (ORT's MatMulNBitsQuantizer, block 32): the projections are MatMulNBits
    "nemotron_h-dynamo-fp16-decode" + INT4: (FIXTURE_DIR, 1, (1,)),
    "granitemoehybrid-dynamo-fp16-batch-decode" + INT4: (BATCH_FIXTURE_DIR, 1, (1, 2, 3)),
}
#: 0: an empty cache (GroupQueryAttention with seqlens_k 0) on the CPU; CUDA runs the others.
PAST_LENGTHS = (0, 1, 8, 33)
_NP = {ir.DataType.FLOAT: np.float32, ir.DataType.FLOAT16: np.float16, ir.DataType.INT64: np.int64}


def _path(stem: str, directory: Path = FIXTURE_DIR) -> Path:
    return directory / f"{stem.removesuffix(INT4)}.onnx"


@cache
def _original(stem: str) -> onnx.ModelProto:
    model = onnx.load(_path(stem, FUSED[stem][0]))
    if stem.endswith(INT4):
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True)
        quantizer.process()
        model = quantizer.model.model
        assert any(node.op_type == "MatMulNBits" for node in model.graph.node)
    return model


@cache
def _optimized(stem: str):
    return optimize_model(_original(stem))


def _is_attention_cache(name: str) -> bool:
    return name.endswith((".keys", ".values"))


def _feeds(stem: str, batch: int, past: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs: the fixture's sample step's shapes with ``batch`` rows and ``past`` cached tokens."""
    directory = FUSED[stem][0]
    refs = load_references(directory)[stem.removesuffix(INT4)]
    model = _original(stem)
    vocab = model.graph.output[0].type.tensor_type.shape.dim[-1].dim_value
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = list(refs[f"input/{value.name}"].shape)
        shape[0] = batch
        dtype = _NP[ir.DataType(value.type.tensor_type.elem_type)]
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, vocab, size=shape, dtype=np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.full(shape, past, dtype=np.int64)
        else:
            if _is_attention_cache(value.name):
                shape[2] = past
            feeds[value.name] = (rng.standard_normal(shape) * 0.5).astype(dtype)
    return feeds


def _io(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(v.name, str(v.type)) for v in (*model.graph.input, *model.graph.output)]


@pytest.mark.parametrize("stem", sorted(FUSED))
def test_the_attention_fuses_and_keeps_the_interface(stem: str) -> None:
    optimized, report = _optimized(stem)
    fused = sum(node.op_type == "GroupQueryAttention" for node in optimized.graph.node)
    assert fused == FUSED[stem][1], report.summary()
    attention = next(result for result in report.passes if result.name == "mambafuse attention")
    assert attention.fused == {"GroupQueryAttention": fused} and not attention.refused, attention.line()
    assert f"mambafuse attention: GroupQueryAttention {fused}" in report.summary()
    softmaxes = [sum(node.op_type == "Softmax" for node in m.graph.node) for m in (_original(stem), optimized)]
    assert softmaxes[1] == softmaxes[0] - fused, softmaxes
    names_types = [(v.name, v.type.tensor_type.elem_type) for v in (*optimized.graph.input, *optimized.graph.output)]
    assert names_types == [
        (v.name, v.type.tensor_type.elem_type) for v in (*_original(stem).graph.input, *_original(stem).graph.output)
    ]


@pytest.mark.parametrize("stem", sorted(FUSED))
def test_the_pass_keeps_every_graph_input_and_output(stem: str) -> None:
    """Names, types and declared shapes, as the attention pass found them (the present caches included)."""
    model = _prepared(stem, FUSED[stem][0])
    before = _io(ir.to_proto(model))
    assert fuse_group_query_attention(model) == FUSED[stem][1]
    assert _io(ir.to_proto(model)) == before


@pytest.mark.parametrize("past", PAST_LENGTHS)
@pytest.mark.parametrize("stem", sorted(FUSED))
def test_the_fused_model_matches_the_original(stem: str, past: int) -> None:
    original = ort.InferenceSession(_original(stem).SerializeToString(), providers=["CPUExecutionProvider"])
    optimized = contrib_ops.session(_optimized(stem)[0], use_library=True)
    names = [output.name for output in original.get_outputs()]
    for batch in FUSED[stem][2]:
        feeds = _feeds(stem, batch, past, seed=1000 * batch + past)
        expected = original.run(None, feeds)
        actual = optimized.run(None, feeds)
        for name, a, e in zip(names, actual, expected, strict=True):
            what = f"{stem} {name} (batch {batch}, past {past})"
            assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
            if _is_attention_cache(name):  # concat(past, new): the past exactly (the new rows as the model's)
                source = feeds[name.replace("present.", "past.", 1)]
                assert e.shape[2] == past + 1 and np.array_equal(a[:, :, :past], source), what
            a64, e64 = a.astype(np.float64), e.astype(np.float64)
            scale = max(float(np.abs(e64).max()), np.finfo(np.float32).tiny)
            error = float(np.abs(a64 - e64).max())
            assert error <= TOLERANCE * scale, f"{what}: max error {error / scale:.3g} of max"


def test_rewrite_does_not_fuse_attention() -> None:
    """GroupQueryAttention is ONNX Runtime's op, without a model-local function: only optimize writes it."""
    rewritten, _ = rewrite.rewrite_model(_original("nemotron_h-dynamo-fp16-decode"))
    assert not any(node.op_type == "GroupQueryAttention" for node in rewritten.graph.node)


# --- refusals ---------------------------------------------------------------------------------------


def _prepared(stem: str, directory: Path = FIXTURE_DIR) -> ir.Model:
    """The fixture as the attention pass sees it: after onnxscript's ORT fusions."""
    model, _ = _ort_fusions(ir.from_proto(_original(stem)) if stem.endswith(INT4) else ir.load(_path(stem, directory)))
    return model


def _node(model: ir.Model, op_type: str, where=lambda node: True) -> ir.Node:
    return next(node for node in model.graph if node.op_type == op_type and where(node))


def _refusals(model: ir.Model) -> list[str]:
    log = FusionLog()
    assert fuse_group_query_attention(model, log) == 0
    assert not any(node.op_type == "GroupQueryAttention" for node in model.graph)
    return [record.reason for record in log.chains.values() if not record.fused]


def _constant(model: ir.Model, name: str, array: np.ndarray) -> ir.Value:
    tensor = ir.tensor(array, name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    model.graph.register_initializer(value)
    return value


def test_a_mask_that_masks_is_refused_less() -> None:
    """kv index < P masks the new token's own key: not GroupQueryAttention's all-visible decode step."""
    model = _prepared("nemotron_h-dynamo-fp16-decode")
    _node(model, "LessOrEqual").op_type = "Less"
    reasons = _refusals(model)
    assert any("LessOrEqual" in reason for reason in reasons), reasons


def test_a_mask_that_masks_is_refused_query_offset() -> None:
    """q_pos = -1 + P masks the newest key."""
    model = _prepared("nemotron_h-dynamo-fp16-decode")
    compare = _node(model, "LessOrEqual")
    position = compare.inputs[1]
    while position.producer().op_type != "Add":
        position = position.producer().inputs[0]
    add = position.producer()
    index = next(i for i, v in enumerate(add.inputs) if v.const_value is not None)
    add.replace_input_with(index, _constant(model, "minus_one", np.array([-1], dtype=np.int64)))
    reasons = _refusals(model)
    assert any("query position is not 0 + P" in reason for reason in reasons), reasons


def test_a_tile_head_mapping_is_refused() -> None:
    """Unsqueeze at axis 1 and Expand to (B, n, Hkv, T, D): query head h reads kv head h % Hkv (tile)."""
    model = _prepared("granitemoehybrid-dynamo-fp16-batch-decode", BATCH_FIXTURE_DIR)
    for unsqueeze in [n for n in model.graph if n.op_type == "Unsqueeze" and n.inputs[0].is_graph_output()]:
        unsqueeze.replace_input_with(1, _constant(model, f"{unsqueeze.name}_axis1", np.array([1], dtype=np.int64)))
        expand = next(user for user, _ in unsqueeze.outputs[0].uses())
        target = expand.inputs[1].producer()
        assert target.op_type == "Concat" and len(target.inputs) == 5
        first, second = target.inputs[1], target.inputs[2]
        target.replace_input_with(1, second)
        target.replace_input_with(2, first)
    reasons = _refusals(model)
    assert any("repeat_interleave" in reason for reason in reasons), reasons


def test_float32_is_refused() -> None:
    reasons = _refusals(_prepared("nemotron_h-dynamo-fp32-decode"))
    assert any("float32" in reason and "CUDA" in reason for reason in reasons), reasons


# --- CUDA (GPU machine only: skipped where onnxruntime has no working CUDA provider) --------------------


def _cuda_session(model: onnx.ModelProto, profile: Path | None = None) -> ort.InferenceSession:
    from tests._cuda import CUDA, with_supported_ir

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile)
    copy = with_supported_ir(onnx.ModelProto.FromString(model.SerializeToString()))
    return ort.InferenceSession(copy.SerializeToString(), options, providers=[CUDA, "CPUExecutionProvider"])


@pytest.mark.parametrize("stem", sorted(FUSED))
def test_the_fused_model_on_cuda(stem: str, tmp_path: Path) -> None:
    """On ORT's CUDA provider the node runs on CUDA (float16 has a CUDA kernel) and gives the original's outputs
    (through the model-local functions, so the custom-op library need not be built for CUDA)."""
    import json

    from tests._cuda import CUDA, cuda_problem

    problem = cuda_problem(ort)
    if problem is not None:
        pytest.skip(problem)
    optimized, _ = optimize_model(_original(stem), function=True)
    original = _cuda_session(_original(stem))
    fused = _cuda_session(optimized, tmp_path / "profile")
    names = [output.name for output in original.get_outputs()]
    for past in PAST_LENGTHS[1:]:
        for batch in FUSED[stem][2]:
            feeds = _feeds(stem, batch, past, seed=1000 * batch + past)
            for name, a, e in zip(names, fused.run(None, feeds), original.run(None, feeds), strict=True):
                what = f"{stem} {name} (CUDA, batch {batch}, past {past})"
                assert a.shape == e.shape and a.dtype == e.dtype, what
                scale = max(float(np.abs(e.astype(np.float64)).max()), np.finfo(np.float32).tiny)
                error = float(np.abs(a.astype(np.float64) - e.astype(np.float64)).max())
                assert error <= TOLERANCE * scale, f"{what}: max error {error / scale:.3g} of max"
    events = json.loads(Path(fused.end_profiling()).read_text())
    # The attention, and the residual norms ``optimize`` folds into SkipSimplifiedLayerNormalization, on CUDA.
    present = {node.op_type for node in optimized.graph.node}
    assert "GroupQueryAttention" in present
    for op in present & {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"}:
        providers = {
            event["args"].get("provider")
            for event in events
            if event.get("cat") == "Node" and event.get("args", {}).get("op_name") == op
        }
        assert providers == {CUDA}, (op, providers)


def test_without_ort_fusions_the_matmul_spelling_fuses() -> None:
    """``--no-ort-fusions``: scores as MatMul(q, Transpose(k_rep)) (onnxscript writes FusedMatMul), same outputs."""
    stem = "nemotron_h-dynamo-fp16-decode"
    optimized, report = optimize_model(_original(stem), ort_fusions=False)
    assert report.pass_named("mambafuse attention").fused == {"GroupQueryAttention": 1}, report.summary()
    assert not any(node.op_type == "FusedMatMul" for node in optimized.graph.node)
    original = ort.InferenceSession(_original(stem).SerializeToString(), providers=["CPUExecutionProvider"])
    fused = contrib_ops.session(optimized, use_library=True)
    for past in PAST_LENGTHS:
        feeds = _feeds(stem, 1, past, seed=past)
        for a, e in zip(fused.run(None, feeds), original.run(None, feeds), strict=True):
            scale = max(float(np.abs(e.astype(np.float64)).max()), np.finfo(np.float32).tiny)
            assert a.shape == e.shape and float(np.abs(a.astype(np.float64) - e).max()) <= TOLERANCE * scale
