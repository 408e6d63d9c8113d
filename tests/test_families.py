"""The Mamba-2 families beyond Nemotron-H and Zamba2: Mamba2, Bamba, GraniteMoeHybrid, Falcon-H1 (both norm orders).

Fixtures: ``tests/fixtures/models/families/`` (``python -m models.fixtures --set families``), a
representative subset of exporter × dtype × mode per family, each record with ``expected_fused`` (every
Mamba layer's chain for a gate-before-norm norm, none for norm-before-gate) and ``expected_refusal``.

- the set: manifest ↔ files, every combination exported or its exact error recorded, size budget;
- each fixture: valid, described, its chains (``models.inspect_chains``) the manifest's, ONNX Runtime CPU
  against the torch references stored by the generator, decode greedy tokens against torch's;
- the rewriter: fused == ``expected_fused``; norm-before-gate chains refused with that reason, one per
  Mamba layer; the fused graph, with and without the mambafuse library, against the original and against
  torch; decode: the same greedy tokens as torch (Falcon-H1 gate-before-norm, form J:
  ``tests/test_families_falcon_h1.py``, with the same checks);
- ``models/README.md``'s families table is ``models.fixtures.families_table()``.
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import contrib_ops
from fusion import rewrite
from models.fixtures import (
    FAMILY_FIXTURE_DIR,
    NORM_MODULE_DIR,
    NORM_MODULES,
    families_table,
    family_fixture_jobs,
)
from models.inspect_chains import inspect_model
from models.runtime import feeds, greedy_decode, load_manifest, load_references
from tests.test_models_fixtures import assert_model_as_recorded

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = load_manifest(FAMILY_FIXTURE_DIR)
REFERENCES = load_references(FAMILY_FIXTURE_DIR)
FIXTURES = MANIFEST["fixtures"]
OP_TYPE, DOMAIN = "GatedGroupRMSNorm", "ai.mambafuse"

#: The families whose fusion is tested here; Falcon-H1 gate-before-norm's in tests/test_families_falcon_h1.py.
FUSION_FAMILIES = ("mamba2", "bamba", "granitemoehybrid", "falcon_h1_nbg")

#: The same tolerances as the Nemotron-H / Zamba2 fixtures (tests/test_models_fixtures.py,
#: tests/test_models_fusion.py; the reasons are written there): ORT vs torch, fused vs original.
TORCH_TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3}
FUSED_TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3}

#: All new fixtures together: well under 4 MB.
FAMILY_BUDGET_BYTES = 4_000_000

#: The refusal reason of a norm-before-gate chain, as the rewriter prints it (docs/forms.md).
REFUSAL_TEXT = {"norm_before_gate": "the gate is applied after the norm"}


def _stems(families: tuple[str, ...] | None = None, *, cpu: bool = False, decode: bool = False) -> list[str]:
    return sorted(
        stem
        for stem, record in FIXTURES.items()
        if (families is None or record["family"] in families)
        and (not cpu or record["dtype"] != "bf16")
        and (not decode or record["mode"] == "decode")
    )


def _path(stem: str) -> Path:
    return FAMILY_FIXTURE_DIR / FIXTURES[stem]["file"]


# --- the set ------------------------------------------------------------------------------------------


# The files vs the manifest and the recorded export failures: tests/test_models_fixtures.py, for both sets.


def test_every_family_has_an_export_of_each_exporter() -> None:
    """Where the whole model fails to export (TorchScript), the mixer alone is exported instead."""
    for family in {job["family"] for job in family_fixture_jobs()}:
        exported = {r["exporter"] for r in FIXTURES.values() if r["family"] == family}
        assert {"dynamo", "transformers"} <= exported, f"{family}: {sorted(exported)}"
        assert exported & {"torchscript", "torchscript-model"}, f"{family}: no TorchScript export"
        failed = {f["exporter"] for f in MANIFEST["failures"].values() if f["family"] == family}
        assert failed <= {"torchscript-model"}, f"{family}: unexpected exporter failures {sorted(failed)}"
        if failed:
            assert "torchscript" in exported, f"{family}: TorchScript whole model failed and no mixer export"


def test_fixture_set_fits_the_budget() -> None:
    total = sum(p.stat().st_size for p in FAMILY_FIXTURE_DIR.rglob("*") if p.is_file())
    assert total <= FAMILY_BUDGET_BYTES, f"family fixtures take {total / 1e6:.2f} MB > {FAMILY_BUDGET_BYTES / 1e6} MB"


# --- each fixture -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stem", _stems())
def test_fixture_is_valid_and_described(stem: str) -> None:
    record = FIXTURES[stem]
    # The step inputs of a decode graph: the token and (not for Mamba2) its position.
    steps = {"input_ids"} if record["family"] == "mamba2" else {"input_ids", "position_ids"}
    assert_model_as_recorded(onnx.load(_path(stem)), record, steps)
    layers = record["num_mamba_layers"]
    if record["norm_order"] == "gate_before_norm":
        assert (record["expected_fused"], record["expected_refusal"]) == (layers, None)
    else:
        assert (record["expected_fused"], record["expected_refusal"]) == (0, "norm_before_gate")


@pytest.mark.parametrize("stem", _stems())
def test_fixture_chains_are_the_manifests(stem: str) -> None:
    record = FIXTURES[stem]
    report = inspect_model(_path(stem))
    # A norm-before-gate norm is not this chain: inspect_chains finds none (the rewriter refuses it, below).
    expected = record["num_mamba_layers"] if record["norm_order"] == "gate_before_norm" else 0
    assert len(report.chains) == expected, f"{stem}: {len(report.chains)} chains, expected {expected}"
    assert all("?" not in chain.form for chain in report.chains), f"{stem}: uncatalogued form {report.forms()}"
    assert report.forms() == record["chains"]["forms"], f"{stem}: forms {report.forms()} != manifest"
    if record["family"] == "falcon_h1":
        assert set(report.forms()) == {"J"}, f"{stem}: Falcon-H1's weight is not inside the grouped view"


def _relative_error(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    assert a.shape == e.shape, f"{a.shape} vs {e.shape}"
    scale = max(float(np.abs(e).max()), float(np.finfo(np.float32).tiny))
    return float(np.abs(a - e).max()), scale


@pytest.mark.parametrize("stem", _stems(cpu=True))
def test_fixture_runs_on_cpu_like_torch(stem: str) -> None:
    record, refs = FIXTURES[stem], REFERENCES[stem]
    session = ort.InferenceSession(str(_path(stem)), providers=["CPUExecutionProvider"])
    first = record["outputs"][0]["name"]
    error, scale = _relative_error(session.run([first], feeds(record, refs))[0], refs[f"output/{first}"])
    tolerance = TORCH_TOLERANCE[record["dtype"]]
    assert error <= tolerance * scale, (
        f"{stem}: max |ORT - torch| {error:.3g} = {error / scale:.3g} of max > {tolerance}"
    )


@pytest.mark.parametrize("stem", _stems(cpu=True, decode=True))
def test_decode_fixture_generates_like_torch(stem: str) -> None:
    record, refs = FIXTURES[stem], REFERENCES[stem]
    session = ort.InferenceSession(str(_path(stem)), providers=["CPUExecutionProvider"])
    tokens = greedy_decode(session, record, refs)
    assert tokens == refs["greedy_tokens"].tolist(), f"{stem}: ORT {tokens} != torch {refs['greedy_tokens'].tolist()}"


# --- the rewriter -------------------------------------------------------------------------------------


@cache
def _original(stem: str) -> onnx.ModelProto:
    return onnx.load(_path(stem))


@cache
def _fused(stem: str) -> tuple[onnx.ModelProto, object]:
    return rewrite.rewrite_model(_original(stem))


def _session(stem: str, use_library: bool | None) -> ort.InferenceSession:
    if use_library is None:
        return ort.InferenceSession(_original(stem).SerializeToString(), providers=["CPUExecutionProvider"])
    return contrib_ops.session(_fused(stem)[0], use_library=use_library)


def check_fusion_count(stem: str) -> None:
    """Fused == expected_fused; the other chains refused with the expected reason, one per Mamba layer."""
    record = FIXTURES[stem]
    fused, report = _fused(stem)
    nodes = [n for n in fused.graph.node if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]
    assert report.fused == record["expected_fused"] == len(nodes), (
        f"{stem}: fused {report.fused} ({len(nodes)} nodes), expected {record['expected_fused']}; "
        f"refused {report.refused}"
    )
    if record["expected_refusal"] is None:
        assert not report.refused, f"{stem}: refused {report.refused}"
        assert inspect_model(fused).chains == [], f"{stem}: a chain is still there after fusion"
        before, after = (Counter(n.op_type for n in m.graph.node) for m in (_original(stem), fused))
        assert before["ReduceMean"] - after["ReduceMean"] == record["expected_fused"]
    else:
        reasons = [reason for _, reason in report.refused]
        text = REFUSAL_TEXT[record["expected_refusal"]]
        assert len(reasons) == record["num_mamba_layers"], f"{stem}: refused {reasons}"
        assert all(text in reason for reason in reasons), f"{stem}: {reasons} do not say {text!r}"
        # the norm rules leave the graph as it was (the decode-step ops, fused in decode graphs, aside)
        norm_only, _ = rewrite.rewrite_model(_original(stem), decode_steps=False)
        assert Counter(n.op_type for n in norm_only.graph.node) == Counter(
            n.op_type for n in _original(stem).graph.node
        )


def check_fused_outputs(stem: str, use_library: bool) -> None:
    """The fused graph against the original graph (FUSED_TOLERANCE) and against torch (TORCH_TOLERANCE)."""
    record, refs = FIXTURES[stem], REFERENCES[stem]
    step = feeds(record, refs)
    expected = _session(stem, None).run(None, step)
    actual = _session(stem, use_library).run(None, step)
    for spec, a, e in zip(record["outputs"], actual, expected, strict=True):
        assert a.dtype == e.dtype, f"{stem} {spec['name']}: {a.dtype} vs {e.dtype}"
        error, scale = _relative_error(a, e)
        tolerance = FUSED_TOLERANCE[record["dtype"]]
        # plus one step of a's type at the bottom of its range: these tiny models' fp16 recurrent states are ~1e-5,
        # near the subnormals, where the library's state update may round one step (6e-8) away from the graph's
        assert error <= tolerance * scale + float(np.finfo(a.dtype).smallest_subnormal), (
            f"{stem} {spec['name']} (library {use_library}): max |fused - original| {error:.3g} = "
            f"{error / scale:.3g} of max > {tolerance}"
        )
    first = record["outputs"][0]["name"]
    error, scale = _relative_error(actual[0], refs[f"output/{first}"])
    tolerance = TORCH_TOLERANCE[record["dtype"]]
    assert error <= tolerance * scale, f"{stem}: max |fused - torch| {error:.3g} = {error / scale:.3g} of max"


def check_fused_tokens(stem: str, use_library: bool) -> None:
    """A fused decode graph generates torch's 16 greedy tokens."""
    record, refs = FIXTURES[stem], REFERENCES[stem]
    tokens = greedy_decode(_session(stem, use_library), record, refs)
    assert tokens == refs["greedy_tokens"].tolist(), f"{stem}: fused {tokens} != torch {refs['greedy_tokens'].tolist()}"


