"""fusion/rules/causal_conv_with_state.py: a mobius build's ``com.microsoft::CausalConvWithState``, or ONNX's
own ``CausalConvWithState`` (opset 27), run as ``CausalConv1d`` (opt-in: ``--opt-in causal_conv_with_state``).

- the node built in code, ORT's and ONNX's, alone (channels-first) and between the Transposes mobius writes
  (channels-last, the Transposes gone), with and without bias and state, every activation the ops name, prompts of
  1, 3 and 37 tokens: the fused model gives ONNX Runtime's outputs (ORT's kernel; for ONNX's op its function body,
  which ONNX Runtime 1.32 runs on the CPU) within float32 rounding, through the library and through the function;
- ORT's float16 op: CausalConv1d with ``round_once = 1`` (ORT's kernel rounds its output once), within that op's
  budget and a float16 ulp of ORT's kernel;
- what is not the same computation is refused with the reason and left unchanged: a double node, a dilation, a state
  window, an unknown attribute, a read third output, a weight that is not a constant (C, 1, K); for ONNX's op also
  float16 (its body rounds the conv to the type, then SiLU once), any attribute but ``activation`` and a model whose
  opset is not 27's;
- every float32 and float16 CPU mobius fixture build: every CausalConvWithState replaced, genai's inputs and outputs
  unchanged, a prompt then decode steps fed state to state give the original's outputs; with the LinearAttention
  opt-in as well; through onnxruntime-genai the greedy tokens of a folder written with both options are the
  default fused folder's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

import contrib_ops
from fusion.reference.causal_conv1d import budget_report as conv_budget_report
from fusion.rewrite import rewrite_model
from fusion.rules.registry import CAUSAL_CONV_WITH_STATE, FUSIONS, OPT_IN_FUSIONS
from models.mobius import decode_steps, extract_builds, load_manifest, sample_feeds

F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
OPT_IN = ["causal_conv_with_state"]
#: The op's spellings: ORT's contrib op (mobius) and ONNX's own, added at opset 27
DOMAINS = {"ort": "com.microsoft", "onnx": ""}
STANDARD_OPSET = 27
MANIFEST = load_manifest()
RECORDS = {r["stem"]: r for r in MANIFEST["builds"]}
CPU_BUILDS = sorted(
    r["stem"] for r in MANIFEST["builds"] if r["target"] == "cpu" and r["dtype"] in ("f32", "f16") and "error" not in r
)
GENAI_F32_BUILDS = sorted(
    r["stem"]
    for r in MANIFEST["builds"]
    if r.get("runtime") == "ort-genai" and r["target"] == "cpu" and r["dtype"] == "f32" and "error" not in r
)
#: Float32 outputs, fused vs ORT's node: a different sigmoid and summation order, a few ulps (max |y| ~ 10).
TOLERANCE = 1e-5
#: Whole-model outputs, fused vs original, max |difference| / max |output| (tests/test_mobius_fixtures.py's bounds).
MODEL_TOLERANCE = {"f32": 1e-5, "f16": 4e-3}
DECODE_STEPS = 3
CHANNELS, KERNEL = 24, 4


# --- the node built in code -----------------------------------------------------------------------------------


def conv_model(
    *,
    transposed: bool = True,
    bias: bool = True,
    state: bool = True,
    activation: str | None = "silu",
    elem: int = F32,
    attributes: dict | None = None,
    read_third: bool = False,
    weight_input: bool = False,
    domain: str = "com.microsoft",
    opset: int | None = None,
) -> onnx.ModelProto:
    """One CausalConvWithState of ``domain`` (ORT's, or ONNX's: ``""``, at ``opset``, by default 27), between
    Transposes of a (B, L, C) input when ``transposed``."""
    np_type = onnx.helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(7)
    weight = oh.make_tensor("weight", elem, [CHANNELS, 1, KERNEL], (rng.standard_normal(CHANNELS * KERNEL) * 0.5))
    initializers = [] if weight_input else [weight]
    if bias:
        initializers.append(oh.make_tensor("bias", elem, [CHANNELS], rng.standard_normal(CHANNELS).astype(np_type)))
    nodes = []
    conv_input = "x"
    if transposed:
        nodes.append(oh.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]))
        conv_input = "xt"
    inputs = [conv_input, "weight", "bias" if bias else "", "past" if state else ""]
    while inputs[-1] == "":
        inputs.pop()
    outputs = ["y", "present", *(["update"] if read_third else [])]
    attrs = dict(attributes or {})
    if activation is not None:
        attrs["activation"] = activation
    nodes.append(oh.make_node("CausalConvWithState", inputs, outputs, domain=domain, **attrs))
    if transposed:
        nodes.append(oh.make_node("Transpose", ["y"], ["out"], perm=[0, 2, 1]))
    x_shape = ["batch", "seq", CHANNELS] if transposed else ["batch", CHANNELS, "seq"]
    graph_inputs = [oh.make_tensor_value_info("x", elem, x_shape)]
    if weight_input:
        graph_inputs.append(oh.make_tensor_value_info("weight", elem, [CHANNELS, 1, KERNEL]))
    if state:
        graph_inputs.append(oh.make_tensor_value_info("past", elem, ["batch", CHANNELS, KERNEL - 1]))
    graph_outputs = [
        oh.make_tensor_value_info("out" if transposed else "y", elem, x_shape),
        oh.make_tensor_value_info("present", elem, ["batch", CHANNELS, KERNEL - 1]),
    ]
    if read_third:
        graph_outputs.append(oh.make_tensor_value_info("update", elem, None))
    graph = oh.make_graph(nodes, "conv", graph_inputs, graph_outputs, initializers)
    if domain:
        opsets = [oh.make_opsetid("", opset or 20), oh.make_opsetid(domain, 1)]
    else:
        opsets = [oh.make_opsetid("", opset or STANDARD_OPSET)]
    model = oh.make_model(graph, opset_imports=opsets)
    model.ir_version = 10 if domain else 13  # ONNX 1.22's IR for opset 27; ONNX Runtime 1.32 reads up to 14
    return model


def conv_feeds(model: onnx.ModelProto, batch: int, length: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(length)
    feeds = {}
    for value in model.graph.input:
        dims = [
            batch if d.dim_param == "batch" else length if d.dim_param == "seq" else d.dim_value
            for d in value.type.tensor_type.shape.dim
        ]
        np_type = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = (rng.standard_normal(dims) * 2).astype(np_type)
    return feeds


def test_the_rule_is_registered_opt_in() -> None:
    assert CAUSAL_CONV_WITH_STATE in OPT_IN_FUSIONS and CAUSAL_CONV_WITH_STATE not in FUSIONS
    assert CAUSAL_CONV_WITH_STATE.op_type == "CausalConv1d"


@pytest.mark.parametrize("spelling", DOMAINS)
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize(
    ("bias", "state", "activation"),
    [(True, True, "silu"), (False, True, "swish"), (True, False, None), (False, False, "none")],
)
@pytest.mark.parametrize("length", [1, 3, 37])
@pytest.mark.parametrize("use_library", [True, False])
def test_the_node_runs_as_causal_conv1d(
    spelling: str,
    transposed: bool,
    bias: bool,
    state: bool,
    activation: str | None,
    length: int,
    use_library: bool,
    library: str,
) -> None:
    model = conv_model(transposed=transposed, bias=bias, state=state, activation=activation, domain=DOMAINS[spelling])
    default, _ = rewrite_model(model)
    assert [n.op_type for n in default.graph.node].count("CausalConvWithState") == 1, "fused without opting in"
    fused, report = rewrite_model(model, opt_in=OPT_IN)
    assert report.decode["CausalConv1d"]["fused"] == 1, report.summary()
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("CausalConv1d") == 1 and not {"CausalConvWithState", "Transpose"} & set(ops), ops
    node = next(n for n in fused.graph.node if n.op_type == "CausalConv1d")
    channels_last = next(a.i for a in node.attribute if a.name == "channels_last")
    assert channels_last == (1 if transposed else 0)
    assert [v.name for v in fused.graph.output] == [v.name for v in model.graph.output]
    assert fused.opset_import[0].version == model.opset_import[0].version and fused.ir_version == model.ir_version
    feeds = conv_feeds(model, batch=2, length=length)
    want = contrib_ops.session(model, use_library=False).run(None, feeds)
    got = contrib_ops.session(fused, use_library=use_library).run(None, feeds)
    for name, w, g in zip(("y", "present"), want, got, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert float(np.abs(g - w).max()) <= TOLERANCE, f"{name}: {np.abs(g - w).max():.3g}"
    assert np.array_equal(got[1], want[1]), "the state is a copy of the window's last columns"


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize(("bias", "state", "activation"), [(True, True, "silu"), (False, False, "none")])
@pytest.mark.parametrize("length", [1, 3, 37])
@pytest.mark.parametrize("use_library", [True, False])
def test_a_16_bit_node_runs_as_causal_conv1d_rounded_once(
    transposed: bool, bias: bool, state: bool, activation: str, length: int, use_library: bool, library: str
) -> None:
    """ORT's float16 op computes the conv, the bias and SiLU in float32 and rounds its output once: it runs as
    CausalConv1d with ``round_once = 1``, within that op's budget and within one float16 ulp of ORT's own kernel (the
    float32 sums in another order, another float32 sigmoid); the state a copy. Its SiLU outputs over 37 tokens are not
    all within the per-step budget (``round_once = 0``): the attribute is what makes the two the same computation."""
    model = conv_model(elem=F16, transposed=transposed, bias=bias, state=state, activation=activation)
    fused, report = rewrite_model(model, opt_in=OPT_IN)
    nodes = [n for n in fused.graph.node if n.op_type == "CausalConv1d"]
    assert len(nodes) == 1 and not report.decode["CausalConv1d"]["refused"]
    assert next(a.i for a in nodes[0].attribute if a.name == "round_once") == 1
    feeds = conv_feeds(model, batch=2, length=length)
    want = contrib_ops.session(model, use_library=False).run(None, feeds)
    got = contrib_ops.session(fused, use_library=use_library).run(None, feeds)
    assert got[0].dtype == want[0].dtype == np.float16
    ulps = np.abs(got[0].astype(np.float32) - want[0].astype(np.float32)) / np.spacing(np.abs(want[0]))
    assert float(ulps.max()) <= 1.0, f"{float(ulps.max())} float16 ulps from ORT's kernel"
    assert np.array_equal(got[1], want[1]), "the state is a copy of the window's last columns"
    weight = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "weight"))
    bias_value = (
        onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "bias")) if bias else None
    )
    x = feeds["x"]
    budget = dict(
        activation="silu" if activation == "silu" else "none",
        channels_last=1 if transposed else 0,
        state_width=KERNEL - 1,
    )
    args = (got[0], got[1], x, weight, bias_value, feeds.get("past"))
    ok, summary = conv_budget_report(*args, **budget, round_once=1)
    assert ok, summary
    if activation == "silu" and length == 37:
        assert not conv_budget_report(*args, **budget, round_once=0)[0], "rounded once is the per-step rounding here"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"elem": onnx.TensorProto.DOUBLE}, "is double: not float, float16 or bfloat16"),
        ({"attributes": {"dilation": 2}}, "dilation is not ORT's default"),
        ({"attributes": {"state_window": 2}}, "state_window is not ORT's default"),
        ({"attributes": {"made_up": 1}}, "attribute 'made_up' is not one the rule knows"),
        ({"read_third": True}, "state_update output is read"),
        ({"weight_input": True}, "the conv weight is not a constant"),
        ({"activation": "gelu"}, "activation 'gelu' is not silu, swish or none"),
    ],
)
def test_another_computation_is_refused(change: dict, reason: str) -> None:
    model = conv_model(**change)
    fused, report = rewrite_model(model, opt_in=OPT_IN)
    refused = report.decode["CausalConv1d"]["refused"]
    assert len(refused) == 1 and reason in refused[0][1], refused
    assert [n.op_type for n in fused.graph.node] == [n.op_type for n in model.graph.node]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"elem": F16}, "is float16: ONNX's function body rounds the conv to the type and SiLU once"),
        ({"attributes": {"dilation": 1}}, "attribute 'dilation' is not one the rule knows"),
        ({"attributes": {"channels_last": 0}}, "attribute 'channels_last' is not one the rule knows"),
        ({"weight_input": True}, "the conv weight is not a constant"),
        ({"activation": "gelu"}, "activation 'gelu' is not silu, swish or none"),
        ({"opset": 26}, "the model's ONNX opset 26 has no standard CausalConvWithState (opset 27 and later)"),
    ],
)
def test_another_computation_of_the_standard_op_is_refused(change: dict, reason: str) -> None:
    """ONNX's op has ``activation`` alone: ORT's other attributes, even at ORT's defaults, are not its schema's."""
    model = conv_model(domain="", **change)
    fused, report = rewrite_model(model, opt_in=OPT_IN)
    refused = report.decode["CausalConv1d"]["refused"]
    assert len(refused) == 1 and reason in refused[0][1], refused
    assert [(n.domain, n.op_type) for n in fused.graph.node] == [(n.domain, n.op_type) for n in model.graph.node]


def test_a_transpose_read_elsewhere_keeps_the_channels_first_form(library: str) -> None:
    """The Transpose before the node also feeds a graph output: the node takes ORT's layout, the Transposes stay."""
    model = conv_model()
    model.graph.output.append(oh.make_tensor_value_info("xt", F32, None))
    fused, report = rewrite_model(model, opt_in=OPT_IN)
    assert report.decode["CausalConv1d"]["fused_chains"][0]["channels_last"] == 0
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("Transpose") == 2 and "CausalConv1d" in ops
    feeds = conv_feeds(model, batch=1, length=9)
    want = contrib_ops.session(model, use_library=False).run(None, feeds)
    got = contrib_ops.session(fused, use_library=True).run(None, feeds)
    for w, g in zip(want, got, strict=True):
        assert float(np.abs(g - w).max()) <= TOLERANCE


