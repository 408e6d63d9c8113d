"""``mambafuse optimize``'s conv parts (fusion/rules/conv_parts.py): a prompt conv whose output is split by channels
becomes one CausalConv1d per part, cut by the projection's Split, and computes the same bits.

Every fused prefill fixture of the torch exporters (dynamo, TorchScript; every family) loses its second Split and
gives the same outputs bit for bit, through the kernels and through the model-local function. Small graphs cover
the forms the fixtures do not (an initial state computed in the graph, the final state read, channels-first, a
Split's sizes as an attribute or an even split) and each refusal.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import contrib_ops
from fusion.rewrite import rewrite_model
from fusion.rules import attach_functions
from fusion.rules.conv_parts import _grouped, split_conv_parts
from models.runtime import feeds, load_references
from tests._cuda import CUDA, cuda_problem, with_supported_ir
from tests.test_decode_step_rules import MANIFESTS, SETS, _run

PREFILL = sorted(
    (name, stem)
    for name, manifest in MANIFESTS.items()
    for stem, record in manifest["fixtures"].items()
    if record["mode"] == "prefill"
)
KEY = "CausalConv1d by part"
PROJECTION = "in-projection by part"


@cache
def _fused(name: str, stem: str) -> onnx.ModelProto:
    return rewrite_model(onnx.load(SETS[name] / MANIFESTS[name]["fixtures"][stem]["file"]))[0]


def _parts(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int], list[str]]:
    graph = ir.from_proto(model)
    counts, refused = split_conv_parts(graph)
    return ir.to_proto(graph), counts, refused


def _split_convs(model: onnx.ModelProto) -> int:
    """CausalConv1d nodes whose output some Split reads."""
    split_inputs = {node.input[0] for node in model.graph.node if node.op_type == "Split"}
    return sum(node.op_type == "CausalConv1d" and node.output[0] in split_inputs for node in model.graph.node)


#: The largest difference, relative to the largest output, of a float16 prefill with its projection cut into parts on
#: ONNX Runtime's CPU (measured at most 8.4e-4 over the fixtures: 1-2 float16 ulps of the largest logit).
PROJECTION_FP16_CPU = 2e-3


def _close(actual: list[np.ndarray], expected: list[np.ndarray], relative: float) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        wide_a, wide_e = a.astype(np.float64), e.astype(np.float64)
        scale = max(float(np.abs(wide_e).max()), np.finfo(np.float32).tiny)
        error = float(np.abs(wide_a - wide_e).max())
        assert error <= relative * scale, f"max difference {error:.3g} = {error / scale:.3g} of the largest output"


def _same_bits(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        differ = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
        assert differ == 0, f"{differ} of {a.size} elements differ"


@pytest.mark.parametrize(("name", "stem"), PREFILL)
def test_every_fixture_conv_is_cut_and_computes_the_same_bits(name: str, stem: str) -> None:
    record = MANIFESTS[name]["fixtures"][stem]
    fused = _fused(name, stem)
    after, counts, refused = _parts(fused)
    before_convs = sum(node.op_type == "CausalConv1d" for node in fused.graph.node)
    if "-transformers-" in stem:
        # transformers' exporter computes the cached conv state from the conv's input in the graph: that reader
        # needs the whole input, so the conv stays whole (and says so where its output is split)
        assert counts[KEY] == 0
        assert all("read by other nodes" in reason for reason in refused)
        return
    assert not refused
    onnx.checker.check_model(after)
    assert counts[KEY] == _split_convs(fused)
    if "-noopt-" not in stem:
        assert counts[KEY] > 0, "the form this pass exists for is gone from the exports"
    # x alone, B and C together: one more conv each, the Split after it now over B and C only; the projection's
    # Split gone where a MatMul of a constant weight makes it (one MatMul per part instead; Falcon-H1 scales the
    # projection's columns by its multipliers first: one MatMul and one Mul per part there)
    assert counts[PROJECTION] == counts[KEY]
    if stem.startswith("falcon_h1"):
        muls = sum(node.op_type == "Mul" for node in after.graph.node) - sum(
            node.op_type == "Mul" for node in fused.graph.node
        )
        assert muls == 3 * counts[PROJECTION]  # the projection's one Mul as 4: z, x, B and C, dt
    assert (
        sum(node.op_type == "Split" for node in after.graph.node)
        == sum(node.op_type == "Split" for node in fused.graph.node) - counts[PROJECTION]
    )
    assert sum(node.op_type == "CausalConv1d" for node in after.graph.node) == before_convs + counts[KEY]
    conv_outputs = {node.output[0] for node in after.graph.node if node.op_type == "CausalConv1d"}
    assert all(len(n.output) == 2 for n in after.graph.node if n.op_type == "Split" and n.input[0] in conv_outputs)
    assert _split_convs(after) == counts[KEY]
    again, second, second_refused = _parts(after)
    assert second[KEY] == 0 and len(second_refused) == counts[KEY]  # run again, it leaves its result alone
    reasons = ["not a Split's output"] * counts[PROJECTION] + ["more than 4"] * (counts[KEY] - counts[PROJECTION])
    assert sorted(any(r in reason for r in reasons) for reason in second_refused) == [True] * counts[KEY]
    assert sum("not a Split's output" in reason for reason in second_refused) == counts[PROJECTION]
    used = {name for node in after.graph.node for name in node.input}
    assert all(tensor.name in used for tensor in after.graph.initializer), "an initializer was left behind"
    if record["dtype"] == "bf16":
        return  # ONNX Runtime's CPU has no bfloat16 Where or Conv: these exports do not run here
    inputs = feeds(record, load_references(SETS[name])[stem])
    if record["dtype"] == "fp16" and counts[PROJECTION]:
        # ONNX Runtime's CPU float16 GEMM rounds a product's columns differently at another width (1-2 ulps of
        # the logits; its float32 GEMM and cuBLAS do not: bit for bit above and in the CUDA test)
        _close(_run(after, inputs, library=True), _run(fused, inputs, library=True), PROJECTION_FP16_CPU)
        _close(_run(after, inputs), _run(fused, inputs), PROJECTION_FP16_CPU)
        return
    _same_bits(_run(after, inputs, library=True), _run(fused, inputs, library=True))
    _same_bits(_run(after, inputs), _run(fused, inputs))


FALCON_FP32 = [
    (name, stem)
    for name, stem in PREFILL
    if stem.startswith("falcon_h1") and "-fp32-" in stem and "-noopt-" not in stem  # noopt: no conv parts
]


def _scaled_projections(model: onnx.ModelProto, seed: int = 0) -> tuple[onnx.ModelProto, int]:
    """``model`` with each constant vector that multiplies a MatMul before a Split (Falcon-H1's in-projection
    multipliers, all ones in the random-weight fixtures) drawn from [0.5, 2) instead, element by element distinct, so
    that a part scaled by another part's columns would show; and how many were drawn."""
    rng = np.random.default_rng(seed)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    split_inputs = {node.input[0] for node in model.graph.node if node.op_type == "Split"}
    drawn = 0
    for node in model.graph.node:
        if node.op_type != "Mul" or node.output[0] not in split_inputs:
            continue
        for name in node.input:
            if name in initializers:
                tensor = initializers[name]
            elif name in producers and producers[name].op_type == "Constant":
                tensor = producers[name].attribute[0].t
            else:
                continue
            data = numpy_helper.to_array(tensor)
            tensor.CopyFrom(numpy_helper.from_array(rng.uniform(0.5, 2.0, data.shape).astype(data.dtype), tensor.name))
            drawn += 1
    return model, drawn


