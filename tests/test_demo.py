"""``make demo`` (python -m fusion.demo) as a user runs it: the bundled model optimized, verified and reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent


def test_demo_optimizes_verifies_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "demo"  # outside the repository: the paths it prints must not assume otherwise
    result = subprocess.run(
        [sys.executable, "-m", "fusion.demo", "--out", str(out), "--runs", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "verify (mambafuse library): PASS" in result.stdout
    optimized = onnx.load(out / "nemotron_h-dynamo-fp32-decode.optimized.onnx")
    fused = {node.op_type for node in optimized.graph.node if node.domain == "ai.mambafuse"}
    assert fused == {"GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate", "SquaredRelu"}
    report = json.loads((out / "report.json").read_text())
    assert report["fused_by_op"] == {
        "GatedGroupRMSNorm": 2,
        "CausalConv1dUpdate": 2,
        "SelectiveStateUpdate": 2,
        "SquaredRelu": 1,
    }
    assert report["after"]["nodes"] == len(optimized.graph.node) < report["before"]["nodes"]
    assert f"results in {out}/" in result.stdout
