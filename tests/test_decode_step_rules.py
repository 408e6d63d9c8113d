"""CausalConv1dUpdate and SelectiveStateUpdate rules on the committed decode fixtures, and their refusals.

Every decode fixture (every family and exporter) must fuse both ops in every Mamba-2 layer, and the fused
model (run through the model-local functions: stock ONNX Runtime, no library) must give the original's
outputs: logits and every present state. Refusals mutate one fixture so that the graph no longer proves
one fact, and check that nothing of that op is fused and the reason is given.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import contrib_ops
from fusion import rewrite
from fusion.rules._decode import same_tensor_source
from fusion.shapes.dims import ForwardShapes
from models.fixtures import FAMILY_FIXTURE_DIR, FIXTURE_DIR
from models.runtime import feeds, load_manifest, load_references

OPS = ("CausalConv1dUpdate", "SelectiveStateUpdate")
SETS = {"models": FIXTURE_DIR, "families": FAMILY_FIXTURE_DIR}
MANIFESTS = {name: load_manifest(path) for name, path in SETS.items()}
DECODE = sorted(
    (name, stem)
    for name, manifest in MANIFESTS.items()
    for stem, record in manifest["fixtures"].items()
    if record["mode"] == "decode"
)
#: Layers the rules refuse, with the reason (strict: the test fails once the gap is closed).
KNOWN_GAPS: dict[str, str] = {}
#: Through the functions the decode ops are bit-identical with the exported ops (the function bodies use
#: them, in the same types and spellings): the fused model's outputs equal those of the model with only
#: the gated norm fused, bit for bit. Against the original, the whole-model difference relative to the
#: largest |output| (tests/test_models_fusion.py's budget, which the gated norm's function needs), plus one
#: step of the output's type at the bottom of its range: these tiny models' fp16 recurrent states are ~1e-5,
#: near the subnormals, where the library's kernels round the float32 state update one step (6e-8) away
#: from the graph in a few elements (bamba / granite transformers fp16 exports: 6.6e-3 of the state's scale).
TOLERANCE = {"fp32": 1e-5, "fp16": 4e-3}


@cache
def _references(name: str):
    return load_references(SETS[name])


@cache
def _original(name: str, stem: str) -> onnx.ModelProto:
    return onnx.load(SETS[name] / MANIFESTS[name]["fixtures"][stem]["file"])


@cache
def _fused(name: str, stem: str):
    return rewrite.rewrite_model(_original(name, stem))


def _params(items):
    return [
        pytest.param(*item, marks=[pytest.mark.xfail(reason=KNOWN_GAPS[item[1]], strict=True)])
        if item[1] in KNOWN_GAPS
        else pytest.param(*item)
        for item in items
    ]


@pytest.mark.parametrize(("name", "stem"), _params(DECODE))
def test_every_mamba_layer_fuses_both_ops(name: str, stem: str) -> None:
    record = MANIFESTS[name]["fixtures"][stem]
    fused, report = _fused(name, stem)
    counts = {op: sum(1 for n in fused.graph.node if n.op_type == op) for op in OPS}
    assert counts == dict.fromkeys(OPS, record["num_mamba_layers"]), (counts, report.summary())
    assert all(not report.decode[op]["refused"] for op in OPS), report.summary()
    # graph inputs and outputs exactly as they were: names, types, shapes
    original = _original(name, stem)
    assert [(v.name, v.type.SerializeToString()) for v in fused.graph.output] == [
        (v.name, v.type.SerializeToString()) for v in original.graph.output
    ]
    assert [(v.name, v.type.SerializeToString()) for v in fused.graph.input] == [
        (v.name, v.type.SerializeToString()) for v in original.graph.input
    ]
    assert {f.name for f in fused.functions} >= set(OPS)
    # The conv weight and bias come straight from the model's constants: a no-op re-view an exporter put in
    # between (dynamo without its optimizer: Unsqueeze(Squeeze(weight, 1), 1)) is not left to run every step.
    producers = {o: n.op_type for n in fused.graph.node for o in n.output}
    for node in fused.graph.node:
        if node.op_type == "CausalConv1dUpdate":
            computed = [(i, producers[i]) for i in node.input[2:] if i in producers]
            assert not computed, f"{node.name} reads its weight / bias through {computed}"
    try:
        onnx.checker.check_model(original)
    except onnx.checker.ValidationError:
        return  # ORT's fusions write contrib ops in the ONNX domain that the checker does not know
    onnx.checker.check_model(fused)


def _run(model: onnx.ModelProto, inputs: dict[str, np.ndarray], library: bool = False) -> list[np.ndarray]:
    if library:
        return contrib_ops.session(model, use_library=True).run(None, inputs)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, inputs
    )


@cache
def _norm_only(name: str, stem: str) -> onnx.ModelProto:
    return rewrite.rewrite_model(_original(name, stem), decode_steps=False)[0]


def scaled_error(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """Return the largest |actual - expected| relative to the largest |expected|, and one subnormal step of
    the output's type on the same scale (the allowance at the bottom of its range)."""
    if not np.issubdtype(expected.dtype, np.floating):  # a count (transformers 5.25's cache lengths): equal
        return (0.0 if np.array_equal(actual, expected) else float("inf")), 0.0
    scale = max(float(np.abs(expected.astype(np.float64)).max()), 1e-30)
    error = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()) / scale
    return error, float(np.finfo(actual.dtype).smallest_subnormal) / scale


