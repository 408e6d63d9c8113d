"""The MambaChunkScan rule (fusion/rules/mamba_chunk_scan.py) on the graphs exporters write.

Two sources of graphs:

* transformers' own torch fallback ``mamba2_chunk_scan`` exported by torch.onnx (dynamo, dynamic prompt length) at
  widths that exercise every input: heads sharing groups, D, dt_bias, an initial and a final state, the model's
  time-step limits; float32, float16 and bfloat16. The fused model (its MambaChunkScan node run through the op's
  model-local function, without the library) is checked against the op's float64 reference within the contract's
  budget, on prompts around the chunk boundaries and in pieces with the state carried; the original graph is
  checked the same way, so both compute what the contract says.
* the prefill fixtures of every family and exporter (tests/fixtures/models, transformers 5.24 and 5.25): every
  dynamo export fuses every layer, with the fused scan's output equal to the original's within the budget's order;
  what is refused is refused for its stated reason (transformers' exporter fixes the chunk count to the traced
  prompt's; exports traced at a multiple of the chunk size drop the output slice; TorchScript's shapes are not
  proven).

And graphs changed in one step each (a mask, an axis, an equation, a padding value, a threshold, a slice) are
refused: the rule proves every step of the chain.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from fusion.function import mamba_chunk_scan as scan_function
from fusion.reference.mamba_chunk_scan import budget_report
from fusion.rules import mamba_chunk_scan as scan_rules
from fusion.rules._log import FusionLog
from tests._prefill import prompt_feeds

torch = pytest.importorskip("torch")
modeling = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")

FIXTURES = Path(__file__).parent / "fixtures" / "models"
CHUNK = 16
HEADS, HEAD_DIM, GROUPS, STATE = 8, 4, 2, 8
#: (name, torch dtype, D and dt_bias, initial and final state, dt limits, groups)
CONFIGS = {
    "f32-full": (torch.float32, True, True, (0.001, 10.0), GROUPS),
    "f32-plain": (torch.float32, False, False, (0.0, float("inf")), 1),
    "f16-full": (torch.float16, True, True, (0.001, float("inf")), GROUPS),
    "bf16-full": (torch.bfloat16, True, True, (0.0, float("inf")), HEADS),
}
# the function body chunks by 64 tokens: 150 crosses its chunks too
LENGTHS = (1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 150)


def _scan_module(dtype, with_params: bool, with_states: bool, limits, groups: int):
    scan = getattr(modeling.mamba2_chunk_scan, "__wrapped__", modeling.mamba2_chunk_scan)

    class Scan(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.A = torch.nn.Parameter(-(torch.rand(HEADS, generator=g) * 2 + 0.1))
            self.D = torch.nn.Parameter(torch.randn(HEADS, generator=g).to(dtype)) if with_params else None
            self.dt_bias = (
                torch.nn.Parameter((torch.randn(HEADS, generator=g) * 0.5).to(dtype)) if with_params else None
            )

        def scan(self, x, dt, B, C, **kwargs):
            return scan(
                x, dt, self.A, B, C, CHUNK, D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=limits, **kwargs
            )

    class Stateless(Scan):
        def forward(self, x, dt, B, C):
            return self.scan(x, dt, B, C)

    class Stateful(Scan):
        def forward(self, x, dt, B, C, initial_state):
            return self.scan(x, dt, B, C, initial_states=initial_state, return_final_states=True)

    return (Stateful if with_states else Stateless)().eval(), groups


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    """Each config of transformers' chunk scan exported by torch.onnx (dynamo, the prompt length dynamic)."""
    out = tmp_path_factory.mktemp("chunk_scan_exports")
    paths = {}
    for name, (dtype, with_params, with_states, limits, groups) in CONFIGS.items():
        module, groups = _scan_module(dtype, with_params, with_states, limits, groups)
        length = 2 * CHUNK + 5
        args = [
            torch.randn(1, length, HEADS, HEAD_DIM, dtype=dtype),
            torch.randn(1, length, HEADS, dtype=dtype),
            torch.randn(1, length, groups, STATE, dtype=dtype),
            torch.randn(1, length, groups, STATE, dtype=dtype),
        ]
        seq = torch.export.Dim("seq", min=2)
        dynamic = [{1: seq}] * 4
        names = ["x", "dt", "B", "C"]
        if with_states:
            args.append(torch.randn(1, HEADS, HEAD_DIM, STATE, dtype=torch.float32))
            dynamic.append(None)
            names.append("initial_state")
        path = out / f"{name}.onnx"
        program = torch.onnx.export(
            module, tuple(args), dynamo=True, optimize=True, dynamic_shapes=tuple(dynamic), input_names=names
        )
        program.save(str(path))
        paths[name] = path
    return paths