@pytest.mark.parametrize(("name", "stem"), FALCON_FP32)
def test_falcon_h1s_multipliers_scale_each_part_by_its_own_columns(name: str, stem: str) -> None:
    """Falcon-H1's projection is MatMul(h, W) * m before its Split: by part, each part is its columns of W times
    its columns of m. With m drawn (not ones), the fused model and the one cut by part give the same bits."""
    fused, drawn = _scaled_projections(_fused(name, stem))
    assert drawn > 0, "no multiplier before the projection's Split: the form this test exists for is gone"
    after, counts, refused = _parts(fused)
    assert counts[PROJECTION] == counts[KEY] > 0 and not refused
    inputs = feeds(MANIFESTS[name]["fixtures"][stem], load_references(SETS[name])[stem])
    _same_bits(_run(after, inputs, library=True), _run(fused, inputs, library=True))
    _same_bits(_run(after, inputs), _run(fused, inputs))


CUDA_PROBLEM = cuda_problem(pytest.importorskip("onnxruntime"))
#: The fixtures that run on ONNX Runtime's CUDA provider with the library (no bfloat16 Where on the CPU either).
CUDA_FIXTURES = [
    (name, stem)
    for name, stem in PREFILL
    if "-transformers-" not in stem and "-noopt-" not in stem and MANIFESTS[name]["fixtures"][stem]["dtype"] != "bf16"
]


