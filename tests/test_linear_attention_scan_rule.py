"""fusion/rules/linear_attention_scan.py: a mobius build's ``LinearAttention(update_rule="gated")`` run as
``MambaChunkScan`` on genai's state as it is (``state_layout`` 1), ORT's ``com.microsoft`` op or ONNX's own (opset 27).

- the mobius form built in code with either op (every group count, prompts of 1, 17 and 150 tokens, an initial
  state; ONNX's op with and without ``chunk_size``): one node fused, the LinearAttention and its glue gone, and
  the fused node's outputs within MambaChunkScan's budget (docs/mamba_chunk_scan.md) of the recurrence on the
  graph's own d, A, x, B and C, as the original's are (ONNX Runtime 1.32 runs ONNX's op as its function body);
- a graph that computes something else (another scale, a decay that may grow, a time step that may be negative,
  groups interleaved instead of repeated, a beta input, an unknown attribute, grouped query heads; for ONNX's op
  also a model whose opset is not 27's) is refused with that step named, and left unchanged; another update rule
  is not a candidate;
- every CPU mobius fixture build: every gated LinearAttention replaced, genai's inputs and outputs unchanged, and
  a prompt then decode steps (T = 1) fed state to state give the original's outputs within the whole-model
  tolerance; through onnxruntime-genai the greedy tokens are the default fused folder's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest

import contrib_ops
from fusion.reference.mamba_chunk_scan import budget_report
from fusion.rules import registry
from fusion.rules._log import FusionLog
from fusion.rules.linear_attention_scan import fuse_linear_attention_scan
from fusion.rules.registry import FUSIONS, LINEAR_ATTENTION_SCAN, OPT_IN_FUSIONS, attach_functions
from models.mobius import decode_steps, extract_builds, load_manifest, sample_feeds

F32 = onnx.TensorProto.FLOAT
MANIFEST = load_manifest()
RECORDS = {r["stem"]: r for r in MANIFEST["builds"]}
CPU_BUILDS = sorted(
    r["stem"] for r in MANIFEST["builds"] if r["target"] == "cpu" and r["dtype"] in ("f32", "f16") and "error" not in r
)
GENAI_BUILDS = sorted(
    r["stem"]
    for r in MANIFEST["builds"]
    if r.get("runtime") == "ort-genai" and r["target"] == "cpu" and "error" not in r
)
#: Whole-model outputs, fused vs original, max |difference| / max |output| (tests/test_mobius_fixtures.py's bounds).
MODEL_TOLERANCE = {"f32": 1e-5, "f16": 4e-3}
DECODE_STEPS = 3
#: The op's spellings: ORT's contrib op (mobius) and ONNX's own, added at opset 27
DOMAINS = {"ort": "com.microsoft", "onnx": ""}
STANDARD_OPSET = 27


# --- the mobius form, built in code ---------------------------------------------------------------------------


def mobius_mixer(
    heads: int = 8,
    head_dim: int = 4,
    groups: int = 2,
    state_size: int = 8,
    *,
    scale: float | None = 1.0,
    clip_min: float | None = 0.001,
    softplus: bool = True,
    decay_rate: str = "neg_exp",
    repeat: str = "expand",
    update_rule: str = "gated",
    beta: bool = False,
    extra_attribute: bool = False,
    attributes: dict | None = None,
    domain: str = "com.microsoft",
    opset: int | None = None,
    widen: dict[str, int] | None = None,
) -> onnx.ModelProto:
    """The scan of one mobius Mamba-2 mixer, node for node as mobius 0.1.0 writes it (tests/fixtures/mobius), from
    the in_proj's x, dt, B and C to LinearAttention's outputs (genai's present state among them). ``domain`` ``""``
    writes ONNX's LinearAttention instead, at ``opset`` (by default 27); ``attributes`` override the node's.
    ``widen`` maps inputs among x_flat, B_flat, C_flat and past_state to an ONNX element type: each is then a graph
    input of that type widened by a Cast to float32, as a mobius float16 or bfloat16 build widens them."""
    h, p, g, n = heads, head_dim, groups, state_size
    widen = widen or {}
    rng = np.random.default_rng(3)
    inits = [
        oh.make_tensor("dt_bias", F32, [h], rng.standard_normal(h).astype(np.float32)),
        oh.make_tensor("A_log", F32, [h], rng.uniform(-1, 2, h).astype(np.float32)),
        oh.make_tensor("x_shape", onnx.TensorProto.INT64, [4], [0, 0, h, p]),
        oh.make_tensor("v_shape", onnx.TensorProto.INT64, [3], [0, 0, h * p]),
        oh.make_tensor("minus_one", onnx.TensorProto.INT64, [1], [-1]),
    ]
    if g != h or repeat != "expand":
        group_shape, repeats = (
            ([0, 0, g, 1, n], [1, 1, 1, h // g, 1]) if repeat == "expand" else ([0, 0, 1, g, n], [1, 1, h // g, 1, 1])
        )
        inits += [
            oh.make_tensor("group_shape", onnx.TensorProto.INT64, [5], group_shape),
            oh.make_tensor("repeat_shape", onnx.TensorProto.INT64, [5], repeats),
            oh.make_tensor("head_shape", onnx.TensorProto.INT64, [3], [0, 0, h * n]),
        ]
    nodes = [oh.make_node("Cast", [f"{name}_narrow"], [name], to=F32) for name in widen]
    nodes.append(oh.make_node("Add", ["dt", "dt_bias"], ["dt_biased"]))
    nodes.append(
        oh.make_node("Softplus", ["dt_biased"], ["soft"])
        if softplus
        else oh.make_node("Identity", ["dt_biased"], ["soft"])
    )
    if clip_min is None:
        nodes.append(oh.make_node("Identity", ["soft"], ["d"]))
    else:
        nodes += [
            oh.make_node("Constant", [], ["clip_min"], value_float=clip_min),
            oh.make_node("Clip", ["soft", "clip_min"], ["d"]),
        ]
    if decay_rate == "neg_exp":
        nodes += [oh.make_node("Exp", ["A_log"], ["A_exp"]), oh.make_node("Neg", ["A_exp"], ["A"])]
    elif decay_rate == "exp":  # a growing state: not Mamba-2's
        nodes.append(oh.make_node("Exp", ["A_log"], ["A"]))
    nodes += [
        oh.make_node("Mul", ["A", "d"], ["decay"]),
        oh.make_node("Unsqueeze", ["d", "minus_one"], ["d4"]),
        oh.make_node("Reshape", ["x_flat", "x_shape"], ["x"]),
        oh.make_node("Mul", ["d4", "x"], ["u"]),
        oh.make_node("Reshape", ["u", "v_shape"], ["v"]),
    ]
    for source, name in (("C_flat", "q"), ("B_flat", "k")):
        if g == h and repeat == "expand":
            nodes.append(oh.make_node("Identity", [source], [name]))
            continue
        nodes += [
            oh.make_node("Reshape", [source, "group_shape"], [f"{name}_5"]),
            oh.make_node("Expand", [f"{name}_5", "repeat_shape"], [f"{name}_e"]),
            oh.make_node("Reshape", [f"{name}_e", "head_shape"], [name]),
        ]
    overrides = attributes
    attributes = dict(update_rule=update_rule, q_num_heads=h, kv_num_heads=h)
    if scale is not None:
        attributes["scale"] = scale
    if extra_attribute:
        attributes["state_window"] = 2
    node_attributes = attributes | (overrides or {})
    inputs = ["q", "k", "v", "past_state", "decay"] + (["beta"] if beta else [])
    nodes.append(oh.make_node("LinearAttention", inputs, ["o", "present_state"], domain=domain, **node_attributes))
    graph_inputs = [
        oh.make_tensor_value_info(f"{name}_narrow" if name in widen else name, widen.get(name, F32), ["batch", *dims])
        for name, dims in (
            ("x_flat", ["seq", h * p]),
            ("dt", ["seq", h]),
            ("B_flat", ["seq", g * n]),
            ("C_flat", ["seq", g * n]),
            ("past_state", [h, n, p]),
        )
    ]
    if beta:
        graph_inputs.append(oh.make_tensor_value_info("beta", F32, ["batch", "seq", h]))
    graph = oh.make_graph(
        nodes,
        "mobius_mixer",
        graph_inputs,
        [
            oh.make_tensor_value_info("o", F32, ["batch", "seq", h * p]),
            oh.make_tensor_value_info("present_state", F32, ["batch", h, n, p]),
        ],
        initializer=inits,
    )
    if domain:
        opsets = [oh.make_opsetid("", opset or 24), oh.make_opsetid(domain, 1)]
    else:
        opsets = [oh.make_opsetid("", opset or STANDARD_OPSET)]
    # ONNX 1.22's IR for opset 27 (ONNX Runtime 1.32 reads up to 14)
    model = oh.make_model(graph, opset_imports=opsets, ir_version=11 if domain else 13)
    return onnx.shape_inference.infer_shapes(model)  # the value types mobius writes


def fuse(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int, FusionLog]:
    ir_model = ir.from_proto(model)
    log = FusionLog()
    count = fuse_linear_attention_scan(ir_model, log)
    attach_functions(ir_model)
    return ir.to_proto(ir_model), count, log


def mixer_feeds(model: onnx.ModelProto, batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [
            batch if d.dim_param == "batch" else length if d.dim_param == "seq" else d.dim_value
            for d in value.type.tensor_type.shape.dim
        ]
        shift = -2.0 if value.name == "dt" else 0.0
        values = (rng.standard_normal(shape) + shift).astype(np.float32)
        feeds[value.name] = values.astype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
    return feeds


def _widened_feeds(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds by the float32 names the graph reads them as (a ``widen`` mixer's 16-bit inputs widened)."""
    return {name.removesuffix("_narrow"): value.astype(np.float32) for name, value in feeds.items()}


def graph_scan_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The graph's own d and A (ONNX Runtime's Softplus and Clip, the A it computes) and x, B, C by group."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend([oh.make_tensor_value_info(name, F32, None) for name in ("d", "A")])
    d, A = run(probe, feeds, False)
    feeds = _widened_feeds(feeds)
    batch, length, _ = feeds["dt"].shape
    heads, head_dim, state_size = (
        feeds["past_state"].shape[1],
        feeds["past_state"].shape[3],
        feeds["past_state"].shape[2],
    )
    groups = feeds["B_flat"].shape[2] // state_size
    return {
        "x": feeds["x_flat"].reshape(batch, length, heads, head_dim),
        "dt": d,
        "A": A,
        "B": feeds["B_flat"].reshape(batch, length, groups, state_size),
        "C": feeds["C_flat"].reshape(batch, length, groups, state_size),
        "initial_state": np.ascontiguousarray(feeds["past_state"].transpose(0, 1, 3, 2)),
    }


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], library: bool) -> list[np.ndarray]:
    """``model``'s outputs on ``feeds`` (bfloat16 ones passed as their bits, typed: numpy has none ORT takes)."""
    import onnxruntime as ort

    values = {
        name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), onnx.TensorProto.BFLOAT16)
        if a.dtype == onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16)
        else ort.OrtValue.ortvalue_from_numpy(a)
        for name, a in feeds.items()
    }
    return [v.numpy() for v in contrib_ops.session(model, use_library=library).run_with_ort_values(None, values)]


