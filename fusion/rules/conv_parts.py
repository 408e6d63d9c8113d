"""Run a prompt conv whose output is split by channels as one ``CausalConv1d`` per part, read from the projection's
own Split.

Used by ``mambafuse optimize``. Every Mamba-2 mixer splits its input projection, runs the prompt conv over one
part and splits the conv's output into the scan's inputs::

    z, xBC, dt = Split(P, [d_inner, d_conv, H], axis=-1)       # P: the in-projection, (B, L, d_in_proj)
    y, state   = CausalConv1d(xBC, w, b, s0)                    # d_conv = d_inner + 2 G N channels
    x, B, C    = Split(y, [d_inner, G N, G N], axis=-1)

ONNX Runtime runs each Split as a copy of its input. The conv is depthwise: channel ``c`` of ``y`` and of ``state``
reads channel ``c`` of ``xBC``, ``w``, ``b`` and ``s0`` and nothing else. So one conv per part of ``y``, each over
that part of ``xBC``, computes the same values, and the first Split can cut those parts directly. It is given at
most MAX_SPLIT_OUTPUTS (4) outputs, so the parts are grouped, the groups of several as narrow as can be, and such a
group's conv output keeps a Split::

    z, x_in, BC_in, dt = Split(P, [d_inner, d_inner, 2 G N, H], axis=-1)
    x, state_x   = CausalConv1d(x_in, w[0:d_inner], b[0:d_inner], s0[:, 0:d_inner])
    BC, state_BC = CausalConv1d(BC_in, w[d_inner:], b[d_inner:], s0[:, d_inner:])
    B, C         = Split(BC, [G N, G N], axis=-1)
    state        = Concat(state_x, state_BC, axis=1)                   # where the graph reads it

Of the second Split's copy only B and C's is left (at Nemotron-H-8B widths and 2048 tokens, 34 of its 42 MB read
and written per layer in float16 are gone). Each output element is the same arithmetic on the same numbers: the
op contract (docs/causal_conv1d.md) fixes every channel's sum, order and roundings, whatever the other channels are.

Where ``P`` is ``MatMul(h, W)`` with a constant weight, or Falcon-H1's ``Mul(MatMul(h, W), m)`` with m a constant
vector over P's columns, and the Split is its only reader, the Split goes too: each part is the product of h with W's
columns of that part (times m's columns of that part),
``MatMul(h, Slice(W, columns))`` (ONNX Runtime folds the Slices when it creates the session; the model keeps one
copy of W). Column j of a product is h times column j of W, so each part is the same dot products; a GEMM may sum
them in another order at another width: ONNX Runtime's CUDA provider (cuBLAS) and its CPU float32 GEMM give the same
bits over every fixture, its CPU float16 GEMM differs by 1-2 float16 ulps of the logits (tests/test_conv_parts.py).
On an H100 the 2048-token prefill of the Nemotron-H-8B-shaped model goes from 8.16 to 7.84 ms (the Splits' 328 µs
gone, the four products 104 µs slower than the one; benchmarks/RESULTS.md).

What is proven from the graph:

* the conv is ``ai.mambafuse::CausalConv1d``, whose ``x`` and ``y`` are 3-D (the op requires it) with channels on
  axis 2 (``channels_last``, the default) or 1; its weight's rows ``C`` are proven (a constant, or proven dims);
* ``y`` is read by one Split only, over the channel axis, and is no graph output; that Split's sizes are a
  constant (its input, or its ``split`` attribute) summing to ``C``, or an even split of ``C``;
* ``x`` is one output of a Split over the same axis with constant sizes, and nothing else reads it but Shapes of
  its other axes (the exporters' batch size for the zero initial state), which then read the Split's input (or h,
  which has those axes too, where the Split goes); that Split has at most MAX_SPLIT_OUTPUTS - 1 outputs (room for
  two groups: the pass, run again, leaves its own result alone);
* for the products: the Split's input is a MatMul's output read by nothing else, of a constant (K, N) weight, and
  the Split is over its last axis.

The weight, bias and initial state are cut along their channel axis (0, 0 and 1): constants here (an initializer,
or one seen through Unsqueeze, Squeeze, Reshape or Identity; a ConstantOfShape of a constant shape, the zeros an
exporter writes for a prompt with no cache), other values by Slice nodes.

A conv whose initial state is one of the graph's inputs (directly or through a Cast) is left whole, by choice, not
for want of a proof: such a graph runs from a cache, so it also serves decode steps of one token (a mobius build
serves the prompt and every step with one graph), and at one token the parts cost more than the copy they save:
four products for one, two convs, the state cut by Slices and joined by a Concat, each a launch of its own. On an
H100 the mobius build's decode step with ``--opt-in linear_attention_scan,causal_conv_with_state`` ran 1101 µs cut
by part against 994 whole, in one run (benchmarks/RESULTS.md); exports of a prompt alone (no cache input) are cut as
above.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import onnx_ir as ir

from fusion._graph import NameSource
from fusion.reference._common import DOMAIN
from fusion.reference.causal_conv1d import OP_TYPE
from fusion.rules._decode import DecodeShapes, Refusal, take_over
from fusion.shapes.dims import constant_array

_ONNX = ("", "ai.onnx")
_RANK = 3  # CausalConv1d's x and y
#: The most outputs the projection's Split is given. ONNX Runtime's CUDA Split copies a last-axis Split of a few
#: outputs with one vectorized kernel whose arguments carry the outputs; with more it runs a generic kernel (one
#: element a thread) after copying its tables to the device (measured on an H100 with onnxruntime-gpu 1.31: the
#: Nemotron-H-8B prefill's 3-output Splits ran 16-byte vectors, a 5-output one 2-byte elements and 4 more copies, so
#: 5 outputs cost more than the copy they saved). A conv's parts beyond this are grouped.
MAX_SPLIT_OUTPUTS = 4
#: The largest ConstantOfShape (an initial conv state of zeros) cut into initializers rather than Slices.
_MAX_FILLED = 1 << 20
_SEEN_THROUGH = ("Unsqueeze", "Squeeze", "Reshape", "Identity", "ConstantOfShape")


@dataclasses.dataclass
class _Plan:
    conv: ir.Node
    after: ir.Node  # the Split of the conv's output
    before: ir.Node  # the Split whose output the conv reads
    index: int  # which output of ``before`` that is
    axis: int  # the channel axis, 1 or 2
    groups: list[list[int]]  # ``after``'s sizes in contiguous groups: a conv each, a Split after a group of several
    before_sizes: list[int]
    shape_readers: list[ir.Node]  # Shapes of the conv's input that read only its other axes
    #: the in-projection MatMul(h, W) whose output only ``before`` reads, cut by W's columns instead of a Split;
    #: None: a Split of ``before``'s input
    projection: ir.Node | None = None
    #: the Mul that scales the projection's columns by a constant vector before ``before`` (Falcon-H1's multipliers),
    #: and which of its inputs is that vector; None: the Split reads the MatMul itself
    scale: tuple[ir.Node, int] | None = None


def _axis(split: ir.Node) -> int:
    """A Split's axis, normalized for a 3-D input."""
    attribute = split.attributes.get("axis")
    axis = 0 if attribute is None else attribute.as_int()
    return axis + _RANK if axis < 0 else axis


