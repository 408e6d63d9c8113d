"""The CLI never damages a user's files, takes every model ONNX Runtime takes, and fails with one line.

Each case here was a way to lose data, write a broken output, or get a traceback (the hardening issue):
an output path that is one of the input's files in any spelling, external tensors in Constant nodes,
truncated external data, signals during a write, --verify arguments found bad only after writing, ORT
contrib ops refused by onnx.checker, models that already hold fused nodes, malformed graphs, API misuse.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import contrib_ops
from fusion import model_io
from fusion._chains import ChainSpec, build_chain, chain_inputs
from fusion.report import main as report_main
from fusion.rewrite import main, rewrite_model
from models.fixtures import FIXTURE_DIR
from models.runtime import load_manifest

SPEC = ChainSpec(channels=1024, group_size=256)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _external(directory: Path, *, convert_attribute: bool = False) -> tuple[Path, Path]:
    """Write a chain model whose weight (and, optionally, a Constant node's tensor) is external data."""
    directory.mkdir(parents=True, exist_ok=True)
    model = build_chain(SPEC)
    if convert_attribute:
        table = numpy_helper.from_array(np.linspace(0, 1, 4096, dtype=np.float32), "table")
        model.graph.node.insert(0, helper.make_node("Constant", [], ["table"], value=table))
        model.graph.output.append(helper.make_tensor_value_info("table", TensorProto.FLOAT, [4096]))
    path = directory / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, location="model.onnx.data", convert_attribute=convert_attribute)
    return path, directory / "model.onnx.data"


def _no_scratch_left(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.startswith((".mambafuse-", ".verify-"))]


# --- 4. an output path that is one of the input's files -----------------------------------------------


