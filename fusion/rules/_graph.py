"""Graph facts that fusion checks need: constant scalars, and the symbolic dims of shape tensors.

A ``Dim`` is what can be proven about one dimension: an ``int`` (static), a ``str`` (a named symbolic
dim: two equal names are the same size), an opaque ``tuple`` token (an unnamed dim of one particular
value: equal only to itself), a ``QuasiAffine`` expression of one symbolic dim (fusion/rules/_arith.py),
or ``None`` (nothing known). Two dims are provably equal only when both
are not None and compare equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from fusion.rules import _arith

Dim = int | str | tuple[Any, ...] | _arith.QuasiAffine | None

#: Producers of shape tensors that resolve_shape_tensor looks through; deeper chains give up.
_MAX_DEPTH = 32


#: Ops that only rearrange (or, Cast, convert) a constant's elements: a small constant seen through them
#: is still a known constant (dynamo's optimize=False writes ReduceMean axes as Reshape(Constant)).
_ELEMENT_PRESERVING = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten", "Cast"})
_MAX_FOLDED_ELEMENTS = 1024


def constant_array(value: ir.Value | None, _depth: int = 0) -> np.ndarray | None:
    """Return the constant data of ``value`` (initializer or Constant node output), else None.

    Small constants are also seen through element-preserving ops (``_ELEMENT_PRESERVING``); those come
    back flattened to 1-D (a Cast converts them), which is all the checks need of axes and scalars.
    """
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if (
            producer is not None
            and producer.op_type in _ELEMENT_PRESERVING
            and producer.domain in ("", "ai.onnx")
            and producer.inputs
            and _depth < _MAX_DEPTH
        ):
            inner = constant_array(producer.inputs[0], _depth + 1)
            if inner is None or inner.size > _MAX_FOLDED_ELEMENTS:
                return None
            if producer.op_type == "Cast":
                to = producer.attributes.get("to")
                if to is None:
                    return None
                return inner.reshape(-1).astype(ir.DataType(to.as_int()).numpy())
            return inner.reshape(-1)
        if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
            return None
        attr = next(iter(producer.attributes.values()), None)
        if attr is None:
            return None
        if attr.name == "value":
            tensor = attr.as_tensor()
        elif attr.name in ("value_float", "value_int"):
            return np.array(attr.value)
        elif attr.name in ("value_floats", "value_ints"):
            return np.array(list(attr.value))
        else:
            return None
    try:
        return tensor.numpy()
    except Exception:  # external data that cannot be read is "not a known constant"
        return None


def constant_scalar(value: ir.Value | None) -> float | None:
    """Return the single element of a constant with one element (shape [] or [1]), else None."""
    array = constant_array(value)
    if array is None or array.size != 1 or array.ndim > 1:
        return None
    return float(array.reshape(()))


def value_dims(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]]) -> list[Dim] | None:
    """Return the dims of ``value`` as Dims, or None when its rank is unknown.

    ``aliases`` maps values whose dims were proven equal to a known list (the chain's tensors).
    """
    if value is None:
        return None
    if value in aliases:
        return list(aliases[value])
    if value.shape is None:
        return None
    dims: list[Dim] = []
    for index, dim in enumerate(value.shape):
        if isinstance(dim, int):
            dims.append(dim)
        elif isinstance(dim, ir.SymbolicDim) and dim.value:
            dims.append(dim.value)
        else:
            dims.append(("dim", id(value), index))
    return dims


def _normalized_slice(length: int, start: int, end: int | None) -> slice:
    # ONNX Shape/Slice semantics: negative indices count from the end, out-of-range ones clamp.
    def clamp(index: int) -> int:
        if index < 0:
            index += length
        return min(max(index, 0), length)

    return slice(clamp(start), length if end is None else clamp(end))


def resolve_shape_tensor(
    value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int = 0
) -> list[Dim] | None:
    """Return the elements of a 1-D int64 shape tensor as Dims, or None when its length is unknown.

    Follows constants and the shape arithmetic that exporters emit around a Reshape: ``Shape`` (with
    start/end), ``Concat``, ``Gather``/``Slice`` of a shape, ``Unsqueeze`` of a scalar, ``Cast``,
    ``Identity``, and scalar ``Mul``/``Div`` of known ints.
    """
    if value is None or depth > _MAX_DEPTH:
        return None
    array = constant_array(value)
    if array is not None:
        if array.ndim > 1 or array.dtype.kind not in "iu":
            return None
        return [int(v) for v in array.reshape(-1)]
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return None
    op = producer.op_type
    inputs = producer.inputs
    if op == "Shape":
        dims = value_dims(inputs[0], aliases)
        if dims is None:
            return None
        start = producer.attributes.get_int("start", 0)
        end_attr = producer.attributes.get("end")
        end = None if end_attr is None else end_attr.as_int()
        return dims[_normalized_slice(len(dims), start, end)]
    if op == "Concat":
        parts = [resolve_shape_tensor(v, aliases, depth + 1) for v in inputs]
        if any(part is None for part in parts):
            return None
        return [dim for part in parts for dim in part]  # type: ignore[union-attr]
    if op == "Reshape" and len(inputs) > 1:
        # A scalar made 1-D: one element. Reshape to [1] guarantees that (or fails); to [-1] only when
        # the input is proven to be one element (a resolved scalar).
        target = constant_array(inputs[1])
        if target is not None and target.size == 1 and int(target.reshape(-1)[0]) in (-1, 1):
            scalar = resolve_scalar(inputs[0], aliases, depth + 1)
            if scalar is not _UNRESOLVED:
                return [scalar]
            return [None] if int(target.reshape(-1)[0]) == 1 else None
    if op in ("Cast", "Identity"):
        return resolve_shape_tensor(inputs[0], aliases, depth + 1)
    if op == "Unsqueeze":
        # The result is a valid 1-D shape only when the input is a scalar: one element, known or not.
        scalar = resolve_scalar(inputs[0], aliases, depth + 1)
        return [None if scalar is _UNRESOLVED else scalar]
    if op == "Gather":
        source = resolve_shape_tensor(inputs[0], aliases, depth + 1)
        indices = constant_array(inputs[1]) if len(inputs) > 1 else None
        if source is None or indices is None or indices.ndim != 1:
            return None
        try:
            return [source[int(i)] for i in indices]
        except IndexError:
            return None
    if op == "Slice":
        source = resolve_shape_tensor(inputs[0], aliases, depth + 1)
        starts = constant_array(inputs[1]) if len(inputs) > 1 else None
        ends = constant_array(inputs[2]) if len(inputs) > 2 else None
        steps = constant_array(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else None
        if source is None or starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        if steps is not None and int(steps.reshape(-1)[0]) != 1:
            return None
        end = int(ends.reshape(-1)[0])
        end = min(end, len(source)) if end >= 0 else end
        return source[_normalized_slice(len(source), int(starts.reshape(-1)[0]), end)]
    return None


class _Unresolved:
    """Marker for a scalar that cannot be resolved (distinct from a resolved-but-unknown None)."""


_UNRESOLVED: Any = _Unresolved()


def resolve_scalar(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int = 0) -> Any:
    """Return one shape element held by a scalar int tensor, as a Dim; _UNRESOLVED when unknown.

    Int arithmetic on shape elements (Add, Sub, Mul, Div, Mod, Min, Max) is followed when it is proven
    to give a constant, or exactly one symbolic dim, for every size of that dim (fusion/rules/_arith.py).
    """
    leaf = _scalar_leaf(value, aliases, depth)
    if leaf is not _UNRESOLVED:
        return leaf
    expression = quasi_affine(value, aliases, depth)
    if expression is None:
        return _UNRESOLVED
    return simplified(expression)


def simplified(expression: _arith.QuasiAffine) -> Dim:
    """Return an expression as the plainest Dim: an int, the symbol itself, or the expression."""
    constant = expression.as_constant()
    if constant is not None:
        return constant
    return expression.symbol if expression.is_symbol() else expression


def as_expression(dim: Dim) -> _arith.QuasiAffine | None:
    """Return a Dim as an expression (None for an unknown dim)."""
    if dim is None:
        return None
    if isinstance(dim, _arith.QuasiAffine):
        return dim
    return _arith.QuasiAffine.constant(dim) if isinstance(dim, int) else _arith.QuasiAffine.of_symbol(dim)


def _scalar_leaf(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int) -> Any:
    """Return a scalar that is a constant or one element of a shape (no arithmetic); else _UNRESOLVED."""
    if value is None or depth > _MAX_DEPTH:
        return _UNRESOLVED
    array = constant_array(value)
    if array is not None:
        return int(array.reshape(-1)[0]) if array.size == 1 and array.dtype.kind in "iu" else _UNRESOLVED
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return _UNRESOLVED
    op, inputs = producer.op_type, producer.inputs
    if op in ("Cast", "Identity", "Squeeze", "Reshape", "Unsqueeze"):
        inner = resolve_shape_tensor(inputs[0], aliases, depth + 1)
        if inner is not None and len(inner) == 1 and inner[0] is not None:
            return inner[0]
        return _scalar_leaf(inputs[0], aliases, depth + 1)
    if op == "Gather":
        source = resolve_shape_tensor(inputs[0], aliases, depth + 1)
        index = constant_array(inputs[1])
        if source is None or index is None or index.size != 1:
            return _UNRESOLVED
        try:
            element = source[int(index.reshape(-1)[0])]
        except IndexError:
            return _UNRESOLVED
        return _UNRESOLVED if element is None else element
    return _UNRESOLVED


_ARITHMETIC = {
    "Add": lambda a, b: _arith.add(a, b),
    "Sub": lambda a, b: _arith.add(a, b, sign=-1),
    "Mul": _arith.multiply,
    "Min": _arith.minimum,
    "Max": lambda a, b: _arith.minimum(a, b, pick_max=True),
}


def quasi_affine(
    value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int = 0
) -> _arith.QuasiAffine | None:
    """Return a scalar int value as an exact expression of one symbolic dim, or None when not proven."""
    if value is None or depth > _MAX_DEPTH:
        return None
    leaf = _scalar_leaf(value, aliases, depth)
    if leaf is not _UNRESOLVED and leaf is not None:
        return as_expression(leaf)
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return None
    op, inputs = producer.op_type, [v for v in producer.inputs]
    if op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape") and inputs:
        return quasi_affine(inputs[0], aliases, depth + 1)
    if len(inputs) != 2 or op not in (*_ARITHMETIC, "Div", "Mod"):
        return None
    left = quasi_affine(inputs[0], aliases, depth + 1)
    right = quasi_affine(inputs[1], aliases, depth + 1)
    if left is None or right is None:
        return None
    if op == "Div":
        # ONNX integer Div truncates toward zero: equal to the floor only for non-negative operands.
        low_left, low_right = left.lower_bound(), right.lower_bound()
        if low_left is None or low_left < 0 or low_right is None or low_right < 1:
            return None
        return _arith.floor_divide(left, right)
    if op == "Mod":
        if producer.attributes.get_int("fmod", 0) != 0:
            return None
        return _arith.modulo(left, right)
    return _ARITHMETIC[op](left, right)


def dims_equal(left: Dim, right: Dim) -> bool:
    """Return whether two Dims are provably the same size."""
    if left is None or right is None:
        return False
    if isinstance(left, _arith.QuasiAffine) or isinstance(right, _arith.QuasiAffine):
        difference = _arith.add(as_expression(left), as_expression(right), sign=-1)  # type: ignore[arg-type]
        return difference is not None and difference.as_constant() == 0
    return left == right


#: Ops whose output has the shape of their (only) data input.
_SAME_SHAPE = frozenset(
    {"Cast", "Identity", "Neg", "Exp", "Log", "Sigmoid", "Softplus", "Relu", "Abs", "Sqrt", "Reciprocal", "Tanh"}
)
#: Elementwise ops with numpy broadcasting.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})


def forward_dims(value: ir.Value | None) -> list[Dim] | None:
    """Return the dims of ``value`` proven from the graph: graph inputs' and initializers' shapes, then
    Reshape targets (shape arithmetic followed), Slice, Transpose, elementwise ops. None when not proven.

    Declared shapes of intermediate values are never used: they are hints, not checked at run time.
    Each value is visited once (a graph's shared subexpressions would otherwise be walked again).
    """
    return _forward_dims(value, 0, {})


def _forward_dims(value: ir.Value | None, depth: int, seen: dict[ir.Value, list[Dim] | None]) -> list[Dim] | None:
    if value is None or depth > 24:
        return None
    if value not in seen:
        seen[value] = None  # also ends a cycle
        seen[value] = _producer_dims(value, depth, seen)
    return seen[value]


def _producer_dims(value: ir.Value, depth: int, seen: dict[ir.Value, list[Dim] | None]) -> list[Dim] | None:
    producer = value.producer()
    if producer is None:  # a graph input (its declared shape is the model's interface) or initializer
        return value_dims(value, {})
    if producer.domain not in ("", "ai.onnx") or not producer.inputs:
        return None
    op, inputs = producer.op_type, producer.inputs

    def dims_of(index: int) -> list[Dim] | None:
        return _forward_dims(inputs[index], depth + 1, seen)

    if op in _SAME_SHAPE:
        return dims_of(0)
    if op in _BROADCASTING and len(inputs) == 2:
        left = dims_of(0)
        return None if left is None else _broadcast(left, dims_of(1))
    if op == "Transpose":
        dims = dims_of(0)
        perm = producer.attributes.get("perm")
        if dims is None:
            return None
        order = list(perm.as_ints()) if perm is not None else list(reversed(range(len(dims))))
        return [dims[i] for i in order] if sorted(order) == list(range(len(dims))) else None
    if op == "Reshape" and len(inputs) > 1:
        return _reshape_dims(producer, lambda: dims_of(0))
    if op == "Slice":
        return _slice_dims(producer, dims_of(0))
    return None


def _broadcast(left: list[Dim] | None, right: list[Dim] | None) -> list[Dim] | None:
    if left is None or right is None:
        return None
    rank = max(len(left), len(right))
    left, right = [1] * (rank - len(left)) + left, [1] * (rank - len(right)) + right
    dims: list[Dim] = []
    for a, b in zip(left, right, strict=True):
        if dims_equal(a, b) or b == 1:
            dims.append(a)
        elif a == 1:
            dims.append(b)
        else:
            return None
    return dims


def _product(dims: Sequence[Dim]) -> _arith.QuasiAffine | None:
    total = _arith.QuasiAffine.constant(1)
    for dim in dims:
        factor = as_expression(dim)
        total = None if factor is None or total is None else _arith.multiply(total, factor)
    return total


def _reshape_dims(reshape: ir.Node, input_dims_of: Callable[[], list[Dim] | None]) -> list[Dim] | None:
    """Return a Reshape's output dims; the input's dims are looked up only for 0 and -1 elements."""
    target = resolve_shape_tensor(reshape.inputs[1], {})
    if target is None or any(d is None for d in target):
        return None
    input_dims = input_dims_of() if any(d in (0, -1) for d in target) else None
    allow_zero = reshape.attributes.get_int("allowzero", 0) == 1
    dims: list[Dim] = []
    for index, dim in enumerate(target):
        if dim == 0 and not allow_zero:
            if input_dims is None or index >= len(input_dims):
                return None
            dim = input_dims[index]
        dims.append(dim)
    if -1 in dims:
        known = [d for d in dims if d != -1]
        total, rest = _product(input_dims) if input_dims is not None else None, _product(known)
        if dims.count(-1) != 1 or total is None or rest is None:
            return None
        missing = _arith.floor_divide(total, rest)
        back = _arith.multiply(missing, rest) if missing is not None else None
        if back is None or not dims_equal(simplified(back), simplified(total)):
            return None  # the element count is not provably a multiple: not followed
        dims[dims.index(-1)] = simplified(missing)
    return dims


def _slice_dims(node: ir.Node, input_dims: list[Dim] | None) -> list[Dim] | None:
    """Slices with step 1 from a non-negative start to a non-negative end, on constant axes."""
    inputs = node.inputs
    if input_dims is None or len(inputs) < 3:
        return None
    starts = resolve_shape_tensor(inputs[1], {})
    ends = resolve_shape_tensor(inputs[2], {})
    axes_array = constant_array(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else None
    steps = constant_array(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else None
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = [int(a) for a in axes_array.reshape(-1)] if axes_array is not None else list(range(len(starts)))
    if steps is not None and any(int(s) != 1 for s in steps.reshape(-1)):
        return None
    dims = list(input_dims)
    for axis, start, end in zip(axes, starts, ends, strict=False):
        axis = axis + len(dims) if axis < 0 else axis
        size, start_e, end_e = as_expression(dims[axis]), as_expression(start), as_expression(end)
        if size is None or start_e is None or end_e is None or start_e.as_constant() != 0:
            return None
        low = end_e.lower_bound()
        if low is None or low < 0:
            return None
        clipped = _arith.minimum(end_e, size)
        if clipped is None:
            return None
        dims[axis] = simplified(clipped)
    return dims


def format_dims(dims: Iterable[Dim] | None) -> str:
    """Return dims as a readable list: ints, names, '?' for anything unnamed or unknown."""
    if dims is None:
        return "[unknown]"
    return "[" + ", ".join(str(d) if isinstance(d, int | str) else "?" for d in dims) + "]"


def remove_dead_producers(values: Iterable[ir.Value | None]) -> int:
    """Remove the producers of ``values`` (and theirs, transitively) that nothing reads any more.

    Also drops initializers among them that lost their last reader. Returns how many nodes went.
    Used after a fusion: the shape arithmetic, Constant nodes and absorbed Casts around a chain are
    dead once the chain is gone; unrelated dead code elsewhere in the model is left alone.
    """
    removed = 0
    # Terminates: a value is pushed again only when a node was removed.
    work = [v for v in values if v is not None]
    while work:
        value = work.pop()
        if value.uses() or value.is_graph_output():
            continue
        graph = value.graph
        if value.is_initializer() and graph is not None and not value.is_graph_input():
            if value.name in graph.initializers:
                graph.initializers.pop(value.name)
            continue
        producer = value.producer()
        if producer is None or producer.graph is None:
            continue
        if any(out.uses() or out.is_graph_output() for out in producer.outputs):
            continue
        inputs = [v for v in producer.inputs if v is not None]  # removal detaches the inputs
        producer.graph.remove(producer, safe=True)
        removed += 1
        work.extend(inputs)
    return removed


def all_values(model: ir.Model) -> list[ir.Value]:
    """Return every value of the model: graph inputs, initializers and node outputs, functions too."""
    values: list[ir.Value] = []
    for graph in [*model.graphs(), *model.functions.values()]:
        values.extend(list(graph.inputs))
        if isinstance(graph, ir.Graph):
            values.extend(list(graph.initializers.values()))
        for node in ir.traversal.RecursiveGraphIterator(graph):
            values.extend(list(node.outputs))
    return values


@contextlib.contextmanager
def value_info_preserved(model: ir.Model) -> Iterator[None]:
    """Restore the type and shape of every value that exists now, when the block ends.

    Matching annotates values as a side effect (the rewriter's constant propagation types Constant
    outputs; shape inference types everything); those annotations would show up as value_info in the
    saved model, so a chain that is not fused would not leave its graph byte-identical.
    """
    saved = [(value, value.type, value.shape) for value in all_values(model)]
    try:
        yield
    finally:
        for value, type_, shape in saved:
            value.type, value.shape = type_, shape