def _split_sizes(split: ir.Node, total: int | None) -> list[int] | None:
    """A Split's sizes: its constant ``split`` input or attribute, or an even split of ``total``; None otherwise."""
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        sizes = constant_array(split.inputs[1])
        return None if sizes is None else [int(size) for size in sizes.reshape(-1)]
    attribute = split.attributes.get("split")
    if attribute is not None:
        return list(attribute.as_ints())
    parts = len(split.outputs)
    if total is None or parts == 0 or total % parts:
        return None
    return [total // parts] * parts


def _folded(value: ir.Value) -> np.ndarray | None:
    """``value``'s data where it is an initializer's or a Constant's (its ``value`` tensor), one's seen through
    Unsqueeze, Squeeze, Reshape (to a target of positive ints) or Identity, or a ConstantOfShape's of a constant shape
    (up to _MAX_FILLED elements); else None."""
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.domain in _ONNX and producer.op_type == "Constant":
        tensor = producer.attributes.get("value")
        return tensor.as_tensor().numpy() if tensor is not None and len(producer.attributes) == 1 else None
    if producer is None or producer.domain not in _ONNX or not producer.inputs or producer.inputs[0] is None:
        return None
    if producer.op_type == "ConstantOfShape":
        return _filled(producer)
    inner = _folded(producer.inputs[0])
    if inner is None:
        return None
    if producer.op_type == "Identity":
        return inner
    if producer.op_type == "Squeeze":
        if len(producer.inputs) < 2 or producer.inputs[1] is None:
            return np.squeeze(inner)
        axes = constant_array(producer.inputs[1])
        if axes is None:
            return None
        return np.squeeze(inner, tuple(int(a) + inner.ndim if a < 0 else int(a) for a in axes.reshape(-1)))
    if producer.op_type == "Unsqueeze" and len(producer.inputs) > 1:
        axes = constant_array(producer.inputs[1])
        if axes is None:
            return None
        rank = inner.ndim + axes.size
        return np.expand_dims(inner, tuple(sorted(int(a) + rank if a < 0 else int(a) for a in axes.reshape(-1))))
    if producer.op_type == "Reshape" and len(producer.inputs) > 1:
        target = constant_array(producer.inputs[1])
        if target is None or np.any(target <= 0) or int(np.prod(target)) != inner.size:
            return None
        return inner.reshape([int(d) for d in target])
    return None


def _filled(node: ir.Node) -> np.ndarray | None:
    """A ConstantOfShape's output where its shape is a constant of at most _MAX_FILLED elements, else None."""
    shape = constant_array(node.inputs[0])
    if shape is None or np.any(shape < 0) or int(np.prod(shape)) > _MAX_FILLED:
        return None
    attribute = node.attributes.get("value")
    fill = np.zeros(1, np.float32) if attribute is None else attribute.as_tensor().numpy().reshape(-1)
    return np.full([int(d) for d in shape.reshape(-1)], fill[0], dtype=fill.dtype)


def _plan(conv: ir.Node, shapes: DecodeShapes) -> _Plan | None:
    """The rewrite of ``conv``, None when its output is not split, Refusal when it is but the rest is not proven."""
    y = conv.outputs[0]
    readers = y.uses()
    if len(readers) != 1 or y.is_graph_output():
        return None
    after = readers[0].node
    if after.op_type != "Split" or after.domain not in _ONNX or readers[0].idx != 0:
        return None
    cache = _graph_input_behind(conv.inputs[3] if len(conv.inputs) > 3 else None)
    if cache is not None:
        raise Refusal(
            f"the conv's initial state is the graph input {cache.name!r}: a graph with a cache serves decode steps "
            "too, where a conv cut by part costs more than the copy it saves (kept whole)",
            conv,
        )
    channels_last = conv.attributes.get("channels_last")
    axis = 2 if channels_last is None or channels_last.as_int() == 1 else 1
    if _axis(after) != axis:
        raise Refusal(f"the Split of the conv's output is over axis {_axis(after)}, not its channels' {axis}", after)
    weight_dims = shapes(conv.inputs[1]) if len(conv.inputs) > 1 and conv.inputs[1] is not None else None
    channels = weight_dims[0] if weight_dims else None
    if not isinstance(channels, int):
        raise Refusal("the conv's weight rows (its channels) are not proven", conv)
    part_sizes = _split_sizes(after, channels)
    if part_sizes is None or any(size < 0 for size in part_sizes) or sum(part_sizes) != channels:
        raise Refusal(f"the Split of the conv's output has no constant sizes summing to its {channels} channels", after)
    x = conv.inputs[0]
    before = x.producer() if x is not None else None
    if before is None or before.op_type != "Split" or before.domain not in _ONNX:
        raise Refusal("the conv's input is not a Split's output (parts of it would be one more copy)", conv)
    shape_readers = [use.node for use in x.uses() if use.node is not conv]
    if x.is_graph_output() or len(x.uses()) != len(shape_readers) + 1:
        raise Refusal("the conv's input is a graph output, or the conv reads it twice", x)
    if not all(_reads_other_axes(node, axis) for node in shape_readers):
        raise Refusal("the conv's input is read by other nodes too (other than Shapes of its other axes)", x)
    if _axis(before) != axis:
        raise Refusal(f"the Split before the conv is over axis {_axis(before)}, not its channels' {axis}", before)
    index = list(before.outputs).index(x)
    total = shapes(before.inputs[0])
    before_sizes = _split_sizes(before, total[axis] if total and len(total) == _RANK else None)
    if before_sizes is None or len(before_sizes) != len(before.outputs) or before_sizes[index] != channels:
        raise Refusal(f"the Split before the conv has no constant sizes giving the conv's {channels} channels", before)
    room = MAX_SPLIT_OUTPUTS - (len(before_sizes) - 1)
    if room < 2:
        raise Refusal(
            f"the Split before the conv has {len(before_sizes)} outputs: cut by part it would have more than "
            f"{MAX_SPLIT_OUTPUTS}",
            before,
        )
    groups = _grouped(part_sizes, room)
    projection, scale = _projection(before, axis)
    return _Plan(conv, after, before, index, axis, groups, before_sizes, shape_readers, projection, scale)


def _graph_input_behind(value: ir.Value | None) -> ir.Value | None:
    """The graph input ``value`` is, or is a chain of Casts and Identities of; None otherwise."""
    while value is not None and not value.is_graph_input():
        producer = value.producer()
        if producer is None or producer.op_type not in ("Cast", "Identity") or producer.domain not in _ONNX:
            return None
        value = producer.inputs[0]
    return value


def _projection(before: ir.Node, axis: int) -> tuple[ir.Node | None, tuple[ir.Node, int] | None]:
    """The ``MatMul(h, W)`` whose output the Split ``before`` alone reads, over its last axis, W a constant 2-D
    weight (an initializer or a Constant), and the ``Mul`` between them where the graph scales the product's columns
    by a constant vector first (Falcon-H1's multipliers: the Mul, and which input is the vector); (None, None) where
    the Split's input is anything else."""
    source = before.inputs[0]
    if axis != _RANK - 1 or not _read_once(source):
        return None, None
    producer = source.producer()
    scale, vector = None, None
    if producer is not None and producer.op_type == "Mul" and producer.domain in _ONNX and len(producer.inputs) == 2:
        for j in (0, 1):
            product, vector = producer.inputs[1 - j], _column_vector(producer.inputs[j])
            matmul = product.producer() if product is not None else None
            if vector is not None and matmul is not None and matmul.op_type == "MatMul" and _read_once(product):
                scale, producer = (producer, j), matmul
                break
        if scale is None:
            return None, None
    if producer is None or producer.op_type != "MatMul" or producer.domain not in _ONNX or len(producer.inputs) != 2:
        return None, None
    h, weight = producer.inputs
    tensor = weight.const_value if weight is not None else None
    if h is None or tensor is None or len(tensor.shape) != 2:
        return None, None
    # the vector has W's type (the Mul's operands share one) and one element per column of the product
    if vector is not None and (
        vector.shape[-1] != tensor.shape[1] or ir.DataType.from_numpy(vector.dtype) != tensor.dtype
    ):
        return None, None
    return producer, scale


def _read_once(value: ir.Value | None) -> bool:
    """Whether ``value`` exists, is no graph output and has one reader."""
    return value is not None and not value.is_graph_output() and len(value.uses()) == 1


def _column_vector(vector: ir.Value | None) -> np.ndarray | None:
    """``vector``'s data where it is a constant that a Mul broadcasts along the last axis only: its shape is (D,),
    (1, D) or (1, 1, D), so column j of the product is multiplied by element j, whatever the rows; else None."""
    data = _folded(vector) if vector is not None else None
    if data is None or not 1 <= data.ndim <= _RANK or any(d != 1 for d in data.shape[:-1]):
        return None
    return data


def _grouped(sizes: list[int], count: int) -> list[list[int]]:
    """``sizes`` in at most ``count`` contiguous groups, the channels of the groups of several parts (which keep a
    Split after their conv) as few as possible; the first such grouping."""
    if len(sizes) <= count:
        return [[size] for size in sizes]
    best: list[list[int]] | None = None
    for cuts in itertools.combinations(range(1, len(sizes)), count - 1):
        bounds = [0, *cuts, len(sizes)]
        groups = [sizes[a:b] for a, b in itertools.pairwise(bounds)]
        if best is None or _shared(groups) < _shared(best):
            best = groups
    assert best is not None
    return best


def _shared(groups: list[list[int]]) -> int:
    return sum(sum(group) for group in groups if len(group) > 1)


def _reads_other_axes(node: ir.Node, axis: int) -> bool:
    """Whether ``node`` is a Shape of a 3-D tensor whose ``start`` / ``end`` leave out ``axis`` (it then reads what
    the Split's input has on those axes: Split keeps them)."""
    if node.op_type != "Shape" or node.domain not in _ONNX:
        return False
    start_attribute, end_attribute = node.attributes.get("start"), node.attributes.get("end")
    start = 0 if start_attribute is None else start_attribute.as_int()
    end = _RANK if end_attribute is None else end_attribute.as_int()
    start = min(max(start + _RANK if start < 0 else start, 0), _RANK)
    end = min(max(end + _RANK if end < 0 else end, 0), _RANK)
    return not start <= axis < end


def _channel_parts(
    graph: ir.Graph, value: ir.Value | None, axis: int, sizes: list[int], fresh: NameSource, new_nodes: list[ir.Node]
) -> list[ir.Value | None]:
    """``value`` cut into ``sizes`` along ``axis``: initializers where its data is known, else Slice nodes (appended
    to ``new_nodes``); Nones for an absent input."""
    if value is None:
        return [None] * len(sizes)
    data = _folded(value)
    parts: list[ir.Value | None] = []
    start = 0
    for size in sizes:
        name = fresh(f"{value.name or 'conv_input'}_channels_{start}_{start + size}")
        if data is not None:
            cut = np.take(data, np.arange(start, start + size), axis=axis)
            part = ir.Value(name=name, const_value=ir.tensor(cut, name=name))
            graph.register_initializer(part)
        else:
            bounds = [
                _int64s(graph, [v], fresh(f"{name}_{what}"))
                for what, v in (("start", start), ("end", start + size), ("axis", axis))
            ]
            slice_node = ir.Node("", "Slice", [value, *bounds], num_outputs=1, name=name)
            slice_node.outputs[0].name = name
            if value.dtype is not None:
                slice_node.outputs[0].dtype = value.dtype
            new_nodes.append(slice_node)
            part = slice_node.outputs[0]
        parts.append(part)
        start += size
    return parts


def _int64s(graph: ir.Graph, ints: list[int], name: str) -> ir.Value:
    """A new 1-D int64 initializer of ``graph``."""
    value = ir.Value(name=name, const_value=ir.tensor(np.array(ints, dtype=np.int64), name=name))
    graph.register_initializer(value)
    return value


def _split_node(
    graph: ir.Graph, source: ir.Value, axis: int, sizes: list[int], fresh: NameSource, name: str
) -> ir.Node:
    """A Split of ``source`` into ``sizes`` along ``axis``: sizes as an input (opset 13 and later) or an attribute."""
    attributes = {"axis": ir.AttrInt64("axis", axis)}
    opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0))
    inputs: list[ir.Value | None] = [source]
    if opset >= 13:
        inputs.append(_int64s(graph, sizes, fresh(f"{name}_sizes")))
    else:
        attributes["split"] = ir.AttrInt64s("split", sizes)
    split = ir.Node("", "Split", inputs, attributes=attributes, num_outputs=len(sizes), name=fresh(name))
    for i, output in enumerate(split.outputs):
        output.name = fresh(f"{name}_{i}")
        if source.dtype is not None:
            output.dtype = source.dtype
    return split