# --- the mobius fixture builds ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_builds(tmp_path_factory.mktemp("mobius-builds"))


def _io(model: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(v.name, str(v.type)) for v in [*model.graph.input, *model.graph.output]]


@pytest.mark.parametrize("stem", CPU_BUILDS)
@pytest.mark.parametrize("opt_in", [OPT_IN, [*OPT_IN, "linear_attention_scan"]], ids=["conv", "conv+scan"])
def test_every_mobius_conv_replaced_and_outputs_kept(stem: str, opt_in: list[str], builds: Path, library: str) -> None:
    original = onnx.load(builds / stem / "model.onnx")
    fused, report = rewrite_model(original, opt_in=opt_in)
    layers = sum(n.op_type == "CausalConvWithState" for n in original.graph.node)
    assert layers == RECORDS[stem]["mamba_layers"]
    assert report.decode["CausalConv1d"]["fused"] == layers, report.summary()
    ops = [n.op_type for n in fused.graph.node]
    assert "CausalConvWithState" not in ops and ops.count("CausalConv1d") == layers
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
                f"step {index} ({'prompt' if index == 0 else 'decode'}) {name}: {difference:.3g} > "
                f"{tolerance} x {scale:.3g}"
            )


@pytest.mark.parametrize("stem", GENAI_F32_BUILDS)
def test_genai_greedy_tokens_unchanged(stem: str, builds: Path, tmp_path: Path, library: str) -> None:
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from fusion import genai as fusion_genai
    from tests.test_genai import generate

    default, opted = tmp_path / "default", tmp_path / "opted"
    assert fusion_genai.main([str(builds / stem), str(default), "--genai-config-edit"]) == 0
    options = ["--opt-in", "causal_conv_with_state", "--opt-in", "linear_attention_scan"]
    assert fusion_genai.main([str(builds / stem), str(opted), "--genai-config-edit", *options]) == 0
    ops = [n.op_type for n in onnx.load(opted / "model.onnx", load_external_data=False).graph.node]
    assert "CausalConvWithState" not in ops and "LinearAttention" not in ops
    tokens, logits = generate(default)
    assert len(set(tokens)) > 4, f"degenerate generation {tokens}: the comparison would prove little"
    opted_tokens, opted_logits = generate(opted)
    assert opted_tokens == tokens
    assert float(np.abs(opted_logits - logits).max()) <= TOLERANCE * float(np.abs(logits).max())