def _compare(name: str, stem: str, library: bool) -> None:
    record = MANIFESTS[name]["fixtures"][stem]
    inputs = feeds(record, _references(name)[stem])
    expected = _run(_original(name, stem), inputs)
    actual = _run(_fused(name, stem)[0], inputs, library)
    names = [o.name for o in _original(name, stem).graph.output]
    tolerance = TOLERANCE[record["dtype"]]
    for output, a, e in zip(names, actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, output
        error, floor = scaled_error(a, e)
        assert error <= tolerance + floor, f"{output}: max error {error:.3g} of the output's scale"
    if library:
        return
    for output, a, e in zip(names, actual, _run(_norm_only(name, stem), inputs), strict=True):
        differ = int(np.sum(~((a == e) | (np.isnan(a) & np.isnan(e)))))
        assert differ == 0, f"{output}: {differ} of {a.size} elements differ from the norm-only fused model's"


CPU_DECODE = [(n, s) for n, s in DECODE if MANIFESTS[n]["fixtures"][s]["dtype"] != "bf16"]


@pytest.mark.parametrize(("name", "stem"), CPU_DECODE)
def test_fused_function_matches_original(name: str, stem: str) -> None:
    _compare(name, stem, library=False)


def _library_has_decode_ops() -> str | None:
    """Return why the library cannot run the decode ops here, or None when it can."""
    try:
        path = contrib_ops.library_path()
    except Exception as error:  # no library built
        return f"no mambafuse library ({error})"
    with open(path, "rb") as library:
        data = library.read()
    missing = [op for op in OPS if op.encode() not in data]
    return f"the library has no kernel for {missing} yet" if missing else None


@pytest.mark.parametrize(("name", "stem"), CPU_DECODE)
def test_fused_with_library_matches_original(name: str, stem: str) -> None:
    reason = _library_has_decode_ops()
    if reason:
        pytest.skip(reason)
    _compare(name, stem, library=True)


# --- refusals -----------------------------------------------------------------------------------------------


def _mutated(name: str, stem: str, mutate) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(_original(name, stem))
    mutate(model)
    return model


def _node(model: onnx.ModelProto, op_type: str, **where) -> onnx.NodeProto:
    for node in model.graph.node:
        if node.op_type == op_type and all(getattr(node, k) == v for k, v in where.items()):
            return node
    raise AssertionError(f"no {op_type}")


def _initializer(model: onnx.ModelProto, name: str) -> tuple[int, np.ndarray]:
    index = next(i for i, t in enumerate(model.graph.initializer) if t.name == name)
    return index, numpy_helper.to_array(model.graph.initializer[index])


def _set_initializer(model: onnx.ModelProto, name: str, array: np.ndarray) -> None:
    index, _ = _initializer(model, name)
    model.graph.initializer[index].CopyFrom(numpy_helper.from_array(array, name))


def _producer(model: onnx.ModelProto, output: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if output in n.output)


def _consumers(model: onnx.ModelProto, value: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if value in n.input]


def _first_exp_mul(model: onnx.ModelProto) -> onnx.NodeProto:
    exp = _node(model, "Exp")
    return _producer(model, exp.input[0])


def _a_not_constant_along_n(model):
    mul = _first_exp_mul(model)
    name = next(i for i in mul.input if any(t.name == i for t in model.graph.initializer))
    _, a = _initializer(model, name)
    a = a.copy()
    a[..., 0] *= 2
    _set_initializer(model, name, a)


def _a_graph_input(model):
    mul = _first_exp_mul(model)
    name = next(i for i in mul.input if any(t.name == i for t in model.graph.initializer))
    index, a = _initializer(model, name)
    del model.graph.initializer[index]
    model.graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(a.shape)))