def _rewrite(plan: _Plan, fresh: NameSource) -> None:
    conv, after, before = plan.conv, plan.after, plan.before
    graph = conv.graph
    k = plan.index
    group_sizes = [sum(group) for group in plan.groups]
    sizes = plan.before_sizes[:k] + group_sizes + plan.before_sizes[k + 1 :]
    if plan.projection is not None:
        parts = _projection_parts(graph, plan.projection, sizes, fresh, plan.scale)
    else:
        split = _split_node(graph, before.inputs[0], plan.axis, sizes, fresh, f"{before.name or 'split'}_parts")
        graph.insert_before(before, split)
        parts = list(split.outputs)

    new_nodes: list[ir.Node] = []
    conv_inputs = list(conv.inputs) + [None] * (4 - len(conv.inputs))
    weights = _channel_parts(graph, conv_inputs[1], 0, group_sizes, fresh, new_nodes)
    biases = _channel_parts(graph, conv_inputs[2], 0, group_sizes, fresh, new_nodes)
    states = _channel_parts(graph, conv_inputs[3], 1, group_sizes, fresh, new_nodes)
    convs, part_outputs = [], []
    start = 0
    for i, group in enumerate(plan.groups):
        part_inputs = [parts[k + i], weights[i], biases[i], states[i]]
        while part_inputs and part_inputs[-1] is None:
            part_inputs.pop()
        node = ir.Node(
            DOMAIN,
            OP_TYPE,
            part_inputs,
            attributes=[ir.Attr(a.name, a.type, a.value) for a in conv.attributes.values()],
            num_outputs=2,
            name=fresh(f"{conv.name or 'conv'}_channels_{start}_{start + group_sizes[i]}"),
            version=conv.version,
            overload=conv.overload,
        )
        for output, old in zip(node.outputs, conv.outputs, strict=False):
            output.name = fresh(f"{old.name or 'conv'}_part{i}")
            if old.dtype is not None:
                output.dtype = old.dtype
        convs.append(node)
        new_nodes.append(node)
        if len(group) == 1:
            part_outputs.append(node.outputs[0])
        else:  # a group of parts: its conv's output split as the old Split did
            name = f"{after.name or 'split'}_{start}_{start + group_sizes[i]}"
            group_split = _split_node(graph, node.outputs[0], plan.axis, group, fresh, name)
            new_nodes.append(group_split)
            part_outputs += list(group_split.outputs)
        start += group_sizes[i]
    state = conv.outputs[1] if len(conv.outputs) > 1 else None
    concat = None
    if state is not None and (state.uses() or state.is_graph_output()):
        concat = ir.Node(
            "",
            "Concat",
            [node.outputs[1] for node in convs],
            attributes=[ir.AttrInt64("axis", 1)],
            num_outputs=1,
            name=fresh(f"{conv.name or 'conv'}_state_parts"),
        )
        concat.outputs[0].name = fresh(f"{state.name or 'conv_state'}_parts")
        if state.dtype is not None:
            concat.outputs[0].dtype = state.dtype
        new_nodes.append(concat)
    graph.insert_before(conv, new_nodes)

    for j, old in enumerate(before.outputs):
        if j < k:
            take_over(old, parts[j], "_unsplit")
        elif j > k:
            take_over(old, parts[j - 1 + len(plan.groups)], "_unsplit")
    for old, new in zip(after.outputs, part_outputs, strict=True):
        take_over(old, new, "_unsplit")
    if concat is not None:
        take_over(state, concat.outputs[0], "_unsplit")
    # the Shapes read the batch and length axes: the projection's input h has them too (MatMul keeps them)
    source = plan.projection.inputs[0] if plan.projection is not None else before.inputs[0]
    for reader in plan.shape_readers:
        reader.replace_input_with(0, source)
    old_inputs = [v for v in [*conv_inputs[1:], *after.inputs[1:], *before.inputs[1:]] if v is not None]
    removed = [after, conv, before]
    if plan.scale is not None:
        removed.append(plan.scale[0])
        old_inputs.append(plan.scale[0].inputs[plan.scale[1]])
    if plan.projection is not None:
        removed.append(plan.projection)
    graph.remove(removed, safe=True)
    _drop_unused(graph, old_inputs)


