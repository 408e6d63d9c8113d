"""Edges of the command line a new user meets: report rows that agree, `| head`, `mambafuse olive`'s
checks and help, `rewrite --help`, FusionLog's repr, the mobius wrapper offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from onnxscript import rewriter

from fusion import report
from fusion.rewrite import rewrite_model
from fusion.rules import rewrite_rules
from models import mobius

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "models"
PREFILL = FIXTURES / "nemotron_h-dynamo-fp32-prefill.onnx"


def _cli(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fusion", *args], capture_output=True, text=True, cwd=ROOT, timeout=600, **kwargs
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("pair")
    fused, result = rewrite_model(onnx.load(PREFILL))
    assert result.fused > 0
    onnx.save(fused, folder / "fused.onnx")
    return PREFILL, folder / "fused.onnx"


# --- 3. report rows that agree --------------------------------------------------------------------------------


def test_report_has_no_profiler_time_row_and_its_json_matches(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """The profiler's kernel durations include its own per-node bookkeeping (sums several times the
    unprofiled latency); neither the table nor the JSON shows them as time."""
    before, after = pair
    out = tmp_path / "r.json"
    result = _cli("report", str(before), str(after), "--runs", "3", "--warmup", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "kernel time" not in result.stdout
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert rows, result.stdout
    data = json.loads(out.read_text())
    for side in ("before", "after"):
        cpu = data[side]["by_provider"]["CPUExecutionProvider"]
        assert not [key for key in cpu if key.startswith("kernel_us")]
        assert cpu["kernels_per_run"] == data[side]["kernels_per_run"]["CPUExecutionProvider"] > 0
        assert cpu["latency_us"] == data[side]["latency_us"]


def test_report_profiler_durations_exceed_the_latency(pair: tuple[Path, Path]) -> None:
    """Why the row went: measured here, the profiled kernel durations of one Run add up to more than
    the unprofiled Run takes, so a row of them contradicts the latency rows."""
    before, _ = pair
    result = report.measure(before, before, runs=20, warmup=5)
    cpu = result.before["CPUExecutionProvider"]
    assert cpu.kernel_us_per_run > 0 and cpu.latency_us["median"] > 0
    assert "kernel_us_per_run" not in cpu.to_json()


# --- 5. | head, olive, --help, repr -------------------------------------------------------------------------


def _closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``mambafuse ARGS`` with a stdout whose reader has gone (as ``| head`` leaves it)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "fusion", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            timeout=600,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("command", ["report", "rewrite"])
def test_closed_stdout_is_not_an_error(command: str, pair: tuple[Path, Path], tmp_path: Path) -> None:
    before, after = pair
    args = {
        "report": ["report", str(before), str(after), "--runs", "2", "--warmup", "1"],
        "rewrite": ["rewrite", str(before), "-o", str(tmp_path / "out.onnx")],
    }[command]
    result = _closed_stdout(*args)
    assert result.returncode == 141, result.stderr
    assert result.stderr == "", "nothing on stderr: the reader left, no error of ours"


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["optimize", "--help"], ["rewrite", "--help"]])
def test_closed_stdout_on_usage_and_version(args: list[str]) -> None:
    """`mambafuse --help | head -1`: the usage, --version and the commands' help end quietly too (the usage
    printed outside the subcommands' guard left a BrokenPipeError traceback)."""
    result = _closed_stdout(*args)
    assert result.returncode in (0, 141), result.stderr
    assert "Traceback" not in result.stderr and "Error" not in result.stderr, result.stderr


def test_report_on_huge_dims_is_one_line(pair: tuple[Path, Path]) -> None:
    before, after = pair
    result = _cli("report", str(before), str(after), "--dim", "seq=100000000000")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "choose smaller --dim sizes" in lines[0] and "MemoryError" not in lines[0]


def test_olive_checks_arguments_before_importing_olive(tmp_path: Path) -> None:
    probe = (
        "import sys; from fusion import cli; "
        f"code = cli.main(['olive', {str(tmp_path / 'missing.json')!r}]); "
        "print(code, 'olive' in sys.modules, 'fusion.olive' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.stdout.split() == ["2", "False", "False"], result.stderr
    assert result.stderr.strip() == f"mambafuse olive: error: {tmp_path / 'missing.json'}: no such file (see --help)"


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.json", "no such file"),
        ("{not json", "bad.json", "not valid JSON (line 1"),
        ("[1, 2]", "list.json", "is a JSON object, not list"),
        ("{}", "config.txt", "Olive reads .json, .yaml and .yml configs"),
    ],
)
@pytest.mark.parametrize("prog", ["mambafuse olive", "python -m fusion.olive"])
def test_olive_config_errors_are_one_line(
    prog: str, content: str | None, name: str, message: str, tmp_path: Path
) -> None:
    config = tmp_path / name
    if content is not None:
        config.write_text(content)
    command = ["-m", "fusion", "olive"] if prog == "mambafuse olive" else ["-m", "fusion.olive"]
    result = subprocess.run(
        [sys.executable, *command, str(config)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and message in lines[0], result.stderr


def test_olive_help_says_what_it_does() -> None:
    result = _cli("olive", "--help")
    assert result.returncode == 0
    assert len(result.stdout.splitlines()) > 5
    assert all(word in result.stdout for word in ("MambafuseGatedGroupRMSNorm", "GraphSurgeries", "exit status"))


@pytest.mark.parametrize("command", ["rewrite", "report"])
def test_help_documents_defaults_exit_statuses_and_progress(command: str) -> None:
    result = _cli(command, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for phrase in ("exit status", "MAMBAFUSE_PROGRESS", "8 for a past/cache length", "past_seq_len + seq_len", "141"):
        assert phrase in text, phrase


def test_fusion_log_repr_says_what_happened() -> None:
    """What an onnxscript user sees of the rule set's log (README, "With onnxscript's rewriter")."""
    model = ir.from_proto(onnx.load(PREFILL))
    rules = rewrite_rules()
    rewriter.RewritePass(rules)(model)
    text = repr(rules.log)
    fused = sum(record.fused for record in rules.log.chains.values())
    assert fused > 0
    assert text.startswith(f"FusionLog({fused} fused, {len(rules.log.chains) - fused} refused: [")
    assert all(record.location in text for record in rules.log.chains.values())
    assert "Node(" not in text and len(text) < 200 * len(rules.log.chains)


def test_mobius_wrapper_is_offline_for_local_folders(tmp_path: Path) -> None:
    assert mobius._local_model(["build", "--model", str(tmp_path), "out"])
    assert mobius._local_model(["build", f"--model={tmp_path}", "out"])
    assert not mobius._local_model(["build", "--model", "nvidia/Nemotron-H-8B-Base-8K", "out"])
    assert not mobius._local_model(["build", "out"])
