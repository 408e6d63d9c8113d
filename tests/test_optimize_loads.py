"""``mambafuse optimize`` never writes a model ONNX Runtime cannot load because of onnxscript's ORT fusions.

After the fusions the result is loaded in ONNX Runtime (CPU, and CUDA where this build has it); when it does not
load, the fusions are replayed and each one after which the model does not load is undone and named, with ONNX
Runtime's error. On the committed fixtures a fusion made to break the graph stands in for onnxscript's bugs; on
tiny GPT-2 and Llama exports (torch's dynamo exporter, random weights) the real ones: onnxscript 0.7's mha2 takes
the Reshape before GPT-2's Gemm, which then reads a rank-3 tensor.
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

from fusion.optimize import optimize_model
from models.fixtures import FIXTURE_DIR

STEM = "nemotron_h-dynamo-fp32-decode"
ROOT = Path(__file__).resolve().parent.parent


def _loads(model: onnx.ModelProto | Path) -> None:
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def _ort_pass(report):
    return report.pass_named("onnxscript ORT fusions")


def _break_loading(model: ir.Model) -> int:
    """Give a Softmax an axis past its input's rank: every value is still produced and typed (``model_problem``
    passes), ONNX Runtime refuses the graph."""
    node = next(node for node in model.graph if node.op_type == "Softmax")
    node.attributes["axis"] = ir.AttrInt64("axis", 7)
    return 1


def _leave_an_intermediate(model: ir.Model) -> int:
    """Put an op of onnxscript's intermediate domain, with no function, between a Softmax and its readers, as a
    fusion whose follow-up never matches leaves its SDPA."""
    node = next(node for node in model.graph if node.op_type == "Softmax")
    output = node.outputs[0]
    readers = list(output.uses())
    mystery = ir.node("Mystery", [output], domain="ai.onnxruntime._fusion", name="mystery")
    mystery.outputs[0].dtype, mystery.outputs[0].shape = output.dtype, output.shape
    model.graph.insert_after(node, mystery)
    for reader, index in readers:
        reader.replace_input_with(index, mystery.outputs[0])
    return 1


def test_a_fusion_that_breaks_loading_is_undone_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxscript.rewriter.ort_fusions.gelu as gelu

    monkeypatch.setattr(gelu, "fuse_gelu", _break_loading)
    optimized, report = optimize_model(onnx.load(FIXTURE_DIR / f"{STEM}.onnx"))
    ort_pass = _ort_pass(report)
    assert len(ort_pass.undone) == 1, ort_pass.line()
    assert ort_pass.undone[0].startswith(
        "gelu broke the graph (ONNX Runtime's CPU provider cannot load the result: "
    ), ort_pass.undone
    assert "axis" in ort_pass.undone[0].lower(), ort_pass.undone  # ONNX Runtime's own words, first line
    # The other fusions stand, the model loads, and the summary says which step was undone and by whom.
    assert ort_pass.fused == {"rms_normalization": 5, "skip_rms_normalization": 4}, ort_pass.line()
    assert "    onnxscript ORT fusions: gelu broke the graph (" in report.summary()
    assert "; undone" in report.summary()
    _loads(optimized)


def test_an_intermediate_op_nothing_replaces_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxscript.rewriter.ort_fusions.gelu as gelu

    monkeypatch.setattr(gelu, "fuse_gelu", _leave_an_intermediate)
    optimized, report = optimize_model(onnx.load(FIXTURE_DIR / f"{STEM}.onnx"))
    undone = _ort_pass(report).undone
    assert undone == [
        "gelu left intermediate ops (ai.onnxruntime._fusion) that no later fusion replaced and ONNX Runtime does "
        "not know"
    ], undone
    assert not any(node.domain == "ai.onnxruntime._fusion" for node in optimized.graph.node)
    _loads(optimized)


def test_the_check_reads_external_weights_where_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose weights are in a data file: the check loads it from its folder (no false refusal: every
    fusion stands), and a fusion that breaks loading is still found."""
    source = onnx.load(FIXTURE_DIR / f"{STEM}.onnx")
    folder = tmp_path / "weights"
    folder.mkdir()
    # Weights of 1 KiB and more in the data file; shape constants stay in the graph (ONNX Runtime's shape
    # inference does not read external data: a Reshape's target there would be refused)
    onnx.save(source, folder / "model.onnx", save_as_external_data=True, location="model.data", size_threshold=1024)
    assert any(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in onnx.load(folder / "model.onnx", load_external_data=False).graph.initializer
    )
    _, report = optimize_model(ir.load(folder / "model.onnx"))
    assert _ort_pass(report).undone == [] and _ort_pass(report).notes == [], _ort_pass(report).line()
    assert _ort_pass(report).fused == {"rms_normalization": 5, "skip_rms_normalization": 4}

    import onnxscript.rewriter.ort_fusions.gelu as gelu

    monkeypatch.setattr(gelu, "fuse_gelu", _break_loading)
    model, report = optimize_model(ir.load(folder / "model.onnx"))
    assert [reason.split(" (")[0] for reason in _ort_pass(report).undone] == ["gelu broke the graph"]
    output = tmp_path / "out" / "model.onnx"
    output.parent.mkdir()
    ir.save(model, output, external_data="model.onnx.data")
    _loads(output)


