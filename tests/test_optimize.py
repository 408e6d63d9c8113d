"""``mambafuse optimize`` on the committed fixtures: onnxscript's ORT fusions, then every mambafuse fusion.

For every CPU-runnable fixture (``tests/fixtures/models``): the optimized model keeps the graph's inputs and
outputs, fuses every gated norm the plain rewrite fuses, and ONNX Runtime CPU gives the original's outputs
(with the custom-op library, and through the model-local functions); decode graphs generate the same greedy
tokens. The counts each pass reports are checked against the graph itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import contrib_ops
from fusion import rewrite
from fusion.optimize import optimize_model
from models.fixtures import BATCH_FIXTURE_DIR, FAMILY_FIXTURE_DIR, FIXTURE_DIR
from models.runtime import feeds, greedy_decode, load_manifest, load_references

MANIFEST = load_manifest()
REFERENCES = load_references()
FIXTURES = MANIFEST["fixtures"]
CPU_FIXTURES = sorted(stem for stem, record in FIXTURES.items() if record["dtype"] != "bf16")
DECODE_CPU_FIXTURES = [stem for stem in CPU_FIXTURES if FIXTURES[stem]["mode"] == "decode"]

#: Optimized vs original whole-model outputs, max |difference| relative to the largest |output|. The ORT
#: fusions onnxscript writes (SkipSimplifiedLayerNormalization, RotaryEmbedding, MultiHeadAttention) compute
#: the same math in another order: on these 2-3 layer models that moved fp32 outputs by < 1e-6 and fp16 by
#: about one fp16 ulp of the largest logit, like the gated norm's own fusion (tests/test_models_fusion.py).
TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3}


@cache
def _original(stem: str) -> onnx.ModelProto:
    return onnx.load(FIXTURE_DIR / FIXTURES[stem]["file"])


@cache
def _optimized(stem: str):
    return optimize_model(_original(stem))


def _io(model: onnx.ModelProto) -> list[tuple[str, int]]:
    return [(v.name, v.type.tensor_type.elem_type) for v in (*model.graph.input, *model.graph.output)]


def _compare(stem: str, actual: list[np.ndarray], expected: list[np.ndarray], what: str) -> None:
    tolerance = TOLERANCE[FIXTURES[stem]["dtype"]]
    for spec, a, e in zip(FIXTURES[stem]["outputs"], actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{stem} {spec['name']}: {a.shape} {a.dtype} vs {e.shape}"
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        scale = max(float(np.abs(e64).max()), np.finfo(np.float32).tiny)
        error = float(np.abs(a64 - e64).max())
        assert error <= tolerance * scale, f"{stem} {spec['name']} ({what}): max error {error / scale:.3g} of max"


@pytest.mark.parametrize("stem", sorted(FIXTURES))
def test_optimize_keeps_the_interface_and_fuses_every_chain(stem: str) -> None:
    original = _original(stem)
    optimized, report = _optimized(stem)
    assert _io(optimized) == _io(original), f"{stem}: graph inputs/outputs changed"
    _, plain = rewrite.rewrite_model(original)
    assert report.rewrite.fused == plain.fused == FIXTURES[stem]["num_mamba_layers"], report.summary()
    assert not report.rewrite.refused, report.summary()
    counts = Counter((node.domain, node.op_type) for node in optimized.graph.node)
    assert counts[("ai.mambafuse", "GatedGroupRMSNorm")] == plain.fused
    # The counts the report gives are the graph's: node totals, and the norms onnxscript fused are there
    # (its rotary and SDPA fusions can be absorbed by its later MultiHeadAttention fusion).
    assert report.nodes_before == len(original.graph.node)
    assert report.nodes_after == len(optimized.graph.node) <= report.nodes_before
    ort_pass = report.pass_named("onnxscript ORT fusions")
    assert ort_pass.skipped is None, ort_pass.line()
    fused_ops = {
        "skip_rms_normalization": "SkipSimplifiedLayerNormalization",
        "rms_normalization": "SimplifiedLayerNormalization",
    }
    for fusion, op_type in fused_ops.items():
        if ort_pass.fused.get(fusion):
            assert any(op == op_type for _, op in counts), f"{stem}: {fusion} reported, no {op_type} in the graph"


@pytest.mark.parametrize("stem", CPU_FIXTURES)
@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
def test_optimized_matches_original(stem: str, use_library: bool) -> None:
    step = feeds(FIXTURES[stem], REFERENCES[stem])
    expected = ort.InferenceSession(_original(stem).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, step
    )
    session = contrib_ops.session(_optimized(stem)[0], use_library=use_library)
    _compare(stem, session.run(None, step), expected, "library" if use_library else "function")


@pytest.mark.parametrize("stem", DECODE_CPU_FIXTURES)
def test_optimized_decode_generates_the_same_tokens(stem: str) -> None:
    record, refs = FIXTURES[stem], REFERENCES[stem]
    original = ort.InferenceSession(_original(stem).SerializeToString(), providers=["CPUExecutionProvider"])
    optimized = contrib_ops.session(_optimized(stem)[0], use_library=True)
    assert greedy_decode(optimized, record, refs) == greedy_decode(original, record, refs)


def test_the_callers_model_is_not_modified() -> None:
    original = onnx.load(FIXTURE_DIR / FIXTURES["zamba2-dynamo-fp16-decode"]["file"])
    before = original.SerializeToString()
    optimize_model(original)
    assert original.SerializeToString() == before


def test_a_fusion_step_that_breaks_the_graph_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises, or leaves a node reading a value nothing produces, is undone and named in the report."""
    import onnxscript.rewriter.ort_fusions.rms_normalization as rms_normalization
    import onnxscript.rewriter.ort_fusions.skip_normalization as skip_normalization

    def dangling(model) -> int:  # what onnxscript 0.7's attention rewrites were seen to leave
        node = next(node for node in model.graph if node.op_type == "MatMul")
        node.replace_input_with(0, ir.Value(name="nothing_makes_this"))
        return 1

    def raises(model) -> int:
        next(iter(model.graph)).name = "half-way damage"
        raise RuntimeError("boom")

    monkeypatch.setattr(skip_normalization, "fuse_skip_rms_normalization", dangling)
    monkeypatch.setattr(rms_normalization, "fuse_rms_normalization", raises)
    stem = "nemotron_h-dynamo-fp32-decode"
    optimized, report = optimize_model(_original(stem))
    undone = report.pass_named("onnxscript ORT fusions").undone
    assert any(
        reason.startswith("skip_rms_normalization broke the graph (node ") and "nothing_makes_this" in reason
        for reason in undone
    ), undone
    assert "rms_normalization failed (boom)" in undone, undone
    summary = report.summary()
    assert "    onnxscript ORT fusions: skip_rms_normalization broke the graph (" in summary, summary
    assert "    onnxscript ORT fusions: rms_normalization failed (boom); undone" in summary, summary
    assert "nothing_makes_this" not in {name for node in optimized.graph.node for name in node.input}
    assert "half-way damage" not in {node.name for node in optimized.graph.node}
    step = feeds(FIXTURES[stem], REFERENCES[stem])
    expected = ort.InferenceSession(_original(stem).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, step
    )
    _compare(stem, contrib_ops.session(optimized, use_library=False).run(None, step), expected, "function")