@pytest.mark.parametrize("spelling", ["absolute", "relative", "dotdot", "symlink", "hardlink"])
def test_output_naming_the_input_weights_is_refused(
    spelling: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source, data = _external(tmp_path / "m")
    before = _digest(data)
    monkeypatch.chdir(tmp_path)
    target = {
        "absolute": data,
        "relative": Path("m/model.onnx.data"),
        "dotdot": Path("m/../m/model.onnx.data"),
        "symlink": tmp_path / "link.onnx",
        "hardlink": tmp_path / "m" / "hard.onnx",
    }[spelling]
    if spelling == "symlink":
        target.symlink_to(data)
    if spelling == "hardlink":  # onnx refuses data files with several links: link the model file itself
        os.link(source, target)
        data = source
        before = _digest(data)
    assert main([str(source), "-o", str(target)]) == 2
    assert "refusing to overwrite the input" in _error(capsys)
    assert _digest(data) == before
    ir.load(source)  # the input still loads with its weights


def test_output_whose_data_file_would_be_the_input_weights_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """-o out/model.onnx from in/ writes out/model.onnx.data: here a link to the input's weights."""
    source, data = _external(tmp_path / "in")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.onnx.data").symlink_to(data)
    before = _digest(data)
    assert main([str(source), "-o", str(tmp_path / "out" / "model.onnx")]) == 2
    assert "external data file" in _error(capsys)
    assert _digest(data) == before


# --- 5. external tensors in Constant nodes --------------------------------------------------------------


def test_constant_node_tensors_in_external_data_resolve_from_another_directory(tmp_path: Path) -> None:
    source, _ = _external(tmp_path / "in", convert_attribute=True)
    (tmp_path / "out").mkdir()
    output = tmp_path / "out" / "fused.onnx"
    assert main([str(source), "-o", str(output)]) == 0
    feeds = chain_inputs(SPEC)
    want = contrib_ops.session(source, use_library=False).run(None, feeds)
    got = contrib_ops.session(output, use_library=True).run(None, feeds)
    np.testing.assert_array_equal(got[1], want[1])  # the Constant's table
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


# --- 6. truncated external data -------------------------------------------------------------------------


def test_truncated_external_data_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, data = _external(tmp_path)
    data.write_bytes(data.read_bytes()[:100])
    assert main([str(source)]) == 2
    assert "is truncated" in _error(capsys)
    assert not (tmp_path / "model.fused.onnx").exists()


# --- 7. signals during a write --------------------------------------------------------------------------


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_the_write_leaves_nothing_behind(
    signal_number: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source, _ = _external(tmp_path / "in")
    (tmp_path / "out").mkdir()
    real_save = ir.save

    def save_then_signal(model: ir.Model, path: Path, **kwargs: object) -> None:
        real_save(model, path, **kwargs)  # the partial files exist in the scratch directory now
        os.kill(os.getpid(), signal_number)

    monkeypatch.setattr(model_io.ir, "save", save_then_signal)
    status = main([str(source), "-o", str(tmp_path / "out" / "fused.onnx")])
    assert status == 128 + signal_number
    assert "interrupted" in _error(capsys)
    assert list((tmp_path / "out").iterdir()) == []


# --- 8. --verify's arguments are checked before anything is written -------------------------------------


def _pickled_npz(path: Path) -> str:
    np.savez(path, y=np.array([object()], dtype=object))
    return str(path)


@pytest.mark.parametrize("case", ["bad_dim", "zero_dim", "pickled", "wrong_rank", "unknown_input"])
def test_bad_verify_arguments_fail_before_writing(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "model.onnx"
    onnx.save(build_chain(ChainSpec(shape_as="dynamic", leading=("batch", "seq"))), source)
    args = {
        "bad_dim": ["--dim", "seq"],
        "zero_dim": ["--dim", "seq=0"],
        "pickled": ["--inputs", _pickled_npz(tmp_path / "p.npz")],
        "wrong_rank": ["--inputs", str(tmp_path / "r.npz")],
        "unknown_input": ["--inputs", str(tmp_path / "u.npz")],
    }[case]
    np.savez(tmp_path / "r.npz", y=np.zeros((2, 64), np.float32))
    np.savez(tmp_path / "u.npz", x=np.zeros((2, 3, 64), np.float32))
    assert main([str(source), "--verify", *args]) == 2
    _error(capsys)
    assert not (tmp_path / "model.fused.onnx").exists()


# --- 9 and 10. what ONNX Runtime takes, the CLI takes ---------------------------------------------------

MANIFEST = load_manifest()
FAMILIES_DIR = FIXTURE_DIR / "families"
FAMILIES = load_manifest(FAMILIES_DIR)
PADDED_DIR = FIXTURE_DIR / "padded"
PADDED = load_manifest(PADDED_DIR)
#: Every committed export: (directory, record), the new families' norm-before-gate ones and the whole-model
#: exports traced past one chunk (issue 25: every chain refused before) included.
EXPORTS = {
    **{stem: (FIXTURE_DIR, record) for stem, record in MANIFEST["fixtures"].items()},
    **{f"families/{stem}": (FAMILIES_DIR, record) for stem, record in FAMILIES["fixtures"].items()},
    **{f"padded/{stem}": (PADDED_DIR, record) for stem, record in PADDED["fixtures"].items()},
}


@pytest.mark.parametrize("stem", sorted(EXPORTS))
def test_cli_fuses_every_committed_fixture(stem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line on the real exports (form F's contrib ops included), not only the Python API."""
    directory, record = EXPORTS[stem]
    output = tmp_path / "fused.onnx"
    assert main([str(directory / record["file"]), "-o", str(output), "--json"]) == 0, capsys.readouterr().err
    fused = onnx.load(output)
    count = sum(1 for n in fused.graph.node if n.op_type == "GatedGroupRMSNorm")
    default = record["num_mamba_layers"] if record["scope"] == "model" else 1
    assert count == record.get("expected_fused", default)


def test_verify_registers_the_library_for_an_input_that_holds_fused_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], library: str
) -> None:
    """A fused model saved without its function (as an ORT session writes it) verifies against itself."""
    source = tmp_path / "model.onnx"
    onnx.save(build_chain(SPEC), source)
    fused = tmp_path / "fused.onnx"
    assert main([str(source), "-o", str(fused), "--no-function"]) == 0
    capsys.readouterr()
    assert main([str(fused), "-o", str(tmp_path / "again.onnx"), "--verify"]) == 0, capsys.readouterr().err
    assert "PASS" in capsys.readouterr().out


# --- clear errors instead of internal ones --------------------------------------------------------------


def test_duplicate_output_names_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_chain(SPEC)
    model.graph.node[1].output[0] = model.graph.node[0].output[0]
    path = tmp_path / "dup.onnx"
    onnx.save(model, path)
    assert main([str(path)]) == 2
    assert "is produced twice" in _error(capsys)


def test_model_in_a_symlinked_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, _ = _external(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    assert main([str(tmp_path / "link" / "model.onnx"), "-o", str(tmp_path / "out.onnx")]) == 0, _error(capsys)
    assert main([str(tmp_path / "link")]) == 2
    assert "is a directory" in _error(capsys)


def test_all_float_node_declared_half_points_at_the_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fused, _ = rewrite_model(build_chain(SPEC))
    node = next(n for n in fused.graph.node if n.op_type == "GatedGroupRMSNorm")
    next(a for a in node.attribute if a.name == "output_dtype").i = TensorProto.FLOAT16
    fused.graph.value_info.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT16, None))
    path = tmp_path / "bad.onnx"
    onnx.save(fused, path)
    assert main([str(path)]) == 2
    assert "all-float32 output rule" in _error(capsys)


@pytest.mark.parametrize("bad", [None, b"\x08\x07", onnx.GraphProto()])
def test_rewrite_model_rejects_what_is_not_a_model(bad: object) -> None:
    with pytest.raises(TypeError, match="rewrite_model takes an onnx.ModelProto or an onnx_ir.Model"):
        rewrite_model(bad)  # type: ignore[arg-type]


def test_register_and_session_are_idempotent(library: str) -> None:
    import onnxruntime as ort

    options = contrib_ops.register(ort.SessionOptions())
    assert contrib_ops.register(options) is options
    fused, _ = rewrite_model(build_chain(SPEC))
    session = contrib_ops.session(fused, session_options=options, use_library=True)
    assert session.run(None, chain_inputs(SPEC))[0].shape == (2, 3, 1024)


# --- fusion.report's arguments --------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    before = tmp_path / "before.onnx"
    onnx.save(build_chain(SPEC), before)
    after = tmp_path / "after.onnx"
    assert main([str(before), "-o", str(after)]) == 0
    return before, after


def test_report_models_with_different_inputs_in_either_direction(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, _ = pair
    other = build_chain(ChainSpec(channels=1024, group_size=256, epsilon_as="graph_input"))
    other_path = tmp_path / "other.onnx"
    onnx.save(other, other_path)
    capsys.readouterr()
    for a, b in ((before, other_path), (other_path, before)):
        assert report_main([str(a), str(b), "--runs", "1", "--quiet"]) == 2
        assert "different inputs" in _error(capsys)


@pytest.mark.parametrize(
    "args", [["--dim", "seq=0"], ["--runs", "abc"], ["--json", "/no/such/dir/r.json"], ["--runs", "0"]]
)
def test_report_bad_arguments_are_one_line_and_early(
    args: list[str], pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = pair
    capsys.readouterr()
    try:
        status = report_main([str(before), str(after), "--quiet", *args])
    except SystemExit as exit_:  # argparse's own errors exit
        status = exit_.code
    assert status == 2
    _error(capsys)


def test_no_scratch_directories_after_a_failed_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "model.onnx"
    onnx.save(build_chain(SPEC), source)
    assert main([str(source), "--verify"]) == 0
    assert _no_scratch_left(tmp_path)


@pytest.mark.parametrize("ir_version", [8, 10])
def test_the_ir_version_is_never_raised(ir_version: int) -> None:
    """onnxruntime-gpu 1.31 loads IR 10-13 only: a fused model keeps its input's IR version."""
    model = build_chain(SPEC)
    model.ir_version = ir_version
    fused, report = rewrite_model(model)
    assert report.fused == 1 and fused.ir_version == ir_version