# --- tiny transformers exports, as a user's -------------------------------------------------------------

torch = pytest.importorskip("torch", reason="needs the models extra (torch)")
transformers = pytest.importorskip("transformers", reason="needs the models extra (transformers)")


def _export(name: str, folder: Path) -> Path:
    """Export a tiny, randomly initialized ``name`` (gpt2, llama) causal LM with torch's dynamo exporter."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=128,
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    path = folder / f"{name}.onnx"
    program = torch.onnx.export(
        model.eval(),
        (torch.randint(0, 128, (1, 8)),),
        dynamo=True,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {1: "sequence"}},
        verbose=False,
    )
    program.save(str(path))
    return path


@pytest.mark.parametrize(("name", "undone"), [("gpt2", ["mha2"]), ("llama", [])])
def test_a_dynamo_export_is_written_loadable(tmp_path: Path, name: str, undone: list[str]) -> None:
    """``mambafuse optimize`` on a model with no Mamba-2 chain: onnxscript's fusions only. GPT-2's mha2 result
    does not load ("node_Gemm_…: Input 0 expected to have rank 2 but has rank 3"): undone and named, with or
    without --verify, and the written model loads and gives the original's logits."""
    source = _export(name, tmp_path)
    output = tmp_path / f"{name}.optimized.onnx"
    script = Path(sys.executable).parent / "mambafuse"
    result = subprocess.run(
        [str(script), "optimize", str(source), str(output), "--json"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    import json

    data = json.loads(result.stdout)
    ort_pass = next(p for p in data["passes"] if p["name"] == "onnxscript ORT fusions")
    assert [reason.split(" broke the graph")[0] for reason in ort_pass["undone"]] == undone, ort_pass
    for reason in ort_pass["undone"]:
        assert "ONNX Runtime's CPU provider cannot load the result: " in reason and "rank" in reason, reason
    assert ort_pass["fused"], "the fusions that load stand"
    tokens = np.random.default_rng(0).integers(0, 128, (1, 7)).astype(np.int64)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"input_ids": tokens})
    got = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"]).run(None, {"input_ids": tokens})
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)
    # --verify: passes, and says nothing about a failed "fused model".
    verified = subprocess.run(
        [str(script), "optimize", str(source), str(tmp_path / "verified.onnx"), "--verify"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "the fused model failed" not in verified.stdout + verified.stderr
    if undone:
        assert f"    onnxscript ORT fusions: {undone[0]} broke the graph (" in verified.stdout