def test_fp16_skip_norm_with_mixed_types_is_undone() -> None:
    """onnxscript fuses fp16 exports' residual Add + float32 RMSNorm into a SkipSimplifiedLayerNormalization with
    float16 and float32 inputs, which ONNX Runtime refuses to load; that step is undone, the model loads."""
    optimized, report = _optimized("nemotron_h-dynamo-fp16-decode")
    undone = report.pass_named("onnxscript ORT fusions").undone
    assert any("SkipSimplifiedLayerNormalization" in reason for reason in undone), report.summary()
    ort.InferenceSession(optimized.SerializeToString(), providers=["CPUExecutionProvider"])


# --- the command line, as a user runs it --------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _mambafuse(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "mambafuse"
    return subprocess.run([str(script), *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_optimize_writes_a_verified_model(tmp_path: Path) -> None:
    source = FIXTURE_DIR / FIXTURES["zamba2-dynamo-fp16-prefill"]["file"]
    before = source.read_bytes()
    output = tmp_path / "out.onnx"
    result = _mambafuse("optimize", str(source), str(output), "--verify")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == f"wrote {output}" and "verify (mambafuse library): PASS" in result.stdout
    assert any(line.startswith("  onnxscript ORT fusions: ") and "skip_rms_normalization 3" in line for line in lines)
    assert any(line.startswith("  mambafuse: GatedGroupRMSNorm 3") for line in lines), result.stdout
    optimized = onnx.load(output)
    assert sum(node.op_type == "GatedGroupRMSNorm" for node in optimized.graph.node) == 3
    assert sum(node.op_type == "SkipSimplifiedLayerNormalization" for node in optimized.graph.node) == 3
    # the prefill's three convs, each as x and BC, fed by one in-projection MatMul per part (no Split of it)
    assert "  mambafuse conv parts: CausalConv1d by part 3, in-projection by part 3; nodes " in result.stdout
    assert sum(node.op_type == "CausalConv1d" for node in optimized.graph.node) == 6
    assert source.read_bytes() == before  # the input model is never modified


def test_cli_optimize_default_output_and_json(tmp_path: Path) -> None:
    source = tmp_path / "model.onnx"
    shutil.copy(FIXTURE_DIR / FIXTURES["nemotron_h-dynamo-fp16-decode"]["file"], source)
    result = _mambafuse("optimize", str(source), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    output = tmp_path / "model.optimized.onnx"
    assert data["output"] == str(output) and output.is_file()
    mambafuse_pass, ort_pass, attention_pass, norm_pass, layout_pass, squares_pass, parts_pass = data["passes"]
    assert mambafuse_pass["name"] == "mambafuse" and ort_pass["name"] == "onnxscript ORT fusions"
    assert any(reason.startswith("skip_rms_normalization broke the graph (") for reason in ort_pass["undone"])
    assert attention_pass["name"] == "mambafuse attention" and attention_pass["fused"] == {"GroupQueryAttention": 1}
    assert norm_pass["name"] == "mambafuse residual norms" and sum(norm_pass["fused"].values()) == 5
    assert mambafuse_pass["fused"]["GatedGroupRMSNorm"] == 2
    assert layout_pass["name"] == "mambafuse layout" and layout_pass["fused"] == {"Transpose as Reshape": 4}
    # the MLP layer's squared ReLU is SquaredRelu by then, the norms' squares inside ORT's fused norms: none left
    assert mambafuse_pass["fused"]["SquaredRelu"] == 1
    assert squares_pass["name"] == "mambafuse squares" and squares_pass["fused"] == {}
    assert not any(node.op_type == "Pow" for node in onnx.load(output).graph.node)
    assert parts_pass["name"] == "mambafuse conv parts" and parts_pass["fused"] == {}  # a decode step: no prompt conv
    assert data["nodes_after"] == len(onnx.load(output).graph.node)


def test_cli_optimize_without_ort_fusions_is_the_rewrite(tmp_path: Path) -> None:
    source = FIXTURE_DIR / FIXTURES["nemotron_h-dynamo-fp32-decode"]["file"]
    result = _mambafuse("optimize", str(source), str(tmp_path / "a.onnx"), "--no-ort-fusions")
    assert result.returncode == 0, result.stderr
    assert "onnxscript ORT fusions: skipped (--no-ort-fusions)" in result.stdout
    assert _mambafuse("rewrite", str(source), str(tmp_path / "b.onnx")).returncode == 0
    a, b = onnx.load(tmp_path / "a.onnx"), onnx.load(tmp_path / "b.onnx")
    # The rewrite's nodes, but for the layout pass's Reshapes in place of Transposes that move only unit axes and
    # the squares pass's Mul(x, x) in place of Pow(x, 2).
    layout = {n.name for n in a.graph.node if n.op_type == "Reshape" and n.name.endswith("_as_reshape")}
    assert len(layout) >= 4, "at least the conv updates' four (B, 1, C) <-> (B, C, 1) Transposes"
    squares = {n.name for n in a.graph.node if n.op_type == "Mul" and n.name.endswith("_as_mul")}
    assert len(squares) == sum(n.op_type == "Pow" for n in b.graph.node) > 0

    def unlaid(node: onnx.NodeProto) -> tuple[str, list[str]]:
        if node.name in layout:
            return "Transpose", list(node.input[:1])
        return ("Pow", list(node.input[:1])) if node.name in squares else (node.op_type, list(node.input))

    assert [unlaid(n) for n in a.graph.node] == [
        (n.op_type, list(n.input[:1]) if n.op_type == "Pow" else list(n.input)) for n in b.graph.node
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/missing.onnx"], "no such file"),
        (["{fixture}", "{tmp}/a.onnx", "-o", "{tmp}/b.onnx"], "two outputs given"),
        (["{fixture}", "{tmp}/no-dir/a.onnx"], "output directory does not exist"),
        (["{fixture}", "--dim", "nosuchdim=3", "--verify"], "nosuchdim"),
    ],
)
def test_cli_optimize_errors_are_one_line_and_write_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    fixture = FIXTURE_DIR / FIXTURES["zamba2-dynamo-fp32-prefill"]["file"]
    argv = [arg.format(tmp=tmp_path, fixture=fixture) for arg in args]
    result = _mambafuse("optimize", *argv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("mambafuse optimize: error:") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("build", ["nemotron_h-g4-f16-default-cpu", "zamba2-g2-f32-default-cpu"])
def test_optimize_keeps_a_builders_contrib_op_functions(build: str, tmp_path: Path) -> None:
    """mobius ships ORT's contrib ops (CausalConvWithState, LinearAttention, ...) with function bodies; inlined, they
    would run as their decomposition (seen: 116 -> 162 kernels a Run). optimize keeps them as ORT's ops, and its
    model has no more kernels than the original nor more nodes than mambafuse's rewrite alone."""
    from models.mobius import extract_builds

    source = extract_builds(tmp_path / "builds") / build / "model.onnx"
    original = onnx.load(source)
    optimized, report = optimize_model(original)
    _, rewritten = rewrite.rewrite_model(original)
    assert {f.name for f in original.functions} <= {f.name for f in optimized.functions}
    for name in ("CausalConvWithState", "LinearAttention"):
        count = sum(n.op_type == name for n in original.graph.node)
        assert count > 0 and sum(n.op_type == name for n in optimized.graph.node) == count
    assert report.rewrite.fused == rewritten.fused > 0
    assert len(optimized.graph.node) <= rewritten.nodes_after


def test_symbolic_batch_export_folds_its_residual_adds() -> None:
    """The residual-norm pass runs after the mambafuse fusions, whose nodes carry the symbolic batch past the
    Reshapes of shape tensors the unfused mixer has: the batch export's norms fold as the single-batch export's
    do, four with their residual Add and the first (after the embedding, no Add) alone. Numbers: the optimized
    batch fixtures run against the original at batch 1, 2 and 3 in tests/test_attention_rule.py."""
    model = onnx.load(BATCH_FIXTURE_DIR / "nemotron_h-dynamo-fp16-batch-decode.onnx")
    _, report = optimize_model(model)
    norms = next(p for p in report.passes if p.name == "mambafuse residual norms")
    assert norms.fused == {"SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 1}, norms
    assert norms.refused == []


# --- what the report says -----------------------------------------------------------------------------------


def test_a_second_run_says_what_changed_the_node_count() -> None:
    """optimize on its own output fuses nothing more; the nodes onnxscript's constant folding still removes (it
    merges each Reshape the layout pass wrote with the Reshape next to it) are named, so that "nothing fused" and
    the node counts agree. One "nodes:" line for the whole run, each pass with its own counts."""
    once, first = _optimized("nemotron_h-dynamo-fp32-decode")
    twice, report = optimize_model(once)
    ort_pass = report.pass_named("onnxscript ORT fusions")
    assert ort_pass.fused == {} and ort_pass.nodes_after < ort_pass.nodes_before, ort_pass.line()
    assert ort_pass.changes == [f"constant folding removed {ort_pass.nodes_before - ort_pass.nodes_after} Reshape"]
    line = ort_pass.line().splitlines()
    assert line[0] == f"onnxscript ORT fusions: nothing fused; nodes {ort_pass.nodes_before} -> {ort_pass.nodes_after}"
    assert line[1] == f"    {ort_pass.changes[0]}"
    for summary in (first.summary(), report.summary()):
        nodes_lines = [line for line in summary.splitlines() if line.startswith("nodes:")]
        assert len(nodes_lines) == 1 and nodes_lines[0].endswith("(all passes)"), summary
    assert report.nodes_after == len(twice.graph.node)
    assert report.rewrite.fused == 0 and report.rewrite.decode_fused == 0


def test_intermediate_ops_inlined_back_are_not_counted_as_fused() -> None:
    """onnxscript's rotary_embedding writes an intermediate RotaryEmbedding that its cos_sin_cache fusion would turn
    into ONNX Runtime's; where that does not match, the clean-up inlines it back: no rotary embedding is fused, and
    the report says so rather than counting it."""
    optimized, report = _optimized("zamba2-dynamo-fp16-decode")
    ort_pass = report.pass_named("onnxscript ORT fusions")
    assert not any(node.op_type == "RotaryEmbedding" for node in optimized.graph.node)
    assert "rotary_embedding" not in ort_pass.fused, ort_pass.line()
    assert "rotary_embedding's 2 RotaryEmbedding inlined back by the clean-up: no later fusion took them" in (
        ort_pass.changes
    ), ort_pass.line()


def test_a_refusal_names_the_chain_as_rewrite_does() -> None:
    """A chain left unfused is named and explained as ``rewrite`` names it on the graph as exported, although
    onnxscript's constant folding renamed its anchor (``/mixer/norm/Reshape`` -> ``node_Reshape_…``)."""
    model = onnx.load(FAMILY_FIXTURE_DIR / "falcon_h1_nbg-torchscript-fp32-prefill.onnx")
    _, rewritten = rewrite.rewrite_model(model)
    _, report = optimize_model(model)
    assert rewritten.refused and report.rewrite.refused == rewritten.refused, report.summary()


def test_a_refusal_says_which_onnxscript_fusion_rewrote_the_chain() -> None:
    """Run the other way round (onnxscript's fusions first, as ``optimize`` did before it ran mambafuse's first),
    Falcon-H1's grouped norm is refused with the rules' bare "does not match any chain form": onnxscript's
    rms_normalization took its RMS and its weight. The optimize path says so."""
    from fusion.optimize import _explain_left_refusals, _ort_fusions

    model = ir.load(FAMILY_FIXTURE_DIR / "falcon_h1-dynamo-fp32-prefill.onnx")
    creators: dict[str, str] = {}
    model, _ = _ort_fusions(model, creators)
    model, report = rewrite.rewrite_model(model)
    assert [reason for _, reason in report.refused] == ["does not match any chain form"] * 2
    _explain_left_refusals(model, report, {}, creators)
    for _, reason in report.refused:
        assert reason.startswith(
            "does not match any chain form (onnxscript's ORT fusions rewrote this chain first: rms_normalization wrote "
        ), reason
