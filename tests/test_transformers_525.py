"""Every fusion on the exports of transformers 5.25 (``tests/fixtures/models/transformers-5.25/``).

transformers 5.25 moved the Mamba-2 decode step into its kernel-hub fallback functions (``causal_conv1d_update``,
``mamba2_selective_state_update``): the step's reshapes take the batch from the cache (``view(-1, H, P)``,
``expand(Shape(conv_state)[0], ...)``) and each Mamba layer gains a ``cumulative_length_linear`` cache tensor.
The 5.24 fixtures stay beside these (tests/fixtures/models/ and its sets): both versions' graphs are tested.
Each fixture must get every op in every Mamba-2 layer (the gated norm in every layer whose norm comes before
the gate; the conv and state updates in every decode step), keep its inputs and outputs, and compute what the
original computes: through the model-local functions (stock ONNX Runtime) and through the library.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import pytest

from fusion import rewrite
from models.fixtures import TF525_FIXTURE_DIR, TF525_VERSION, tf525_fixture_jobs
from models.runtime import feeds, load_manifest, load_references
from tests.test_decode_step_rules import TOLERANCE, _library_has_decode_ops, _run, scaled_error

MANIFEST = load_manifest(TF525_FIXTURE_DIR)
FIXTURES = MANIFEST["fixtures"]
STEMS = sorted(FIXTURES)
DECODE_OPS = ("CausalConv1dUpdate", "SelectiveStateUpdate")
#: Families whose gate multiplies after the norm (``norm_before_gate``): another op, refused with that reason.
NORM_AFTER_GATE = ("falcon_h1_nbg",)


@cache
def _references():
    return load_references(TF525_FIXTURE_DIR)


@cache
def _original(stem: str) -> onnx.ModelProto:
    return onnx.load(TF525_FIXTURE_DIR / FIXTURES[stem]["file"])


@cache
def _fused(stem: str):
    return rewrite.rewrite_model(_original(stem))


#: Exports of 5.25 that ONNX Runtime cannot run (the fixture generator records them as failures, with the error):
#: TorchScript's export of the 5.25 mixer writes a Tile whose repeats are not 1-D.
EXPORT_FAILURES = {
    "nemotron_h-torchscript-fp32-prefill": "'repeat' input tensor must be 1 dimensional",
    "zamba2-torchscript-fp32-prefill": "'repeat' input tensor must be 1 dimensional",
}


def test_the_set_is_transformers_525_and_complete() -> None:
    failures = {stem: failure["error"] for stem, failure in MANIFEST["failures"].items()}
    assert failures.keys() == EXPORT_FAILURES.keys(), failures
    assert all(EXPORT_FAILURES[stem] in error for stem, error in failures.items()), failures
    assert set(FIXTURES) | set(failures) == {job["stem"] for job in tf525_fixture_jobs()}
    versions = {record["versions"]["transformers"] for record in FIXTURES.values()}
    assert {v.rsplit(".", 1)[0] for v in versions} == {TF525_VERSION}, versions
    # the 5.25 graph: a cumulative_length_linear cache input per Mamba layer (the decode steps')
    decode = [r for r in FIXTURES.values() if r["mode"] == "decode"]
    assert all(any("cumulative_length_linear" in i["name"] for i in r["inputs"]) for r in decode)


@pytest.mark.parametrize("stem", STEMS)
def test_every_mamba_layer_gets_every_op(stem: str) -> None:
    record = FIXTURES[stem]
    fused, report = _fused(stem)
    layers = record["num_mamba_layers"]
    counts = {op: sum(1 for n in fused.graph.node if n.op_type == op) for op in ("GatedGroupRMSNorm", *DECODE_OPS)}
    expected_norms = 0 if record["family"] in NORM_AFTER_GATE else layers
    expected_steps = layers if record["mode"] == "decode" else 0
    assert counts == {
        "GatedGroupRMSNorm": expected_norms,
        **dict.fromkeys(DECODE_OPS, expected_steps),
    }, report.summary()
    if record["family"] in NORM_AFTER_GATE:
        assert len(report.refused) == layers and all("norm_before_gate" in why for _, why in report.refused)
    else:
        assert not report.refused, report.summary()
    original = _original(stem)
    assert [(v.name, v.type.SerializeToString()) for v in fused.graph.output] == [
        (v.name, v.type.SerializeToString()) for v in original.graph.output
    ]
    assert [(v.name, v.type.SerializeToString()) for v in fused.graph.input] == [
        (v.name, v.type.SerializeToString()) for v in original.graph.input
    ]


CPU_STEMS = [s for s in STEMS if FIXTURES[s]["dtype"] != "bf16"]


@pytest.mark.parametrize("library", [False, True], ids=["function", "library"])
@pytest.mark.parametrize("stem", CPU_STEMS)
def test_fused_matches_original(stem: str, library: bool) -> None:
    if library and (reason := _library_has_decode_ops()):
        pytest.skip(reason)
    record = FIXTURES[stem]
    inputs = feeds(record, _references()[stem])
    expected = _run(_original(stem), inputs)
    actual = _run(_fused(stem)[0], inputs, library)
    names = [o.name for o in _original(stem).graph.output]
    tolerance = TOLERANCE[record["dtype"]]
    for output, a, e in zip(names, actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, output
        error, floor = scaled_error(a, e)
        assert error <= tolerance + floor, f"{output}: max error {error:.3g} of the output's scale"
    # and the original is the torch model's step (the references' logits), so parity means the model's result
    logits = _references()[stem].get("output/logits")
    if logits is not None and record["scope"] != "mixer":
        error, floor = scaled_error(actual[names.index("logits")].astype(np.float32), logits.astype(np.float32))
        assert error <= {"fp32": 1e-4, "fp16": 2e-2}[record["dtype"]] + floor, error
