"""``python -m fusion.genai`` on mobius's onnxruntime-genai folders, and generation with onnxruntime-genai.

Folders: the ``--runtime ort-genai`` builds of ``tests/fixtures/mobius`` (Nemotron-H, Zamba2, Mamba2; f32 and
f16; cpu target). For each: the command writes a complete new folder (fused model, the library beside it,
``custom_ops_library`` set, every other file unchanged) and leaves the input alone; genai rejects the
model types mobius writes, so by default the command declares the folder as genai's ``decoder`` (with
``--keep-model-type`` it keeps the type and says genai cannot load it); genai generates from the default
folder, and the greedy tokens from a fixed prompt are the same for the original model, the fused model
with the library and the ``--no-library`` folder (ORT inlines the model-local function). Logits
differences are reported (``-s``) and bounded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusion import genai as fusion_genai
from fusion.rules import registry
from models.mobius import extract_builds, load_manifest

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install -e '.[models]')")

MANIFEST = load_manifest()
GENAI_BUILDS = sorted(
    r["stem"]
    for r in MANIFEST["builds"]
    if r.get("runtime") == "ort-genai" and r["target"] == "cpu" and "error" not in r
)
RECORDS = {r["stem"]: r for r in MANIFEST["builds"]}
PROMPT = "the red door was on the west side"
NEW_TOKENS = 16
OP_TYPE = "GatedGroupRMSNorm"

#: Fused vs original logits over the 16 generated steps, max |difference| relative to the largest |logit|
#: (the bounds of tests/test_models_fusion.py: fp32 1e-5; fp16 4e-3, a few fp16 ulps of the logit scale).
LOGITS_TOLERANCE = {"f32": 1e-5, "f16": 4e-3}


@pytest.fixture(scope="session")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_builds(tmp_path_factory.mktemp("mobius-builds"))


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _fuse(source: Path, output: Path, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = fusion_genai.main([str(source), str(output), *args])
        except SystemExit as exit:  # argument errors exit from the parser, as on the command line
            status = exit.code
    return status, out.getvalue(), err.getvalue()


def _edited_original(source: Path, dest: Path) -> Path:
    """Copy ``source`` to ``dest`` with the same config edit the command makes (no fusion, no library)."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "genai_config.json").read_text())
    model = onnx.load(dest / "model.onnx", load_external_data=False)
    fusion_genai.edit_config_for_genai(
        config, [v.name for v in model.graph.input], [v.name for v in model.graph.output]
    )
    (dest / "genai_config.json").write_text(json.dumps(config))
    return dest


def _without_library(fused: Path, dest: Path) -> Path:
    """Write ``dest`` from a fused folder with ``--no-library`` (genai's ORT then inlines the function)."""
    status, _, err = _fuse(fused, dest, "--no-library")
    assert status == 0, err
    return dest


def fusion_genai_library_name() -> str:
    import contrib_ops

    return Path(contrib_ops.library_path()).name


def generate(folder: Path) -> tuple[list[int], np.ndarray]:
    """Return the greedy tokens genai generates from ``PROMPT`` and, per token, the logits it was chosen from.

    Logits genai masked (the EOS token before ``min_length``: -FLT_MAX) are set to 0.
    """
    graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
    logits_type = next(o.type.tensor_type.elem_type for o in graph.output if o.name == "logits")
    model = og.Model(str(folder))
    prompt = og.Tokenizer(model).encode(PROMPT)
    params = og.GeneratorParams(model)
    total = len(prompt) + NEW_TOKENS
    # min_length = max_length: the random model's EOS token must not end the comparison early.
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, dtype=np.int32)[None, :])
    tokens, logits = [], []
    while not generator.is_done() and len(tokens) < NEW_TOKENS:  # bounded: with bf16 logits genai-cuda 0.18
        # was seen to run past max_length
        # generate_next_token runs the model for the previous token, then picks: the logits it picked from
        # are the ones get_output returns after it.
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
        if logits_type == onnx.TensorProto.BFLOAT16:  # get_output has no numpy type for bf16; genai's fp32 copy
            logits.append(np.asarray(generator.get_logits(), dtype=np.float32).reshape(-1))
        else:
            logits.append(np.asarray(generator.get_output("logits"), dtype=np.float32)[0, -1])
    stacked = np.stack(logits)
    return tokens, np.where(np.abs(stacked) < 1e30, stacked, 0.0)


