"""The decode-step rules on exports with a symbolic batch (``tests/fixtures/models/batch``), and their refusals.

Every Mamba-2 layer of every batch fixture must fuse both decode ops, and the fused model (through the
model-local functions, and with the library) must give the original's outputs at batch 1, 2 and 3, each row
its own seeded cache and token. A layout that is right at batch 1 only (the readout's rows in (h, b) order),
a readout that bakes batch 1 in, and a state whose batch is another symbol than x's stay refused, with the
reason.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import pytest
from onnx import helper

import tests.test_decode_step_rules as decode_rules
from fusion import rewrite
from fusion.rules._decode import BATCH_SAMPLES, batch_blocked
from models.fixtures import BATCH_FIXTURE_DIR, batch_fixture_jobs
from models.runtime import load_manifest, load_references

OPS = ("CausalConv1dUpdate", "SelectiveStateUpdate")
MANIFEST = load_manifest(BATCH_FIXTURE_DIR)
FIXTURES = MANIFEST["fixtures"]
STEMS = sorted(FIXTURES)
CPU_STEMS = [stem for stem in STEMS if FIXTURES[stem]["dtype"] != "bf16"]
TOLERANCE = decode_rules.TOLERANCE
_NP = {"FLOAT": np.float32, "FLOAT16": np.float16, "INT64": np.int64}
#: The fixture the refusal tests mutate (its first Mamba-2 layer).
MUTATED = "nemotron_h-dynamo-fp32-batch-decode"


@cache
def _references():
    return load_references(BATCH_FIXTURE_DIR)


@cache
def _original(stem: str) -> onnx.ModelProto:
    return onnx.load(BATCH_FIXTURE_DIR / FIXTURES[stem]["file"])


@cache
def _fused(stem: str):
    return rewrite.rewrite_model(_original(stem))


@cache
def _norm_only(stem: str) -> onnx.ModelProto:
    return rewrite.rewrite_model(_original(stem), decode_steps=False)[0]


def _ops(model: onnx.ModelProto) -> dict[str, int]:
    return {op: sum(1 for n in model.graph.node if n.op_type == op) for op in OPS}


# --- the fixtures --------------------------------------------------------------------------------------------


def test_manifest_lists_the_set() -> None:
    assert sorted(job["stem"] for job in batch_fixture_jobs()) == STEMS and not MANIFEST["failures"]
    assert {p.name for p in BATCH_FIXTURE_DIR.glob("*.onnx")} == {FIXTURES[s]["file"] for s in STEMS}
    total = sum(p.stat().st_size for p in BATCH_FIXTURE_DIR.iterdir() if p.is_file())
    assert total < 2 * 1024 * 1024, f"{total / 2**20:.2f} MiB"


@pytest.mark.parametrize("stem", STEMS)
def test_batch_axis_is_symbolic(stem: str) -> None:
    """input_ids and every cache input share one symbolic batch dim (the exporter's, not a number)."""
    inputs = {v.name: v.type.tensor_type.shape.dim for v in _original(stem).graph.input}
    batch = inputs["input_ids"][0]
    assert batch.HasField("dim_param") and not batch.HasField("dim_value"), stem
    for name, dims in inputs.items():
        if name != "position_ids":
            assert dims[0].dim_param == batch.dim_param, name


# --- fused, and equal to the original at every batch --------------------------------------------------------


@pytest.mark.parametrize("stem", STEMS)
def test_every_mamba_layer_fuses_both_ops(stem: str) -> None:
    fused, report = _fused(stem)
    assert _ops(fused) == dict.fromkeys(OPS, FIXTURES[stem]["num_mamba_layers"]), report.summary()
    assert all(not report.decode[op]["refused"] for op in OPS), report.summary()
    assert [(v.name, v.type.SerializeToString()) for v in fused.graph.output] == [
        (v.name, v.type.SerializeToString()) for v in _original(stem).graph.output
    ]


def _batch_feeds(stem: str, batch: int) -> dict[str, np.ndarray]:
    """Feeds of ``batch`` rows, each its own: the traced step's cache rows with seeded noise, seeded tokens."""
    record, refs = FIXTURES[stem], _references()[stem]
    rng = np.random.default_rng(1000 * batch + len(stem))
    vocab = int(refs["output/logits"].shape[-1])
    feeds = {}
    for spec in record["inputs"]:
        name, np_type = spec["name"], _NP[spec["dtype"]]
        traced = refs[f"input/{name}"]
        if name == "input_ids":
            value = rng.integers(3, vocab, size=(batch, 1))
        elif name == "position_ids":
            value = np.repeat(traced[:1], batch, axis=0)
        else:
            rows = traced[np.arange(batch) % traced.shape[0]].astype(np.float64)
            value = rows + 0.25 * float(np.std(traced)) * rng.standard_normal(rows.shape)
        feeds[name] = value.astype(np_type)
    return feeds


def _compare(stem: str, batch: int, library: bool) -> None:
    inputs = _batch_feeds(stem, batch)
    expected = decode_rules._run(_original(stem), inputs)
    actual = decode_rules._run(_fused(stem)[0], inputs, library)
    names = [o.name for o in _original(stem).graph.output]
    tolerance = TOLERANCE[FIXTURES[stem]["dtype"]]
    for output, a, e in zip(names, actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype and e.shape[0] == batch, output
        error, floor = decode_rules.scaled_error(a, e)
        assert error <= tolerance + floor, f"{output} at batch {batch}: max error {error:.3g} of the output's scale"
    if library:
        return
    # through the functions the decode ops are the exported ops: bit for bit the norm-only fused model's
    for output, a, e in zip(names, actual, decode_rules._run(_norm_only(stem), inputs), strict=True):
        differ = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
        assert differ == 0, f"{output} at batch {batch}: {differ} of {a.size} elements differ from the norm-only's"


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("stem", CPU_STEMS)
def test_fused_function_matches_original(stem: str, batch: int) -> None:
    _compare(stem, batch, library=False)


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("stem", CPU_STEMS)
def test_fused_with_library_matches_original(stem: str, batch: int) -> None:
    reason = decode_rules._library_has_decode_ops()
    if reason:
        pytest.skip(reason)
    _compare(stem, batch, library=True)


#: Fused model against torch's logits (tests/test_families.py's budget).
TORCH_TOLERANCE = {"fp32": 1e-5, "fp16": 5e-3}


@pytest.mark.parametrize("stem", CPU_STEMS)
def test_fused_matches_torch_at_the_traced_batch(stem: str) -> None:
    """On the traced step (two rows, the cache generate() built), the fused model gives torch's logits."""
    record, refs = FIXTURES[stem], _references()[stem]
    inputs = {s["name"]: refs[f"input/{s['name']}"].astype(_NP[s["dtype"]]) for s in record["inputs"]}
    assert inputs["input_ids"].shape[0] == record["batch"] > 1
    logits = decode_rules._run(_fused(stem)[0], inputs)[0].astype(np.float64)
    expected = refs["output/logits"].astype(np.float64)
    scale = float(np.abs(expected).max())
    error = float(np.abs(logits - expected).max())
    assert error <= TORCH_TOLERANCE[record["dtype"]] * scale, f"max |fused - torch| {error:.3g} of {scale:.3g}"


def test_rows_differ_within_a_batch() -> None:
    """The comparison feeds distinct rows: a kernel that read row 0 for every row would be caught."""
    feeds = _batch_feeds(MUTATED, 3)
    for name, value in feeds.items():
        if name != "position_ids":
            assert not np.array_equal(value[0], value[1]) and not np.array_equal(value[1], value[2]), name


# --- refusals ------------------------------------------------------------------------------------------------


def _mutated(mutate) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(_original(MUTATED))
    mutate(model)
    return model


def _readout_rows(model: onnx.ModelProto) -> onnx.NodeProto:
    """The first layer's Reshape of the present recurrent state into the readout's (B*H, P, N) rows."""
    state = next(o.name for o in model.graph.output if "recurrent_states" in o.name)
    return next(n for n in model.graph.node if n.op_type == "Reshape" and n.input[0] == state)


def _rows_in_head_batch_order(model: onnx.ModelProto) -> None:
    # (B, H, P, N) -> (H, B, P, N) -> rows: h-major. The same as the op's at batch 1, wrong above.
    reshape = _readout_rows(model)
    helper_out = reshape.input[0] + "_hb"
    index = list(model.graph.node).index(reshape)
    model.graph.node.insert(index, helper.make_node("Transpose", [reshape.input[0]], [helper_out], perm=[1, 0, 2, 3]))
    reshape.input[0] = helper_out


def _rows_bake_batch_one(model: onnx.ModelProto) -> None:
    # Reshape to (H, P, N): the rows of batch 1 only (the step fails at batch 2 where the original did not).
    reshape = _readout_rows(model)
    name = reshape.input[1] + "_baked"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([4, 16, 8], dtype=np.int64), name))
    reshape.input[1] = name


