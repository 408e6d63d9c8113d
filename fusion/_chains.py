"""Build tiny ONNX models holding one gated group-RMSNorm chain, in any docs/forms.md spelling.

Tests, the CLI tests and benchmarks need a chain of each form and variant without exporting a model;
``build_chain(ChainSpec(...))`` writes the nodes the exporters write. Negative variants (norm before
gate, a wrong axis, a leaked intermediate...) are spec fields too, so a near-miss is one field away
from a chain that fuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fusion.reference import SUPPORTED_TYPES

FLOAT, FLOAT16, BFLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def half_decode(dtype: int = FLOAT16) -> dict[str, int | bool]:
    """Return the ChainSpec fields of a half-precision decode chain (form C): y and gate cast up to fp32,
    the normalized value cast back to ``dtype`` before a ``dtype`` weight multiply."""
    return dict(y_dtype=dtype, z_dtype=dtype, cast_y=True, cast_z=True, norm_cast=dtype, weight_dtype=dtype)


@dataclasses.dataclass(frozen=True)
class ChainSpec:
    """One chain's spelling. Defaults give form A (dynamo fp32, opset 18) with static leading dims."""

    channels: int = 64
    group_size: int = 16
    leading: tuple[int | str, ...] = (2, 3)
    opset: int = 18
    epsilon: float = 1e-5
    # inputs: element types of the graph inputs y / z, and whether a Cast(to=f32) follows them
    y_dtype: int = FLOAT
    z_dtype: int = FLOAT
    cast_y: bool = False
    cast_z: bool = False
    # gate
    silu: Literal["sigmoid_mul", "sigmoid_mul_swapped", "quick_gelu"] = "sigmoid_mul"
    quick_gelu_alpha: float = 1.0
    silu_first: bool = False  # Mul(silu, y) instead of Mul(y, silu)
    # the inner norm
    inner: Literal["decomposed", "sln", "sln_ms", "rms"] = "decomposed"
    inner_scale_shape: Literal["gs", "G_gs"] = "gs"
    inner_scale_value: float = 1.0
    inner_axis: int = -1
    square: Literal["pow", "mul"] = "pow"
    exponent: float = 2.0
    rsqrt: Literal["reciprocal", "div_one", "pow", "div_x"] = "reciprocal"
    axes_as: Literal["input", "attribute"] = "input"
    axis: int | None = None  # None: -1; else the literal axis written
    keepdims: int = 1
    epsilon_as: Literal["initializer", "constant_node", "graph_input", "vector"] = "initializer"
    epsilon_first: bool = False  # Add(eps, mean) instead of Add(mean, eps)
    normed_rsqrt_first: bool = False  # Mul(rsqrt, hg) instead of Mul(hg, rsqrt)
    scalars_as_constants: bool = False  # exponent / axes as Constant nodes (dynamo optimize=False)
    # shapes
    shape_as: Literal["constant", "dynamic", "torchscript"] = "constant"
    restore_shape: tuple[int, ...] | None = None  # override the 2nd Reshape's constant target
    # override the 1st Reshape's target: ints are constants (0 and -1 keep ONNX's meaning), "Li" is
    # Shape(product)[i] (computed at run time)
    group_target: tuple[int | str, ...] | None = None
    # the 1st Reshape's target is a graph input "group_shape" (its value_info claims [..., G, gs])
    group_target_as_input: bool = False
    # the 2nd Reshape's target is Shape(product) (mobius)
    restore_from_shape: bool = False
    # no Reshapes: the norm works on the product's last axis (one group, group_size = C)
    grouped: bool = True
    # Cast(to=gated_cast) of the product before the norm: the third rounding point (mobius, fp16/bf16)
    gated_cast: int | None = None
    # the inner RMSNormalization's scale is the weight (mobius): Reshape(W[C], [G, gs]) when grouped
    # (a constant [G, gs] when scale_reshaped is False), W[C] when not; no weight Mul after the norm
    weight_as_scale: bool = False
    scale_reshaped: bool = True
    # Falcon-H1: the weight multiplies inside the grouped view, before the 2nd Reshape, as a [G, gs]
    # constant ("G_gs"), Reshape(W[C], [G, gs]) ("reshape"), and with a Cast(W -> f32) after or before it
    weight_in_group: Literal["G_gs", "reshape", "reshape_cast", "cast_reshape"] | None = None
    # norm dtype / weight / output
    norm_cast: int | None = None  # Cast after the 2nd Reshape (form C: FLOAT16)
    weight_dtype: int = FLOAT
    weight_cast: bool = False  # explicit Cast(W -> f32) node
    weight_shape: tuple[int, ...] | None = None  # override, for the "W not [C]" near-miss
    weight_first: bool = True  # Mul(W, normed) instead of Mul(normed, W)
    trailing_cast: int | None = None
    # near-misses
    norm_before_gate: bool = False  # norm(y) * silu(z)
    leak: str | None = None  # name of an intermediate that is also a graph output
    seed: int = 0


