"""The GatedGroupRMSNorm fusion rule on tiny chains of every docs/forms.md form and variant.

Positive cases: exactly one fusion, none of the replaced ops left, the attributes the chain implies,
and parity with the original graph through ONNX Runtime, both with the mambafuse library and with
the model-local function alone. Negative cases: no fusion, a reason, and a byte-identical graph.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import contrib_ops
from fusion._chains import (
    BFLOAT16,
    FLOAT,
    FLOAT16,
    ChainSpec,
    build_chain,
    build_chain_sequence,
    chain_inputs,
    half_decode,
)
from fusion.reference import (
    budget_report,
    gated_group_rms_norm,
    onnx_type_to_dtype,
    reference_for_budget,
    ulp_distance,
)
from fusion.rewrite import Report, rewrite_model
from fusion.rules.gated_group_rms_norm import FusionLog, fuse_gated_group_rms_norm

DOUBLE = onnx.TensorProto.DOUBLE
CHAIN_OPS = {
    "Sigmoid",
    "QuickGelu",
    "Reshape",
    "Pow",
    "ReduceMean",
    "Add",
    "Sqrt",
    "Reciprocal",
    "Div",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "Shape",
    "Concat",
    "Gather",
    "Unsqueeze",
    "Constant",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """A chain spelling, the form it is, and what the fused node must say."""

    spec: ChainSpec
    form: str
    norm_dtype: int = FLOAT
    output_dtype: int = FLOAT
    #: ONNX Runtime CPU cannot run the original (bf16, com.microsoft SLN): no parity check.
    runnable: bool = True
    #: Nodes that must stay outside the fused node (a Cast the op cannot absorb).
    kept_ops: tuple[str, ...] = ()
    gated_dtype: int = FLOAT


F16_DECODE = half_decode(FLOAT16)
MOBIUS = dict(weight_as_scale=True, opset=23)
#: Falcon-H1 in half precision: y and gate cast up, W cast up, one Cast to half at the end.
FALCON_HALF = dict(
    y_dtype=FLOAT16, z_dtype=FLOAT16, cast_y=True, cast_z=True, weight_dtype=FLOAT16, trailing_cast=FLOAT16
)


def mobius_half(dtype: int) -> dict[str, int | bool]:
    """Return the ChainSpec fields of a mobius half build: y and gate cast up, h rounded back to ``dtype``."""
    return dict(y_dtype=dtype, z_dtype=dtype, cast_y=True, cast_z=True, gated_cast=dtype, weight_dtype=dtype)


CASES: dict[str, Case] = {
    # A: dynamo fp32
    "A_constant_shapes": Case(ChainSpec(), "A"),
    "A_dynamic_shapes": Case(ChainSpec(shape_as="dynamic", leading=("batch", "seq")), "A"),
    "A_opset23": Case(ChainSpec(opset=23), "A"),
    "A_one_leading_dim": Case(ChainSpec(leading=(5,)), "A"),
    "A_three_leading_dims": Case(ChainSpec(leading=(2, 1, 3), shape_as="dynamic"), "A"),
    "A_operands_swapped": Case(
        ChainSpec(
            silu="sigmoid_mul_swapped",
            silu_first=True,
            weight_first=False,
            normed_rsqrt_first=True,
            epsilon_first=True,
        ),
        "A",
    ),
    "A_positive_axis": Case(ChainSpec(axis=3), "A"),
    "A_one_group": Case(ChainSpec(channels=48, group_size=48), "A"),
    "A_group_size_40": Case(ChainSpec(channels=120, group_size=40, epsilon=1e-6), "A"),
    "A_no_op_norm_cast": Case(ChainSpec(norm_cast=FLOAT), "A"),
    "A_trailing_cast_f32": Case(ChainSpec(trailing_cast=FLOAT), "A"),
    # B: dynamo half prefill, y already f32, gate cast, trailing Cast absorbed
    "B_f16_prefill": Case(
        ChainSpec(z_dtype=FLOAT16, cast_z=True, trailing_cast=FLOAT16, shape_as="dynamic", leading=("b", "s")),
        "B",
        output_dtype=FLOAT16,
    ),
    "B_bf16_prefill": Case(
        ChainSpec(z_dtype=BFLOAT16, cast_z=True, trailing_cast=BFLOAT16),
        "B",
        output_dtype=BFLOAT16,
        runnable=False,
    ),
    # C: half decode, norm rounded to f16, f16 weight Mul
    "C_f16_decode": Case(ChainSpec(**F16_DECODE, leading=(1, 1)), "C", FLOAT16, FLOAT16),
    "C_f16_weight_last": Case(ChainSpec(**F16_DECODE, weight_first=False), "C", FLOAT16, FLOAT16),
    "C_bf16_decode": Case(
        ChainSpec(**half_decode(BFLOAT16)),
        "C",
        BFLOAT16,
        BFLOAT16,
        runnable=False,
    ),
    "C_trailing_cast_stays": Case(
        ChainSpec(**F16_DECODE, trailing_cast=FLOAT), "C", FLOAT16, FLOAT16, kept_ops=("Cast",)
    ),
    # D: dynamo optimize=False: Constant nodes, explicit Cast(W -> f32)
    "D_constant_nodes": Case(ChainSpec(scalars_as_constants=True, epsilon_as="constant_node", weight_cast=True), "D"),
    "D_f16_weight_cast": Case(
        ChainSpec(
            scalars_as_constants=True,
            epsilon_as="constant_node",
            weight_dtype=FLOAT16,
            weight_cast=True,
            z_dtype=FLOAT16,
            cast_z=True,
            trailing_cast=FLOAT16,
        ),
        "D",
        output_dtype=FLOAT16,
    ),
    # E: TorchScript, opset 17
    "E_torchscript": Case(
        ChainSpec(opset=17, axes_as="attribute", rsqrt="div_one", cast_y=True, cast_z=True, shape_as="torchscript"),
        "E",
    ),
    "E_positive_axis_attribute": Case(ChainSpec(opset=17, axes_as="attribute", axis=3), "E"),
    # F: SimplifiedLayerNormalization inner norm
    "F_sln": Case(ChainSpec(inner="sln"), "F"),
    "F_sln_com_microsoft": Case(ChainSpec(inner="sln_ms"), "F", runnable=False),
    "F_sln_f16": Case(
        ChainSpec(inner="sln", **F16_DECODE, shape_as="dynamic", leading=("b", "s")), "F", FLOAT16, FLOAT16
    ),
    # G: after ORT's optimizer
    "G_quick_gelu": Case(ChainSpec(silu="quick_gelu"), "G"),
    "G_div_by_sqrt": Case(ChainSpec(rsqrt="div_x"), "G"),
    "G_quick_gelu_div_f16_cast_inputs": Case(
        ChainSpec(silu="quick_gelu", rsqrt="div_x", y_dtype=FLOAT16, z_dtype=FLOAT16, cast_y=True, cast_z=True),
        "G",
    ),
    # H: hand-built, opset 23
    "H_rms_normalization_G_gs_scale": Case(ChainSpec(opset=23, inner="rms", inner_scale_shape="G_gs"), "H"),
    "H_rms_normalization_gs_scale": Case(ChainSpec(opset=23, inner="rms"), "H"),
    "H_mul_square": Case(ChainSpec(opset=23, square="mul"), "H"),
    "H_pow_rsqrt": Case(ChainSpec(opset=23, rsqrt="pow"), "H"),
    # I: mobius, the weight is the RMSNormalization's scale; half builds round h before the norm
    "I_f32_grouped": Case(ChainSpec(**MOBIUS, group_target=(-1, 4, 16), restore_from_shape=True), "I"),
    "I_f16_grouped": Case(
        ChainSpec(**MOBIUS, **mobius_half(FLOAT16), group_target=(-1, 4, 16), restore_from_shape=True),
        "I",
        output_dtype=FLOAT16,
        gated_dtype=FLOAT16,
    ),
    "I_bf16_grouped": Case(
        ChainSpec(**MOBIUS, **mobius_half(BFLOAT16), group_target=(-1, 4, 16), restore_from_shape=True),
        "I",
        output_dtype=BFLOAT16,
        gated_dtype=BFLOAT16,
        runnable=False,
    ),
    "I_constant_G_gs_scale": Case(ChainSpec(**MOBIUS, scale_reshaped=False), "I"),
    "I_f32_ungrouped": Case(ChainSpec(**MOBIUS, grouped=False, group_size=64), "I"),
    "I_f16_ungrouped": Case(
        ChainSpec(**MOBIUS, **mobius_half(FLOAT16), grouped=False, group_size=64),
        "I",
        output_dtype=FLOAT16,
        gated_dtype=FLOAT16,
    ),
    # J: Falcon-H1, the weight multiplies the groups (as [G, gs]) before the second Reshape, in float32
    "J_f32_constant_G_gs": Case(ChainSpec(weight_in_group="G_gs"), "J"),
    "J_f32_reshaped_weight": Case(ChainSpec(weight_in_group="reshape", shape_as="dynamic", leading=("b", "s")), "J"),
    "J_weight_target_concat_of_constants": Case(
        ChainSpec(weight_in_group="reshape", scalars_as_constants=True, epsilon_as="constant_node"), "J"
    ),
    "J_f16_reshape_then_cast": Case(
        ChainSpec(weight_in_group="reshape_cast", **FALCON_HALF), "J", output_dtype=FLOAT16
    ),
    "J_f16_cast_then_reshape_weight_last": Case(
        ChainSpec(weight_in_group="cast_reshape", weight_first=False, **FALCON_HALF), "J", output_dtype=FLOAT16
    ),
    "J_torchscript_no_op_cast": Case(
        ChainSpec(
            weight_in_group="reshape",
            opset=17,
            axes_as="attribute",
            rsqrt="div_one",
            shape_as="torchscript",
            gated_cast=FLOAT,
        ),
        "J",
    ),
    # ungrouped spellings of the other forms (n_groups = 1 without a Reshape): group_size = C
    "A_ungrouped": Case(ChainSpec(grouped=False, group_size=64), "A"),
    "C_ungrouped_f16": Case(ChainSpec(**F16_DECODE, grouped=False, group_size=64), "C", FLOAT16, FLOAT16),
    "F_ungrouped": Case(ChainSpec(inner="sln", grouped=False, group_size=64), "F"),
    "H_ungrouped": Case(ChainSpec(opset=23, inner="rms", grouped=False, group_size=64), "H"),
    # TorchScript's no-op Cast(to=f32) of the product before the first Reshape
    "E_no_op_gated_cast": Case(
        ChainSpec(opset=17, axes_as="attribute", rsqrt="div_one", shape_as="torchscript", gated_cast=FLOAT), "E"
    ),
    # inputs: a narrowing Cast (double -> f32) stays in front of the fused node
    "narrowing_input_cast_stays": Case(ChainSpec(y_dtype=DOUBLE, cast_y=True), "A", kept_ops=("Cast",)),
}


def _nodes(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def _fused_node(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "GatedGroupRMSNorm"]
    return node


def _expected(case: Case, feeds: dict[str, np.ndarray], model: onnx.ModelProto) -> np.ndarray:
    """Return the float64-evaluated op on the fused node's attributes (the accuracy yardstick)."""
    weight = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name.startswith("weight")))
    weight = weight.reshape(-1)  # a [G, gs] scale is W row by row
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in _fused_node(model).attribute}
    y = feeds["y"].astype(np.float32) if feeds["y"].dtype == np.float64 else feeds["y"]
    result = gated_group_rms_norm(
        y,
        feeds["z"],
        weight,
        epsilon=attrs["epsilon"],
        group_size=attrs["group_size"],
        norm_dtype=onnx_type_to_dtype(attrs["norm_dtype"]),
        output_dtype=onnx_type_to_dtype(attrs["output_dtype"]),
        gated_dtype=onnx_type_to_dtype(attrs["gated_dtype"]) if "gated_dtype" in attrs else None,
        compute_dtype=np.float64,
    )
    if case.spec.trailing_cast is not None and case.kept_ops:
        # The Cast after a half weight Mul stays in the graph: it widens the op's output exactly.
        result = result.astype(onnx_type_to_dtype(case.spec.trailing_cast))
    return result