def within_budget(model: onnx.ModelProto, feeds: dict[str, np.ndarray], library: bool) -> tuple[bool, str]:
    """Run ``model``; return budget_report of its (o, present) against the recurrence on the graph's inputs."""
    o, present = run(model, feeds, library)
    inputs = graph_scan_inputs(model, feeds)
    out = o.reshape(inputs["x"].shape)
    return budget_report(
        out,
        present.transpose(0, 1, 3, 2),
        inputs["x"],
        inputs["dt"],
        None,
        inputs["A"],
        inputs["B"],
        inputs["C"],
        None,
        inputs["initial_state"],
        dt_softplus=0,
    )


def test_the_rule_is_registered_opt_in() -> None:
    assert LINEAR_ATTENTION_SCAN in OPT_IN_FUSIONS and LINEAR_ATTENTION_SCAN not in FUSIONS
    assert LINEAR_ATTENTION_SCAN.op_type == "MambaChunkScan"


# --- opting in: the API and the command lines --------------------------------------------------------------


def test_rewrite_model_runs_it_only_when_named() -> None:
    from fusion.rewrite import rewrite_model

    model = mobius_mixer()
    default, report = rewrite_model(model)
    assert [n.op_type for n in default.graph.node].count("LinearAttention") == 1
    assert "MambaChunkScan" not in report.decode
    opted, report = rewrite_model(model, opt_in=["linear_attention_scan"])
    ops = [n.op_type for n in opted.graph.node]
    assert "LinearAttention" not in ops and ops.count("MambaChunkScan") == 1
    assert report.decode["MambaChunkScan"]["fused"] == 1 and report.function_attached
    assert [n.op_type for n in model.graph.node].count("LinearAttention") == 1, "the input model was modified"
    feeds = mixer_feeds(model, batch=2, length=70)
    ok, detail = within_budget(opted, feeds, library=True)
    assert ok, detail