# --- the folder the command writes -------------------------------------------------------------------


@pytest.mark.parametrize("stem", GENAI_BUILDS)
def test_output_folder_layout(stem: str, builds: Path, tmp_path: Path, library: str) -> None:
    source = builds / stem
    before = _tree_digest(source)
    status, _, err = _fuse(source, tmp_path / "out", "--genai-config-edit")
    assert status == 0, err
    assert _tree_digest(source) == before, "the input folder was modified"
    out = tmp_path / "out"
    config = json.loads((out / "genai_config.json").read_text())
    name = config["model"]["decoder"]["session_options"]["custom_ops_library"]
    assert name == Path(library).name and "/" not in name and ".." not in name
    assert (out / name).read_bytes() == Path(library).read_bytes()
    copied = {p for p in before if p not in ("model.onnx", "model.onnx.data", "genai_config.json")}
    after = _tree_digest(out)
    assert {p: after.get(p) for p in copied} == {p: before[p] for p in copied}, "files not copied unchanged"
    assert set(after) == copied | {"model.onnx", "model.onnx.data", "genai_config.json", name}
    model = onnx.load(out / "model.onnx")  # its weights resolve from the new folder
    assert all(
        e.value == "model.onnx.data" for t in model.graph.initializer for e in t.external_data if e.key == "location"
    )
    # The config differs from the input's by the library and the opt-in edit only.
    original = json.loads((source / "genai_config.json").read_text())
    original["model"]["decoder"]["session_options"]["custom_ops_library"] = name
    expected_edit = _edited_original(source, tmp_path / "edited")
    edited = json.loads((expected_edit / "genai_config.json").read_text())
    edited["model"]["decoder"]["session_options"]["custom_ops_library"] = name
    assert config == edited
    assert config["model"]["type"] == "decoder" and original["model"]["type"] == RECORDS[stem]["family"]


@pytest.mark.parametrize("stem", GENAI_BUILDS)
def test_keep_model_type_says_genai_cannot_load_it(stem: str, builds: Path, tmp_path: Path) -> None:
    """With --keep-model-type the folder keeps its type and the command says genai cannot load it — true."""
    status, _, err = _fuse(builds / stem, tmp_path / "out", "--keep-model-type")
    assert status == 0
    family = RECORDS[stem]["family"]
    assert f"cannot load model type '{family}'" in err and "without --keep-model-type" in err
    config = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert config["model"]["type"] == family
    with pytest.raises(Exception, match=f"Unsupported model_type in config.json: {family}"):
        og.Model(str(tmp_path / "out"))