def _half(case: Case) -> bool:
    return case.norm_dtype != FLOAT


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, use_library: bool) -> np.ndarray:
    return contrib_ops.session(model, use_library=use_library).run(["out"], feeds)[0]


def _assert_within(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    ok, message = budget_report(actual, expected)
    assert ok, f"{what}: {message}"


def _assert_close_to_stock_ort(
    actual: np.ndarray, stock: np.ndarray, what: str, *, half_rounding: bool = False
) -> None:
    """Compare with the unfused chain run by ORT CPU, which is less exact than the op's budget.

    Measured: ORT's Sigmoid (MLAS) puts the unfused chain up to ~3e-5 relative off the float64 result
    where the gate is very negative, so the op's 2e-6 budget cannot hold against it; and for a half
    weight Mul, ORT computes in f32 and drops the Casts around it (no half rounding at all). Half
    outputs: at most 1 ulp apart. float32: rtol 1e-4, or 2e-3 (one half ulp) when the chain rounds
    to half before a float32 output.
    """
    assert actual.dtype == stock.dtype and actual.shape == stock.shape, what
    if actual.dtype == np.float32:
        rtol = 2e-3 if half_rounding else 1e-4
        np.testing.assert_allclose(actual, stock, rtol=rtol, atol=1e-6, err_msg=what)
    else:
        distance = ulp_distance(actual, stock)
        assert int(distance.max()) <= 1, f"{what}: {int((distance > 1).sum())} elements > 1 ulp"


def _fuse(name: str) -> tuple[Case, onnx.ModelProto, onnx.ModelProto, Report]:
    case = CASES[name]
    original = build_chain(case.spec)
    fused, report = rewrite_model(original)
    return case, original, fused, report


@pytest.fixture(scope="module", params=sorted(CASES))
def fused_case(request) -> tuple[Case, onnx.ModelProto, onnx.ModelProto, Report]:
    return _fuse(request.param)


#: ONNX Runtime CPU runs these originals (not bf16, not com.microsoft SimplifiedLayerNormalization).
RUNNABLE = sorted(name for name, case in CASES.items() if case.runnable)


@pytest.fixture(scope="module", params=RUNNABLE)
def runnable_case(request) -> tuple[Case, onnx.ModelProto, onnx.ModelProto, Report]:
    return _fuse(request.param)


def test_fuses_exactly_one_chain(fused_case) -> None:
    case, original, fused, report = fused_case
    assert report.fused == 1, report.summary()
    assert report.refused == []
    assert report.chains_found == {case.form: 1}
    assert sorted(_nodes(fused)) == sorted(["GatedGroupRMSNorm", "Identity", *case.kept_ops])
    assert not CHAIN_OPS & set(_nodes(fused))
    assert report.nodes_after == len(fused.graph.node) < report.nodes_before == len(original.graph.node)


def test_infers_attributes(fused_case) -> None:
    case, _, fused, _ = fused_case
    node = _fused_node(fused)
    assert node.domain == "ai.mambafuse"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["epsilon"] == pytest.approx(case.spec.epsilon, rel=1e-6)
    assert attrs["group_size"] == case.spec.group_size
    assert attrs["norm_dtype"] == case.norm_dtype
    assert attrs["output_dtype"] == case.output_dtype
    assert attrs.get("gated_dtype", FLOAT) == case.gated_dtype
    # Inputs are the tensors before any widening Cast: the kernel widens them exactly. A narrowing
    # Cast (double -> f32) stays, and its output is the input.
    if case.spec.y_dtype == DOUBLE:
        cast = next(n for n in fused.graph.node if n.op_type == "Cast")
        assert list(node.input[:2]) == [cast.output[0], "z"]
    else:
        assert list(node.input[:2]) == ["y", "z"]


def test_fused_model_is_valid_and_carries_the_function(fused_case) -> None:
    case, _, fused, _ = fused_case
    assert [(f.domain, f.name) for f in fused.functions] == [("ai.mambafuse", "GatedGroupRMSNorm")]
    if case.runnable:  # the others use ops whose schema the checker does not know (com.microsoft)
        onnx.checker.check_model(
            fused, full_check=case.spec.inner not in ("sln", "sln_ms") and case.spec.silu != "quick_gelu"
        )


@pytest.mark.parametrize("use_library", [False, True], ids=["function", "library"])
def test_parity(runnable_case, use_library: bool, request: pytest.FixtureRequest) -> None:
    """The fused model, through its function or the library, against the reference and the original."""
    if use_library:
        request.getfixturevalue("library")  # a missing library fails here, it is not skipped
    case, original, fused, _ = runnable_case
    feeds = chain_inputs(case.spec)
    backend = "library" if use_library else "function"
    fused_out = _run(fused, feeds, use_library=use_library)
    _assert_within(fused_out, _expected(case, feeds, fused), f"fused ({backend}) vs float64 reference")
    _assert_close_to_stock_ort(
        fused_out,
        _run(original, feeds, use_library=False),
        f"fused ({backend}) vs original",
        half_rounding=_half(case),
    )


def test_parity_reference_evaluator_half_types() -> None:
    """bf16 chains cannot run in ORT CPU: check the fused node's attributes against onnx.reference."""
    from fusion.reference import reference_evaluator

    case = CASES["C_bf16_decode"]
    original = build_chain(case.spec)
    fused, _ = rewrite_model(original, function=False)
    feeds = chain_inputs(case.spec)
    want = onnx.reference.ReferenceEvaluator(original).run(["out"], feeds)[0]
    got = reference_evaluator(fused).run(["out"], feeds)[0]
    _assert_within(got, _expected(case, feeds, fused), "fused, reference evaluator")
    _assert_within(want, _expected(case, feeds, fused), "original, reference evaluator")


def test_dynamic_leading_dims_run_at_other_sizes(library: str) -> None:
    spec = ChainSpec(shape_as="dynamic", leading=("batch", "seq"), z_dtype=FLOAT16, cast_z=True, trailing_cast=FLOAT16)
    original = build_chain(spec)
    fused, _ = rewrite_model(original)
    for leading in ((1, 1), (3, 7)):
        feeds = chain_inputs(spec, leading)
        want = _run(original, feeds, use_library=False)
        for use_library in (False, True):
            got = _run(fused, feeds, use_library=use_library)
            _assert_close_to_stock_ort(got, want, f"{leading} library={use_library}")


def test_every_chain_of_a_multi_chain_model_is_fused() -> None:
    """Two chains sharing eps/shape initializers: both fuse, and the shared constants go with them."""
    first = build_chain(ChainSpec(seed=1))
    graph = first.graph
    # Feed the first chain's output as the second chain's y (a Mamba layer's next block, roughly).
    second = build_chain(ChainSpec(seed=2))
    rename = {name: f"second_{name}" for node in second.graph.node for name in node.output}
    rename["y"] = "out"
    rename["weight"] = "second_weight"
    for node in second.graph.node:
        node.name = f"second_{node.name}"
        node.input[:] = [rename.get(i, i) for i in node.input]
        node.output[:] = [rename.get(o, o) for o in node.output]
    graph.node.extend(second.graph.node)
    weight = next(i for i in second.graph.initializer if i.name == "weight")
    weight.name = "second_weight"
    graph.initializer.append(weight)
    graph.output[0].name = "second_out"
    graph.output.append(onnx.helper.make_tensor_value_info("out", FLOAT, [2, 3, 64]))
    onnx.checker.check_model(first)
    fused, report = rewrite_model(first)
    assert report.fused == 2, report.summary()
    assert _nodes(fused).count("GatedGroupRMSNorm") == 2
    assert {i.name for i in fused.graph.initializer} == {"weight", "second_weight"}
    feeds = chain_inputs(ChainSpec())
    sess = contrib_ops.session(first, use_library=False)
    want = sess.run(["second_out", "out"], feeds)
    got = contrib_ops.session(fused, use_library=False).run(["second_out", "out"], feeds)
    for w, g in zip(want, got, strict=True):
        _assert_close_to_stock_ort(g, w, "multi-chain")


def test_second_run_fuses_nothing() -> None:
    fused, _ = rewrite_model(build_chain(ChainSpec(**F16_DECODE)))
    again, report = rewrite_model(fused)
    assert report.fused == 0 and report.chains_found == {} and report.refused == []
    assert again.SerializeToString() == fused.SerializeToString()


def test_shape_reader_of_the_product_is_rerouted() -> None:
    """A Shape(h) feeding something outside the chain is rerouted to Shape(y): h and y agree."""
    model = build_chain(ChainSpec(shape_as="dynamic", leading=("b", "s")))
    shape_node = next(n for n in model.graph.node if n.op_type == "Shape")
    model.graph.node.append(onnx.helper.make_node("Shape", [shape_node.input[0]], ["h_shape"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("h_shape", onnx.TensorProto.INT64, [3]))
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    (shape,) = [n for n in fused.graph.node if n.op_type == "Shape"]
    assert list(shape.input) == ["y"]
    feeds = chain_inputs(ChainSpec(leading=(2, 3)))
    got = contrib_ops.session(fused, use_library=False).run(["h_shape"], feeds)[0]
    assert got.tolist() == [2, 3, 64]


def test_widening_cast_read_elsewhere_stays() -> None:
    """Cast(z -> f32) also read outside the chain: the Cast stays and its output feeds the fused node."""
    spec = ChainSpec(z_dtype=FLOAT16, cast_z=True)
    model = build_chain(spec)
    cast = next(n for n in model.graph.node if n.op_type == "Cast")
    model.graph.node.append(onnx.helper.make_node("Neg", [cast.output[0]], ["z_neg"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("z_neg", FLOAT, [2, 3, 64]))
    fused, report = rewrite_model(model)
    assert report.fused == 1
    assert _fused_node(fused).input[1] == cast.output[0]
    assert "Cast" in _nodes(fused)


# --- near-misses: not fused, a reason, graph unchanged -------------------------------------------------

NEAR_MISSES: dict[str, tuple[ChainSpec, str]] = {
    "norm_before_gate": (ChainSpec(norm_before_gate=True), "norm_before_gate"),
    "reduce_other_axis": (ChainSpec(axis=-2), "not the last (group) axis"),
    "reduce_other_axis_attribute": (ChainSpec(opset=17, axes_as="attribute", axis=2), "not the last"),
    "keepdims_0": (ChainSpec(keepdims=0), "keepdims=0"),
    "exponent_3": (ChainSpec(exponent=3.0), "Pow(x, 3.0)"),
    "exponent_3_constant_nodes": (
        ChainSpec(exponent=3.0, scalars_as_constants=True, epsilon_as="constant_node"),
        "Pow(x, 3.0)",
    ),
    "keepdims_0_torchscript": (
        ChainSpec(opset=17, axes_as="attribute", shape_as="torchscript", keepdims=0),
        "keepdims=0",
    ),
    "epsilon_not_constant": (ChainSpec(epsilon_as="graph_input"), "epsilon is not a constant"),
    "epsilon_not_scalar": (ChainSpec(epsilon_as="vector"), "not a scalar"),
    "weight_not_C": (ChainSpec(weight_shape=(1, 64)), "not [C]"),
    "C_not_divisible": (ChainSpec(channels=64, group_size=24), "not divisible"),
    # W [C] times a [2, 3, C, 1] output is an outer product
    "restore_not_ending_in_C": (ChainSpec(restore_shape=(2, 3, 64, 1)), "does not end in C = 64"),
    "leak_product": (ChainSpec(leak="gated"), "graph output"),
    "leak_groups": (ChainSpec(leak="grouped"), "graph output"),
    "leak_normalized": (ChainSpec(leak="flat"), "graph output"),
    "quick_gelu_not_silu": (ChainSpec(silu="quick_gelu", quick_gelu_alpha=1.702), None),
    "sln_scale_not_ones": (ChainSpec(inner="sln", inner_scale_value=2.0), "not all ones"),
    "sln_over_two_axes": (ChainSpec(inner="sln", inner_axis=-2), "not over the last axis"),
    "half_product": (ChainSpec(y_dtype=FLOAT16, z_dtype=FLOAT16, weight_dtype=FLOAT16), "float32"),
}


def _serialized(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString()


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_miss_is_refused_and_graph_unchanged(name: str) -> None:
    spec, reason = NEAR_MISSES[name]
    model = ir.from_proto(build_chain(spec))
    before = _serialized(model)
    log = FusionLog()
    assert fuse_gated_group_rms_norm(model, log) == 0
    assert _serialized(model) == before
    fused, report = rewrite_model(build_chain(spec))
    assert report.fused == 0
    assert fused.SerializeToString() == build_chain(spec).SerializeToString()
    assert len(report.refused) == 1, report.summary()
    if reason is not None:
        assert reason in report.refused[0][1], report.refused


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("target", [(3, 2, 64), (6, 64)])
def test_restore_to_another_shape_keeps_that_reshape(target: tuple[int, ...], opset: int) -> None:
    """A second Reshape to another shape ending in C: the fused node's output (y's shape, the same elements
    in the same order) is reshaped to the original's target, so the output is the original's. Opset 13's
    Reshape has no allowzero attribute: the model stays valid."""
    spec = ChainSpec(restore_shape=target, opset=opset, axes_as="attribute" if opset < 18 else "input")
    model = build_chain(spec)
    fused, report = rewrite_model(model)
    onnx.checker.check_model(fused)
    assert report.fused == 1, report.summary()
    node = next(n for n in fused.graph.node if n.op_type == "GatedGroupRMSNorm")
    reshape = next(n for n in fused.graph.node if node.output[0] in n.input)
    assert reshape.op_type == "Reshape"
    feeds = chain_inputs(spec)
    want = contrib_ops.session(model, use_library=False).run(None, feeds)[0]
    assert want.shape == target
    for use_library in (True, False):
        got = contrib_ops.session(fused, use_library=use_library).run(None, feeds)[0]
        assert got.shape == target
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_restore_to_y_shape_adds_no_reshape() -> None:
    fused, report = rewrite_model(build_chain(ChainSpec()))
    assert report.fused == 1
    assert "Reshape" not in [n.op_type for n in fused.graph.node]


def test_rsqrt_pow_other_exponent_is_refused() -> None:
    model = build_chain(ChainSpec(opset=23, rsqrt="pow"))
    minus_half = next(i for i in model.graph.initializer if i.name == "minus_half")
    minus_half.CopyFrom(onnx.numpy_helper.from_array(np.array(-0.25, np.float32), "minus_half"))
    ir_model = ir.from_proto(model)
    before = _serialized(ir_model)
    assert fuse_gated_group_rms_norm(ir_model) == 0
    assert _serialized(ir_model) == before
    _, report = rewrite_model(model)
    assert "Pow(x, -0.25)" in report.refused[0][1]


def test_div_numerator_not_one_is_refused() -> None:
    model = build_chain(ChainSpec(rsqrt="div_one"))
    one = next(i for i in model.graph.initializer if i.name == "one")
    one.CopyFrom(onnx.numpy_helper.from_array(np.array(2.0, np.float32), "one"))
    _, report = rewrite_model(model)
    assert report.fused == 0 and "Div(2.0" in report.refused[0][1]


def test_intermediate_read_by_another_node_is_refused() -> None:
    model = build_chain(ChainSpec())
    mean = next(n for n in model.graph.node if n.op_type == "ReduceMean")
    model.graph.node.append(onnx.helper.make_node("Neg", [mean.output[0]], ["mean_neg"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("mean_neg", FLOAT, [2, 3, 4, 1]))
    ir_model = ir.from_proto(model)
    before = _serialized(ir_model)
    assert fuse_gated_group_rms_norm(ir_model) == 0
    assert _serialized(ir_model) == before
    _, report = rewrite_model(model)
    assert "outside the chain" in report.refused[0][1]


def test_trailing_half_cast_after_all_float_chain_stays() -> None:
    """y, gate and W float32 with a trailing Cast(to=f16): the op's output is float32 for all-float
    inputs, so the chain fuses with output_dtype float and the Cast stays after it."""
    model = build_chain(ChainSpec(trailing_cast=FLOAT16))
    fused, report = rewrite_model(model)
    assert report.fused == 1
    (node,) = [n for n in fused.graph.node if n.op_type == "GatedGroupRMSNorm"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["output_dtype"] == FLOAT
    casts = [n for n in fused.graph.node if n.op_type == "Cast"]
    assert [onnx.helper.get_attribute_value(c.attribute[0]) for c in casts] == [FLOAT16]
    assert casts[0].input[0] == node.output[0]


def test_axes_as_a_reshaped_constant_fuse() -> None:
    """dynamo with optimize=False writes ReduceMean's axes as Reshape(Constant([-1]), [1])."""
    model = build_chain(ChainSpec(scalars_as_constants=True))
    (mean,) = [n for n in model.graph.node if n.op_type == "ReduceMean"]
    reshaped = onnx.helper.make_node("Reshape", [mean.input[1], "axes_shape"], ["axes_reshaped"])
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "axes_shape"))
    index = list(model.graph.node).index(mean)
    model.graph.node.insert(index, reshaped)
    mean.input[1] = "axes_reshaped"
    onnx.checker.check_model(model)
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    assert "ReduceMean" not in {n.op_type for n in fused.graph.node}


def test_domain_imported_at_ort_placeholder_version_is_reset() -> None:
    """A model saved by an ORT session with the library registered imports ai.mambafuse at 1000."""
    model = build_chain(ChainSpec())
    model.opset_import.append(onnx.helper.make_opsetid("ai.mambafuse", 1000))
    fused, report = rewrite_model(model)
    assert report.fused == 1
    assert {o.domain: o.version for o in fused.opset_import}["ai.mambafuse"] == 1
    onnx.checker.check_model(fused)


def test_y_width_written_as_an_expression_of_seq_fuses() -> None:
    """torch.export records y's width after a chunked scan as an expression of seq that equals C."""
    model = build_chain(ChainSpec(shape_as="dynamic", leading=("batch", "seq")))
    y = next(i for i in model.graph.input if i.name == "y")
    y.type.tensor_type.shape.dim[-1].dim_param = "((64*Min(seq, 16*((seq + Mod(16 - Mod(seq, 16), 16))//16)))//seq)"
    fused, report = rewrite_model(model)
    assert report.fused == 1, report.summary()
    feeds = chain_inputs(ChainSpec(shape_as="dynamic", leading=("batch", "seq")), leading=(2, 5))
    got = contrib_ops.session(fused, use_library=True).run(None, feeds)[0]
    want = contrib_ops.session(model, use_library=False).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# --- diagnostics: counts count chains, reasons are true -------------------------------------------------


def _insert_identity_after(model: onnx.ModelProto, op_type: str) -> onnx.ModelProto:
    """Put an Identity after every ``op_type`` node: a spelling no rule knows, the chain otherwise intact."""
    for index in reversed(range(len(model.graph.node))):
        node = model.graph.node[index]
        if node.op_type != op_type:
            continue
        original = node.output[0]
        node.output[0] = f"{original}_pre_identity"
        model.graph.node.insert(index + 1, onnx.helper.make_node("Identity", [node.output[0]], [original]))
    return model


def test_weight_reshape_is_not_counted_as_a_chain() -> None:
    """mobius reshapes the weight into the norm's scale: 2 chains are 2, fused or refused."""
    spec = ChainSpec(**MOBIUS, group_target=(-1, 4, 16), restore_from_shape=True)
    _, report = rewrite_model(build_chain_sequence(spec, 2))
    assert (report.fused, sum(report.chains_found.values())) == (2, 2)
    unknown = _insert_identity_after(build_chain_sequence(spec, 2), "RMSNormalization")
    _, report = rewrite_model(unknown)
    assert (report.fused, sum(report.chains_found.values()), len(report.refused)) == (0, 2, 2), report.summary()


def test_unknown_spelling_of_a_gate_first_chain_is_not_called_gate_after_norm() -> None:
    """The reason comes from the chain itself, never from the next layer's gate."""
    spec = ChainSpec(**MOBIUS, **mobius_half(FLOAT16), group_target=(-1, 4, 16), restore_from_shape=True)
    model = _insert_identity_after(build_chain_sequence(spec, 2), "RMSNormalization")
    _, report = rewrite_model(model)
    reasons = [reason for _, reason in report.refused]
    assert len(reasons) == 2
    assert not any("after the norm" in reason for reason in reasons), reasons


def test_norm_before_gate_is_still_named() -> None:
    _, report = rewrite_model(build_chain(ChainSpec(norm_before_gate=True)))
    assert report.fused == 0
    assert "after the norm" in report.refused[0][1]


def _with_float_cast_before_trailing(model: onnx.ModelProto, to: int = FLOAT) -> onnx.ModelProto:
    """The chain with a Cast of the weighted product to ``to`` inserted before its trailing Cast (TorchScript's
    Falcon-H1 norm writes ``.to(float32)`` there, before the model's own Cast to half)."""
    output = next(n for n in model.graph.node if n.output[0] == "out")  # the chain's Identity to "out"
    trailing = next(n for n in model.graph.node if n.output[0] == output.input[0])
    assert trailing.op_type == "Cast"
    first = onnx.helper.make_node("Cast", [trailing.input[0]], ["product_cast"], to=to)
    model.graph.node.insert(list(model.graph.node).index(trailing), first)
    trailing.input[0] = "product_cast"
    onnx.checker.check_model(model)
    return model


def _fused_attrs(fused: onnx.ModelProto) -> tuple[onnx.NodeProto, dict]:
    node = _fused_node(fused)
    return node, {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _assert_node_within_budget(got: np.ndarray, fused: onnx.ModelProto, feeds: dict, output_dtype: type) -> None:
    """``got`` (the node's output, or its exact widening) inside the op's budget for the fused node's inputs."""
    node, attrs = _fused_attrs(fused)
    weight = next(i for i in fused.graph.initializer if i.name == node.input[2])
    reference = reference_for_budget(
        feeds["y"],
        feeds["z"],
        onnx.numpy_helper.to_array(weight),
        epsilon=attrs["epsilon"],
        group_size=attrs["group_size"],
        norm_dtype=np.float32,
        output_dtype=output_dtype,
    )
    ok, message = budget_report(got.astype(output_dtype), **reference)
    assert ok, message


def _fused_with_a_cast_after(model: onnx.ModelProto, output_dtype: int, cast_to: int) -> onnx.ModelProto:
    """Fuse ``model`` (one chain, no refusal) and check the node's output_dtype and the one Cast left after it."""
    fused, report = rewrite_model(model)
    assert report.fused == 1 and not report.refused, report.summary()
    node, attrs = _fused_attrs(fused)
    assert attrs["output_dtype"] == output_dtype
    (cast,) = [n for n in fused.graph.node if n.op_type == "Cast"]
    assert cast.input[0] == node.output[0] and onnx.helper.get_attribute_value(cast.attribute[0]) == cast_to
    return fused


@pytest.mark.parametrize("weight_in_group", [None, "reshape"], ids=["weight-after", "weight-in-group"])
def test_trailing_half_cast_after_a_float32_cast_is_absorbed(weight_in_group: str | None) -> None:
    """Cast(to=f32) of the float32 product, then the Cast to half: the first is a no-op, so the node takes
    both and rounds to half once, as the graph does; nothing is left after it. Through the function body and
    the library's kernel: inside the op's budget."""
    spec = ChainSpec(z_dtype=FLOAT16, cast_z=True, trailing_cast=FLOAT16, weight_in_group=weight_in_group)
    model = _with_float_cast_before_trailing(build_chain(spec))
    fused, report = rewrite_model(model)
    assert report.fused == 1 and not report.refused, report.summary()
    _, attrs = _fused_attrs(fused)
    assert attrs["output_dtype"] == FLOAT16
    assert "Cast" not in {n.op_type for n in fused.graph.node}
    feeds = chain_inputs(spec)
    for use_library in (True, False):
        _assert_node_within_budget(_run(fused, feeds, use_library=use_library), fused, feeds, np.float16)
    _assert_node_within_budget(_run(model, feeds, use_library=False), fused, feeds, np.float16)


def test_product_rounded_then_widened_before_the_trailing_cast_is_not_one_cast() -> None:
    """Cast(to=f16) then Cast(to=f32): a rounding and a widening. The node takes the first as its output
    rounding and the widening stays after it."""
    spec = ChainSpec(z_dtype=FLOAT16, cast_z=True, trailing_cast=FLOAT)
    fused = _fused_with_a_cast_after(_with_float_cast_before_trailing(build_chain(spec), to=FLOAT16), FLOAT16, FLOAT)
    feeds = chain_inputs(spec)
    for use_library in (True, False):
        got = _run(fused, feeds, use_library=use_library)
        assert got.dtype == np.float32
        _assert_node_within_budget(got, fused, feeds, np.float16)


def test_float32_cast_read_elsewhere_stays_with_the_half_cast() -> None:
    """The float32 Cast's output read by another node: the node ends at that Cast (output float32) and the
    Cast to half stays after it, with no refusal reported (a rule that ends earlier explains the chain)."""
    spec = ChainSpec(z_dtype=FLOAT16, cast_z=True, trailing_cast=FLOAT16)
    model = _with_float_cast_before_trailing(build_chain(spec))
    model.graph.node.append(onnx.helper.make_node("Neg", ["product_cast"], ["product_neg"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("product_neg", FLOAT, None))
    fused = _fused_with_a_cast_after(model, FLOAT, FLOAT16)
    feeds = chain_inputs(spec)
    for use_library in (True, False):
        out, negated = contrib_ops.session(fused, use_library=use_library).run(["out", "product_neg"], feeds)
        _assert_node_within_budget(-negated, fused, feeds, np.float32)
        _assert_node_within_budget(out, fused, feeds, np.float16)
