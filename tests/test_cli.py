"""The ``mambafuse`` console command (fusion/cli.py): dispatch, --version, one-line errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import onnx
import pytest

from fusion import cli

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "models" / "nemotron_h-dynamo-fp32-decode.onnx"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fusion", *args], capture_output=True, text=True, cwd=ROOT)


def test_version_is_the_package_metadata(library: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    result = _run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"mambafuse {project['version']}", f"custom-op library: {library}"]


def test_console_script_is_declared_and_installed() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"mambafuse": "fusion.cli:main"}
    script = Path(sys.executable).parent / "mambafuse"
    assert script.is_file(), f"{script} missing: reinstall the package (make build)"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("mambafuse ")


def test_rewrite_dispatches_to_fusion_rewrite(tmp_path: Path) -> None:
    output = tmp_path / "fused.onnx"
    result = _run("rewrite", str(FIXTURE), "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert "fused: 2, refused: 0" in result.stdout
    assert sum(node.op_type == "GatedGroupRMSNorm" for node in onnx.load(output).graph.node) == 2


def test_genai_dispatches_to_fusion_genai(tmp_path: Path) -> None:
    result = _run("genai", str(tmp_path / "no-such-folder"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.startswith("mambafuse genai: error:") and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_report_dispatches_to_fusion_report(tmp_path: Path) -> None:
    fused = tmp_path / "fused.onnx"
    shutil.copy(FIXTURE.with_name("nemotron_h-dynamo-fp32-prefill.onnx"), tmp_path / "model.onnx")
    assert cli.main(["rewrite", str(tmp_path / "model.onnx"), "-o", str(fused)]) == 0
    result = _run("report", str(tmp_path / "model.onnx"), str(fused), "--runs", "3", "--warmup", "1")
    assert result.returncode == 0, result.stderr
    assert "kernel dispatches per Run" in result.stdout


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["frobnicate"], 2, "mambafuse: error: unknown command 'frobnicate'"),
        ([], 2, "usage: mambafuse"),
        (["rewrite", "tests/no-such-model.onnx"], 2, "no such file"),
        (["rewrite", "--no-such-flag"], 2, "error:"),
        (["olive"], 2, "mambafuse olive: error: expected one CONFIG file, got 0 arguments"),
        (["olive", "a.json", "b.json"], 2, "mambafuse olive: error: expected one CONFIG file, got 2 arguments"),
    ],
)
def test_errors_are_one_line(args: list[str], status: int, message: str) -> None:
    result = _run(*args)
    assert result.returncode == status
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("rewrite", "report", "genai", "olive", "--version"))
    assert cli.main(["rewrite", "--help"]) == 0
    assert "--verify" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["rewrite", "report"])
def test_errors_name_the_console_command(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.onnx")
    argv = [command, missing] if command == "rewrite" else [command, missing, missing, "--quiet"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"mambafuse {command}: error:")