@pytest.mark.skipif(CUDA_PROBLEM is not None, reason=CUDA_PROBLEM or "")
@pytest.mark.parametrize(("name", "stem"), CUDA_FIXTURES)
def test_on_cuda_the_parts_compute_the_same_bits(name: str, stem: str) -> None:
    """The CUDA kernel picks its path by the channel count (the parts are narrower than the whole): every path
    computes each channel alike."""
    fused = _fused(name, stem)
    after, counts, _ = _parts(fused)
    assert counts[KEY] > 0
    inputs = feeds(MANIFESTS[name]["fixtures"][stem], load_references(SETS[name])[stem])

    def run(model: onnx.ModelProto) -> list[np.ndarray]:
        providers = [CUDA, "CPUExecutionProvider"]
        return contrib_ops.session(with_supported_ir(model), providers=providers, use_library=True).run(None, inputs)

    _same_bits(run(after), run(fused))


# Small graphs: P (B, L, 4 + C + 2) split into (z, xBC, dt); the conv over xBC; its output split into parts.
C, K, S = 24, 4, 3


def _graph(
    *,
    parts: list[int] | None = (8, 8, 8),
    part_axis: int = -1,
    before_axis: int = -1,
    channels_last: bool = True,
    state: str = "zeros",  # "input": a graph input, "cast input": a Cast of one; "zeros": a ConstantOfShape; "none"
    final_state_out: bool = False,
    sizes_as_attribute: bool = False,
    even: bool = False,
    extra_x_reader: bool = False,
    opset: int = 18,
    projection: bool = False,  # P = MatMul(h, W) with W an initializer (h: (B, L, 16))
    extra_p_reader: bool = False,
    shape_reader: bool = False,  # a Shape of xBC's batch axis, as the exporters' zero initial state reads it
) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    width = 4 + C + 2
    p_shape = ["B", "L", width] if channels_last else ["B", width, "L"]
    initializers = [
        numpy_helper.from_array(rng.standard_normal((C, 1, K)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "b"),
    ]
    nodes = []
    if projection:
        inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "L", 16])]
        initializers.append(numpy_helper.from_array(rng.standard_normal((16, width)).astype(np.float32), "W"))
        nodes.append(helper.make_node("MatMul", ["h", "W"], ["P"]))
    else:
        inputs = [helper.make_tensor_value_info("P", TensorProto.FLOAT, p_shape)]
    before_sizes = [4, C, 2]
    if sizes_as_attribute:
        nodes.append(helper.make_node("Split", ["P"], ["z", "xBC", "dt"], axis=before_axis, split=before_sizes))
    else:
        initializers.append(numpy_helper.from_array(np.array(before_sizes, np.int64), "before_sizes"))
        nodes.append(helper.make_node("Split", ["P", "before_sizes"], ["z", "xBC", "dt"], axis=before_axis))
    conv_inputs = ["xBC", "w", "b"]
    if state == "input":
        inputs.append(helper.make_tensor_value_info("s0", TensorProto.FLOAT, ["B", C, S]))
        conv_inputs.append("s0")
    elif state == "cast input":
        inputs.append(helper.make_tensor_value_info("s0_half", TensorProto.FLOAT16, ["B", C, S]))
        nodes.append(helper.make_node("Cast", ["s0_half"], ["s0"], to=TensorProto.FLOAT))
        conv_inputs.append("s0")
    elif state == "zeros":
        initializers.append(numpy_helper.from_array(np.array([2, C, S], np.int64), "state_shape"))
        nodes.append(helper.make_node("ConstantOfShape", ["state_shape"], ["s0"]))
        conv_inputs.append("s0")
    nodes.append(
        helper.make_node(
            "CausalConv1d",
            conv_inputs,
            ["y", "final_state"],
            domain="ai.mambafuse",
            state_width=S,
            channels_last=int(channels_last),
        )
    )
    names = ["x", "B_", "C_"][: len(parts) if parts else 3]
    if even:
        nodes.append(helper.make_node("Split", ["y"], names, axis=part_axis, num_outputs=len(names)))
    elif sizes_as_attribute:
        nodes.append(helper.make_node("Split", ["y"], names, axis=part_axis, split=list(parts)))
    else:
        initializers.append(numpy_helper.from_array(np.array(parts, np.int64), "part_sizes"))
        nodes.append(helper.make_node("Split", ["y", "part_sizes"], names, axis=part_axis))
    outputs = ["z", *names, "dt"]
    if extra_p_reader:
        nodes.append(helper.make_node("Neg", ["P"], ["P_neg"]))
        outputs.append("P_neg")
    if shape_reader:
        nodes.append(helper.make_node("Shape", ["xBC"], ["batch"], end=1))
        outputs.append("batch")
    if extra_x_reader:
        nodes.append(helper.make_node("Neg", ["xBC"], ["xBC_neg"]))
        outputs.append("xBC_neg")
    if final_state_out:
        outputs.append("final_state")
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [
            helper.make_tensor_value_info(o, TensorProto.INT64 if o == "batch" else TensorProto.FLOAT, None)
            for o in outputs
        ],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("ai.mambafuse", 1)]
    )
    return _with_functions(with_supported_ir(model))