def _fuse(model: ir.Model) -> tuple[int, FusionLog]:
    log = FusionLog()
    return scan_rules.fuse_mamba_chunk_scan(model, log), log


def _with_function(model: ir.Model) -> onnx.ModelProto:
    proto = ir.serde.serialize_model(model)
    proto.functions.append(scan_function.make_function(model.opset_imports[""]))
    if all(o.domain != "ai.mambafuse" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("ai.mambafuse", 1))
    return proto


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _inputs(name: str, length: int, seed: int) -> dict[str, np.ndarray]:
    dtype, _, with_states, _, groups = CONFIGS[name]
    np_type = {torch.float32: np.float32, torch.float16: np.float16}[dtype]
    rng = np.random.default_rng(seed)
    feeds = {
        "x": rng.standard_normal((1, length, HEADS, HEAD_DIM)).astype(np_type),
        "dt": rng.standard_normal((1, length, HEADS)).astype(np_type),
        "B": rng.standard_normal((1, length, groups, STATE)).astype(np_type),
        "C": rng.standard_normal((1, length, groups, STATE)).astype(np_type),
    }
    if with_states:
        feeds["initial_state"] = rng.standard_normal((1, HEADS, HEAD_DIM, STATE)).astype(np.float32)
    return feeds


def _node_inputs(fused: ir.Model) -> dict[str, object]:
    """The fused node's constant inputs and attributes, by the reference's argument names."""
    node = next(n for n in fused.graph if n.op_type == "MambaChunkScan")
    consts = {}
    for key, value in zip(("dt_bias", "A", "D"), (node.inputs[2], node.inputs[3], node.inputs[6]), strict=True):
        consts[key] = value.const_value.numpy() if value.const_value is not None else None
    consts["dt_softplus"] = node.attributes.get_int("dt_softplus", 1)
    consts["dt_min"] = node.attributes.get_float("dt_min", 0.0)
    consts["dt_max"] = node.attributes.get_float("dt_max", float("inf"))
    return consts


@pytest.mark.parametrize("name", [n for n in CONFIGS if not n.startswith("bf16")])
def test_exported_chunk_scan_fuses_and_meets_the_budget(exported, name):
    original = onnx.load(str(exported[name]))
    model = ir.serde.deserialize_model(original)
    fused_count, log = _fuse(model)
    assert fused_count == 1, [r.reason for r in log.chains.values()]
    assert sum(1 for n in model.graph if n.op_type == "Einsum") == 0
    record = next(iter(log.chains.values()))
    dtype, with_params, with_states, limits, groups = CONFIGS[name]
    module, _ = _scan_module(dtype, with_params, with_states, limits, groups)
    assert record.attributes["groups"] == groups and record.attributes["graph_chunk"] == CHUNK
    assert record.attributes["initial_state"] is with_states and record.attributes["final_state"] is with_states
    consts = _node_inputs(model)
    assert consts["dt_min"] == pytest.approx(limits[0], rel=1e-3) and consts["dt_max"] == limits[1]
    before, after = _session(original), _session(_with_function(model))
    for length in LENGTHS:
        feeds = _inputs(name, length, seed=length)
        reference_inputs = {
            "x": feeds["x"],
            "dt": feeds["dt"],
            "dt_bias": consts["dt_bias"] if with_params else None,
            "A": consts["A"],
            "B": feeds["B"],
            "C": feeds["C"],
            "D": consts["D"] if with_params else None,
            "initial_state": feeds.get("initial_state"),
            "dt_softplus": 1,
            "dt_min": consts["dt_min"],
            "dt_max": consts["dt_max"],
        }
        results = {"fused": after.run(None, feeds)}
        if dtype == torch.float32:
            # ONNX Runtime's float16 Softplus is not correctly rounded below about -5 (it is log(1 + exp(v)) in
            # float32, where torch and the contract take log1p): its run of the original half graph is a time-step
            # ulp off torch's, outside the budget; torch's own run below is the semantics the contract follows
            results["original"] = before.run(None, feeds)
        with torch.no_grad():
            module_inputs = [torch.from_numpy(feeds[k]) for k in ("x", "dt", "B", "C")]
            if with_states:
                module_inputs.append(torch.from_numpy(feeds["initial_state"]))
            torch_out = module(*module_inputs)
        results["torch"] = [t.float().numpy() for t in (torch_out if with_states else (torch_out,))]
        for label, outputs in results.items():
            state = outputs[1] if with_states else _reference_state(reference_inputs)
            ok, summary = budget_report(outputs[0], state, **reference_inputs)
            assert ok, f"{label} at T={length}: {summary}"