def _dt_bias_varies_along_p(model):
    softplus = _node(model, "Softplus")
    add = _producer(model, softplus.input[0])
    name = next(i for i in add.input if any(t.name == i for t in model.graph.initializer))
    _, bias = _initializer(model, name)
    bias = bias.copy()
    bias[:, 0] += 1
    _set_initializer(model, name, bias)


def _conv_padded(model):
    conv = _node(model, "Conv")
    for attr in conv.attribute:
        if attr.name == "pads":
            attr.ints[:] = [1, 1]


def _conv_slice_wrong_start(model):
    conv = _node(model, "Conv")
    slice_node = _consumers(model, conv.output[0])[0]
    model.graph.initializer.append(numpy_helper.from_array(np.array([-2], np.int64), "wrong_start"))
    slice_node.input[1] = "wrong_start"


def _groups_tiled(model):
    # Reshape(B, [1, G, 1, N]) -> Expand([1, G, r, N]) becomes Reshape(B, [1, 1, G, N]) -> Expand([1, r, G, N]):
    # head h then reads group h % G (torch's repeat, not repeat_interleave).
    expand = next(
        n for n in model.graph.node if n.op_type == "Expand" and len(_initializer_or_none(model, n.input[1])) == 4
    )
    reshape = _producer(model, expand.input[0])
    _, target = _initializer(model, reshape.input[1])
    _, shape = _initializer(model, expand.input[1])
    groups, size = int(target[1]), int(target[3])
    repeats = int(shape[2])
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1, groups, size], np.int64), "tile_target"))
    model.graph.initializer.append(
        numpy_helper.from_array(np.array([1, repeats, groups, size], np.int64), "tile_shape")
    )
    reshape.input[1] = "tile_target"
    expand.input[1] = "tile_shape"


def _initializer_or_none(model, name):
    found = [t for t in model.graph.initializer if t.name == name]
    return numpy_helper.to_array(found[0]).reshape(-1) if found else []


def _extra_rounding(model, consumer_op: str, producer_op: str, to: int, feeds: str | None = None):
    """Insert Cast(to) -> Cast(back) on the first value a ``producer_op`` gives a ``consumer_op`` (one that
    feeds a ``feeds`` node, if given)."""
    for node in model.graph.node:
        if node.op_type != consumer_op:
            continue
        if feeds is not None and not any(n.op_type == feeds for n in _consumers(model, node.output[0])):
            continue
        for index, name in enumerate(node.input):
            source = next((n for n in model.graph.node if name in n.output), None)
            if source is None or source.op_type != producer_op:
                continue
            back = _value_type(model, name)
            node.input[index] = f"{name}_twice"
            position = list(model.graph.node).index(node)
            model.graph.node.insert(position, helper.make_node("Cast", [f"{name}_narrow"], [f"{name}_twice"], to=back))
            model.graph.node.insert(position, helper.make_node("Cast", [name], [f"{name}_narrow"], to=to))
            return
    raise AssertionError(f"no {producer_op} -> {consumer_op}")


def _value_type(model, name: str) -> int:
    inferred = onnx.shape_inference.infer_shapes(model)
    for info in [*inferred.graph.value_info, *inferred.graph.output]:
        if info.name == name:
            return info.type.tensor_type.elem_type
    raise AssertionError(f"no type for {name}")


