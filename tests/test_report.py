"""fusion/report.py: counts on graphs whose answer is known by construction, schema, plot, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusion import report
from fusion._chains import ChainSpec, build_chain, build_chain_sequence
from fusion.rewrite import rewrite_model

K_CHAINS = 4
EXTRA_NODES = K_CHAINS - 1  # one Relu between consecutive chains


def k_chain_model(k: int = K_CHAINS, spec: ChainSpec | None = None) -> tuple[onnx.ModelProto, int]:
    """Return (model, nodes per chain): k copies of one chain in sequence, a Relu between two chains."""
    spec = spec or ChainSpec(channels=64, group_size=16, leading=(1,))
    per_chain = sum(1 for n in build_chain(spec).graph.node if n.op_type != "Identity")
    return build_chain_sequence(spec, k, between="Relu"), per_chain


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    model, per_chain = k_chain_model()
    fused, rewrite_report = rewrite_model(model)
    assert rewrite_report.fused == K_CHAINS
    folder = tmp_path_factory.mktemp("report")
    before, after = folder / "before.onnx", folder / "after.onnx"
    onnx.save(model, before)
    onnx.save(fused, after)
    return before, after, per_chain


def test_counts_known_by_construction(pair: tuple[Path, Path, int]) -> None:
    before, after, per_chain = pair
    result = report.measure(before, after, runs=5, warmup=1, optimization_level="disable")
    assert result.before_nodes == K_CHAINS * per_chain + EXTRA_NODES
    assert result.after_nodes == K_CHAINS + EXTRA_NODES
    assert result.fused_nodes == K_CHAINS
    assert result.chain_nodes == K_CHAINS * per_chain
    cpu_before, cpu_after = result.before["CPUExecutionProvider"], result.after["CPUExecutionProvider"]
    # Without ORT's optimizations every node is one kernel dispatch per Run.
    assert cpu_before.kernels_per_run == result.before_nodes
    assert cpu_after.kernels_per_run == result.after_nodes
    assert cpu_after.kernels_by_op == {"GatedGroupRMSNorm": K_CHAINS, "Relu": EXTRA_NODES}
    assert cpu_before.partitions == cpu_after.partitions == 1
    assert result.max_abs_error < 1e-4


def test_profiled_dispatches_equal_the_optimized_graph(pair: tuple[Path, Path, int]) -> None:
    before, after, _ = pair
    result = report.measure(before, after, runs=5, warmup=1, optimization_level="all")
    for side in (result.before, result.after):
        cpu = side["CPUExecutionProvider"]
        assert cpu.kernels_per_run == cpu.optimized_nodes
        assert cpu.memcpy_nodes == 0
    assert result.after["CPUExecutionProvider"].kernels_by_op["GatedGroupRMSNorm"] == K_CHAINS


def test_json_schema_is_stable(pair: tuple[Path, Path, int], tmp_path: Path) -> None:
    before, after, _ = pair
    out = tmp_path / "r.json"
    code = report.main([str(before), str(after), "--runs", "3", "--warmup", "1", "--json", str(out), "--quiet"])
    assert code == 0
    data = json.loads(out.read_text())
    for side in ("before", "after"):
        assert isinstance(data[side]["nodes"], int)
        assert isinstance(data[side]["kernels_per_run"]["CPUExecutionProvider"], int)
        assert set(data[side]["latency_us"]) >= {"median", "p90"}
        assert all(isinstance(v, float) for v in data[side]["latency_us"].values())
    assert data["fused_nodes"] == K_CHAINS
    assert isinstance(data["max_abs_error"], float)
    assert {"cpu", "intra_op_threads", "onnxruntime", "available_providers"} <= set(data["environment"])


def test_plot_is_a_png(pair: tuple[Path, Path, int], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] dependency")
    before, after, _ = pair
    out = tmp_path / "r.png"
    assert report.main([str(before), str(after), "--runs", "3", "--warmup", "1", "--plot", str(out), "--quiet"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


def test_table_has_units_and_changes(pair: tuple[Path, Path, int]) -> None:
    before, after, _ = pair
    text = report.measure(before, after, runs=3, warmup=1).table()
    assert "kernel dispatches per Run" in text
    assert " us" in text and "%" in text and "speedup" in text


def test_inputs_bind_symbolic_dims() -> None:
    model, _ = k_chain_model(2, ChainSpec(channels=64, group_size=16, leading=("batch", "seq"), shape_as="dynamic"))
    feeds = report.make_inputs(model, {"seq": 5})
    assert {a.shape for a in feeds.values()} == {(1, 5, 64)}
    assert all(a.dtype == np.float32 for a in feeds.values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}", "{after}"], "does not exist"),
        (["{garbage}", "{after}"], "not a readable ONNX model"),
        (["{before}", "{after}", "--runs", "0"], "--runs must be >= 1"),
        (["{before}", "{after}", "--providers", "NoSuchExecutionProvider"], "is not available"),
        (["{before}", "{after}", "--dim", "batch"], "--dim expects NAME=SIZE"),
        (["{before}", "{after}", "--threads", "0"], "--threads must be >= 1"),
    ],
)
def test_bad_arguments_give_one_clear_line(
    pair: tuple[Path, Path, int], tmp_path: Path, args: list[str], message: str
) -> None:
    before, after, _ = pair
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not an onnx model at all")
    paths = {"before": before, "after": after, "missing": tmp_path / "missing.onnx", "garbage": garbage}
    argv = [a.format(**paths) for a in args] + [
        "--quiet",
        "--runs" if "--runs" not in args else "--warmup",
        "2",
    ]
    proc = subprocess.run([sys.executable, "-m", "fusion.report", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_rewrite_cli_report_and_verify(tmp_path: Path) -> None:
    model, _ = k_chain_model(3)
    source = tmp_path / "model.onnx"
    onnx.save(model, source)
    out_json = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fusion.rewrite", str(source), "--verify", "--report", "--runs", "3"]
        + ["--report-json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "fused nodes vs float64 reference on their real inputs: 3 of 3 within their op's accuracy budget" in proc.stdout
    )
    assert "kernel dispatches per Run" in proc.stdout
    data = json.loads(out_json.read_text())
    assert data["fused_nodes"] == 3
    assert (
        data["after"]["kernels_per_run"]["CPUExecutionProvider"]
        < data["before"]["kernels_per_run"]["CPUExecutionProvider"]
    )