def _reference_state(inputs) -> np.ndarray:
    from fusion.reference.mamba_chunk_scan import mamba_chunk_scan

    return mamba_chunk_scan(**inputs)[1]


def test_a_prompt_in_pieces_equals_one_shot(exported):
    """The fused model run on a 153-token prompt as 20 + 116 + 17 tokens, the state carried, within the budget."""
    model = ir.load(str(exported["f32-full"]))
    assert _fuse(model)[0] == 1
    consts = _node_inputs(model)
    session = _session(_with_function(model))
    feeds = _inputs("f32-full", 153, seed=7)
    state = feeds["initial_state"]
    outs = []
    for start, stop in ((0, 20), (20, 136), (136, 153)):
        piece = {k: v[:, start:stop] for k, v in feeds.items() if k != "initial_state"}
        out, state = session.run(None, {**piece, "initial_state": state})
        outs.append(out)
    reference_inputs = {k: feeds[k] for k in ("x", "dt", "B", "C", "initial_state")}
    ok, summary = budget_report(np.concatenate(outs, axis=1), state, **reference_inputs, **consts)
    assert ok, summary


def test_bfloat16_export_fuses_with_its_types(exported):
    model = ir.load(str(exported["bf16-full"]))
    fused_count, log = _fuse(model)
    assert fused_count == 1, [r.reason for r in log.chains.values()]
    node = next(n for n in model.graph if n.op_type == "MambaChunkScan")
    assert node.inputs[0].dtype == ir.DataType.BFLOAT16 and node.inputs[2].dtype == ir.DataType.BFLOAT16
    assert node.inputs[3].dtype == ir.DataType.FLOAT and node.inputs[6].dtype == ir.DataType.FLOAT
    assert next(iter(log.chains.values())).attributes["groups"] == HEADS


# one step changed: refused ------------------------------------------------------------------------------------


def _first(model: onnx.ModelProto, predicate):
    return next(n for n in model.graph.node if predicate(n))


def _constant_of(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def _set_constant(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    tensor = _constant_of(model, name)
    tensor.CopyFrom(onnx.numpy_helper.from_array(array.astype(onnx.numpy_helper.to_array(tensor).dtype), name))


def _mutate_mask(model):
    where = _first(
        model,
        lambda n: (
            n.op_type == "Where"
            and any(
                i in {t.name for t in model.graph.initializer}
                and onnx.numpy_helper.to_array(_constant_of(model, i)).dtype == bool
                and onnx.numpy_helper.to_array(_constant_of(model, i)).ndim == 2
                for i in n.input
            )
        ),
    )  # noqa: E501
    name = next(i for i in where.input if i in {t.name for t in model.graph.initializer})
    mask = onnx.numpy_helper.to_array(_constant_of(model, name)).copy()
    mask[CHUNK - 1, 0] = ~mask[CHUNK - 1, 0]
    _set_constant(model, name, mask)


def _mutate_cumsum_axis(model):
    cumsum = _first(model, lambda n: n.op_type == "CumSum")
    axis = f"{cumsum.input[1]}_changed"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, dtype=np.int64), axis))
    cumsum.input[1] = axis


def _mutate_equation(model):
    einsum = _first(
        model, lambda n: n.op_type == "Einsum" and "bzch" in onnx.helper.get_attribute_value(n.attribute[0]).decode()
    )
    einsum.attribute[0].s = b"bzch,bzhpn->bzhpn"


def _mutate_pad_value(model):
    pad = _first(model, lambda n: n.op_type == "Pad" and len(n.input) > 2 and n.input[2])
    value = f"{pad.input[2]}_one"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.0, dtype=np.float32), value))
    pad.input[2] = value


def _mutate_threshold(model):
    greater = _first(model, lambda n: n.op_type == "Greater")
    value = f"{greater.input[1]}_ten"
    t = onnx.numpy_helper.to_array(_constant_of(model, greater.input[1]))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(10.0, dtype=t.dtype), value))
    greater.input[1] = value


def _mutate_gather_index(model):
    gather = _first(model, lambda n: n.op_type == "Gather" and n.attribute and n.attribute[0].i == 3)
    value = f"{gather.input[1]}_zero"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(0, dtype=np.int64), value))
    gather.input[1] = value


def _mutate_transpose(model):
    transpose = _first(
        model,
        lambda n: n.op_type == "Transpose" and list(onnx.helper.get_attribute_value(n.attribute[0])) == [0, 3, 2, 1],
    )
    transpose.attribute[0].ints[:] = [0, 2, 3, 1]


