"""Property-based tests of the fusion rule: random valid chain spellings fuse and compute the same;
random near-misses (one field away from valid) are left byte-identical.

Deterministic (derandomized) and with modest example counts: each example builds a model and runs
ONNX Runtime sessions.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contrib_ops
from fusion._chains import BFLOAT16, FLOAT, FLOAT16, ChainSpec, build_chain, chain_inputs
from fusion.reference import budget_report, onnx_type_to_dtype, reference_for_budget
from fusion.rewrite import rewrite_model
from fusion.rules.gated_group_rms_norm import fuse_gated_group_rms_norm

SETTINGS = settings(
    derandomize=True,
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def valid_chains(draw: st.DrawFn) -> ChainSpec:
    """Return a random chain spelling that must fuse (ORT CPU can run it: no bf16, no com.microsoft SLN)."""
    group_size = draw(st.sampled_from([8, 16, 24, 40]))
    groups = draw(st.integers(1, 4))
    inner = draw(st.sampled_from(["decomposed", "decomposed", "sln", "rms"]))
    opset = 23 if inner == "rms" else draw(st.sampled_from([17, 18, 23]))
    half_decode = draw(st.booleans())
    half_inputs = half_decode or draw(st.booleans())
    input_dtype = FLOAT16 if half_inputs else FLOAT
    shape_as = draw(st.sampled_from(["constant", "dynamic", "torchscript"]))
    leading_rank = draw(st.integers(1, 3))
    leading = (
        tuple(draw(st.integers(1, 3)) for _ in range(leading_rank))
        if shape_as == "constant"
        else tuple(f"d{i}" for i in range(leading_rank))
    )
    return ChainSpec(
        channels=group_size * groups,
        group_size=group_size,
        leading=leading,
        opset=opset,
        epsilon=draw(st.sampled_from([1e-5, 1e-6, 1e-3])),
        y_dtype=input_dtype,
        z_dtype=input_dtype,
        cast_y=half_inputs or draw(st.booleans()),
        cast_z=half_inputs or draw(st.booleans()),
        silu=draw(st.sampled_from(["sigmoid_mul", "sigmoid_mul_swapped", "quick_gelu"])),
        silu_first=draw(st.booleans()),
        inner=inner,
        inner_scale_shape=draw(st.sampled_from(["gs", "G_gs"])),
        square=draw(st.sampled_from(["pow", "mul"])),
        rsqrt=draw(st.sampled_from(["reciprocal", "div_one", "pow", "div_x"])),
        axes_as="attribute" if opset < 18 else "input",  # ReduceMean axes became an input in 18
        axis=draw(st.sampled_from([None, leading_rank + 1])),
        epsilon_as=draw(st.sampled_from(["initializer", "constant_node"])),
        epsilon_first=draw(st.booleans()),
        normed_rsqrt_first=draw(st.booleans()),
        scalars_as_constants=draw(st.booleans()),
        shape_as=shape_as,
        norm_cast=FLOAT16 if half_decode else draw(st.sampled_from([None, FLOAT])),
        weight_dtype=FLOAT16 if half_decode else draw(st.sampled_from([FLOAT, FLOAT16])),
        weight_cast=not half_decode and draw(st.booleans()),
        weight_first=draw(st.booleans()),
        trailing_cast=None if half_decode else draw(st.sampled_from([None, FLOAT16, FLOAT])),
        seed=draw(st.integers(0, 2**16)),
    )


def _fix_weight(spec: ChainSpec) -> ChainSpec:
    # An f16 weight initializer multiplies an f32 value only through an explicit Cast.
    if spec.norm_cast != FLOAT16 and spec.weight_dtype == FLOAT16 and not spec.weight_cast:
        return dataclasses.replace(spec, weight_cast=True)
    return spec


@SETTINGS
@given(valid_chains())
def test_random_valid_chain_fuses_and_matches_the_reference(spec: ChainSpec) -> None:
    spec = _fix_weight(spec)
    original = build_chain(spec)
    fused, report = rewrite_model(original)
    assert report.fused == 1 and report.refused == [], report.summary()
    assert [n.op_type for n in fused.graph.node if n.op_type != "Cast"] == ["GatedGroupRMSNorm", "Identity"]
    node = next(n for n in fused.graph.node if n.op_type == "GatedGroupRMSNorm")
    attrs = {a.name: a for a in node.attribute}
    assert attrs["group_size"].i == spec.group_size
    feeds = chain_inputs(spec)
    weight = next(i for i in fused.graph.initializer if i.name == "weight")
    from onnx import numpy_helper

    # The budget's yardstick, with what it needs for the norm_dtype tie case (reference_for_budget).
    reference = reference_for_budget(
        feeds["y"],
        feeds["z"],
        numpy_helper.to_array(weight),
        epsilon=attrs["epsilon"].f,
        group_size=attrs["group_size"].i,
        norm_dtype=onnx_type_to_dtype(attrs["norm_dtype"].i),
        output_dtype=onnx_type_to_dtype(attrs["output_dtype"].i),
    )
    # A Cast to half after an all-float32 chain stays after the node (its output is float32): it rounds once.
    kept = [n for n in fused.graph.node if n.op_type == "Cast" and n.input[0] == node.output[0]]
    if kept:
        reference["expected"] = reference["expected"].astype(onnx_type_to_dtype(kept[0].attribute[0].i))
    got = contrib_ops.session(fused, use_library=False).run(["out"], feeds)[0]
    ok, message = budget_report(got, **reference)
    assert ok, message


#: One field changed from a valid chain, and each makes the chain something the op is not.
NEAR_MISS_FIELDS = {
    "norm_before_gate": True,
    "axis": -2,
    "keepdims": 0,
    "exponent": 3.0,
    "epsilon_as": "graph_input",
    "weight_shape": "wrong",
    "leak": "gated",
    "restore_shape": "wrong",
    "quick_gelu_alpha": 1.702,
}


@st.composite
def near_misses(draw: st.DrawFn) -> ChainSpec:
    spec = _fix_weight(draw(valid_chains()))
    field = draw(st.sampled_from(sorted(NEAR_MISS_FIELDS)))
    value = NEAR_MISS_FIELDS[field]
    if field == "weight_shape":
        value = (1, spec.channels)
    if field == "restore_shape":
        spec = dataclasses.replace(spec, shape_as="constant", leading=(2, 3))
        value = (2, 3, spec.channels, 1)  # W then broadcasts into an outer product: not the op
    if field in ("axis", "keepdims", "exponent", "epsilon_as"):
        spec = dataclasses.replace(spec, inner="decomposed", square="pow", opset=18, axes_as="input")
    if field == "quick_gelu_alpha":
        spec = dataclasses.replace(spec, silu="quick_gelu")
    return dataclasses.replace(spec, **{field: value})


@SETTINGS
@given(near_misses())
def test_random_near_miss_is_left_byte_identical(spec: ChainSpec) -> None:
    model = ir.from_proto(build_chain(spec))
    before = ir.to_proto(model).SerializeToString()
    assert fuse_gated_group_rms_norm(model) == 0
    assert ir.to_proto(model).SerializeToString() == before
    _, report = rewrite_model(build_chain(spec))
    assert report.fused == 0 and len(report.refused) == 1, report.summary()


@settings(derandomize=True, max_examples=15, deadline=None)
@given(valid_chains(), st.sampled_from([BFLOAT16]))
def test_random_bf16_chain_fuses_with_bf16_types(spec: ChainSpec, half: int) -> None:
    """bf16 (not runnable on ORT CPU): the fused node keeps the chain's bf16 rounding points."""
    spec = _fix_weight(spec)
    spec = dataclasses.replace(
        spec,
        y_dtype=half if spec.cast_y else spec.y_dtype,
        z_dtype=half if spec.cast_z else spec.z_dtype,
        norm_cast=half if spec.norm_cast == FLOAT16 else spec.norm_cast,
        weight_dtype=half if spec.weight_dtype == FLOAT16 else spec.weight_dtype,
        trailing_cast=half if spec.trailing_cast == FLOAT16 else spec.trailing_cast,
    )
    fused, report = rewrite_model(build_chain(spec))
    assert report.fused == 1, report.summary()
    node = next(n for n in fused.graph.node if n.op_type == "GatedGroupRMSNorm")
    attrs = {a.name: a.i for a in node.attribute if a.name.endswith("dtype")}
    assert attrs["norm_dtype"] == (spec.norm_cast or FLOAT)
    expected_out = spec.norm_cast if spec.norm_cast not in (None, FLOAT) else (spec.trailing_cast or FLOAT)
    assert attrs["output_dtype"] == expected_out
