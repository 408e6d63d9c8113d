"""Proofs shared by the decode-step rules (CausalConv1dUpdate, SelectiveStateUpdate).

The layout proof: a value reached from a few "leaf" values through layout ops only (Reshape, Expand,
Unsqueeze, Squeeze, Transpose, Identity) is emulated on index arrays: each leaf becomes
``arange(numel).reshape(dims)`` (ints, proven from the graph) and each op is applied as ONNX defines it.
The result says, element by element, which leaf element the value holds, so a rule can compare it with
the op's own indexing (repeat_interleave of groups, the (B, H) rows of a batched MatMul, ...). An op that
would fail on those shapes (a Reshape whose element count does not match) fails the emulation too: the
original graph does not run there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from fusion.rules._graph import Dim, ForwardShapes, constant_array, resolve_shape_tensor

_ONNX_DOMAINS = ("", "ai.onnx")
#: Ops that move elements without computing: the layout proof follows them.
LAYOUT_OPS = frozenset({"Reshape", "Expand", "Unsqueeze", "Squeeze", "Transpose", "Identity"})
_MAX_DEPTH = 16
_MAX_ELEMENTS = 1 << 22


class Refusal(Exception):
    """A check failure: the reason and the node or value it is about."""

    def __init__(self, reason: str, culprit: ir.Node | ir.Value | None = None, *, logged: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.culprit = culprit
        #: False when the matched nodes are not this op's chain at all (nothing to report).
        self.logged = logged


def dtype_name(dtype: ir.DataType | int | None) -> str:
    return "unknown" if dtype is None else ir.DataType(dtype).name.lower()


def producer_op(value: ir.Value | None) -> str | None:
    producer = value.producer() if value is not None else None
    if producer is None or producer.domain not in _ONNX_DOMAINS:
        return None
    return producer.op_type


def int_dims(value: ir.Value, shapes: ForwardShapes, what: str) -> list[int]:
    """Return the proven dims of ``value``, all ints, or refuse naming ``what``."""
    dims = shapes(value)
    if dims is None or not all(isinstance(d, int) for d in dims):
        shown = (
            "unknown" if dims is None else "[" + ", ".join(str(d) if isinstance(d, int) else "?" for d in dims) + "]"
        )
        raise Refusal(f"{what}'s shape is not proven static by the graph ({shown})", value)
    return [int(d) for d in dims]  # type: ignore[arg-type]


def shape_ints(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]]) -> list[int] | None:
    """Return a shape tensor's elements when every one is a proven int, else None."""
    dims = resolve_shape_tensor(value, aliases)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    return [int(d) for d in dims]  # type: ignore[arg-type]


def _attribute_ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(v) for v in attr.as_ints()]


def emulate(
    value: ir.Value, leaves: Mapping[ir.Value, np.ndarray], aliases: Mapping[ir.Value, Sequence[Dim]], depth: int = 0
) -> np.ndarray | None:
    """Return the index array that ``value`` holds, following layout ops back to ``leaves``; None if not."""
    if value in leaves:
        return leaves[value]
    producer = value.producer()
    if depth > _MAX_DEPTH or producer is None or producer.domain not in _ONNX_DOMAINS:
        return None
    op = producer.op_type
    if op not in LAYOUT_OPS or not producer.inputs or producer.inputs[0] is None:
        return None
    source = emulate(producer.inputs[0], leaves, aliases, depth + 1)
    if source is None:
        return None
    second = producer.inputs[1] if len(producer.inputs) > 1 else None
    try:
        if op == "Identity":
            return source
        if op == "Transpose":
            perm = _attribute_ints(producer, "perm")
            return np.transpose(source, perm) if perm is not None else np.transpose(source)
        if op == "Reshape":
            target = shape_ints(second, aliases)
            if target is None:
                return None
            allowzero = producer.attributes.get_int("allowzero", 0)
            if not allowzero:
                target = [source.shape[i] if d == 0 else d for i, d in enumerate(target)]
            elif 0 in target and source.size != 0:
                return None
            return source.reshape(target)
        if op == "Expand":
            target = shape_ints(second, aliases)
            if target is None:
                return None
            shape = np.broadcast_shapes(source.shape, tuple(target))
            if int(np.prod(shape)) > _MAX_ELEMENTS:
                return None
            return np.broadcast_to(source, shape)
        if op in ("Unsqueeze", "Squeeze"):
            axes_array = constant_array(second) if second is not None else None
            axes = (
                [int(a) for a in axes_array.reshape(-1)]
                if axes_array is not None
                else _attribute_ints(producer, "axes")
            )
            if op == "Unsqueeze":
                if axes is None:
                    return None
                rank = source.ndim + len(axes)
                result = source
                for axis in sorted(a % rank for a in axes):
                    result = np.expand_dims(result, axis)
                return result
            if axes is None:
                return np.squeeze(source)
            axes = [a % source.ndim for a in axes]
            if any(source.shape[a] != 1 for a in axes):
                return None
            return np.squeeze(source, axis=tuple(axes))
    except (ValueError, IndexError):
        return None  # the op fails on these shapes: the original does not run there
    return None