def _np_dtype(elem_type: int) -> np.dtype:
    # double is not an op type, but a chain may start from it (a narrowing Cast the rule must keep).
    return np.dtype(np.float64) if elem_type == TensorProto.DOUBLE else SUPPORTED_TYPES[elem_type]


def build_chain(spec: ChainSpec) -> onnx.ModelProto:
    """Return a checked ONNX model ``(y, z) -> out`` with one chain spelled as ``spec`` says."""
    rng = np.random.default_rng(spec.seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    extra_inputs: list[onnx.ValueInfoProto] = []
    channels, group_size = spec.channels, spec.group_size
    groups = channels // group_size if group_size else 0
    counter = iter(range(10_000))

    def node(op: str, inputs: Sequence[str], domain: str = "", outputs: int = 1, **attrs: object) -> str:
        index = next(counter)
        names = [f"{op.lower()}_{index}" if i == 0 else f"{op.lower()}_{index}_{i}" for i in range(outputs)]
        nodes.append(helper.make_node(op, list(inputs), names, name=f"{op}_{index}", domain=domain, **attrs))
        return names[0]

    def const(name: str, array: np.ndarray, as_node: bool = False) -> str:
        if as_node:
            nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name)))
        else:
            inits.append(numpy_helper.from_array(array, name))
        return name

    def ints(name: str, values: Sequence[int], as_node: bool = False) -> str:
        return const(name, np.array(values, dtype=np.int64), as_node)

    y = z = None
    y = "y"
    z = "z"
    if spec.cast_y:
        y = node("Cast", [y], to=FLOAT)
    if spec.cast_z:
        z = node("Cast", [z], to=FLOAT)

    if spec.silu == "quick_gelu":
        silu = node("QuickGelu", [z], domain="com.microsoft", alpha=spec.quick_gelu_alpha)
    else:
        sigmoid = node("Sigmoid", [z])
        silu = node("Mul", [sigmoid, z] if spec.silu == "sigmoid_mul_swapped" else [z, sigmoid])

    def gate(value: str) -> str:
        return node("Mul", [silu, value] if spec.silu_first else [value, silu])

    gated = y if spec.norm_before_gate else gate(y)
    if spec.gated_cast is not None:
        gated = node("Cast", [gated], to=spec.gated_cast)
    constant_nodes = spec.scalars_as_constants or spec.shape_as == "torchscript"

    def target_shape(tail: Sequence[int], tag: str) -> str:
        rank = len(spec.leading)
        if spec.shape_as == "constant":
            if any(isinstance(d, str) for d in spec.leading):
                raise ValueError("constant Reshape targets need static leading dims")
            return ints(f"shape_{tag}", [*spec.leading, *tail], spec.scalars_as_constants)  # type: ignore[list-item]
        parts = []
        if spec.shape_as == "dynamic":
            for i in range(rank):
                parts.append(node("Shape", [gated], start=i, end=i + 1))
        else:  # torchscript: Shape -> Gather(i) -> Unsqueeze(0), constants as nodes
            shape = node("Shape", [gated])
            for i in range(rank):
                index = ints(f"index_{tag}_{i}", np.array(i), as_node=True)  # type: ignore[arg-type]
                picked = node("Gather", [shape, index], axis=0)
                axes0 = ints(f"unsqueeze_axes_{tag}_{i}", [0], as_node=True)
                parts.append(node("Unsqueeze", [picked, axes0]))
        parts.append(ints(f"tail_{tag}", list(tail), constant_nodes))
        return node("Concat", parts, axis=0)

    weight_shape = list(spec.weight_shape) if spec.weight_shape is not None else [channels]
    weight_data = (1.0 + 0.5 * rng.standard_normal(weight_shape)).astype(_np_dtype(spec.weight_dtype))
    if not spec.grouped:
        grouped = gated
    elif spec.group_target_as_input:
        extra_inputs.append(helper.make_tensor_value_info("group_shape", TensorProto.INT64, [len(spec.leading) + 2]))
        grouped = node("Reshape", [gated, "group_shape"])
    elif spec.group_target is not None:
        elements = []
        for index, element in enumerate(spec.group_target):
            if isinstance(element, str):
                elements.append(node("Shape", [gated], start=int(element[1:]), end=int(element[1:]) + 1))
            else:
                elements.append(ints(f"group_target_{index}", [element]))
        grouped = node("Reshape", [gated, node("Concat", elements, axis=0)])
    else:
        grouped = node("Reshape", [gated, target_shape([groups, group_size], "in")])

    if spec.weight_as_scale:
        if not spec.grouped:
            scale = const("weight", weight_data)
        elif spec.scale_reshaped:
            scale = node("Reshape", [const("weight", weight_data), ints("scale_shape", [groups, group_size])])
        else:
            scale = const("weight", weight_data.reshape(groups, group_size))
        normed_groups = node("RMSNormalization", [grouped, scale], axis=spec.inner_axis, epsilon=spec.epsilon)
    elif spec.inner in ("sln", "sln_ms", "rms"):
        scale_shape = [group_size] if spec.inner_scale_shape == "gs" else [groups, group_size]
        scale = const("inner_scale", np.full(scale_shape, spec.inner_scale_value, np.float32))
        op = "RMSNormalization" if spec.inner == "rms" else "SimplifiedLayerNormalization"
        domain = "com.microsoft" if spec.inner == "sln_ms" else ""
        attrs: dict[str, object] = {"axis": spec.inner_axis, "epsilon": spec.epsilon}
        if spec.inner != "rms":
            attrs["stash_type"] = 1
        normed_groups = node(op, [grouped, scale], domain=domain, **attrs)
    else:
        if spec.square == "pow":
            exponent = const("exponent", np.array(spec.exponent, np.float32), spec.scalars_as_constants)
            square = node("Pow", [grouped, exponent])
        else:
            square = node("Mul", [grouped, grouped])
        axis = -1 if spec.axis is None else spec.axis
        if spec.axes_as == "input":
            axes = ints("axes", [axis], spec.scalars_as_constants)
            mean = node("ReduceMean", [square, axes], keepdims=spec.keepdims)
        else:
            mean = node("ReduceMean", [square], axes=[axis], keepdims=spec.keepdims)
        if spec.epsilon_as == "graph_input":
            epsilon = "epsilon"
            extra_inputs.append(helper.make_tensor_value_info("epsilon", FLOAT, []))
        elif spec.epsilon_as == "vector":
            epsilon = const("epsilon", np.full([group_size], spec.epsilon, np.float32))
        else:
            epsilon = const("epsilon", np.array(spec.epsilon, np.float32), spec.epsilon_as == "constant_node")
        variance = node("Add", [epsilon, mean] if spec.epsilon_first else [mean, epsilon])
        if spec.rsqrt == "pow":
            minus_half = const("minus_half", np.array(-0.5, np.float32), spec.scalars_as_constants)
            inv_rms = node("Pow", [variance, minus_half])
        else:
            rms = node("Sqrt", [variance])
            if spec.rsqrt == "reciprocal":
                inv_rms = node("Reciprocal", [rms])
            elif spec.rsqrt == "div_one":
                one = const("one", np.array(1.0, np.float32), spec.scalars_as_constants)
                inv_rms = node("Div", [one, rms])
        if spec.rsqrt == "div_x":
            normed_groups = node("Div", [grouped, rms])
        else:
            pair = [inv_rms, grouped] if spec.normed_rsqrt_first else [grouped, inv_rms]
            normed_groups = node("Mul", pair)

    if spec.weight_in_group is not None:
        if spec.weight_in_group == "G_gs":
            grid = ""
        elif spec.scalars_as_constants:  # dynamo optimize=False: Concat of Constant nodes
            parts = [ints("weight_groups", [groups], True), ints("weight_group_size", [group_size], True)]
            grid = node("Concat", parts, axis=0)
        else:
            grid = ints("weight_grid", [groups, group_size])
        if spec.weight_in_group == "G_gs":
            weight_groups = const("weight", weight_data.reshape(groups, group_size))
        elif spec.weight_in_group == "reshape":
            weight_groups = node("Reshape", [const("weight", weight_data), grid])
        elif spec.weight_in_group == "reshape_cast":
            weight_groups = node("Cast", [node("Reshape", [const("weight", weight_data), grid])], to=FLOAT)
        else:
            weight_groups = node("Reshape", [node("Cast", [const("weight", weight_data)], to=FLOAT), grid])
        pair = [weight_groups, normed_groups] if spec.weight_first else [normed_groups, weight_groups]
        normed_groups = node("Mul", pair)
    if not spec.grouped:
        flat = normed_groups
    elif spec.restore_shape is not None:
        flat = node("Reshape", [normed_groups, ints("shape_restore", list(spec.restore_shape))])
    elif spec.restore_from_shape:
        flat = node("Reshape", [normed_groups, node("Shape", [gated])])
    else:
        flat = node("Reshape", [normed_groups, target_shape([channels], "out")])
    normed = node("Cast", [flat], to=spec.norm_cast) if spec.norm_cast is not None else flat

    if spec.weight_as_scale or spec.weight_in_group is not None:
        out = normed
    else:
        weight = const("weight", weight_data)
        if spec.weight_cast:
            weight = node("Cast", [weight], to=FLOAT)
        out = node("Mul", [weight, normed] if spec.weight_first else [normed, weight])
    if spec.norm_before_gate:
        out = gate(out)
    if spec.trailing_cast is not None:
        out = node("Cast", [out], to=spec.trailing_cast)
    nodes.append(helper.make_node("Identity", [out], ["out"], name="output"))

    dims = [*spec.leading, channels]
    inputs = [
        helper.make_tensor_value_info("y", spec.y_dtype, dims),
        helper.make_tensor_value_info("z", spec.z_dtype, dims),
        *extra_inputs,
    ]
    out_dtype = spec.trailing_cast or spec.norm_cast or (spec.weight_dtype if spec.weight_as_scale else FLOAT)
    outputs = [helper.make_tensor_value_info("out", out_dtype, dims)]
    if spec.leak is not None:
        leaked = {"gated": gated, "grouped": grouped, "normed_groups": normed_groups, "flat": flat}[spec.leak]
        leaked_dims = [*spec.leading, groups, group_size] if spec.leak in ("grouped", "normed_groups") else dims
        outputs.append(helper.make_tensor_value_info(leaked, FLOAT, leaked_dims))
    opsets = [helper.make_opsetid("", spec.opset)]
    if spec.silu == "quick_gelu" or spec.inner == "sln_ms":
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    graph = helper.make_graph(nodes, "gated_group_rms_norm_chain", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=opsets, producer_name="mambafuse-tests")
    model.ir_version = min(model.ir_version, 10)  # loadable by onnxruntime 1.23
    # Exports carry value_info for every tensor; shape inference gives the tiny model the same.
    model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    if spec.group_target_as_input:
        # What an exporter might claim about the grouped tensor: [..., G, gs], true or not at run time.
        claimed = helper.make_tensor_value_info(grouped, FLOAT, [*spec.leading, groups, group_size])
        kept = [v for v in model.graph.value_info if v.name != grouped]
        del model.graph.value_info[:]
        model.graph.value_info.extend([*kept, claimed])
    return model


