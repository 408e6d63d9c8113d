"""Re-export one tiny model per exporter with the installed torch / transformers and re-count its chains.

Catches exporter drift: when a new torch, onnxscript or transformers changes the chain an exporter
emits, the chain count or the docs/forms.md form stops matching the committed fixture of the same
combination (regenerate the fixtures with ``python -m models.fixtures`` and teach the rewriter the new
form). Marked slow: about 75 s on a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from models.inspect_chains import inspect_model
from models.onnx_utils import check
from models.runtime import load_manifest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="needs the models extra (torch)")
pytest.importorskip("transformers", reason="needs the models extra (transformers)")

from models import export, fixtures  # noqa: E402  (after the importorskip: they import torch lazily)

MANIFEST = load_manifest()
FAMILY_MANIFEST = load_manifest(fixtures.FAMILY_FIXTURE_DIR)

#: One combination per exporter (family, exporter, dtype, mode), chosen to cover both families, all
#: modes and a half-precision chain while keeping each export to seconds.
ONE_PER_EXPORTER = [
    ("nemotron_h", "dynamo", "fp16", "prefill"),
    ("zamba2", "dynamo-noopt", "fp32", "decode"),
    ("nemotron_h", "torchscript", "fp32", "prefill"),
    ("nemotron_h", "transformers", "fp16", "decode"),
    ("zamba2", "transformers-ort", "fp32", "prefill"),
]

#: One combination per family of the families set (tests/fixtures/models/families/).
ONE_PER_FAMILY = [
    ("mamba2", "torchscript-model", "fp32", "prefill"),
    ("bamba", "dynamo", "fp16", "decode"),
    ("granitemoehybrid", "dynamo", "fp16", "prefill"),
    ("falcon_h1", "dynamo-noopt", "fp16", "decode"),
    ("falcon_h1_nbg", "transformers", "fp32", "decode"),
]


@pytest.mark.parametrize(("family", "exporter", "dtype", "mode"), ONE_PER_EXPORTER)
def test_reexport_has_the_committed_chains(tmp_path: Path, family: str, exporter: str, dtype: str, mode: str) -> None:
    out = tmp_path / "model.onnx"
    record = export.export_model(family, exporter, dtype, mode, out=out)
    assert check(onnx.load(out)) == record.checker  # "ok", or the one objection transformers-ort earns
    report = inspect_model(out)
    assert len(report.chains) == record.num_mamba_layers, (
        f"{family} {exporter} {dtype} {mode}: {len(report.chains)} chains, {record.num_mamba_layers} layers"
    )
    stem = fixtures.fixture_stem(family, exporter, export.DEFAULT_OPSET[exporter], dtype, mode)
    committed = MANIFEST["fixtures"].get(stem)
    assert committed is not None, f"{stem} is not among the committed fixtures"
    assert record.checker == committed["checker"], f"{stem}: onnx.checker now says {record.checker!r}"
    assert report.forms() == committed["chains"]["forms"], (
        f"{stem}: the installed exporter emits forms {report.forms()}, the fixture has "
        f"{committed['chains']['forms']} (versions then: {committed['versions']})"
    )


@pytest.mark.parametrize(("family", "exporter", "dtype", "mode"), ONE_PER_FAMILY)
def test_family_reexport_has_the_committed_chains(
    tmp_path: Path, family: str, exporter: str, dtype: str, mode: str
) -> None:
    out = tmp_path / "model.onnx"
    record = export.export_model(family, exporter, dtype, mode, out=out)
    stem = fixtures.fixture_stem(family, exporter, export.DEFAULT_OPSET[exporter], dtype, mode)
    committed = FAMILY_MANIFEST["fixtures"].get(stem)
    assert committed is not None, f"{stem} is not among the committed family fixtures"
    assert (record.expected_fused, record.expected_refusal) == (
        committed["expected_fused"],
        committed["expected_refusal"],
    )
    assert inspect_model(out).forms() == committed["chains"]["forms"], (
        f"{stem}: the installed exporter emits other forms than the fixture (versions then: {committed['versions']})"
    )


@pytest.mark.parametrize("stem", sorted(FAMILY_MANIFEST["failures"]))
def test_family_exporter_failure_still_fails(tmp_path: Path, stem: str) -> None:
    # Recorded failures (whole-model TorchScript): if one starts exporting, make it a fixture.
    job = FAMILY_MANIFEST["failures"][stem]
    with pytest.raises(Exception) as error:
        export.export_model(job["family"], job["exporter"], job["dtype"], job["mode"], out=tmp_path / "m.onnx")
    assert fixtures._exact_error(error.value) == job["error"]


def test_torchscript_full_model_still_fails() -> None:
    # The reason the TorchScript fixtures hold the mixer alone; if this starts passing, export the full model.
    error = fixtures.probe_torchscript_full_model()
    assert error is not None, "TorchScript now exports the full causal LM: export it instead of the mixer"


@pytest.mark.parametrize("wrap", ["_prefill_wrapper", "_decode_wrapper"])
def test_export_wrappers_are_in_eval_mode(wrap: str) -> None:
    """The exported module is the wrapper: it and every submodule run in inference mode (dropout off)."""
    model = export.build_model("nemotron_h", "tiny", "fp32")
    model.train()  # the wrapper must not rely on the caller's mode
    wrapped = getattr(export, wrap)(model)
    assert not any(module.training for module in wrapped.modules())
