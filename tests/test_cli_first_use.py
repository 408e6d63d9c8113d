"""What a new user tripped over on the command line (issue 39, item 6), each fixed or decided:

- a directory given as the model (``mambafuse optimize .``) is one line that names what it holds;
- the report says whether the fused nodes ran with the library, and ``--no-library`` measures the function body;
- the report's node counts agree with its "graph nodes" row (the arithmetic printed);
- ``--dim`` / ``--inputs`` / the report's options given without the option that uses them are errors;
- an ``--inputs`` .npz with more arrays than the model's inputs is used, the others ignored with a note (one with
  no input of the model at all is refused);
- the error that refuses an output names the output as the user gave it (``OUT`` or ``-o``);
- a prefill graph is verified over several SSD chunks, at one where the original rejects that, and says so;
- an inline output written over an old one removes the old ``<out>.data`` it no longer uses, and nothing else.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusion import cli, inputs, model_io, report
from fusion.rewrite import load, main, rewrite_model, save
from models.mobius import extract_builds

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "models"
DECODE = FIXTURES / "nemotron_h-dynamo-fp32-decode.onnx"
PREFILL = FIXTURES / "nemotron_h-dynamo-fp32-prefill.onnx"
TRANSFORMERS_PREFILL = FIXTURES / "nemotron_h-transformers-fp32-prefill.onnx"
PADDED_PREFILL = FIXTURES / "padded" / "nemotron_h-dynamo-fp32-chunk8-len16-prefill.onnx"


def _one_error_line(err: str, prog: str = "mambafuse rewrite") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err, err
    return lines[0]


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# --- a. a directory is no model --------------------------------------------------------------------------------


def _genai_folder(folder: Path) -> None:
    shutil.copy(DECODE, folder / "model.onnx")
    (folder / "genai_config.json").write_text('{"model": {"decoder": {"filename": "model.onnx"}}}')


FOLDERS = {
    "empty": (lambda d: None, "it holds no .onnx file"),
    "one model": (lambda d: shutil.copy(DECODE, d / "model.onnx"), "it holds one model: model.onnx"),
    "two models": (
        lambda d: (shutil.copy(DECODE, d / "a.onnx"), shutil.copy(PREFILL, d / "b.onnx")),
        "it holds 2 models (a.onnx, b.onnx): name one",
    ),
    "genai folder": (_genai_folder, "onnxruntime-genai model folder: fuse it with mambafuse genai"),
}


@pytest.mark.parametrize("command", ["rewrite", "optimize"])
@pytest.mark.parametrize("contents", sorted(FOLDERS))
def test_a_directory_is_refused_naming_what_it_holds(
    command: str, contents: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mambafuse optimize .`` was an internal error ("PosixPath('.') has an empty name"). A directory is never
    taken for the model it holds (decided: the output name and the external data follow the model file)."""
    make, message = FOLDERS[contents]
    make(tmp_path)
    before = _listing(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, "."]) == 2
    line = _one_error_line(capsys.readouterr().err, f"mambafuse {command}")
    assert line.startswith(f"mambafuse {command}: error: .: is a directory, not an ONNX model; ")
    assert message in line and "internal error" not in line
    assert _listing(tmp_path) == before, "nothing written"


