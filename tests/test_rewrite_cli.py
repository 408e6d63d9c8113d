"""``python -m fusion.rewrite``: outputs, external data, verification, and one-line errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import helper

from fusion._chains import FLOAT16, ChainSpec, build_chain, half_decode
from fusion.rewrite import main

REPO = Path(__file__).resolve().parents[1]
F16_DECODE = ChainSpec(**half_decode(FLOAT16))


def _digest(*paths: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in paths)).hexdigest()


def _write(path: Path, spec: ChainSpec | None = None) -> Path:
    onnx.save(build_chain(spec or ChainSpec()), path)
    return path


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    return lines[0]


def test_default_output_is_beside_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path / "model.onnx")
    before = _digest(source)
    assert main([str(source)]) == 0
    out = capsys.readouterr().out
    assert "fused: 1" in out and "model.fused.onnx" in out
    fused = onnx.load(tmp_path / "model.fused.onnx")
    assert [n.op_type for n in fused.graph.node] == ["GatedGroupRMSNorm", "Identity"]
    assert len(fused.functions) == 1
    assert _digest(source) == before, "the input model must never be modified"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.fused.onnx", "model.onnx"], "no temp files left"


def test_output_option_no_function_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path / "in.onnx", F16_DECODE)
    target = tmp_path / "sub" / "out.onnx"
    target.parent.mkdir()
    assert main([str(source), "-o", str(target), "--no-function", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fused"] == 1 and report["chains_found"] == {"C": 1} and report["function_attached"] is False
    assert report["fused_chains"][0]["norm_dtype"] == "float16"
    assert onnx.load(target).functions == []


def test_refuses_to_overwrite_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path / "model.onnx")
    before = _digest(source)
    assert main([str(source), "-o", str(source)]) == 2
    assert "overwrite the input" in _error_line(capsys)
    assert _digest(source) == before


def test_verify_passes_and_says_which_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str], library: str) -> None:
    source = _write(tmp_path / "model.onnx", ChainSpec(shape_as="dynamic", leading=("batch", "seq")))
    assert main([str(source), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify (mambafuse library): PASS" in out


def test_verify_without_library_uses_the_function(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAMBAFUSE_LIBRARY", str(tmp_path / "missing.so"))
    source = _write(tmp_path / "model.onnx", F16_DECODE)
    assert main([str(source), "--verify"]) == 0
    assert "verify (model-local function (library not built)): PASS" in capsys.readouterr().out


def test_second_run_fuses_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path / "model.onnx")
    assert main([str(source)]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "model.fused.onnx"), "-o", str(tmp_path / "again.onnx"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fused"] == 0 and report["chains_found"] == {} and report["refused"] == []
    again = onnx.load(tmp_path / "again.onnx")
    assert onnx.load(tmp_path / "model.fused.onnx").SerializeToString() == again.SerializeToString()


def test_debug_explains_near_misses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path / "model.onnx", ChainSpec(norm_before_gate=True))
    assert main([str(source), "--debug"]) == 0
    captured = capsys.readouterr()
    assert "refused: 1" in captured.out
    assert "norm_before_gate" in captured.err


# --- external data ------------------------------------------------------------------------------------


def _write_external(path: Path) -> Path:
    model = build_chain(ChainSpec(channels=512, group_size=64))
    # Exporters keep small tensors (shapes, eps) inline; ORT cannot read a Reshape target from a file.
    onnx.save(model, path, save_as_external_data=True, location=path.name + ".weights", size_threshold=1024)
    return path


def _external_locations(path: Path) -> set[str]:
    """Return the data files the model's weight refers to; fail if the weight was embedded."""
    model = onnx.load(path, load_external_data=False)
    (weight,) = [t for t in model.graph.initializer if t.name == "weight"]
    assert weight.data_location == onnx.TensorProto.EXTERNAL, "the weight was embedded"
    return {e.value for e in weight.external_data if e.key == "location"}


def test_external_data_same_directory_refers_to_the_weights(tmp_path: Path) -> None:
    source = _write_external(tmp_path / "model.onnx")
    weights = tmp_path / "model.onnx.weights"
    before = _digest(source, weights)
    assert main([str(source), "--verify"]) == 0
    assert _external_locations(tmp_path / "model.fused.onnx") == {"model.onnx.weights"}
    assert _digest(source, weights) == before
    onnx.checker.check_model(str(tmp_path / "model.fused.onnx"))


def test_external_data_other_directory_gets_its_own_file(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    source = _write_external(tmp_path / "in" / "model.onnx")
    target = tmp_path / "out" / "fused.onnx"
    assert main([str(source), "-o", str(target), "--verify"]) == 0
    assert _external_locations(target) == {"fused.onnx.data"}
    assert sorted(p.name for p in target.parent.iterdir()) == ["fused.onnx", "fused.onnx.data"]


def test_missing_external_data_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write_external(tmp_path / "model.onnx")
    (tmp_path / "model.onnx.weights").unlink()
    assert main([str(source)]) == 2
    assert "external data" in _error_line(capsys)


# --- errors: one line, non-zero, no traceback ----------------------------------------------------------


def _bad_graph(path: Path) -> Path:
    node = helper.make_node("Relu", ["undefined_input"], ["out"])
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1])])
    path.write_bytes(helper.make_model(graph).SerializeToString())
    return path