# --- mambafuse genai: the CPU and CUDA folders' default ----------------------------------------------------------


def _folder_ops(folder: Path) -> list[str]:
    return [n.op_type for n in onnx.load(folder / "model.onnx", load_external_data=False).graph.node]


def test_a_cpu_folder_gets_the_conv_by_default(builds: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from fusion import genai as fusion_genai

    stem = "nemotron_h-g2-f32-default-cpu"
    default, kept = tmp_path / "default", tmp_path / "kept"
    assert fusion_genai.main([str(builds / stem), str(default)]) == 0
    printed = capsys.readouterr().out
    assert "opted in (the CPU folder's default; --keep-builder-ops: none): causal_conv_with_state" in printed
    ops = _folder_ops(default)
    assert "CausalConvWithState" not in ops and ops.count("CausalConv1d") == RECORDS[stem]["mamba_layers"]
    assert "LinearAttention" in ops, "a toy model's scans stay LinearAttention (under SCAN_MIN_STATE)"
    assert fusion_genai.main([str(builds / stem), str(kept), "--keep-builder-ops"]) == 0
    assert "opted in" not in capsys.readouterr().out
    assert _folder_ops(kept).count("CausalConvWithState") == RECORDS[stem]["mamba_layers"]


def test_a_cuda_folder_gets_the_conv_by_default(builds: Path, tmp_path: Path) -> None:
    from fusion import genai as fusion_genai

    stem = "nemotron_h-g4-f32-default-cuda"
    output = tmp_path / "out"
    report, summary = fusion_genai.fuse_folder(builds / stem, output)
    assert summary["opt_in"] == ["causal_conv_with_state"] and summary["provider"] == "cuda"
    ops = _folder_ops(output)
    assert "CausalConvWithState" not in ops and ops.count("CausalConv1d") == RECORDS[stem]["mamba_layers"]