def _state_of_another_batch(model: onnx.ModelProto) -> None:
    state = next(i for i in model.graph.input if "recurrent_states" in i.name)
    state.type.tensor_type.shape.dim[0].dim_param = "other_batch"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (_rows_in_head_batch_order, "not the state's (b, h) rows in order (at batch size 2 of 'batch')"),
        (_rows_bake_batch_one, "(at batch size 2 of 'batch')"),
        (_state_of_another_batch, "the state's batch is not proven to be x's"),
    ],
    ids=["rows-h-major", "rows-bake-batch-1", "state-other-batch"],
)
def test_wrong_batch_layout_refused(mutate, reason: str) -> None:
    model = _mutated(mutate)
    onnx.checker.check_model(model)
    fused, report = rewrite.rewrite_model(model)
    state = report.decode["SelectiveStateUpdate"]
    # the first layer refused with the reason (a later layer may then be unproven too: its x comes through it)
    assert state["fused"] <= FIXTURES[MUTATED]["num_mamba_layers"] - 1, report.summary()
    assert _ops(fused)["SelectiveStateUpdate"] == state["fused"]
    assert any(reason in why for _, why in state["refused"]), report.summary()
    assert _readout_rows(_original(MUTATED)).name in {n.name for n in fused.graph.node}, "the first readout is kept"