def _projection_parts(
    graph: ir.Graph,
    projection: ir.Node,
    sizes: list[int],
    fresh: NameSource,
    scale: tuple[ir.Node, int] | None = None,
) -> list[ir.Value]:
    """``MatMul(h, W[:, a:b])`` for each part [a, b) of ``sizes``, inserted before ``projection``: column j of a
    product is h times column j of W, so each part is what the whole product's columns [a, b) are. The weight's
    columns are Slices of the initializer (ONNX Runtime folds them when the session is created; the model keeps one
    copy of the weight). With ``scale`` (the Mul by a constant vector m after the product, and m's input index) each
    part is then multiplied by m[..., a:b], in the Mul's operand order: element j of the product times m[j], as
    before."""
    h, weight = projection.inputs
    assert h is not None and weight is not None
    name = projection.name or "projection"
    nodes: list[ir.Node] = []
    outputs: list[ir.Value] = []
    start = 0
    for size in sizes:
        bounds = [
            _int64s(graph, [v], fresh(f"{name}_columns_{start}_{start + size}_{what}"))
            for what, v in (("start", start), ("end", start + size), ("axis", 1))
        ]
        columns = ir.Node("", "Slice", [weight, *bounds], num_outputs=1, name=fresh(f"{name}_weight_{start}"))
        columns.outputs[0].name = fresh(f"{weight.name or 'weight'}_columns_{start}_{start + size}")
        columns.outputs[0].dtype = weight.dtype
        product = ir.Node("", "MatMul", [h, columns.outputs[0]], num_outputs=1, name=fresh(f"{name}_part_{start}"))
        product.outputs[0].name = fresh(f"{projection.outputs[0].name or 'projection'}_{start}_{start + size}")
        if projection.outputs[0].dtype is not None:
            product.outputs[0].dtype = projection.outputs[0].dtype
        nodes += [columns, product]
        part = product.outputs[0]
        if scale is not None:
            mul, index = scale
            vector = mul.inputs[index]
            assert vector is not None
            data = _folded(vector)
            assert data is not None
            cut_name = fresh(f"{vector.name or 'scale'}_columns_{start}_{start + size}")
            cut = ir.Value(name=cut_name, const_value=ir.tensor(np.ascontiguousarray(data[..., start : start + size])))
            graph.register_initializer(cut)
            operands = [cut, part] if index == 0 else [part, cut]
            scaled = ir.Node("", "Mul", operands, num_outputs=1, name=fresh(f"{mul.name or 'scale'}_part_{start}"))
            scaled.outputs[0].name = fresh(f"{mul.outputs[0].name or 'scaled'}_{start}_{start + size}")
            scaled.outputs[0].dtype = weight.dtype
            nodes.append(scaled)
            part = scaled.outputs[0]
        outputs.append(part)
        start += size
    graph.insert_before(projection, nodes)
    return outputs