def _with_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    attach_functions(model)  # none below opset 15, the body's
    return model


def _feeds(model: onnx.ModelProto, batch: int = 2, length: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    out = {}
    for value in model.graph.input:
        dims = [d.dim_value or {"B": batch, "L": length}[d.dim_param] for d in value.type.tensor_type.shape.dim]
        out[value.name] = rng.standard_normal(dims).astype(np.float32)
    return out


FORMS = {
    "zeros": {},
    "no state, final state read": {"state": "none", "final_state_out": True},
    "channels first": {"channels_last": False, "part_axis": 1, "before_axis": 1, "final_state_out": True},
    "sizes as attributes, opset 11": {"sizes_as_attribute": True, "opset": 11},
    "even split": {"even": True},
    "two uneven parts, positive axes": {"parts": [20, 4], "part_axis": 2, "before_axis": 2},
}


@pytest.mark.parametrize("form", FORMS)
def test_a_small_graph_is_cut_and_computes_the_same_bits(form: str) -> None:
    kwargs = FORMS[form]
    model = _graph(**kwargs)
    after, counts, refused = _parts(model)
    assert counts[KEY] == 1 and not refused
    node_types = [node.op_type for node in after.graph.node]
    parts = len(kwargs.get("parts", (8, 8, 8)))
    # the projection's Split has room for two groups: three parts are x alone and the other two behind a Split
    assert node_types.count("CausalConv1d") == min(parts, 2)
    assert node_types.count("Split") == (2 if parts > 2 else 1)
    assert ("Concat" in node_types) == kwargs.get("final_state_out", False)
    # the weight and bias are cut into initializers; the old ones are gone
    initializer_names = {tensor.name for tensor in after.graph.initializer}
    assert "w" not in initializer_names and "b" not in initializer_names
    assert "Slice" not in node_types  # every cut input a constant
    inputs = _feeds(model)
    _same_bits(_run(after, inputs, library=True), _run(model, inputs, library=True))
    if model.functions and kwargs.get("state") != "none":  # the body takes every input (docs/causal_conv1d.md)
        assert len(after.functions) == 1
        _same_bits(_run(after, inputs), _run(model, inputs))


def test_a_projection_matmul_is_cut_by_its_weight_columns() -> None:
    """P = MatMul(h, W) read by the Split alone: one MatMul of W's columns per part (z, x, B and C, dt), no Split of
    P; the Shape of the conv input's batch reads h; the same bits (float32 on the CPU)."""
    model = _graph(projection=True, shape_reader=True)
    after, counts, refused = _parts(model)
    assert counts == {KEY: 1, PROJECTION: 1} and not refused
    node_types = [node.op_type for node in after.graph.node]
    assert node_types.count("MatMul") == 4 and node_types.count("Split") == 1  # only B and C's, after their conv
    slices = [node for node in after.graph.node if node.op_type == "Slice" and node.input[0] == "W"]
    assert len(slices) == 4, "the weight's columns are Slices of the one initializer"
    assert next(node for node in after.graph.node if node.op_type == "Shape").input[0] == "h"
    inputs = _feeds(model)
    _same_bits(_run(after, inputs, library=True), _run(model, inputs, library=True))


def test_a_projection_read_elsewhere_keeps_its_split() -> None:
    model = _graph(projection=True, extra_p_reader=True)
    after, counts, refused = _parts(model)
    assert counts == {KEY: 1, PROJECTION: 0} and not refused
    assert [node.op_type for node in after.graph.node].count("MatMul") == 1
    inputs = _feeds(model)
    _same_bits(_run(after, inputs, library=True), _run(model, inputs, library=True))


REFUSALS = {
    "parts over the tokens": ({"part_axis": 1, "parts": [3, 4]}, "not its channels'"),
    "projection split over the tokens": ({"before_axis": 1}, "the Split before the conv is over axis 1"),
    "parts not summing to the channels": ({"parts": [8, 8, 4]}, "summing to its 24 channels"),
    "input read elsewhere": ({"extra_x_reader": True}, "read by other nodes"),
    "state from the graph's inputs (a cache)": ({"state": "input"}, "is the graph input 's0'"),
    "state cast from the graph's inputs": ({"state": "cast input", "projection": True}, "is the graph input 's0_half'"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_leave_the_graph_alone(case: str) -> None:
    kwargs, reason = REFUSALS[case]
    model = _graph(**kwargs)
    after, counts, refused = _parts(model)
    assert counts[KEY] == 0
    assert len(refused) == 1 and reason in refused[0], refused
    assert [n.op_type for n in after.graph.node] == [n.op_type for n in model.graph.node]


def test_a_conv_whose_output_is_not_split_is_not_a_candidate() -> None:
    model = _graph()
    del model.graph.node[-1]
    model.graph.output.pop(1)
    for _ in range(2):
        model.graph.output.pop(1)
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    after, counts, refused = _parts(model)
    assert counts[KEY] == 0 and not refused


@pytest.mark.parametrize(
    ("sizes", "count", "groups"),
    [
        ([8192, 1024, 1024], 2, [[8192], [1024, 1024]]),
        ([1024, 1024, 8192], 2, [[1024, 1024], [8192]]),
        ([5, 1, 1, 5], 3, [[5], [1, 1], [5]]),
        ([8, 8, 8], 3, [[8], [8], [8]]),
        ([3, 4], 4, [[3], [4]]),
    ],
)
def test_parts_are_grouped_with_the_narrowest_shared_groups(sizes, count, groups) -> None:
    assert _grouped(sizes, count) == groups


def test_a_projection_split_without_room_for_two_groups_is_refused() -> None:
    model = _graph()
    split = model.graph.node[0]
    model.graph.initializer.append(numpy_helper.from_array(np.array([2, 2, C, 1, 1], np.int64), "five_sizes"))
    split.input[1] = "five_sizes"
    split.output[:] = ["z", "z2", "xBC", "dt", "dt2"]
    after, counts, refused = _parts(model)
    assert counts[KEY] == 0 and len(refused) == 1 and "more than 4" in refused[0]