def chain_inputs(spec: ChainSpec, leading: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Return seeded inputs for ``build_chain(spec)``; symbolic leading dims become ``leading``."""
    rng = np.random.default_rng(spec.seed + 1)
    sizes = list(leading) if leading is not None else [d if isinstance(d, int) else 2 for d in spec.leading]
    shape = [*sizes, spec.channels]
    feeds = {
        "y": (2.0 * rng.standard_normal(shape)).astype(_np_dtype(spec.y_dtype)),
        "z": (2.0 * rng.standard_normal(shape)).astype(_np_dtype(spec.z_dtype)),
    }
    if spec.epsilon_as == "graph_input":
        feeds["epsilon"] = np.array(spec.epsilon, np.float32)
    return feeds


def build_chain_sequence(
    spec: ChainSpec, count: int, between: str | None = None, residual: bool = False
) -> onnx.ModelProto:
    """Return ``count`` copies of one chain in sequence: chain i's output is chain i+1's ``y``.

    All chains share the gate input ``z``, which keeps the inputs few. ``between`` puts one unary node
    of that op type (e.g. "Relu") between consecutive chains; ``residual`` adds the chain's ``y`` to its
    output (``Add``), as the residual stream of a real model does — without it, elements whose gate is
    near 0 shrink by silu(z) per chain and reach float subnormals after a few dozen chains, which would
    make a benchmark measure denormal arithmetic. Models a decode step's worth of Mamba layers for
    benchmarks and for counts known by construction.
    """
    base = build_chain(spec)
    y_in, z_in = (i.name for i in base.graph.input)
    out = base.graph.output[0].name
    if base.graph.node[-1].op_type == "Identity":  # build_chain names its output through an Identity
        out = base.graph.node[-1].input[0]
        base.graph.node.pop()
    nodes, initializers = [], []
    previous = y_in
    for i in range(count):
        part = onnx.compose.add_prefix(base, f"c{i}_")
        rename = {f"c{i}_{y_in}": previous, f"c{i}_{z_in}": z_in}
        for node in part.graph.node:
            node.input[:] = [rename.get(name, name) for name in node.input]
            nodes.append(node)
        initializers.extend(part.graph.initializer)
        if residual:
            nodes.append(helper.make_node("Add", [f"c{i}_{out}", previous], [f"c{i}_residual"]))
            previous = f"c{i}_residual"
        else:
            previous = f"c{i}_{out}"
        if between is not None and i < count - 1:
            nodes.append(helper.make_node(between, [previous], [f"{between.lower()}{i}"]))
            previous = f"{between.lower()}{i}"
    graph = helper.make_graph(
        nodes,
        f"{count}_chains",
        list(base.graph.input),
        [helper.make_value_info(previous, base.graph.output[0].type)],  # same type and shape as y
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=list(base.opset_import), ir_version=base.ir_version)
    onnx.checker.check_model(model)
    return model