def _drop_unused(graph: ir.Graph, values: list[ir.Value]) -> None:
    """Remove the initializers among ``values`` (and the nodes of _SEEN_THROUGH they were seen through, with their
    own constant inputs) that nothing reads any more."""
    for value in values:
        if value.uses() or value.is_graph_output() or value.is_graph_input():
            continue
        producer = value.producer()
        if producer is None:
            if value.name in graph.initializers:
                del graph.initializers[value.name]
        elif producer.op_type in _SEEN_THROUGH and len(producer.outputs) == 1:
            inputs = [v for v in producer.inputs if v is not None]
            graph.remove(producer, safe=True)
            _drop_unused(graph, inputs)


def split_conv_parts(model: ir.Model) -> tuple[dict[str, int], list[str]]:
    """Rewrite every prompt conv of ``model``'s main graph whose output is split, as above, in place.

    Returns how many were rewritten, and for each one refused, where and why.
    """
    graph = model.graph
    shapes = DecodeShapes(graph)
    fresh = NameSource(model)
    plans: list[_Plan] = []
    refused: list[str] = []
    for node in list(graph):
        if node.op_type != OP_TYPE or node.domain != DOMAIN or not node.inputs:
            continue
        try:
            plan = _plan(node, shapes)
        except Refusal as refusal:
            where = getattr(refusal.culprit, "name", None) or node.name
            refused.append(f"{where}: {refusal.reason}")
            continue
        if plan is not None and not any(plan.before is other.before for other in plans):
            plans.append(plan)
    for plan in plans:
        _rewrite(plan, fresh)
    return {
        "CausalConv1d by part": len(plans),
        "in-projection by part": sum(plan.projection is not None for plan in plans),
    }, refused


__all__ = ["split_conv_parts"]