MUTATIONS = {
    "mask": (_mutate_mask, "mask"),
    "cumsum axis": (_mutate_cumsum_axis, "sums over another axis"),
    "equation": (_mutate_equation, "not the chunked algorithm's"),
    "pad value": (_mutate_pad_value, "not zeros"),
    "threshold": (_mutate_threshold, "threshold"),
    "gather index": (_mutate_gather_index, "last cumulative sums"),
    "transpose": (_mutate_transpose, "Transpose by"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_changed_step_is_refused_with_its_reason(exported, mutation):
    mutate, reason = MUTATIONS[mutation]
    proto = onnx.load(str(exported["f32-full"]))
    mutate(proto)
    model = ir.serde.deserialize_model(proto)
    fused_count, log = _fuse(model)
    assert fused_count == 0
    reasons = [r.reason for r in log.chains.values() if not r.fused]
    assert reasons and reason in reasons[0], reasons


# the fixtures of every family and exporter ---------------------------------------------------------------------


def _prefill_fixtures() -> list[Path]:
    patterns = (
        "*prefill*.onnx",
        "transformers-5.25/*prefill*.onnx",
        "families/*prefill*.onnx",
        "padded/*prefill*.onnx",
    )
    return sorted(Path(p) for pattern in patterns for p in glob.glob(str(FIXTURES / pattern)))


def _fixture_id(path: Path) -> str:
    return os.path.relpath(path, FIXTURES)


def _expected(path: Path) -> str | None:
    """None: every scan fuses; else a phrase of the refusal reason every scan must give."""
    name = path.name
    if "-transformers-" in name:
        return "the export specialized the number of chunks"
    if "torchscript" in name:
        return "not proven by the graph"
    if path.parent.name == "padded" and "len16" in name or "chunk4-len8" in name:
        return "is not cut back to the prompt's length"
    return None


@pytest.mark.parametrize("path", _prefill_fixtures(), ids=_fixture_id)
def test_prefill_fixtures_fuse_or_are_refused_for_their_reason(path):
    model = ir.load(str(path))
    anchors = len(scan_rules.find_anchors(model.graph))
    assert anchors >= 1
    fused_count, log = _fuse(model)
    expected = _expected(path)
    if expected is None:
        assert fused_count == anchors, [r.reason for r in log.chains.values()]
        assert not scan_rules.find_anchors(model.graph)
    else:
        assert fused_count == 0
        reasons = [r.reason for r in log.chains.values()]
        assert len(reasons) == anchors and all(expected in r for r in reasons), reasons


PARITY_FIXTURES = [
    "nemotron_h-dynamo-fp32-prefill.onnx",
    "nemotron_h-dynamo-noopt-fp16-prefill.onnx",
    "zamba2-dynamo-fp16-prefill.onnx",
    "transformers-5.25/bamba-dynamo-fp32-prefill.onnx",
    "transformers-5.25/mamba2-dynamo-fp32-prefill.onnx",
    "families/falcon_h1-dynamo-fp32-prefill.onnx",
    "families/granitemoehybrid-dynamo-fp16-prefill.onnx",
]


def _scan_outputs_exposed(model: ir.Model) -> ir.Model:
    """Make each scan's output (the Slice / skip Add the rule replaces) a graph output."""
    for anchor in scan_rules.find_anchors(model.graph):
        value = anchor.outputs[0]
        for _ in range(4):
            users = [user for user, _ in value.uses()]
            slices = [u for u in users if u.op_type == "Slice"]
            if slices:
                model.graph.outputs.append(slices[0].outputs[0])
                break
            value = users[0].outputs[0]
    return model


@pytest.mark.parametrize("name", PARITY_FIXTURES)
def test_fused_fixture_scans_equal_the_originals(name):
    """Each fused scan's output (through the op's function) against the original's, at prompt lengths around the
    fixture's chunk size: within 1e-4 of the largest output magnitude (float16 inputs: 1e-3)."""
    model = _scan_outputs_exposed(ir.load(str(FIXTURES / name)))
    original = ir.serde.serialize_model(model)
    fused_count, _ = _fuse(model)
    assert fused_count >= 2
    before, after = _session(original), _session(_with_function(model))
    chunk = next(iter(_fuse(_scan_outputs_exposed(ir.load(str(FIXTURES / name))))[1].chains.values())).attributes[
        "graph_chunk"
    ]
    tolerance = 1e-3 if "fp16" in name else 1e-4
    rng = np.random.default_rng(0)
    for length in (1, chunk - 1, chunk + 1, 2 * chunk + 3):
        feeds = prompt_feeds(before, length, rng)
        expected, got = before.run(None, feeds), after.run(None, feeds)
        for a, b in zip(expected[1:], got[1:], strict=True):
            scale = float(np.max(np.abs(a.astype(np.float64)))) or 1.0
            assert np.max(np.abs(a.astype(np.float64) - b)) <= tolerance * scale, (name, length)