def test_default_folder_loads_and_generates(builds: Path, tmp_path: Path) -> None:
    """The command line without options writes a folder genai loads, and generates what the original does.

    Run as a user runs it (the console script's module, a fresh process), one build per family.
    """
    import subprocess
    import sys

    for family in sorted({RECORDS[s]["family"] for s in GENAI_BUILDS}):
        stem = next(s for s in GENAI_BUILDS if RECORDS[s]["family"] == family and RECORDS[s]["dtype"] == "f32")
        out = tmp_path / stem
        done = subprocess.run(
            [sys.executable, "-m", "fusion.genai", str(builds / stem), str(out)], capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert f"genai_config.json: model.type: '{family}' -> 'decoder'" in done.stdout
        tokens, _ = generate(_edited_original(builds / stem, tmp_path / f"{stem}-original"))
        fused_tokens, _ = generate(out)
        assert fused_tokens == tokens, f"{stem}: {fused_tokens} != {tokens}"


def test_default_fails_when_the_config_cannot_be_edited(builds: Path, tmp_path: Path) -> None:
    """State names without one pattern: no folder, one line with the reason and --keep-model-type."""
    source = tmp_path / "in"
    shutil.copytree(builds / GENAI_BUILDS[0], source)
    model = onnx.load(source / "model.onnx", load_external_data=False)
    renamed = next(v.name for v in model.graph.input if v.name.endswith(".conv_state"))
    for value in model.graph.input:
        if value.name == renamed:
            value.name = "cache.0.conv_state"
    for node in model.graph.node:
        node.input[:] = ["cache.0.conv_state" if i == renamed else i for i in node.input]
    onnx.save(model, source / "model.onnx")
    status, out, err = _fuse(source, tmp_path / "out")
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "past_conv_names" in err and "--keep-model-type" in err
    assert not (tmp_path / "out").exists()
    assert _fuse(source, tmp_path / "kept", "--keep-model-type")[0] == 0


def test_no_library_folder(builds: Path, tmp_path: Path, library: str) -> None:
    """--no-library: no library file and no custom_ops_library, from a genai folder or from our own output."""
    stem = GENAI_BUILDS[0]
    source = builds / stem
    status, out, err = _fuse(source, tmp_path / "plain", "--no-library")
    assert status == 0, err
    assert "no library: the fused nodes run through the model-local function" in out
    assert _fuse(source, tmp_path / "fused")[0] == 0
    assert _fuse(tmp_path / "fused", tmp_path / "dropped", "--no-library")[0] == 0
    for folder in (tmp_path / "plain", tmp_path / "dropped"):
        config = json.loads((folder / "genai_config.json").read_text())
        assert "custom_ops_library" not in config["model"]["decoder"].get("session_options", {})
        assert Path(library).name not in {p.name for p in folder.iterdir()}
        model = onnx.load(folder / "model.onnx", load_external_data=False)
        # a CPU folder: its norms and (the opt-in of CPU folders) its convs; its scans stay LinearAttention (a toy
        # model's state, under SCAN_MIN_STATE)
        assert sorted(f.name for f in model.functions if f.domain == "ai.mambafuse") == [
            "CausalConv1d",
            "GatedGroupRMSNorm",
        ]
    status, _, err = _fuse(source, tmp_path / "neither", "--no-library", "--no-function")
    assert status == 2 and "not allowed with" in err and not (tmp_path / "neither").exists()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_cpu_folder_runs_its_scans_as_mamba_chunk_scan_above_toy_widths(
    dtype: str, builds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU folder's LinearAttention scans become MambaChunkScan (state_layout 1, no Transposes) by default where a
    layer's state reaches SCAN_MIN_STATE; the fixtures' toy state (4 heads · 8 · 16) stays LinearAttention with
    a note that says why and how to opt in. The float16 build's state is found behind its Cast."""
    stem = next(s for s in GENAI_BUILDS if RECORDS[s]["dtype"] == dtype and s.startswith("nemotron"))
    status, out, err = _fuse(builds / stem, tmp_path / "toy")
    assert status == 0, err
    assert "LinearAttention kept: a layer's state has 512 elements, under the 65536" in out
    ops = [n.op_type for n in onnx.load(tmp_path / "toy" / "model.onnx", load_external_data=False).graph.node]
    assert "LinearAttention" in ops and "MambaChunkScan" not in ops
    monkeypatch.setattr(registry, "SCAN_MIN_STATE", 512)
    status, out, err = _fuse(builds / stem, tmp_path / "scan")
    assert status == 0, err
    assert "LinearAttention kept" not in out and "linear_attention_scan" in out
    graph = onnx.load(tmp_path / "scan" / "model.onnx", load_external_data=False).graph
    scans = [n for n in graph.node if n.op_type == "MambaChunkScan"]
    assert scans and "LinearAttention" not in [n.op_type for n in graph.node]
    layouts = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("state_layout") for n in scans]
    assert layouts == [1] * len(scans)
    assert "Transpose" not in [n.op_type for n in graph.node]


def test_a_cuda_folder_runs_its_builder_ops_as_ours(
    builds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder for CUDA gets the conv's and the scan's defaults (the scans above SCAN_MIN_STATE; lowered here to the
    fixtures' 512), the summary naming the provider's default; --keep-builder-ops keeps ORT's ops; a folder for
    another provider (DirectML) gets neither."""
    stem = next(s for s in GENAI_BUILDS if RECORDS[s]["dtype"] == "f32" and s.startswith("nemotron"))
    source = tmp_path / "cuda-in"
    shutil.copytree(builds / stem, source)
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["provider_options"] = [{"cuda": {}}]
    (source / "genai_config.json").write_text(json.dumps(config))
    status, out, err = _fuse(source, tmp_path / "toy")
    assert status == 0, err
    assert "LinearAttention kept: a layer's state has 512 elements, under the 65536" in out
    assert "opted in (the CUDA folder's default; --keep-builder-ops: none): causal_conv_with_state\n" in out
    monkeypatch.setattr(registry, "SCAN_MIN_STATE", 512)
    status, out, err = _fuse(source, tmp_path / "scan")
    assert status == 0, err
    default = "opted in (the CUDA folder's default; --keep-builder-ops: none): "
    assert default + "linear_attention_scan, causal_conv_with_state\n" in out
    ops = [n.op_type for n in onnx.load(tmp_path / "scan" / "model.onnx", load_external_data=False).graph.node]
    assert "MambaChunkScan" in ops and "CausalConv1d" in ops
    assert "LinearAttention" not in ops and "CausalConvWithState" not in ops
    status, out, err = _fuse(source, tmp_path / "kept", "--keep-builder-ops")
    assert status == 0, err
    ops = [n.op_type for n in onnx.load(tmp_path / "kept" / "model.onnx", load_external_data=False).graph.node]
    assert "LinearAttention" in ops and "CausalConvWithState" in ops
    assert "MambaChunkScan" not in ops and "CausalConv1d" not in ops
    config["model"]["decoder"]["session_options"]["provider_options"] = [{"dml": {}}]
    (source / "genai_config.json").write_text(json.dumps(config))
    status, out, err = _fuse(source, tmp_path / "dml")
    assert status == 0, err
    ops = [n.op_type for n in onnx.load(tmp_path / "dml" / "model.onnx", load_external_data=False).graph.node]
    assert "LinearAttention" in ops and "CausalConvWithState" in ops and "opted in" not in out


def test_opt_in_names_add_to_a_cpu_folders_defaults(builds: Path, tmp_path: Path) -> None:
    """--opt-in adds to a CPU folder's default fusions (a named scan runs whatever its state's size; the conv's
    default stays), and --keep-builder-ops drops the defaults but keeps the named ones."""
    stem = next(s for s in GENAI_BUILDS if RECORDS[s]["dtype"] == "f32" and s.startswith("nemotron"))
    status, out, err = _fuse(builds / stem, tmp_path / "named", "--opt-in", "linear_attention_scan")
    assert status == 0, err
    default = "opted in (the CPU folder's default; --keep-builder-ops: none): "
    assert default + "linear_attention_scan, causal_conv_with_state" in out
    assert "LinearAttention kept" not in out
    ops = [n.op_type for n in onnx.load(tmp_path / "named" / "model.onnx", load_external_data=False).graph.node]
    assert "MambaChunkScan" in ops and "CausalConv1d" in ops
    assert "LinearAttention" not in ops and "CausalConvWithState" not in ops
    status, out, err = _fuse(
        builds / stem, tmp_path / "kept", "--keep-builder-ops", "--opt-in", "linear_attention_scan"
    )
    assert status == 0, err
    assert "opted in" not in out
    ops = [n.op_type for n in onnx.load(tmp_path / "kept" / "model.onnx", load_external_data=False).graph.node]
    assert "MambaChunkScan" in ops and "CausalConvWithState" in ops and "CausalConv1d" not in ops


def test_genai_loads_the_named_library(builds: Path, tmp_path: Path) -> None:
    """genai resolves custom_ops_library from the model folder: without the file there, loading fails.

    In a fresh process each (a library genai loaded once stays loaded in its process).
    """
    import subprocess
    import sys

    stem = next(s for s in GENAI_BUILDS if RECORDS[s]["family"] == "nemotron_h")
    assert _fuse(builds / stem, tmp_path / "out", "--genai-config-edit")[0] == 0
    load = [sys.executable, "-c", "import sys, onnxruntime_genai as og; og.Model(sys.argv[1])", str(tmp_path / "out")]
    loaded = subprocess.run(load, capture_output=True, text=True, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    (tmp_path / "out" / fusion_genai_library_name()).unlink()
    missing = subprocess.run(load, capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode != 0 and fusion_genai_library_name() in missing.stderr, missing.stderr


BAD_FOLDERS = {
    "missing": lambda d: d / "nope",
    "a file": lambda d: (d / "file.onnx").write_bytes(b"x") or d / "file.onnx",
    "no config": lambda d: (d / "empty").mkdir() or d / "empty",
    "bad json": lambda d: ((d / "bad").mkdir(), (d / "bad" / "genai_config.json").write_text("{"))[0] or d / "bad",
    "no filename": lambda d: (
        (
            (d / "nofile").mkdir(),
            (d / "nofile" / "genai_config.json").write_text('{"model": {"decoder": {}}}'),
        )[0]
        or d / "nofile"
    ),
    "model missing": lambda d: (
        (
            (d / "nomodel").mkdir(),
            (d / "nomodel" / "genai_config.json").write_text('{"model": {"decoder": {"filename": "model.onnx"}}}'),
        )[0]
        or d / "nomodel"
    ),
    "filename outside": lambda d: (
        (
            (d / "outside").mkdir(),
            (d / "outside" / "genai_config.json").write_text('{"model": {"decoder": {"filename": "../x.onnx"}}}'),
        )[0]
        or d / "outside"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_bad_input_folder(case: str, tmp_path: Path) -> None:
    source = BAD_FOLDERS[case](tmp_path)
    status, out, err = _fuse(source, tmp_path / "out")
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("python -m fusion.genai: error: "), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["non-empty", "inside input", "is the input"])
def test_bad_output_folder(where: str, builds: Path, tmp_path: Path) -> None:
    source = tmp_path / "in"
    shutil.copytree(builds / GENAI_BUILDS[0], source)
    before = _tree_digest(source)
    output = {"non-empty": tmp_path / "full", "inside input": source / "sub", "is the input": source}[where]
    if where == "non-empty":
        output.mkdir()
        (output / "keep.txt").write_text("keep")
    status, _, err = _fuse(source, output, "--genai-config-edit")
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert _tree_digest(source) == before
    if where == "non-empty":
        assert [p.name for p in output.iterdir()] == ["keep.txt"]
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_edit_refused_for_other_model_types(builds: Path, tmp_path: Path) -> None:
    source = tmp_path / "in"
    shutil.copytree(builds / GENAI_BUILDS[0], source)
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["type"] = "phi3"
    (source / "genai_config.json").write_text(json.dumps(config))
    status, _, err = _fuse(source, tmp_path / "out", "--genai-config-edit")
    assert status == 2 and "'phi3' is not one it edits" in err
    assert not (tmp_path / "out").exists()


# --- fusion and generation (need the mobius forms S1 / S3 fused) ----------------------------------


@pytest.mark.parametrize("stem", GENAI_BUILDS)
def test_every_gated_norm_fused(stem: str, builds: Path, tmp_path: Path) -> None:
    status, out, err = _fuse(builds / stem, tmp_path / "out", "--genai-config-edit", "--json")
    assert status == 0, err
    report = json.loads(out)
    record = RECORDS[stem]
    assert report["fused"] == record["mamba_layers"] and report["refused"] == [], report
    model = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    assert sum(n.op_type == OP_TYPE for n in model.graph.node) == record["mamba_layers"]


def _compare(tokens: list[int], logits: np.ndarray, fused_tokens: list[int], fused_logits: np.ndarray) -> str:
    """Return a one-line comparison; assert equal tokens, or a divergence only at a tie of the original.

    A divergence is accepted only at a step where the original's two best logits are closer than the
    fused logits differ from the original's there (an fp16 tie that any last-bit difference flips);
    logits are compared up to and including that step.
    """
    steps = next((k for k, (a, b) in enumerate(zip(tokens, fused_tokens, strict=True)) if a != b), len(tokens))
    compared = slice(0, min(steps + 1, len(tokens)))
    difference = float(np.abs(fused_logits[compared] - logits[compared]).max())
    line = f"tokens identical over {len(tokens)}"
    if steps < len(tokens):
        top2 = np.sort(logits[steps])[-2:]
        margin = float(top2[1] - top2[0])
        step_difference = float(np.abs(fused_logits[steps] - logits[steps]).max())
        assert margin <= step_difference, (
            f"tokens diverge at step {steps} where the original's top-2 margin {margin:.3g} exceeds the logits "
            f"difference {step_difference:.3g}: {fused_tokens} != {tokens}"
        )
        line = f"tokens identical for {steps}, then a tie flips (top-2 margin {margin:.3g} <= {step_difference:.3g})"
    return f"{line}; logits max |fused - original| = {difference:.3g}"


@pytest.mark.parametrize("stem", GENAI_BUILDS)
def test_generation_same_before_and_after_fusion(stem: str, builds: Path, tmp_path: Path) -> None:
    original = _edited_original(builds / stem, tmp_path / "original")
    status, _, err = _fuse(builds / stem, tmp_path / "fused", "--genai-config-edit")
    assert status == 0, err
    function_only = tmp_path / "function"
    status, _, err = _fuse(builds / stem, function_only, "--no-library")
    assert status == 0, err
    tokens, logits = generate(original)
    assert len(set(tokens)) > 4, f"degenerate generation {tokens}: the comparison would prove little"
    limit = LOGITS_TOLERANCE[RECORDS[stem]["dtype"]] * float(np.abs(logits).max())
    for label, folder in (("library", tmp_path / "fused"), ("function", function_only)):
        fused_tokens, fused_logits = generate(folder)
        line = _compare(tokens, logits, fused_tokens, fused_logits)
        print(f"{stem} [{label}]: {line} (limit {limit:.3g})")
        difference = float(line.rsplit("= ", 1)[1])
        assert difference <= limit, f"{label}: {line}, over {limit:.3g}"


def test_int4_folder_with_the_weight_products_generates_the_same(builds: Path, tmp_path: Path) -> None:
    """An int4 folder (ORT's MatMulNBitsQuantizer) with ``--opt-in decode_matmul_nbits``: every 4-bit product is a
    DecodeMatMulNBits node, and on the CPU (its function: the MatMulNBits it replaced) genai generates the same
    tokens from the same logits, bit for bit, as the folder fused without it."""
    from benchmarks.bench_genai import _quantized_copy

    stem = next(s for s in GENAI_BUILDS if RECORDS[s]["dtype"] == "f32" and s.startswith("nemotron"))
    int4 = _quantized_copy(builds / stem, tmp_path / "int4")
    status, _, err = _fuse(int4, tmp_path / "plain")
    assert status == 0, err
    status, out, err = _fuse(
        int4, tmp_path / "gemv", "--opt-in", "causal_conv_with_state", "--opt-in", "decode_matmul_nbits"
    )
    assert status == 0, err
    graph = onnx.load(tmp_path / "gemv" / "model.onnx", load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    assert ops.count("DecodeMatMulNBits") > 0 and "MatMulNBits" not in ops, out
    tokens, logits = generate(tmp_path / "plain")
    assert len(set(tokens)) > 4, f"degenerate generation {tokens}"
    gemv_tokens, gemv_logits = generate(tmp_path / "gemv")
    assert gemv_tokens == tokens
    np.testing.assert_array_equal(gemv_logits, logits)


def test_the_genai_bench_measures_genai_builds_of_its_target(builds: Path) -> None:
    """bench_genai's ``--target`` lists: for that target, a genai build of each family in f32 and f16, each a
    folder whose config names that provider (``cpu`` where it names none)."""
    from benchmarks.bench_genai import STEMS, _provider

    for target in ("cpu", "cuda"):
        records = [RECORDS[stem] for stem in STEMS[target]]
        assert all(r["runtime"] == "ort-genai" and r["target"] == target and "error" not in r for r in records)
        assert {(r["family"], r["dtype"]) for r in records} == {
            (family, dtype) for family in ("nemotron_h", "zamba2", "mamba2") for dtype in ("f32", "f16")
        }
        assert {_provider(builds / stem) for stem in STEMS[target]} == {target}


def test_the_int4_accuracy_hint_follows_the_folders_provider(builds: Path, tmp_path: Path) -> None:
    """An int4 CPU folder quantized at the quantizer's default accuracy level gets the hint to requantize at level 4
    (ONNX Runtime's CPU int4 kernel is 2-3x faster there); at level 4 it does not, and neither does the same model
    in a folder for CUDA (whose kernel ignores the level)."""
    from benchmarks.bench_genai import _quantized_copy

    stem = next(s for s in GENAI_BUILDS if RECORDS[s]["dtype"] == "f32" and s.startswith("nemotron"))
    level0 = _quantized_copy(builds / stem, tmp_path / "int4")
    level4 = _quantized_copy(builds / stem, tmp_path / "int4-acc4", accuracy_level=4)
    cuda = tmp_path / "int4-cuda"
    shutil.copytree(level0, cuda)
    config = json.loads((cuda / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["provider_options"] = [{"cuda": {}}]
    (cuda / "genai_config.json").write_text(json.dumps(config))
    for folder, hinted in ((level0, True), (level4, False), (cuda, False)):
        status, out, err = _fuse(folder, tmp_path / f"{folder.name}-fused")
        assert status == 0, err
        hints = [line for line in out.splitlines() if line.startswith("hint: ")]
        builder_ops = [hint for hint in hints if "--opt-in" in hint]
        hints = [hint for hint in hints if hint not in builder_ops]
        if hinted:
            assert len(hints) == 1 and "accuracy_level < 4" in hints[0] and "--accuracy_level 4" in hints[0], out
        else:
            assert hints == [], out
        # A CPU or CUDA folder's defaults decided on the builder's ops: no hint of them (the notes say why the toy
        # scans stay LinearAttention).
        assert builder_ops == [], out
        assert "LinearAttention kept: a layer's state has 512 elements" in out


def test_refuses_a_folder_that_already_names_another_library(builds: Path, tmp_path: Path) -> None:
    source = tmp_path / "in"
    shutil.copytree(builds / GENAI_BUILDS[0], source)
    config = json.loads((source / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = "libother_ops.so"
    (source / "genai_config.json").write_text(json.dumps(config))
    status, _, err = _fuse(source, tmp_path / "out", "--genai-config-edit")
    assert status == 2 and "libother_ops.so" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_fused_folder_fuses_again_to_the_same_model(builds: Path, tmp_path: Path) -> None:
    """Running the command on its own output (library already named) finds nothing left to fuse."""
    stem = GENAI_BUILDS[0]
    assert _fuse(builds / stem, tmp_path / "once", "--genai-config-edit")[0] == 0
    status, out, err = _fuse(tmp_path / "once", tmp_path / "twice", "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["fused"] == 0 and sum(report["chains_found"].values()) == 0
    assert (tmp_path / "twice" / fusion_genai_library_name()).is_file()


def test_the_weights_copy_reports_progress(builds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing a large model's data takes minutes: save() reports every tensor written, genai shows it."""
    from fusion import model_io

    stem = GENAI_BUILDS[0]
    model = model_io.load(builds / stem / "model.onnx")
    external = len(model_io.external_tensors(model))
    calls: list[tuple[int, int, str]] = []
    model_io.save(
        model, tmp_path / "copy.onnx", progress=lambda done, total, message: calls.append((done, total, message))
    )
    assert [done for done, _, _ in calls] == list(range(1, len(calls) + 1)) and len(calls) >= external > 0
    assert {total for _, total, _ in calls} == {len(calls)} and "MiB into copy.onnx.data" in calls[-1][2]

    monkeypatch.setenv("MAMBAFUSE_PROGRESS", "1")
    status, _, err = _fuse(builds / stem, tmp_path / "out")
    assert status == 0 and "writing model.onnx:" in err and "copying the folder's other files:" in err


# --- --config-only: the unfused baseline genai can load ------------------------------------------------------


def test_config_only_writes_the_unfused_baseline(builds: Path, tmp_path: Path) -> None:
    """``--config-only``: every file copied unchanged (the model unfused, no library), the config edited as the
    fusing command edits it; genai loads the folder and generates what the fused folder generates."""
    stem = next(s for s in GENAI_BUILDS if RECORDS[s]["family"] == "nemotron_h" and RECORDS[s]["dtype"] == "f32")
    source = builds / stem
    before = _tree_digest(source)
    status, out, err = _fuse(source, tmp_path / "baseline", "--config-only")
    assert status == 0 and err == "", err
    assert "genai_config.json: model.type: 'nemotron_h' -> 'decoder'" in out
    assert "not fused: the model and every other file copied unchanged, only genai_config.json edited" in out
    assert _tree_digest(source) == before, "the input folder was modified"
    after = _tree_digest(tmp_path / "baseline")
    assert set(after) == set(before)
    assert {p: h for p, h in after.items() if p != "genai_config.json"} == {
        p: h for p, h in before.items() if p != "genai_config.json"
    }, "files not copied unchanged"
    config = json.loads((tmp_path / "baseline" / "genai_config.json").read_text())
    assert config == json.loads((_edited_original(source, tmp_path / "edited") / "genai_config.json").read_text())
    assert _fuse(source, tmp_path / "fused")[0] == 0
    fused_config = json.loads((tmp_path / "fused" / "genai_config.json").read_text())
    del fused_config["model"]["decoder"]["session_options"]["custom_ops_library"]
    assert config == fused_config, "the same edit as the fusing command's"
    tokens, logits = generate(tmp_path / "baseline")
    fused_tokens, fused_logits = generate(tmp_path / "fused")
    print(f"{stem} [config-only vs fused]: {_compare(tokens, logits, fused_tokens, fused_logits)}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-library"], "argument --config-only: not allowed with --no-library"),
        (["--keep-model-type"], "argument --config-only: not allowed with --keep-model-type"),
    ],
)
def test_config_only_refuses_fusion_options(args: list[str], message: str, builds: Path, tmp_path: Path) -> None:
    status, out, err = _fuse(builds / GENAI_BUILDS[0], tmp_path / "out", "--config-only", *args)
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_config_only_refuses_a_folder_genai_loads_as_it_is(builds: Path, tmp_path: Path) -> None:
    assert _fuse(builds / GENAI_BUILDS[0], tmp_path / "edited", "--config-only")[0] == 0
    status, out, err = _fuse(tmp_path / "edited", tmp_path / "again", "--config-only")
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "nothing to edit" in err and "loads model type 'decoder' as it is" in err
    assert not (tmp_path / "again").exists()