def test_a_directory_in_a_real_process_and_in_the_report(tmp_path: Path) -> None:
    """As the user ran it (the console command's module, a fresh process); `report` says the same of its models."""
    for args, prog in ((["optimize", "."], "mambafuse optimize"), (["report", ".", "."], "mambafuse report")):
        result = subprocess.run(
            [sys.executable, "-m", "fusion", *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
        )
        assert result.returncode == 2
        assert "is a directory, not an ONNX model; it holds no .onnx file" in _one_error_line(result.stderr, prog)
    assert list(tmp_path.iterdir()) == []


# --- b, e. what the report says: the library, and node counts that agree ----------------------------------------


@pytest.fixture(scope="module")
def decode_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("decode")
    fused, result = rewrite_model(onnx.load(DECODE))
    assert result.fused and result.decode_fused
    onnx.save(fused, folder / "fused.onnx")
    return DECODE, folder / "fused.onnx"


def test_the_report_says_the_library_ran_the_fused_nodes(decode_pair: tuple[Path, Path], library: str) -> None:
    before, after = decode_pair
    result = report.measure(before, after, runs=3, warmup=1)
    assert result.library == library and result.to_json()["library"] == library
    table = result.table()
    assert f"after: the fused nodes run the mambafuse library's kernels ({library})" in table
    kernels = result.after["CPUExecutionProvider"].kernels_by_op
    assert {"GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate"} <= set(kernels)


def test_no_library_measures_the_function_body(decode_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """``--no-library``: no session registers the library; ONNX Runtime inlines the fused nodes' functions."""
    before, after = decode_pair
    out = tmp_path / "r.json"
    result = subprocess.run(
        [sys.executable, "-m", "fusion", "report", str(before), str(after), "--runs", "3", "--warmup", "1"]
        + ["--no-library", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "after: the fused nodes run through their model-local function, without the mambafuse library" in (
        result.stdout
    )
    data = json.loads(out.read_text())
    assert data["library"] is None
    kernels = data["after"]["by_provider"]["CPUExecutionProvider"]["kernels_by_op"]
    assert not {"GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate"} & set(kernels), kernels
    assert data["max_abs_error"] < 1e-4


def test_no_library_refuses_fused_nodes_without_a_function(tmp_path: Path) -> None:
    fused, _ = rewrite_model(onnx.load(DECODE), function=False)
    onnx.save(fused, tmp_path / "fused.onnx")
    result = subprocess.run(
        [sys.executable, "-m", "fusion", "report", str(DECODE), str(tmp_path / "fused.onnx"), "--no-library"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 2
    line = _one_error_line(result.stderr, "mambafuse report")
    assert "--no-library: the after model's" in line and "no model-local function" in line


def test_the_node_counts_agree_with_the_graph_nodes_row(decode_pair: tuple[Path, Path]) -> None:
    """The first line printed "the fusions replaced 118 nodes" beside a -112 row; now it shows the arithmetic."""
    before, after = decode_pair
    result = report.measure(before, after, runs=3, warmup=1)
    table = result.table()
    match = re.search(r"where the original had (\d+) other nodes \(graph nodes: -(\d+) \+ (\d+) = ([-+]\d+)\)", table)
    assert match, table
    other, removed, added, net = (int(group) for group in match.groups())
    # two Mamba layers (a gated norm, a conv update, a state update each) and the MLP layer's squared ReLU
    assert other == removed == result.chain_nodes and added == result.fused_nodes == 7
    row = next(line for line in table.splitlines() if line.startswith("graph nodes"))
    assert net == -removed + added == result.after_nodes - result.before_nodes == int(row.split()[4])


# --- e. options that would do nothing, and --dim names -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dim", "bogus=3"], "--dim sets the inputs of --verify and --report, and neither is given"),
        (["--dim", "seq=3"], "--dim sets the inputs of --verify and --report, and neither is given"),
        (["--inputs", "x.npz"], "--inputs sets the inputs of --verify and --report, and neither is given"),
        (["--runs", "5"], "--runs is an option of --report, which is not given"),
        (["--providers", "CPUExecutionProvider"], "--providers is an option of --report, which is not given"),
        (["--report-no-library"], "--report-no-library is an option of --report, which is not given"),
        (["--report", "--report-no-library", "--no-function"], "without the function only the library runs"),
        (["--dim", "bogus=3", "--verify"], "--dim 'bogus': the model has no such symbolic dim (its dims: 'seq')"),
        (["--dim", "bogus=3", "--report"], "--dim 'bogus': the model has no such symbolic dim (its dims: 'seq')"),
    ],
)
def test_options_without_their_use_are_errors(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "model.onnx"
    shutil.copy(PREFILL, source)
    assert main([str(source), *args]) == 2
    assert message in _one_error_line(capsys.readouterr().err, "python -m fusion.rewrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


# --- e. an --inputs file with more arrays than the model's inputs ------------------------------------------------


def test_extra_arrays_are_ignored_with_a_note(
    decode_pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Decided: an .npz often holds a step's outputs or other arrays too; those are ignored, and a note says which."""
    npz = tmp_path / "step.npz"
    np.savez(npz, input_ids=np.array([[3]], np.int64), logits=np.zeros((1, 1, 64), np.float32), extra=np.ones(2))
    assert main([str(DECODE), "-o", str(tmp_path / "out.onnx"), "--verify", "--inputs", str(npz)]) == 0
    captured = capsys.readouterr()
    note = captured.err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith("python -m fusion.rewrite: note: --inputs: ignored 2 array(s)"), note
    assert "'extra', 'logits'" in note[0] and "(its inputs: input_ids, position_ids," in note[0]
    assert "verify (mambafuse library): PASS" in captured.out and "inputs: 1 of 8 given" in captured.out

    _, after = decode_pair
    result = subprocess.run(
        [sys.executable, "-m", "fusion", "report", str(DECODE), str(after), "--runs", "2", "--inputs", str(npz)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("mambafuse report: note: --inputs: ignored 2 array(s)"), result.stderr


def test_an_npz_with_no_input_of_the_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npz = tmp_path / "other.npz"
    np.savez(npz, hidden_states=np.zeros((1, 2, 3), np.float32))
    assert main([str(DECODE), "-o", str(tmp_path / "out.onnx"), "--verify", "--inputs", str(npz)]) == 2
    line = _one_error_line(capsys.readouterr().err, "python -m fusion.rewrite")
    assert "none of its arrays ('hidden_states') is an input of the model" in line
    assert not (tmp_path / "out.onnx").exists()


# --- e. the output as the user named it --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("positional", "refusing to overwrite the input: choose another OUT (the second argument)"),
        ("-o", "refusing to overwrite the input: choose another -o"),
        ("positional directory", "is a directory; OUT names the output file (e.g. "),
        ("-o directory", "is a directory; -o names the output file (e.g. "),
    ],
)
def test_the_output_error_names_the_argument_given(
    how: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "model.onnx"
    shutil.copy(PREFILL, source)
    (tmp_path / "out").mkdir()
    target = str(tmp_path / "out") if "directory" in how else str(source)
    args = [str(source), target] if how.startswith("positional") else [str(source), "-o", target]
    assert main(args) == 2
    line = _one_error_line(capsys.readouterr().err, "python -m fusion.rewrite")
    assert message in line
    if "directory" in how:
        assert f"{tmp_path / 'out' / 'model.fused.onnx'})" in line


# --- e. prefill graphs are verified over several chunks ----------------------------------------------------------


def test_the_chunk_size_marks_a_prefill_graph(tmp_path: Path) -> None:
    """The chunked scan's Mod by its chunk size is in every exporter's prefill graph and in no decode step."""
    assert inputs.ssd_chunk_size(onnx.load(PREFILL)) == 16
    assert inputs.ssd_chunk_size(onnx.load(TRANSFORMERS_PREFILL)) == 16
    assert inputs.ssd_chunk_size(onnx.load(PADDED_PREFILL)) == 8
    assert inputs.ssd_chunk_size(onnx.load(FIXTURES / "nemotron_h-torchscript-fp32-prefill.onnx")) == 16
    assert inputs.ssd_chunk_size(onnx.load(DECODE)) is None
    builds = extract_builds(tmp_path)
    mobius = onnx.load(builds / "nemotron_h-g4-f32-default-cpu" / "model.onnx", load_external_data=False)
    assert inputs.ssd_chunk_size(mobius) is None, "mobius' one graph does prefill and decode: decode defaults"
    assert inputs.prefill_lengths(onnx.load(PREFILL)) == [33, 16]
    assert inputs.resolve_dims(onnx.load(PREFILL)) == {"seq": 33}
    assert inputs.resolve_dims(onnx.load(PREFILL), {"seq": 5}) == {"seq": 5}
    assert inputs.resolve_dims(onnx.load(DECODE))["s17"] == 1


@pytest.mark.parametrize(
    ("model", "dims"),
    [
        (PREFILL, "dims seq=33 (prefill graph: 2 chunks of 16 + 1 by default; --dim seq=N to choose)"),
        (
            TRANSFORMERS_PREFILL,
            "dims s70=16, s9=16 (prefill graph: one chunk of 16, as the original rejects 33 (Expand: invalid expand "
            "shape); --dim s70=N --dim s9=N to choose)",
        ),
        (
            PADDED_PREFILL,
            "dims seq=8 (prefill graph: one chunk of 8, as the original rejects 17 (Reshape: The input tensor cannot "
            "be reshaped to the requested shape.",
        ),
    ],
)
def test_prefill_verify_runs_several_chunks_and_says_so(
    model: Path, dims: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(model), "-o", str(tmp_path / "out.onnx"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and f"  inputs: generated; {dims}" in out, out


def test_prefill_length_bound_by_the_user_has_no_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(PREFILL), "-o", str(tmp_path / "out.onnx"), "--verify", "--dim", "seq=5", "--json"]) == 0
    verification = json.loads(capsys.readouterr().out)["verification"]
    assert verification["dims"] == {"seq": 5} and verification["dims_note"] is None


def test_the_report_on_a_prefill_graph_falls_back_to_one_chunk(tmp_path: Path) -> None:
    fused, _ = rewrite_model(onnx.load(TRANSFORMERS_PREFILL))
    onnx.save(fused, tmp_path / "fused.onnx")
    result = report.measure(TRANSFORMERS_PREFILL, tmp_path / "fused.onnx", runs=2, warmup=1)
    assert result.dims == {"s70": 16, "s9": 16}
    assert result.dims_note is not None and "as the original rejects 33" in result.dims_note
    assert "dims s70=16, s9=16 (prefill graph: one chunk of 16" in result.table()


# --- e. an inline output over an old one with external data ------------------------------------------------------


def _external_copy(source: Path, target: Path) -> Path:
    model = onnx.load(source)
    onnx.save(model, target, save_as_external_data=True, location=target.name + ".data", size_threshold=0)
    return target


def test_an_inline_output_removes_the_old_outputs_data_file(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    external = _external_copy(DECODE, tmp_path / "in" / "ext.onnx")
    output = tmp_path / "out" / "o.onnx"
    assert main([str(external), "-o", str(output)]) == 0
    assert (tmp_path / "out" / "o.onnx.data").is_file(), "written with its own data file"
    result = subprocess.run(
        [sys.executable, "-m", "fusion", "rewrite", str(DECODE), "-o", str(output)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert (
        f"removed {tmp_path / 'out' / 'o.onnx.data'}: the replaced output's data file, which o.onnx does not use"
        in (result.stdout)
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["o.onnx"]
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["ext.onnx", "ext.onnx.data"], "input untouched"
    onnx.checker.check_model(onnx.load(output))


def test_a_data_file_the_old_output_does_not_name_stays(tmp_path: Path) -> None:
    """``<out>.data`` beside an inline old output belongs to something else: it is left alone."""
    output = tmp_path / "o.onnx"
    shutil.copy(DECODE, output)
    (tmp_path / "o.onnx.data").write_bytes(b"someone else's bytes")
    fused, _ = rewrite_model(load(DECODE))
    assert save(fused, output) == []
    assert (tmp_path / "o.onnx.data").read_bytes() == b"someone else's bytes"


def test_a_data_file_the_new_output_uses_stays(tmp_path: Path) -> None:
    """An output beside its input's data refers to it: a data file named like the output is then not stale."""
    source = _external_copy(DECODE, tmp_path / "o.onnx")  # its data file is o.onnx.data
    moved = tmp_path / "model.onnx"
    # The input is renamed; its data keeps the name o.onnx.data, which the old output (o.onnx itself) names.
    shutil.copy(source, moved)
    fused, _ = rewrite_model(load(moved))
    assert not model_io.writes_own_data(fused, source)
    assert save(fused, source) == []
    assert (tmp_path / "o.onnx.data").is_file()
    onnx.checker.check_model(str(source))