def leaf_indices(dims: Sequence[int]) -> np.ndarray:
    """Return ``arange(numel).reshape(dims)``: each element's flat index."""
    return np.arange(int(np.prod(dims, dtype=np.int64)), dtype=np.int64).reshape(tuple(dims))


def layout_source(value: ir.Value, depth: int = 0) -> ir.Value:
    """Return the value ``value`` is made from through layout ops only (itself when not a layout op)."""
    producer = value.producer()
    while (
        producer is not None
        and producer.domain in _ONNX_DOMAINS
        and producer.op_type in LAYOUT_OPS
        and producer.inputs
        and producer.inputs[0] is not None
        and depth < _MAX_DEPTH
    ):
        value = producer.inputs[0]
        producer = value.producer()
        depth += 1
    return value


def depends_on_graph_inputs(value: ir.Value, graph: ir.Graph) -> bool:
    """Whether ``value`` is (or is computed from) a graph input: not a constant of the model."""
    inputs = set(graph.inputs)
    work, seen = [value], set()
    while work:
        current = work.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in inputs:
            return True
        producer = current.producer()
        if producer is None:
            if current.const_value is None:
                return True  # an outer scope's value: not known constant
            continue
        work.extend(v for v in producer.inputs if v is not None)
    return False


def per_head(
    value: ir.Value,
    heads: int,
    broadcast_dims: Sequence[int],
    aliases: Mapping[ir.Value, Sequence[Dim]],
    graph: ir.Graph,
    what: str,
    dtype: ir.DataType,
) -> tuple[ir.Value | None, np.ndarray | None]:
    """Prove ``value`` (broadcast to ``broadcast_dims`` = (H, ...)) depends on the head only.

    Returns (a graph value of H elements to read, None) or (None, the H constants). Refuses when it varies
    along another axis, when it is not computed from constants, or when its dtype is not ``dtype``.
    """
    if value.dtype != dtype:
        raise Refusal(f"{what} is {dtype_name(value.dtype)}, the op reads it as {dtype_name(dtype)}", value)
    source = layout_source(value)
    data = constant_array(source)
    if source.producer() is None and source.const_value is None:
        raise Refusal(f"{what} is not a constant of the model (it is the graph input {source.name!r})", value)
    if data is None and depends_on_graph_inputs(source, graph):
        raise Refusal(f"{what} is not a constant of the model (it is computed from graph inputs)", value)
    source_dims = list(data.shape) if data is not None else None
    if source_dims is None:
        proven = ForwardShapes(None)(source)
        if proven is None or not all(isinstance(d, int) for d in proven):
            raise Refusal(f"{what}'s shape is not proven", value)
        source_dims = [int(d) for d in proven]  # type: ignore[arg-type]
    indices = emulate(value, {source: leaf_indices(source_dims)}, aliases)
    if indices is None:
        raise Refusal(f"{what} is not a broadcast of one tensor that the graph proves", value)
    rank = len(broadcast_dims)
    if indices.ndim > rank or any(
        d not in (1, t) for d, t in zip(indices.shape[::-1], broadcast_dims[::-1], strict=False)
    ):
        raise Refusal(f"{what} (shape {list(indices.shape)}) does not broadcast to {list(broadcast_dims)}", value)
    full = np.broadcast_to(indices.reshape((1,) * (rank - indices.ndim) + indices.shape), tuple(broadcast_dims))
    full = full.reshape(heads, -1)
    if data is not None:
        values = data.reshape(-1)[full]
        same = (values == values[:, :1]) | (np.isnan(values) & np.isnan(values[:, :1]))
        if not same.all():
            raise Refusal(f"{what} is not constant along {broadcast_dims[1:]} (it varies within a head)", value)
        return None, np.ascontiguousarray(values[:, 0])
    if int(np.prod(source_dims)) != heads or not (full == np.arange(heads)[:, None]).all():
        raise Refusal(f"{what} is not one value per head (its elements are not read as [H] broadcast)", value)
    return source, None


def outside_readers(values: Sequence[ir.Value], chain: set[ir.Node]) -> list[ir.Value]:
    """Return the values among ``values`` that a node outside ``chain`` (or the graph's outputs) reads."""
    return [v for v in values if v.is_graph_output() or any(user not in chain for user, _ in v.uses())]


def replace_graph_output(old: ir.Value, new: ir.Value) -> None:
    """Make ``new`` the graph output ``old`` was, under ``old``'s name, type and shape."""
    graph = old.graph
    assert graph is not None
    name = old.name
    old.name = f"{name}_unfused"
    new.name = name
    new.type = old.type if old.type is not None else new.type
    new.shape = old.shape if old.shape is not None else new.shape
    for index, output in enumerate(graph.outputs):
        if output is old:
            graph.outputs[index] = new


def negative_zeros(name: str, count: int, dtype: ir.DataType) -> ir.Value:
    """Return an initializer-ready value of ``count`` -0.0s (adding -0.0 is the identity, even for -0.0)."""
    return ir.Value(name=name, const_value=ir.tensor(np.full(count, -0.0, dtype=dtype.numpy()), name=name))
