"""Every fusion on tiny exports made now, with the transformers this environment installed.

The committed fixtures are the graphs of the transformers versions they were exported with (5.24, 5.25). A
new transformers release can write the Mamba-2 mixer differently and lose a fusion while every fixture test
stays green: this test exports every family again (torch dynamo, decode step and prefill, fp32) with the
installed transformers on every run and requires every Mamba-2 layer to get every op it should, with the
fused model computing what the export computes (stock ONNX Runtime through the functions, and the library).
The ``models`` extra of pyproject.toml bounds transformers to the versions this has passed with; widening
that bound is a one-line change that this test then checks.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusion import rewrite
from models.build import FAMILIES
from models.runtime import feeds
from tests.test_decode_step_rules import TOLERANCE, _library_has_decode_ops, _run, scaled_error

ROOT = Path(__file__).resolve().parent.parent
MODES = ("decode", "prefill")
#: Families whose gate multiplies after the norm (``norm_before_gate``): another op, refused with that reason.
NORM_AFTER_GATE = ("falcon_h1_nbg",)
JOBS = [
    dict(stem=f"{family}-dynamo-fp32-{mode}", family=family, exporter="dynamo", opset=18, dtype="fp32", mode=mode)
    for family in FAMILIES
    for mode in MODES
]


def _export(job: dict, workdir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "models.fixtures", "--one", json.dumps(job), "--workdir", str(workdir)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, dict]:
    """Export every job (two at a time, a subprocess each); per stem the manifest record, or the error."""
    pytest.importorskip("transformers", reason="the models extra is not installed")
    workdir = tmp_path_factory.mktemp("installed-transformers")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = dict(zip([job["stem"] for job in JOBS], pool.map(lambda job: _export(job, workdir), JOBS), strict=True))
    results = {}
    for stem, run in runs.items():
        result_path = workdir / f"{stem}.json"
        if not result_path.exists():
            results[stem] = {"error": f"exit {run.returncode}: {run.stderr[-2000:]}"}
            continue
        result = json.loads(result_path.read_text())
        if "record" in result:
            result["path"] = str(workdir / result["record"]["file"])
            result["references"] = str(workdir / f"{stem}.npz")
        results[stem] = result
    return results


def test_the_installed_transformers_is_in_the_tested_range() -> None:
    transformers = pytest.importorskip("transformers", reason="the models extra is not installed")
    import tomllib

    from packaging.specifiers import SpecifierSet

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    requirement = next(r for r in extra if r.startswith("transformers"))
    assert transformers.__version__ in SpecifierSet(requirement.removeprefix("transformers")), requirement


@pytest.mark.parametrize("stem", [job["stem"] for job in JOBS])
def test_every_mamba_layer_gets_every_op(exports: dict, stem: str) -> None:
    result = exports[stem]
    assert "record" in result, f"the export failed: {result.get('error')}"
    record = result["record"]
    fused, report = rewrite.rewrite_model(onnx.load(result["path"]))
    layers = record["num_mamba_layers"]
    norms = 0 if record["family"] in NORM_AFTER_GATE else layers
    steps = layers if record["mode"] == "decode" else 0
    counts = {
        op: sum(1 for n in fused.graph.node if n.op_type == op)
        for op in ("GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate")
    }
    assert counts == {"GatedGroupRMSNorm": norms, "CausalConv1dUpdate": steps, "SelectiveStateUpdate": steps}, (
        f"transformers {record['versions']['transformers']}:\n{report.summary()}"
    )
    original = onnx.load(result["path"])
    with np.load(result["references"]) as refs:
        inputs = feeds(record, {k: refs[k] for k in refs.files})
    expected = _run(original, inputs)
    variants = [False] + ([] if _library_has_decode_ops() else [True])
    for library in variants:
        actual = _run(fused, inputs, library)
        for output, a, e in zip([o.name for o in original.graph.output], actual, expected, strict=True):
            error, floor = scaled_error(a, e)
            assert error <= TOLERANCE["fp32"] + floor, f"{output} ({'library' if library else 'function'}): {error:.3g}"
