"""The committed model fixtures: manifest, validity, chains, and ONNX Runtime CPU against torch.

Needs neither torch nor transformers: the torch model's outputs were stored in ``references.npz`` when
``python -m models.fixtures`` exported the fixtures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models.fixtures import FAMILY_FIXTURE_DIR, FIXTURE_DIR, family_fixture_jobs, fixture_jobs
from models.inspect_chains import inspect_model
from models.onnx_utils import check
from models.runtime import feeds, greedy_decode, load_manifest, load_references

MANIFEST = load_manifest()
REFERENCES = load_references()
FIXTURES = MANIFEST["fixtures"]
CPU_FIXTURES = [stem for stem, record in FIXTURES.items() if record["dtype"] != "bf16"]
DECODE_CPU_FIXTURES = [stem for stem in CPU_FIXTURES if FIXTURES[stem]["mode"] == "decode"]

#: Export vs torch on the same weights and inputs, relative to the largest |logit|. fp32: both sides
#: compute in fp32 with different op orders and reductions (seen: <= 5e-7). fp16: torch CPU runs fp16
#: matmuls with fp32 accumulation and ORT CPU casts fp16 MatMuls to fp32, so intermediates round at
#: different points; seen <= 1e-3, i.e. about two fp16 ulps of the largest logit.
TORCH_TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3}

#: The fixture set is committed to the repository; keep it small.
FIXTURE_BUDGET_BYTES = 8_500_000


def _path(stem: str) -> Path:
    return FIXTURE_DIR / FIXTURES[stem]["file"]


#: Both committed export sets: (directory, the manifest, the jobs that made it).
FIXTURE_SETS = {
    "models": (FIXTURE_DIR, MANIFEST, fixture_jobs),
    "families": (FAMILY_FIXTURE_DIR, load_manifest(FAMILY_FIXTURE_DIR), family_fixture_jobs),
}


@pytest.mark.parametrize("fixture_set", sorted(FIXTURE_SETS))
def test_manifest_lists_exactly_the_files(fixture_set: str) -> None:
    directory, manifest, _ = FIXTURE_SETS[fixture_set]
    on_disk = {p.name for p in directory.glob("*.onnx")}
    listed = {record["file"] for record in manifest["fixtures"].values()}
    assert on_disk == listed, f"not in manifest: {sorted(on_disk - listed)}; missing: {sorted(listed - on_disk)}"


@pytest.mark.parametrize("fixture_set", sorted(FIXTURE_SETS))
def test_every_combination_is_exported_or_its_failure_recorded(fixture_set: str) -> None:
    _, manifest, jobs = FIXTURE_SETS[fixture_set]
    expected = {job["stem"] for job in jobs()}
    accounted = set(manifest["fixtures"]) | set(manifest["failures"])
    assert accounted == expected, (
        f"unaccounted: {sorted(expected - accounted)}; unknown: {sorted(accounted - expected)}"
    )
    assert not set(manifest["fixtures"]) & set(manifest["failures"])
    for stem, failure in manifest["failures"].items():
        assert failure["error"].strip(), f"{stem}: failure recorded without its error"


def test_fixture_set_fits_the_budget() -> None:
    total = sum(p.stat().st_size for p in FIXTURE_DIR.iterdir() if p.is_file())
    assert total <= FIXTURE_BUDGET_BYTES, f"fixtures take {total / 1e6:.2f} MB > {FIXTURE_BUDGET_BYTES / 1e6} MB"


def assert_model_as_recorded(model: onnx.ModelProto, record: dict, step_inputs: set[str]) -> None:
    """The model passes onnx.checker or with the recorded objection only (ORT-only ops in the default
    domain, written by transformers' ort_fusions; see models.onnx_utils.check), its inputs, outputs and
    opset are the manifest's, and a decode graph feeds every cache input back: its other inputs are
    ``step_inputs``."""
    assert check(model) == record["checker"]
    assert [i.name for i in model.graph.input] == [i["name"] for i in record["inputs"]]
    assert [o.name for o in model.graph.output] == [o["name"] for o in record["outputs"]]
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == record["opset"]
    if record["mode"] == "decode":
        inputs = {i["name"] for i in record["inputs"]}
        assert record["cache_map"], f"{record['file']}: decode graph without a cache map"
        assert set(record["cache_map"].values()) <= inputs
        assert inputs - set(record["cache_map"].values()) == step_inputs


@pytest.mark.parametrize("stem", sorted(FIXTURES))
def test_fixture_is_valid_and_described(stem: str) -> None:
    record = FIXTURES[stem]
    # The step inputs: the token, its position (and the cache).
    assert_model_as_recorded(onnx.load(_path(stem)), record, {"input_ids", "position_ids"})
    for key in ("torch", "transformers", "onnx"):
        assert record["versions"][key], f"{stem}: no {key} version recorded"
    if record["mode"] == "decode":
        assert set(record["cache_map"]) <= {o["name"] for o in record["outputs"]}


@pytest.mark.parametrize("stem", sorted(FIXTURES))
def test_fixture_has_one_chain_per_mamba_layer(stem: str) -> None:
    record = FIXTURES[stem]
    report = inspect_model(_path(stem))
    assert len(report.chains) == record["num_mamba_layers"], (
        f"{stem}: {len(report.chains)} chains for {record['num_mamba_layers']} Mamba layers"
    )
    assert all("?" not in chain.form for chain in report.chains), f"{stem}: uncatalogued form {report.forms()}"
    assert report.forms() == record["chains"]["forms"], f"{stem}: forms {report.forms()} != manifest"


@pytest.mark.parametrize("stem", sorted(CPU_FIXTURES))
def test_fixture_runs_on_cpu_like_torch(stem: str) -> None:
    record, refs = FIXTURES[stem], REFERENCES[stem]
    session = ort.InferenceSession(str(_path(stem)), providers=["CPUExecutionProvider"])
    first_output = record["outputs"][0]["name"]
    actual = session.run([first_output], feeds(record, refs))[0].astype(np.float32)
    expected = refs[f"output/{first_output}"].astype(np.float32)
    assert actual.shape == expected.shape
    scale = float(np.abs(expected).max())
    error = float(np.abs(actual - expected).max())
    assert error <= TORCH_TOLERANCE[record["dtype"]] * scale, (
        f"{stem}: max |ORT - torch| = {error:.3g} (relative to max |{first_output}| {error / scale:.3g}); "
        f"allowed {TORCH_TOLERANCE[record['dtype']]}"
    )


@pytest.mark.parametrize("stem", sorted(DECODE_CPU_FIXTURES))
def test_decode_fixture_generates_like_torch(stem: str) -> None:
    record, refs = FIXTURES[stem], REFERENCES[stem]
    session = ort.InferenceSession(str(_path(stem)), providers=["CPUExecutionProvider"])
    tokens = greedy_decode(session, record, refs)
    assert tokens == refs["greedy_tokens"].tolist(), f"{stem}: ORT {tokens} != torch {refs['greedy_tokens'].tolist()}"


def test_bf16_fixtures_are_counted_not_run() -> None:
    # ORT's CPU provider has no bf16 Conv / Softplus / MatMul (README.md, Platforms): these fixtures are checked
    # for chains only (test_fixture_has_one_chain_per_mamba_layer), and run on CUDA elsewhere.
    bf16 = [stem for stem, record in FIXTURES.items() if record["dtype"] == "bf16"]
    assert bf16, "no bf16 fixture exported"


def _runs_at(path: Path, length: int) -> bool:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = (np.arange(length, dtype=np.int64) % 50).reshape(1, length)
    try:
        session.run(None, {i.name: ids for i in session.get_inputs()})
    except Exception as error:  # onnxruntime raises its own classes
        assert "Expand" in str(error), error
        return False
    return True


@pytest.mark.parametrize("family", ["nemotron_h", "zamba2"])
def test_transformers_prefill_runs_one_chunk_only(family: str) -> None:
    """models/README.md, exporter failure 6: transformers' exporter bakes the traced chunk count into the prefill
    graph (an Expand to a constant mask shape). Traced from 8 tokens, one chunk of 16: runs at 16 tokens, fails at
    17. The dynamo export of the same model runs at any length. If a new transformers lifts the limit, this
    fails and the README's note goes."""
    transformers_prefill = FIXTURE_DIR / FIXTURES[f"{family}-transformers-fp32-prefill"]["file"]
    assert _runs_at(transformers_prefill, 16)
    assert not _runs_at(transformers_prefill, 17)
    dynamo_prefill = FIXTURE_DIR / FIXTURES[f"{family}-dynamo-fp32-prefill"]["file"]
    assert _runs_at(dynamo_prefill, 17) and _runs_at(dynamo_prefill, 40)