def test_rows_in_head_batch_order_is_a_different_model_above_batch_one() -> None:
    """The h-major mutation runs at every batch and agrees with the original at batch 1 only: fusing it would
    have been wrong (the refusal above is needed, not incidental)."""
    model = _mutated(_rows_in_head_batch_order)
    for batch in (1, 2):
        inputs = _batch_feeds(MUTATED, batch)
        mutated, original = decode_rules._run(model, inputs)[0], decode_rules._run(_original(MUTATED), inputs)[0]
        assert np.array_equal(mutated, original) == (batch == 1), batch


def test_batch_blocked() -> None:
    node = object()
    assert batch_blocked([[(node, (n, 4, 16))] for n in BATCH_SAMPLES], BATCH_SAMPLES) is None
    assert batch_blocked([[(node, (1, 4 * n, 16))] for n in BATCH_SAMPLES], BATCH_SAMPLES) is None
    assert "behind another axis" in batch_blocked([[(node, (4, n, 16))] for n in BATCH_SAMPLES], BATCH_SAMPLES)
    assert "one batch axis" in batch_blocked([[(node, (n, n, 16))] for n in BATCH_SAMPLES], BATCH_SAMPLES)
    assert "not a multiple" in batch_blocked([[(node, (n + 1, 16))] for n in BATCH_SAMPLES], BATCH_SAMPLES)
    assert "another rank" in batch_blocked(
        [[(node, (16,) if n == 1 else (n, 16))] for n in BATCH_SAMPLES], BATCH_SAMPLES
    )