def test_an_unknown_opt_in_name_is_an_error_naming_the_choices() -> None:
    from fusion.rewrite import rewrite_model

    with pytest.raises(ValueError, match="no opt-in fusion named 'linear_attention'.*choices: linear_attention_scan"):
        rewrite_model(mobius_mixer(), opt_in=["linear_attention"])


@pytest.mark.parametrize("command", ["rewrite", "optimize"])
def test_the_command_lines_opt_in(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusion import optimize, rewrite

    main = rewrite.main if command == "rewrite" else optimize.main
    source = tmp_path / "mixer.onnx"
    onnx.save(mobius_mixer(), source)
    default, opted = tmp_path / "default.onnx", tmp_path / "opted.onnx"
    assert main([str(source), "-o", str(default)]) == 0
    assert "LinearAttention" in [n.op_type for n in onnx.load(default).graph.node]
    hint = "hint: 1 LinearAttention scans as the builder wrote them: --opt-in linear_attention_scan runs them as "
    assert hint + "ai.mambafuse::MambaChunkScan" in capsys.readouterr().out
    assert main([str(source), "-o", str(opted), "--opt-in", "linear_attention_scan", "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "LinearAttention scans found: 1 (ai.mambafuse::MambaChunkScan), fused: 1" in printed, printed
    assert "--opt-in linear_attention_scan runs them" not in printed
    ops = [n.op_type for n in onnx.load(opted).graph.node]
    assert "LinearAttention" not in ops and "MambaChunkScan" in ops


@pytest.mark.parametrize("command", ["rewrite", "optimize"])
def test_the_provider_option_runs_its_measured_opt_ins(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--provider takes registry.FOLDER_OPT_IN's fusions as mambafuse genai does for a folder: the mixer's 256-element
    state keeps its LinearAttention with a note and without the hint (under SCAN_MIN_STATE); with the bound lowered
    to 256 the scan is fused and verified; a provider without measured choices is an argument error."""
    from fusion import optimize, rewrite

    main = rewrite.main if command == "rewrite" else optimize.main
    source = tmp_path / "mixer.onnx"
    onnx.save(mobius_mixer(), source)
    kept, fused = tmp_path / "kept.onnx", tmp_path / "fused.onnx"
    assert main([str(source), "-o", str(kept), "--provider", "CUDA"]) == 0
    printed = capsys.readouterr()
    assert "--provider cuda: opted in causal_conv_with_state" in printed.err, printed.err
    assert "LinearAttention kept: a layer's state has 256 elements, under the 65536" in printed.err
    assert "--opt-in linear_attention_scan runs them" not in printed.out, printed.out
    assert "LinearAttention" in [n.op_type for n in onnx.load(kept).graph.node]
    monkeypatch.setattr(registry, "SCAN_MIN_STATE", 256)
    assert main([str(source), "-o", str(fused), "--provider", "cpu", "--verify"]) == 0
    printed = capsys.readouterr()
    assert "--provider cpu: opted in linear_attention_scan, causal_conv_with_state" in printed.err
    assert "LinearAttention scans found: 1 (ai.mambafuse::MambaChunkScan), fused: 1" in printed.out, printed.out
    ops = [n.op_type for n in onnx.load(fused).graph.node]
    assert "LinearAttention" not in ops and "MambaChunkScan" in ops
    with pytest.raises(SystemExit) as exit_info:
        main([str(source), "-o", str(tmp_path / "dml.onnx"), "--provider", "dml"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--provider" in error and "cuda" in error and "Traceback" not in error
    assert not (tmp_path / "dml.onnx").exists()


def test_a_wrong_opt_in_name_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusion import rewrite

    source = tmp_path / "mixer.onnx"
    onnx.save(mobius_mixer(), source)
    with pytest.raises(SystemExit) as exit_info:
        rewrite.main([str(source), "-o", str(tmp_path / "out.onnx"), "--opt-in", "linear_attention"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--opt-in" in error and "linear_attention_scan" in error and "Traceback" not in error
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("spelling", DOMAINS)
@pytest.mark.parametrize(("heads", "groups"), [(8, 1), (8, 2), (8, 8)])
@pytest.mark.parametrize("length", [1, 17, 150])
def test_the_mobius_form_fuses_within_the_budget(
    spelling: str, heads: int, groups: int, length: int, library: str
) -> None:
    model = mobius_mixer(heads=heads, groups=groups, domain=DOMAINS[spelling])
    fused, count, log = fuse(model)
    assert count == 1, log
    ops = [n.op_type for n in fused.graph.node]
    assert "LinearAttention" not in ops and ops.count("MambaChunkScan") == 1
    assert "Expand" not in ops, "the groups' repeat to heads stays in the fused graph"
    scan = next(n for n in fused.graph.node if n.op_type == "MambaChunkScan")
    assert next(a.i for a in scan.attribute if a.name == "dt_softplus") == 0
    assert [i.name for i in fused.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in fused.graph.output] == [o.name for o in model.graph.output]
    assert fused.opset_import[0].version == model.opset_import[0].version and fused.ir_version == model.ir_version
    feeds = mixer_feeds(model, batch=2, length=length)
    for label, candidate, use_library in (("original", model, False), ("fused", fused, True)):
        ok, summary = within_budget(candidate, feeds, use_library)
        assert ok, f"{label}: {summary}"


SIXTEEN_BITS = {"f16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}
#: x, B, C and the state widened from 16 bits: what a mobius float16 or bfloat16 build writes
WIDENED = ("x_flat", "B_flat", "C_flat", "past_state")


def _scan_input_types(model: onnx.ModelProto) -> dict[str, int]:
    """The fused MambaChunkScan's inputs x, dt, B, C and the state by their element types (inferred)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.input]}
    scan = next(n for n in model.graph.node if n.op_type == "MambaChunkScan")
    reshape = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Reshape"}
    x, dt, _, _, b, c, _, state = scan.input
    return {
        "x": types[reshape.get(x, x)],
        "dt": types[dt],
        "B": types[reshape.get(b, b)],
        "C": types[reshape.get(c, c)],
        "state": types[state],
    }


def _without_narrowing(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` fused as before the rule read 16-bit x, B and C: every input the widened float32 one."""
    from unittest import mock

    with mock.patch("fusion.rules.linear_attention_scan._widened", lambda _value: None):
        fused, count, _ = fuse(model)
    assert count == 1
    return fused


@pytest.mark.parametrize("sixteen", SIXTEEN_BITS)
@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("length", [1, 70])
@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
def test_16_bit_activations_are_read_as_they_are(sixteen: str, groups: int, length: int, use_library: bool) -> None:
    """x, B, C and the state widened from float16 or bfloat16 (mobius' 16-bit builds): the scan reads the 16-bit
    values with the float32 time step, and computes exactly what it computes on the widened ones (a 16-bit value is
    exact in float32), bit for bit, in the library's kernel and in the function body; within the budget."""
    type_16 = SIXTEEN_BITS[sixteen]
    model = mobius_mixer(groups=groups, widen=dict.fromkeys(WIDENED, type_16))
    fused, count, log = fuse(model)
    assert count == 1, log
    assert _scan_input_types(fused) == {"x": type_16, "dt": F32, "B": type_16, "C": type_16, "state": type_16}
    assert not [n for n in fused.graph.node if n.op_type == "Cast"], "the widening Casts stay in the fused graph"
    feeds = mixer_feeds(model, batch=2, length=length)
    got = run(fused, feeds, use_library)
    want = run(_without_narrowing(model), feeds, use_library)
    for have, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(have, expected)
    ok, summary = within_budget(fused, feeds, use_library)
    assert ok, summary


@pytest.mark.parametrize(
    ("widen", "narrowed"),
    [
        ({"x_flat": onnx.TensorProto.FLOAT16, "B_flat": onnx.TensorProto.FLOAT16}, set()),  # C float32
        (
            {
                "x_flat": onnx.TensorProto.FLOAT16,
                "B_flat": onnx.TensorProto.FLOAT16,
                "C_flat": onnx.TensorProto.BFLOAT16,
            },
            set(),
        ),
        (dict.fromkeys(("x_flat", "B_flat", "C_flat"), onnx.TensorProto.FLOAT16), {"x", "B", "C"}),  # the state float
        (
            {
                **dict.fromkeys(("x_flat", "B_flat", "C_flat"), onnx.TensorProto.FLOAT16),
                "past_state": SIXTEEN_BITS["bf16"],
            },
            {"x", "B", "C"},
        ),
    ],
    ids=["C-float", "mixed-16-bit-types", "state-float", "state-other-16-bit-type"],
)
def test_only_x_B_and_C_of_one_16_bit_type_are_read_narrow(widen: dict[str, int], narrowed: set[str]) -> None:
    """The scan takes x, B and C as 16-bit values only where all three widen from one type (the op's T), and the
    state only where it widens from that type too; otherwise it reads the float32 values, as before."""
    model = mobius_mixer(groups=2, widen=widen)
    fused, count, log = fuse(model)
    assert count == 1, log
    types = _scan_input_types(fused)
    assert {name for name in ("x", "B", "C", "state") if types[name] != F32} == narrowed
    feeds = mixer_feeds(model, batch=1, length=9)
    got = run(fused, feeds, True)
    want = run(_without_narrowing(model), feeds, True)
    for have, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(have, expected)


@pytest.mark.parametrize("domain", ["", "com.microsoft"], ids=["onnx", "ort"])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("use_library", [True, False])
def test_chunk_size_changes_nothing(domain: str, chunk_size: int, use_library: bool, library: str) -> None:
    """``chunk_size`` is "a tuning hint; does not affect output correctness" (ONNX's and ORT's schemas): fused
    whatever its value, and the fused model (the library's kernel or the function) gives the same outputs as without
    it."""
    plain = mobius_mixer(domain=domain)
    model = mobius_mixer(domain=domain, attributes={"chunk_size": chunk_size})
    feeds = mixer_feeds(model, batch=2, length=70, seed=chunk_size)
    outputs = []
    for candidate in (plain, model):
        fused, count, log = fuse(candidate)
        assert count == 1, log
        ok, summary = within_budget(fused, feeds, use_library)
        assert ok, summary
        outputs.append(contrib_ops.session(fused, use_library=use_library).run(None, feeds))
    for name, without, with_hint in zip(("o", "present_state"), *outputs, strict=True):
        assert np.array_equal(without, with_hint), f"{name}: {np.abs(without - with_hint).max():.3g}"


def test_a_standard_prompt_in_pieces_carries_the_state(library: str) -> None:
    """ONNX's op through the fused node: a prompt, one decode step and a second prompt fed state to state give
    ONNX Runtime's run of the original (its function body)."""
    model = mobius_mixer(domain="")
    fused, count, _ = fuse(model)
    assert count == 1
    feeds = mixer_feeds(model, batch=2, length=40, seed=9)
    original = contrib_ops.session(model, use_library=False)
    replaced = contrib_ops.session(fused, use_library=True)
    want_state = got_state = feeds["past_state"]
    for start, end in ((0, 25), (25, 26), (26, 40)):
        piece = {k: v[:, start:end] for k, v in feeds.items() if k != "past_state"}
        want, want_state = original.run(None, piece | {"past_state": want_state})
        got, got_state = replaced.run(None, piece | {"past_state": got_state})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got_state, want_state, rtol=1e-4, atol=1e-5)


def test_a_prompt_in_pieces_carries_the_state(library: str) -> None:
    model = mobius_mixer()
    fused, count, _ = fuse(model)
    assert count == 1
    feeds = mixer_feeds(model, batch=1, length=40, seed=5)
    whole = contrib_ops.session(fused, use_library=True).run(None, feeds)
    session = contrib_ops.session(fused, use_library=True)
    state, outs = feeds["past_state"], []
    for start, end in ((0, 25), (25, 26), (26, 40)):  # a prompt, one decode step, a second prompt
        piece = {k: v[:, start:end] for k, v in feeds.items() if k != "past_state"} | {"past_state": state}
        o, state = session.run(None, piece)
        outs.append(o)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, whole[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(scale=None), "scale is None, not 1"),
        (dict(scale=0.5), "scale is 0.5, not 1"),
        (dict(decay_rate="exp"), "A is not -exp(.)"),
        (dict(softplus=False), "d is not a Softplus"),
        (dict(clip_min=-0.5), "Clip limit -0.5 is not a constant >= 0"),
        (dict(repeat="interleaved"), "not its groups repeated to the heads"),
        (dict(beta=True), "beta input"),
        (dict(extra_attribute=True), "attributes the proof does not read: ['state_window']"),
    ],
)
def test_a_different_computation_is_refused(change: dict, reason: str) -> None:
    model = mobius_mixer(**change)
    fused, count, log = fuse(model)
    assert count == 0
    reasons = [record.reason for record in log.chains.values()]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert [n.op_type for n in fused.graph.node] == [n.op_type for n in model.graph.node]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(scale=None), "scale is None, not 1"),
        (dict(attributes={"scale": 0.0}), "scale is 0.0, not 1"),
        (dict(scale=0.5), "scale is 0.5, not 1"),
        (dict(attributes={"q_num_heads": 16}), "q_num_heads and kv_num_heads differ"),
        (dict(beta=True), "beta input"),
        (dict(decay_rate="exp"), "A is not -exp(.)"),
        (dict(attributes={"state_window": 0}), "attributes the proof does not read: ['state_window']"),
        (dict(opset=26), "the model's ONNX opset 26 has no standard LinearAttention (opset 27 and later)"),
    ],
)
def test_a_different_computation_of_the_standard_op_is_refused(change: dict, reason: str) -> None:
    """ONNX's op: its default scale (0: 1/sqrt(d_k)) and grouped heads change the math; ORT's ``state_window`` is not
    its schema's; before opset 27 the default domain has no LinearAttention."""
    model = mobius_mixer(domain="", **change)
    fused, count, log = fuse(model)
    assert count == 0
    reasons = [record.reason for record in log.chains.values()]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert [(n.domain, n.op_type) for n in fused.graph.node] == [(n.domain, n.op_type) for n in model.graph.node]


@pytest.mark.parametrize("spelling", DOMAINS)
def test_another_update_rule_is_not_a_candidate(spelling: str) -> None:
    fused, count, log = fuse(mobius_mixer(update_rule="linear", domain=DOMAINS[spelling]))
    assert count == 0 and not log.chains
    assert sum(n.op_type == "LinearAttention" for n in fused.graph.node) == 1


def test_the_standard_ops_default_update_rule_is_not_a_candidate() -> None:
    """ONNX's LinearAttention without ``update_rule`` is gated_delta (it needs beta): not the scan's recurrence."""
    model = mobius_mixer(domain="", beta=True)
    node = next(n for n in model.graph.node if n.op_type == "LinearAttention")
    node.attribute.remove(next(a for a in node.attribute if a.name == "update_rule"))
    fused, count, log = fuse(model)
    assert count == 0 and not log.chains


# --- the mobius fixture builds ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_builds(tmp_path_factory.mktemp("mobius-builds"))


def fused_build(source: Path) -> tuple[onnx.ModelProto, onnx.ModelProto, int]:
    original = onnx.load(source / "model.onnx")  # the weights in memory: the fused copy embeds them
    fused, count, log = fuse(original)
    assert not [r.reason for r in log.chains.values() if not r.fused], log
    return original, fused, count


def _io(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(v.name, str(v.type)) for v in [*model.graph.input, *model.graph.output]]


@pytest.mark.parametrize("stem", CPU_BUILDS)
def test_every_mobius_scan_replaced_and_outputs_kept(stem: str, builds: Path, library: str) -> None:
    original, fused, count = fused_build(builds / stem)
    layers = sum(n.op_type == "LinearAttention" for n in original.graph.node)
    assert layers == RECORDS[stem]["mamba_layers"] and count == layers
    assert not any(n.op_type == "LinearAttention" for n in fused.graph.node)
    assert _io(fused) == _io(original), "genai's inputs and outputs changed"
    feeds, cache = sample_feeds(builds / stem / "model.onnx", RECORDS[stem]["checkpoint"])
    reference = decode_steps(contrib_ops.session(original, use_library=False), feeds, cache, DECODE_STEPS)
    tokens = [int(step["logits"][0, -1].astype(np.float32).argmax()) for step in reference[:-1]]
    got = decode_steps(contrib_ops.session(fused, use_library=True), feeds, cache, DECODE_STEPS, tokens)
    tolerance = MODEL_TOLERANCE[RECORDS[stem]["dtype"]]
    for index, (want, have) in enumerate(zip(reference, got, strict=True)):
        for name, value in want.items():
            scale = float(np.abs(value.astype(np.float32)).max()) or 1.0
            difference = float(np.abs(have[name].astype(np.float32) - value.astype(np.float32)).max())
            assert difference <= tolerance * scale, (
                f"step {index} ({'prompt' if index == 0 else 'decode'}) {name}: "
                f"{difference:.3g} > {tolerance} x {scale:.3g}"
            )


@pytest.mark.parametrize("stem", GENAI_BUILDS)
def test_genai_greedy_tokens_unchanged(stem: str, builds: Path, tmp_path: Path, library: str) -> None:
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from fusion import genai as fusion_genai
    from tests.test_genai import generate

    default = tmp_path / "default"
    assert fusion_genai.main([str(builds / stem), str(default), "--genai-config-edit"]) == 0
    opted = tmp_path / "opted"
    assert (
        fusion_genai.main([str(builds / stem), str(opted), "--genai-config-edit", "--opt-in", "linear_attention_scan"])
        == 0
    )
    ops = [n.op_type for n in onnx.load(opted / "model.onnx", load_external_data=False).graph.node]
    assert "LinearAttention" not in ops and ops.count("MambaChunkScan") == RECORDS[stem]["mamba_layers"]
    assert json.loads((opted / "genai_config.json").read_text()) == json.loads(
        (default / "genai_config.json").read_text()
    )
    del og
    tokens, logits = generate(default)
    assert len(set(tokens)) > 4, f"degenerate generation {tokens}: the comparison would prove little"
    opted_tokens, opted_logits = generate(opted)
    assert opted_tokens == tokens
    limit = MODEL_TOLERANCE[RECORDS[stem]["dtype"]] * float(np.abs(logits).max())
    assert float(np.abs(opted_logits - logits).max()) <= limit