def _dbx_rounded_to_bfloat16(model):
    # dBx (fp16) -> Cast(bf16) -> Cast(fp16) before its widening Cast: a rounding point the op does not have
    _extra_rounding(model, "Cast", "Mul", onnx.TensorProto.BFLOAT16, feeds="Add")


def _conv_output_rounded_to_bfloat16(model):
    _extra_rounding(model, "Slice", "Conv", onnx.TensorProto.BFLOAT16)


REFUSALS = [
    ("SelectiveStateUpdate", "nemotron_h-dynamo-fp32-decode", "models", _a_not_constant_along_n, "A is not constant"),
    ("SelectiveStateUpdate", "nemotron_h-dynamo-fp32-decode", "models", _a_graph_input, "A is not a constant"),
    (
        "SelectiveStateUpdate",
        "nemotron_h-dynamo-fp32-decode",
        "models",
        _dt_bias_varies_along_p,
        "dt_bias is not constant",
    ),
    ("SelectiveStateUpdate", "mamba2-dynamo-fp16-decode", "families", _groups_tiled, "repeat_interleave"),
    (
        "SelectiveStateUpdate",
        "nemotron_h-dynamo-fp16-decode",
        "models",
        _dbx_rounded_to_bfloat16,
        "dBx is rounded through bfloat16",
    ),
    (
        "CausalConv1dUpdate",
        "nemotron_h-dynamo-fp16-decode",
        "models",
        _conv_output_rounded_to_bfloat16,
        "does not match",
    ),
    ("CausalConv1dUpdate", "nemotron_h-dynamo-fp32-decode", "models", _conv_padded, "pads"),
    ("CausalConv1dUpdate", "nemotron_h-dynamo-fp32-decode", "models", _conv_slice_wrong_start, "last L columns"),
]


@pytest.mark.parametrize(("op", "stem", "name", "mutate", "reason"), REFUSALS, ids=[r[3].__name__ for r in REFUSALS])
def test_refused_with_reason(op: str, stem: str, name: str, mutate, reason: str) -> None:
    model = _mutated(name, stem, mutate)
    fused, report = rewrite.rewrite_model(model)
    refused = report.decode[op]["refused"]
    assert refused, report.summary()
    assert any(reason in why for _, why in refused), refused
    # the mutated chain (the first layer's) is left as it was: one op node fewer than the Mamba layers
    layers = MANIFESTS[name]["fixtures"][stem]["num_mamba_layers"]
    assert sum(1 for n in fused.graph.node if n.op_type == op) == layers - len(refused)


def test_same_tensor_source_follows_only_order_keeping_views() -> None:
    """A no-op re-view chain resolves to its source; a Transpose or a widening Cast in between, or a source of
    other dims, does not."""
    w_data = np.arange(6, dtype=np.float32).reshape(2, 1, 3)
    nodes = [
        helper.make_node("Squeeze", ["w", "one"], ["squeezed"]),
        helper.make_node("Unsqueeze", ["squeezed", "one"], ["view"]),  # (2, 1, 3) again: w itself
        helper.make_node("Reshape", ["w", "shape_231"], ["other"]),  # (2, 3, 1): other dims, itself
        helper.make_node("Transpose", ["other"], ["moved"], perm=[0, 2, 1]),  # (2, 1, 3), but moved
        helper.make_node("Identity", ["moved"], ["moved_view"]),
        helper.make_node("Cast", ["view"], ["wide"], to=TensorProto.DOUBLE),  # another type
    ]
    initializers = [
        numpy_helper.from_array(w_data, "w"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
        numpy_helper.from_array(np.array([2, 3, 1], dtype=np.int64), "shape_231"),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("view", "other", "moved_view")]
    outputs.append(helper.make_tensor_value_info("wide", TensorProto.DOUBLE, None))
    model = helper.make_model(helper.make_graph(nodes, "g", [], outputs, initializers))
    graph = ir.from_proto(model).graph
    values = {v.name: v for v in graph.outputs}
    shapes = ForwardShapes(graph)
    assert same_tensor_source(values["view"], shapes).name == "w"
    assert same_tensor_source(values["other"], shapes).name == "other"
    assert same_tensor_source(values["moved_view"], shapes).name in ("moved", "moved_view")  # never past Transpose
    assert same_tensor_source(values["wide"], shapes).name == "wide"