@pytest.mark.parametrize("stem", _stems(FUSION_FAMILIES))
def test_rewrite_fuses_the_expected_chains(stem: str) -> None:
    check_fusion_count(stem)


@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
@pytest.mark.parametrize("stem", _stems(FUSION_FAMILIES, cpu=True))
def test_fused_matches_original_and_torch(stem: str, use_library: bool, library: str) -> None:
    check_fused_outputs(stem, use_library)


@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
@pytest.mark.parametrize("stem", _stems(FUSION_FAMILIES, cpu=True, decode=True))
def test_fused_decode_generates_torchs_tokens(stem: str, use_library: bool, library: str) -> None:
    check_fused_tokens(stem, use_library)


# --- norm-before-gate norms of the families not exported whole (Qwen3-Next, Qwen3.5, Kimi Linear) ------


def test_norm_module_files_are_the_generators() -> None:
    assert {p.stem for p in NORM_MODULE_DIR.glob("*.onnx")} == set(NORM_MODULES)


@pytest.mark.parametrize("name", sorted(NORM_MODULES))
def test_norm_before_gate_module_is_left_alone(name: str) -> None:
    """A per-head norm-before-gate norm has no group Reshape: the rewriter finds no chain, changes nothing."""
    original = onnx.load(NORM_MODULE_DIR / f"{name}.onnx")
    fused, report = rewrite.rewrite_model(original)
    assert report.fused == 0 and sum(report.chains_found.values()) == 0, f"{name}: {report.summary()}"
    assert [(n.op_type, list(n.input)) for n in fused.graph.node] == [
        (n.op_type, list(n.input)) for n in original.graph.node
    ]
    with np.load(NORM_MODULE_DIR / "references.npz") as refs:
        x, gate, out = refs[f"{name}/x"], refs[f"{name}/gate"], refs[f"{name}/out"]
    session = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"])
    error, scale = _relative_error(session.run(None, {"x": x, "gate": gate})[0], out)
    assert error <= TORCH_TOLERANCE["fp32"] * scale, f"{name}: max |ORT - torch| {error:.3g} of {scale:.3g}"


# --- the families table -------------------------------------------------------------------------------


def test_every_family_is_fusion_tested() -> None:
    families = {record["family"] for record in FIXTURES.values()}
    assert families == {*FUSION_FAMILIES, "falcon_h1"}, sorted(families)


def test_readme_families_table_is_generated_from_the_manifests() -> None:
    text = (ROOT / "models" / "README.md").read_text()
    start, end = "<!-- families table: python -m models.fixtures --families-table -->", "<!-- end families table -->"
    assert start in text and end in text, "models/README.md has no families table"
    documented = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert documented == families_table().strip(), "models/README.md's families table is stale: regenerate it"
    assert families_table().strip() in (ROOT / "README.md").read_text(), "README.md's families table is stale"