def _old_opset(path: Path) -> Path:
    node = helper.make_node("Relu", ["x"], ["out"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 6
    path.write_bytes(model.SerializeToString())
    return path


def _truncated(path: Path) -> Path:
    data = build_chain(ChainSpec()).SerializeToString()
    path.write_bytes(data[: len(data) // 2])
    return path


ERROR_CASES = {
    "missing_file": (lambda p: p / "nope.onnx", "no such file"),
    "directory": (lambda p: p, "is a directory"),
    "not_onnx": (lambda p: (p / "text.onnx").write_text("hello, not a model\n") and p / "text.onnx", "ONNX"),
    "empty_file": (lambda p: (p / "empty.onnx").write_bytes(b"") or p / "empty.onnx", "ONNX"),
    "truncated": (lambda p: _truncated(p / "cut.onnx"), "model"),
    "invalid_graph": (lambda p: _bad_graph(p / "bad.onnx"), "invalid ONNX model"),
    "unsupported_opset": (lambda p: _old_opset(p / "old.onnx"), "opset 11 is not supported"),
}


@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_bad_input_is_one_line(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, expected = ERROR_CASES[name]
    path = make(tmp_path)
    assert main([str(path)]) == 2
    line = _error_line(capsys)
    assert expected in line, line


def test_missing_output_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path / "model.onnx")
    assert main([str(source), "-o", str(tmp_path / "no" / "such" / "dir.onnx")]) == 2
    assert "does not exist" in _error_line(capsys)


@pytest.mark.parametrize("argv", [[], ["--frobnicate", "x.onnx"], ["a.onnx", "b.onnx", "c.onnx"]])
def test_bad_arguments_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in _error_line(capsys)


def test_module_entry_point_in_a_real_process(tmp_path: Path) -> None:
    """The same one-line error and exit status through ``python -m`` (no traceback from the runtime)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "fusion.rewrite", str(tmp_path / "missing.onnx")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    source = _write(tmp_path / "model.onnx")
    command = [sys.executable, "-m", "fusion.rewrite", str(source)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr
    assert "fused: 1" in result.stdout


def test_external_weights_are_not_read_when_output_stays_beside_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading, rewriting and saving next to the data file never reads the external weights."""
    import onnx_ir as ir

    from fusion.rewrite import load, rewrite_model, save

    source = _write_external(tmp_path / "model.onnx")

    def refuse_to_read(self: ir.ExternalTensor, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"external tensor {self.name} was read")

    monkeypatch.setattr(ir.ExternalTensor, "numpy", refuse_to_read)
    monkeypatch.setattr(ir.ExternalTensor, "tobytes", refuse_to_read)
    model, report = rewrite_model(load(source))
    assert report.fused == 1
    save(model, tmp_path / "model.fused.onnx")
    assert _external_locations(tmp_path / "model.fused.onnx") == {"model.onnx.weights"}


def test_verify_takes_real_inputs_and_dims(tmp_path: Path, capsys: pytest.CaptureFixture[str], library: str) -> None:
    import numpy as np

    source = _write(tmp_path / "model.onnx", ChainSpec(shape_as="dynamic", leading=("batch", "seq")))
    rng = np.random.default_rng(4)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, y=rng.standard_normal((2, 7, 64)).astype(np.float32), z=rng.standard_normal((2, 7, 64)))
    assert main([str(source), "--verify", "--inputs", str(inputs)]) == 0
    assert "verify (mambafuse library): PASS" in capsys.readouterr().out
    assert main([str(source), "--verify", "--dim", "seq=5", "--dim", "batch=3"]) == 0
    capsys.readouterr()
    np.savez(inputs, y=np.zeros((2, 7, 64), np.float32), z=np.zeros((2, 7, 48), np.float32))
    assert main([str(source), "--verify", "--inputs", str(inputs)]) == 2
    line = _error_line(capsys)
    assert "the original model rejects its inputs" in line and "--inputs FILE.npz" in line
    assert main([str(source), "--verify", "--inputs", str(tmp_path / "none.npz")]) == 2
    assert "does not exist" in _error_line(capsys)
    assert main([str(source), "--verify", "--dim", "seq"]) == 2
    assert "--dim expects NAME=SIZE" in _error_line(capsys)


def test_progress_on_a_terminal_and_quiet_in_a_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _write(tmp_path / "model.onnx")
    assert main([str(source), "--verify"]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: nothing but errors
    monkeypatch.setenv("MAMBAFUSE_PROGRESS", "1")  # as on a terminal
    assert main([str(source), "-o", str(tmp_path / "again.onnx"), "--verify"]) == 0
    err = capsys.readouterr().err
    assert "verifying" in err and err.endswith("\r\033[K")  # the line is erased before the summary


def test_verify_on_a_model_onnx_shape_inference_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], library: str
) -> None:
    """transformers' exporter with ORT fusions writes value_info that ONNX shape inference contradicts: the
    fused nodes' input types then come from what the model declares, and --verify still runs."""
    source = tmp_path / "model.onnx"
    shutil.copy(Path(__file__).parent / "fixtures" / "models" / "nemotron_h-transformers-ort-fp32-prefill.onnx", source)
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(onnx.load(source), strict_mode=False)
    assert main([str(source), "-o", str(tmp_path / "fused.onnx"), "--verify"]) == 0
    assert "verify (mambafuse library): PASS" in capsys.readouterr().out


def test_verify_checks_a_node_behind_the_broadcast_guard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The guard's Expand output is a new value: its type comes from the fused model itself."""
    model = build_chain(ChainSpec())
    y = next(v for v in model.graph.input if v.name == "y")
    y.type.tensor_type.shape.dim[-1].ClearField("dim_value")
    y.type.tensor_type.shape.dim[-1].dim_param = "width"
    del model.graph.value_info[:]
    source = tmp_path / "model.onnx"
    onnx.save(onnx.shape_inference.infer_shapes(model), source)
    assert main([str(source), "--verify", "--dim", "width=64"]) == 0
    assert "1 of 1 within their op's accuracy budget" in capsys.readouterr().out
