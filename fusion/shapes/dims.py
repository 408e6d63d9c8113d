"""Graph facts that fusion checks need: constant scalars, and the symbolic dims of shape tensors.

A ``Dim`` is what can be proven about one dimension: an ``int`` (static), a ``str`` (a named symbolic
dim: two equal names are the same size), an opaque ``tuple`` token (an unnamed dim of one particular
value: equal only to itself), a ``QuasiAffine`` expression of one symbolic dim (fusion/shapes/arith.py),
or ``None`` (nothing known). Two dims are provably equal only when both
are not None and compare equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from fusion.shapes import arith as _arith

Dim = int | str | tuple[Any, ...] | _arith.QuasiAffine | None

#: Producers of shape tensors that resolve_shape_tensor looks through; deeper chains give up.
_MAX_DEPTH = 32


#: Ops that only rearrange (or, Cast, convert) a constant's elements: a small constant seen through them
#: is still a known constant (dynamo's optimize=False writes ReduceMean axes as Reshape(Constant)).
_ELEMENT_PRESERVING = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten", "Cast", "CastLike"})
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
            if producer.op_type == "CastLike":  # to the type of its second input (e.g. a float 0 made int64)
                like = producer.inputs[1] if len(producer.inputs) > 1 else None
                like_type = None if like is None or like.dtype is None else like.dtype.numpy()
                if like_type is None:  # an untyped Constant: its own data's type
                    like_data = constant_array(like, _depth + 1)
                    like_type = None if like_data is None else like_data.dtype
                if like_type is None:
                    return None
                return inner.reshape(-1).astype(like_type)
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
        elif attr.name == "value_ints":
            return np.array(list(attr.value), dtype=np.int64)  # also when empty (numpy's default is float)
        elif attr.name == "value_floats":
            return np.array(list(attr.value), dtype=np.float32)
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


def value_dims(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim] | None]) -> list[Dim] | None:
    """Return the dims of ``value`` as Dims, or None when its rank is unknown.

    ``aliases`` maps values whose dims were proven equal to a known list (the chain's tensors).
    """
    if value is None:
        return None
    if value in aliases:
        known = aliases[value]
        return None if known is None else list(known)
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


#: Cast targets that hold every int64 shape value exactly (float32 is exact only up to 2^24, bool and the narrow
#: ints change values): a shape value seen through such a Cast is the same value.
_VALUE_KEEPING = frozenset({ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT64, ir.DataType.DOUBLE})


def _keeps_value(node: ir.Node) -> bool:
    """Whether ``node`` (Identity, Cast, CastLike) passes a shape value on unchanged.

    INT32 and UINT64 are taken as exact for shape values (sizes below 2^31, never negative where they matter).
    """
    if node.op_type == "Identity":
        return True
    if node.op_type == "Cast":
        to = node.attributes.get("to")
        return to is not None and to.as_int() in _VALUE_KEEPING
    if node.op_type == "CastLike" and len(node.inputs) > 1 and node.inputs[1] is not None:
        return node.inputs[1].dtype in _VALUE_KEEPING
    return False


def _nonzero(value: _arith.QuasiAffine | None) -> _arith.QuasiAffine | None:
    """value != 0 as 0 or 1 (a Cast to bool): known where the value is a constant or provably positive."""
    if value is None:
        return None
    constant = value.as_constant()
    if constant is not None:
        return _arith.QuasiAffine.constant(int(constant != 0))
    low = value.lower_bound()
    return _arith.QuasiAffine.constant(1) if low is not None and low >= 1 else None


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
    ``Identity``, and int arithmetic of one-element tensors (as ``resolve_scalar`` follows it).
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
        # the input is proven to be one element (a resolved scalar, or a value whose proven dims are all
        # 1: torch's (8 * ceil(L / 8)) // L, which no expression of L follows, is still one element).
        target = constant_array(inputs[1])
        if target is not None and target.size == 1 and int(target.reshape(-1)[0]) in (-1, 1):
            scalar = resolve_scalar(inputs[0], aliases, depth + 1)
            if scalar is not _UNRESOLVED:
                return [scalar]
            one = int(target.reshape(-1)[0]) == 1 or _proven_one_element(inputs[0], aliases)
            if one:
                return [None]
        if resolve_shape_tensor(inputs[1], aliases, depth + 1) == [-1]:
            # Flattened: a 2-D shape tensor (TorchScript's pad list reordered as a matrix, its repeat_interleave's
            # OneHot) row by row, or a 1-D one as it is.
            matrix = _shape_matrix(inputs[0], aliases, depth + 1)
            if matrix is not None:
                return [dim for row in matrix for dim in row]
            operand = _vector(inputs[0], aliases, depth + 1)
            return None if operand is None else operand[0]
        return None
    if op == "Cast" and producer.attributes.get_int("to", 0) == ir.DataType.BOOL:
        source = resolve_shape_tensor(inputs[0], aliases, depth + 1)
        if source is None:
            return None
        flags = [_nonzero(as_expression(dim)) for dim in source]
        return [None if flag is None else simplified(flag) for flag in flags]
    if op in ("Cast", "CastLike", "Identity"):
        return resolve_shape_tensor(inputs[0], aliases, depth + 1) if _keeps_value(producer) else None
    if op == "Unsqueeze":
        # The result is a valid 1-D shape only when the input is a scalar: one element, known or not. A value not
        # resolved as a scalar counts as one element only where its data or its proven dims say so (a 1-D input
        # of k elements would make k, which a one-element claim would miscount further on).
        scalar = resolve_scalar(inputs[0], aliases, depth + 1)
        if scalar is not _UNRESOLVED:
            return [scalar]
        return [None] if _proven_one_element(inputs[0], aliases) else None
    if op == "Gather":
        source = resolve_shape_tensor(inputs[0], aliases, depth + 1)
        indices = constant_array(inputs[1]) if len(inputs) > 1 else None
        if source is None or indices is None or indices.ndim != 1:
            return None
        try:
            return [source[int(i)] for i in indices]
        except IndexError:
            return None
    if op in (*_ARITHMETIC, "Div", "Mod") and len(inputs) == 2:
        # Elementwise on two one-element tensors (torch's exporter computes a length as Max(Sub(Shape, Shape),
        # c) this way): one element, the value resolve_scalar follows.
        if all(_one_element(v, aliases, depth + 1) for v in inputs):
            element = resolve_scalar(value, aliases, depth + 1)
            return [None if element is _UNRESOLVED else element]
        # Longer 1-D tensors, element by element (TorchScript's expand: Mul(ConstantOfShape(n), -1)).
        return _elementwise(op, [_vector(v, aliases, depth + 1) for v in inputs], producer)
    if op == "Equal" and len(inputs) == 2:
        return _elementwise(op, [_vector(v, aliases, depth + 1) for v in inputs], producer)
    if op == "Where" and len(inputs) == 3:
        # TorchScript's expand replaces each -1 of its target by 1: Where(Equal(shape, -1s), 1s, shape)
        return _where([_vector(v, aliases, depth + 1) for v in inputs])
    if op == "ConstantOfShape" and inputs:
        shape = _vector(inputs[0], aliases, depth + 1)
        return None if shape is None or shape[1] else _constant_of_shape(producer, shape[0])
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


#: Longest shape tensor that ConstantOfShape is followed to (a pad list is twice a rank).
_MAX_SHAPE_LENGTH = 64


def _constant_of_shape(node: ir.Node, shape: list[Dim] | None) -> list[Dim] | None:
    """ConstantOfShape's elements for a 1-D constant length (TorchScript fills a pad list out with its zeros)."""
    if shape is None or len(shape) != 1 or not isinstance(shape[0], int) or not 0 <= shape[0] <= _MAX_SHAPE_LENGTH:
        return None
    attr = node.attributes.get("value")
    if attr is None:
        return None  # float zeros: not a shape tensor
    fill = attr.as_tensor().numpy()
    if fill.size != 1 or fill.dtype.kind not in "iub":
        return None
    return [int(fill.reshape(-1)[0])] * shape[0]


def _vector(
    value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int
) -> tuple[list[Dim], bool] | None:
    """A shape tensor's elements and whether it is a scalar, where its proven dims confirm them: a 1-D tensor of that
    many elements, or a scalar for one. ``resolve_shape_tensor`` assumes its value is a valid 1-D shape (what its
    readers require); element-wise ops and a flattening Reshape take tensors of any rank, so they check."""
    elements = resolve_shape_tensor(value, aliases, depth)
    if value is None or elements is None or (value.producer() is not None and value not in aliases):
        return None
    dims = value_dims(value, aliases)  # proven (ProvenAliases), or a graph input's or initializer's own
    if dims == [len(elements)]:
        return elements, False
    return (elements, True) if dims == [] and len(elements) == 1 else None


def _broadcast_lists(operands: Sequence[tuple[list[Dim], bool] | None]) -> list[list[Dim]] | None:
    """Scalars and 1-D shape tensors of one length, broadcast to it (a 1-D tensor of one element beside a longer one
    is not followed), or None."""
    if any(operand is None for operand in operands):
        return None
    lengths = {len(elements) for elements, scalar in operands if not scalar}  # type: ignore[misc]
    if len(lengths) > 1:
        return None
    length = lengths.pop() if lengths else 1
    return [elements if len(elements) == length else elements * length for elements, _ in operands]  # type: ignore[misc]


def _provably_different(left: Dim, right: Dim) -> bool:
    """Whether two dims differ for every size: their difference is bounded away from 0 on one side."""
    a, b = as_expression(left), as_expression(right)
    if a is None or b is None:
        return False
    for difference in (_arith.add(a, b, sign=-1), _arith.add(b, a, sign=-1)):
        low = None if difference is None else difference.lower_bound()
        if low is not None and low >= 1:
            return True
    return False


def _elementwise(op: str, operands: Sequence[tuple[list[Dim], bool] | None], node: ir.Node) -> list[Dim] | None:
    """Integer arithmetic (``_ARITHMETIC``, Div, Mod) or Equal (as 0 / 1), element by element, on 1-D shape tensors
    that broadcast; an element not proven is None."""
    lists = _broadcast_lists(operands)
    if lists is None:
        return None
    result: list[Dim] = []
    for left, right in zip(*lists, strict=True):
        if op == "Equal":
            equal = 1 if dims_equal(left, right) else 0 if _provably_different(left, right) else None
            result.append(equal)
            continue
        a, b = as_expression(left), as_expression(right)
        if a is None or b is None:
            result.append(None)
            continue
        if op == "Div":
            # ONNX integer Div truncates toward zero: equal to the floor only for non-negative operands.
            low_a, low_b = a.lower_bound(), b.lower_bound()
            combined = _arith.floor_divide(a, b) if low_a is not None and low_a >= 0 and low_b and low_b >= 1 else None
        elif op == "Mod":
            combined = _arith.modulo(a, b) if node.attributes.get_int("fmod", 0) == 0 else None
        else:
            combined = _ARITHMETIC[op](a, b)
        result.append(None if combined is None else simplified(combined))
    return result


def _where(operands: Sequence[tuple[list[Dim], bool] | None]) -> list[Dim] | None:
    """Where (condition, then, else) on 1-D shape tensors: an element whose condition is not a proven 0 / 1 is None."""
    lists = _broadcast_lists(operands)
    if lists is None:
        return None
    return [a if c == 1 else b if c == 0 else None for c, a, b in zip(*lists, strict=True)]


def _slice_range(length: int, start: int, end: int, step: int) -> range | None:
    """The indices ONNX Slice takes along an axis of ``length`` (negative steps included), None for step 0."""
    if step == 0:
        return None
    start = start + length if start < 0 else start
    end = end + length if end < 0 else end
    if step > 0:
        return range(min(max(start, 0), length), min(max(end, 0), length), step)
    return range(min(max(start, 0), length - 1), min(max(end, -1), length - 1), step)


def _shape_matrix(
    value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int
) -> list[list[Dim]] | None:
    """The rows of a 2-D int shape tensor, or None.

    TorchScript writes ``F.pad``'s list (torch's order: the last axis first, (begin, end) pairs) in ONNX's order as
    ``Reshape(Transpose(Slice(Reshape(pads, [-1, 2]), -1::-1 on axis 0), [1, 0]), [-1])``, and torch's
    ``repeat_interleave`` its repeats as ``OneHot``: a constant 2-D tensor, a 1-D one reshaped to two axes, a Slice
    of one by constant starts, ends and steps, its transpose and a OneHot of constant indices are followed.
    """
    if value is None or depth > _MAX_DEPTH:
        return None
    array = constant_array(value)
    if array is not None:
        if array.ndim != 2 or array.dtype.kind not in "iu" or array.size > _MAX_FOLDED_ELEMENTS:
            return None
        return [[int(v) for v in row] for row in array]
    producer = value.producer()
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return None
    op, inputs = producer.op_type, producer.inputs
    if op in ("Cast", "CastLike", "Identity"):
        return _shape_matrix(inputs[0], aliases, depth + 1) if _keeps_value(producer) else None
    if op == "Reshape" and len(inputs) > 1:
        target = _constant_ints(inputs[1])
        operand = _vector(inputs[0], aliases, depth + 1)
        if target is None or len(target) != 2 or operand is None or producer.attributes.get_int("allowzero", 0):
            return None
        flat = operand[0]
        rows, columns = target
        if columns == -1 and rows > 0 and len(flat) % rows == 0:
            columns = len(flat) // rows
        elif rows == -1 and columns > 0 and len(flat) % columns == 0:
            rows = len(flat) // columns
        if rows < 0 or columns < 0 or rows * columns != len(flat):
            return None
        return [flat[r * columns : (r + 1) * columns] for r in range(rows)]
    if op == "Transpose":
        matrix = _shape_matrix(inputs[0], aliases, depth + 1)
        perm = producer.attributes.get("perm")
        if matrix is None or (perm is not None and list(perm.as_ints()) != [1, 0]):
            return None
        return [list(column) for column in zip(*matrix, strict=True)] if matrix else None
    if op == "Slice" and len(inputs) > 2:
        matrix = _shape_matrix(inputs[0], aliases, depth + 1)
        starts, ends = _constant_ints(inputs[1]), _constant_ints(inputs[2])
        axes = _constant_ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else None
        steps = _constant_ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else None
        if matrix is None or not matrix or starts is None or ends is None or len(starts) != len(ends):
            return None
        axes = list(range(len(starts))) if axes is None else _normalized_axes(axes, 2)
        steps = [1] * len(starts) if steps is None else steps
        if axes is None or len(axes) != len(starts) or len(steps) != len(starts):
            return None
        for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
            kept = _slice_range(len(matrix) if axis == 0 else len(matrix[0]), start, end, step)
            if kept is None:
                return None
            matrix = [matrix[i] for i in kept] if axis == 0 else [[row[i] for i in kept] for row in matrix]
            if not matrix:
                return None
        return matrix
    if op == "OneHot" and len(inputs) == 3:
        indices = constant_array(inputs[0])
        depth_value = resolve_shape_tensor(inputs[1], aliases, depth + 1)
        operand = _vector(inputs[2], aliases, depth + 1)
        values = None if operand is None or operand[1] else operand[0]
        if (
            indices is None
            or indices.ndim != 1
            or indices.dtype.kind not in "iu"
            or producer.attributes.get_int("axis", -1) not in (-1, 1)
            or depth_value is None
            or len(depth_value) != 1
            or not isinstance(depth_value[0], int)
            or not 1 <= depth_value[0] <= _MAX_SHAPE_LENGTH
            or values is None
            or len(values) != 2
        ):
            return None
        size = depth_value[0]
        off, on = values
        # ONNX OneHot: index i (i < 0: i + depth) is "on"; an index outside [-depth, depth) gives a row of "off"
        return [
            [on if int(i) % size == column and -size <= int(i) < size else off for column in range(size)]
            for i in indices
        ]
    return None


def _proven_one_element(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]]) -> bool | None:
    """Whether a value holds exactly one element by its constant data or by the dims ``aliases`` proves for it
    (``ProvenAliases``: from the graph's inputs on, never a declared shape): True when every dim is 1, False
    when one is a number other than 1, None when neither says."""
    array = constant_array(value)
    if array is not None:
        return array.size == 1
    if value is None or value.producer() is None or value not in aliases:
        return None
    proven = aliases[value]
    if proven is None:
        return None
    if any(isinstance(d, int) and d != 1 for d in proven):
        return False
    return True if all(d == 1 for d in proven) else None


def _one_element(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int) -> bool:
    """Whether a value is proven to hold exactly one element (a scalar or a tensor of shape [1]).

    Proven dims decide (a constant, or ``_proven_one_element``); else a shape tensor of length 1 (where it
    is a valid 1-D shape: an Unsqueeze of a non-scalar is not one, and its proven dims say so).
    """
    proven = _proven_one_element(value, aliases)
    if proven is not None:
        return proven
    shape = resolve_shape_tensor(value, aliases, depth)
    return shape is not None and len(shape) == 1


class _Unresolved:
    """Marker for a scalar that cannot be resolved (distinct from a resolved-but-unknown None)."""


_UNRESOLVED: Any = _Unresolved()


def resolve_scalar(value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], depth: int = 0) -> Any:
    """Return one shape element held by a scalar int tensor, as a Dim; _UNRESOLVED when unknown.

    Int arithmetic on shape elements (Add, Sub, Mul, Div, Mod, Min, Max) is followed when it is proven
    to give a constant, or exactly one symbolic dim, for every size of that dim (fusion/shapes/arith.py).
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
    if op in ("Shape", "Concat", "Slice"):  # a one-element 1-D tensor of a shape's elements: that element
        inner = resolve_shape_tensor(value, aliases, depth + 1)
        return inner[0] if inner is not None and len(inner) == 1 and inner[0] is not None else _UNRESOLVED
    if op in ("Cast", "CastLike", "Identity") and not _keeps_value(producer):
        return _UNRESOLVED  # quasi_affine looks at a Cast to bool
    if op in ("Cast", "CastLike", "Identity", "Squeeze", "Reshape", "Unsqueeze"):
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
    if op == "Cast" and inputs and producer.attributes.get_int("to", 0) == ir.DataType.BOOL:
        return _nonzero(quasi_affine(inputs[0], aliases, depth + 1))
    if op in ("Cast", "CastLike", "Identity") and not _keeps_value(producer):
        return None
    if op in ("Cast", "CastLike", "Identity", "Squeeze", "Unsqueeze", "Reshape") and inputs:
        return quasi_affine(inputs[0], aliases, depth + 1)
    if op in ("Sign", "Not", "Equal", "And", "Or"):
        return _logic(op, [quasi_affine(v, aliases, depth + 1) for v in inputs])
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


def _logic(op: str, operands: list[_arith.QuasiAffine | None]) -> _arith.QuasiAffine | None:
    """Sign, and the boolean ops on 0 / 1 (Not, Equal, And, Or), where the operands decide them: constants, a
    provably positive value (Sign 1), two values provably equal or different (Equal), one false operand of And
    or one true operand of Or (whatever the other is)."""
    constants = [None if e is None else e.as_constant() for e in operands]
    if op == "Sign" and len(operands) == 1:
        c = constants[0]
        return _nonzero(operands[0]) if c is None else _arith.QuasiAffine.constant((c > 0) - (c < 0))
    if op == "Not" and len(operands) == 1:
        return _arith.QuasiAffine.constant(1 - constants[0]) if constants[0] in (0, 1) else None
    if op == "Equal" and len(operands) == 2:
        left, right = operands
        difference = None if left is None or right is None else _arith.add(left, right, sign=-1)
        constant = None if difference is None else difference.as_constant()
        return None if constant is None else _arith.QuasiAffine.constant(int(constant == 0))
    if op in ("And", "Or") and len(operands) == 2:
        decisive = 0 if op == "And" else 1
        if decisive in constants:
            return _arith.QuasiAffine.constant(decisive)
        if all(c is not None for c in constants):
            return _arith.QuasiAffine.constant(1 - decisive)
    return None


def dims_equal(left: Dim, right: Dim) -> bool:
    """Return whether two Dims are provably the same size."""
    if left is None or right is None:
        return False
    if isinstance(left, _arith.QuasiAffine) or isinstance(right, _arith.QuasiAffine):
        difference = _arith.add(as_expression(left), as_expression(right), sign=-1)  # type: ignore[arg-type]
        return difference is not None and difference.as_constant() == 0
    return left == right


#: Ops whose output 0 has the shape of their data input 0 (other inputs are scalars, axes or parameters that
#: cannot change it; ops with several outputs only for output 0).
_SAME_SHAPE = frozenset(
    {
        "Cast", "CastLike", "Identity", "Neg", "Exp", "Log", "Sigmoid", "Softplus", "Relu", "Abs", "Sqrt",
        "Reciprocal", "Tanh", "Erf", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Not", "IsNaN", "IsInf",
        "Softmax", "LogSoftmax", "CumSum", "Trilu", "Clip", "Dropout", "HardSigmoid", "LeakyRelu", "Elu", "Selu",
        "Celu", "Softsign", "Mish", "Gelu", "LayerNormalization", "RMSNormalization", "RotaryEmbedding",
        "SimplifiedLayerNormalization", "QuantizeLinear", "DequantizeLinear",
    }
)  # fmt: skip
#: Elementwise ops with numpy (multidirectional) broadcasting, any number of inputs.
_BROADCASTING = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Mod", "Equal", "Less", "Greater",
        "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where", "BitShift",
    }
)  # fmt: skip
#: Reductions with the keepdims / axes / noop_with_empty_axes convention.
_REDUCTIONS = frozenset(
    {
        "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
        "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
    }
)  # fmt: skip
#: This project's fused op: its output has Y's shape (the op requires Z to have it too).
_OWN_DOMAIN = "ai.mambafuse"
#: ONNX Runtime's contrib ops (com.microsoft) that onnxscript's and ORT's fusions write into these models, and
#: the outputs that have the shape of input 0 (ORT's contrib op schemas; the normalizations' mean and
#: inverse-std outputs do not). SimplifiedLayerNormalization is ORT's op in the default domain.
_CONTRIB_SAME_SHAPE = {
    "SkipSimplifiedLayerNormalization": (0, 3),
    "SkipLayerNormalization": (0, 3),
    "FastGelu": (0,),
    "BiasGelu": (0,),
    "QuickGelu": (0,),
    "Gelu": (0,),
    "RotaryEmbedding": (0,),
    # mixture-of-experts layers (GraniteMoeHybrid's, float or quantized experts): the output is the input's shape
    "MoE": (0,),
    "QMoE": (0,),
}


def forward_dims(value: ir.Value | None) -> list[Dim] | None:
    """Return the dims of ``value`` proven from the graph: graph inputs' and initializers' shapes, then each
    op's output shape from its inputs' (``_infer_dims``). None when not proven.

    Declared shapes of intermediate values are never used: they are hints, not checked at run time.
    Walks the producers back to a bounded depth; ``ForwardShapes`` covers a whole graph in one pass.
    """
    return _forward_dims(value, 0, {})


def _forward_dims(value: ir.Value | None, depth: int, seen: dict[ir.Value, list[Dim] | None]) -> list[Dim] | None:
    if value is None or depth > 24:
        return None
    if value not in seen:
        seen[value] = None  # also ends a cycle
        producer = value.producer()
        if producer is None:  # a graph input (its declared shape is the model's interface) or initializer
            seen[value] = value_dims(value, {})
        else:

            def dims_of(source: ir.Value | None) -> list[Dim] | None:
                return _forward_dims(source, depth + 1, seen)

            seen[value] = _infer_dims(producer, value.index(), dims_of, ProvenAliases(dims_of))
    return seen[value]


class ForwardShapes:
    """The proven dims of every value of one graph, from one pass over its nodes in order (ONNX graphs are
    topologically sorted; a value used before its producer ran is simply not proven).

    Shape tensors are resolved with the proven dims of the values their ``Shape`` nodes read, never with the
    declared dims of an intermediate value. Built on the first query; values created afterwards (by a rewrite)
    fall back to ``forward_dims``. A rewrite that preserves what the graph computes keeps every entry true, so
    one instance serves one rewrite pass (the rules make a new one per pass).
    """

    def __init__(self, graph: ir.Graph | None) -> None:
        self._graph = graph
        #: graph inputs whose symbols a node fixes to numbers, with those numbers in their dims
        self._bound_inputs: dict[ir.Value, list[Dim]] = {}
        self._dims: dict[ir.Value, list[Dim] | None] | None = None

    def __call__(self, value: ir.Value | None) -> list[Dim] | None:
        if value is None:
            return None
        if self._dims is None:
            self._dims = self._infer_all()
        if value in self._dims:
            return self._dims[value]
        return forward_dims(value)

    def aliases(self, known: Mapping[ir.Value, Sequence[Dim] | None]) -> ProvenAliases:
        """Aliases for ``resolve_shape_tensor``: ``known`` values' dims as given, every other produced value's
        as this graph proves them (and graph inputs with their symbols bound where the graph fixes them)."""
        if self._dims is None:
            self._dims = self._infer_all()
        return ProvenAliases(self, {**self._bound_inputs, **known})

    def _infer_all(self) -> dict[ir.Value, list[Dim] | None]:
        # A graph input's symbol that a node fixes to a number (the node fails for any other size) is that number
        # from the node on (``_equal_dims``), and in a second pass from the graph inputs on: values computed before
        # the node learn it too. Passes until one fixes nothing new (usually two: a layer's cache batch is fixed
        # as the pass reaches that layer's conv, after the layer before it).
        bindings: dict[str, int] = {}
        while True:
            dims, found = self._infer_pass(bindings)
            if found.keys() <= bindings.keys():
                return dims
            bindings.update(found)

    def _infer_pass(self, bindings: Mapping[str, int]) -> tuple[dict[ir.Value, list[Dim] | None], dict[str, int]]:
        dims: dict[ir.Value, list[Dim] | None] = {}
        fixed = dict(bindings)
        self._bound_inputs = {}
        if self._graph is None:
            return dims, fixed
        symbols = {d for value in self._graph.inputs for d in (value_dims(value, {}) or []) if isinstance(d, str)}

        def substituted(found: list[Dim] | None) -> list[Dim] | None:
            if found is None or not fixed:
                return found
            return [fixed.get(d, d) if isinstance(d, str) else d for d in found]

        def bind_inputs() -> None:
            for value in self._graph.inputs:  # type: ignore[union-attr]
                declared = value_dims(value, {})
                if declared is not None and any(isinstance(d, str) and d in fixed for d in declared):
                    self._bound_inputs[value] = substituted(declared)  # type: ignore[assignment]
                    dims[value] = self._bound_inputs[value]

        for value in [*self._graph.inputs, *self._graph.initializers.values()]:
            dims[value] = value_dims(value, {})
        bind_inputs()
        aliases = ProvenAliases(lambda value: substituted(dims.get(value)), self._bound_inputs)

        def dims_of(value: ir.Value | None) -> list[Dim] | None:
            if value is None:
                return None
            if value in dims:
                return substituted(dims[value])
            # Not produced in this graph before here: an outer scope's value, or one used before its producer.
            return value_dims(value, {}) if value.producer() is None and value.const_value is not None else None

        for node in self._graph:
            for index, output in enumerate(node.outputs):
                dims[output] = _infer_dims(node, index, dims_of, aliases)
            new = _fixed_symbols(node, dims_of, symbols)
            if new.keys() - fixed.keys():
                fixed.update({k: v for k, v in new.items() if k not in fixed})
                bind_inputs()
        return {value: substituted(found) for value, found in dims.items()}, fixed


def _fixed_symbols(
    node: ir.Node, dims_of: Callable[[ir.Value | None], list[Dim] | None], symbols: set[str]
) -> dict[str, int]:
    """Return the graph inputs' ``symbols`` that ``node`` fixes to a number: a ``Concat`` runs only where its
    inputs agree on every axis but the joined one, so a symbol there beside a number is that number (a decode
    step's cache batch beside its token batch of 1); likewise the inputs of this project's decode ops that
    their kernels require to match. A column with two different numbers fixes nothing (the node never runs; a
    symbol fixed earlier in the pass keeps its number, which is as true of a graph that never runs)."""
    found: dict[str, int] = {}
    for column in _equal_dims(node, dims_of):
        numbers = {d for d in column if isinstance(d, int)}
        if len(numbers) == 1:
            found.update({d: next(iter(numbers)) for d in column if isinstance(d, str) and d in symbols})
    return found


#: This project's fused ops: the input whose dims output 0 has (x; GatedGroupRMSNorm's Y), and for the decode ops
#: the past state's input (output 1 has its dims) and how many leading axes the kernels require it to share with
#: x (docs/: the conv state's batch and channels; the recurrent state's batch, heads and head dim).
_OWN_OPS: dict[str, tuple[int, int | None, int]] = {
    "GatedGroupRMSNorm": (0, None, 0),
    "CausalConv1dUpdate": (0, 1, 2),
    "SelectiveStateUpdate": (1, 0, 3),
    # the prefill ops: the final state has the initial state's dims (the rules always pass one); x and it share the
    # batch (CausalConv1d's x may be channels-last, so only axis 0 is shared in either layout)
    "MambaChunkScan": (0, 7, 1),
    "CausalConv1d": (0, 3, 1),
    "SquaredRelu": (0, None, 0),
}


def _equal_dims(node: ir.Node, dims_of_value: Callable[[ir.Value | None], list[Dim] | None]) -> Iterator[list[Dim]]:
    """Yield columns of dims that ``node`` runs only where they are equal: a Concat's inputs on every axis but
    the joined one, and the inputs of this project's decode ops that their kernels require to match."""

    def dims_of(index: int) -> list[Dim] | None:
        return dims_of_value(node.inputs[index]) if index < len(node.inputs) else None

    if node.domain == _OWN_DOMAIN and node.op_type in _OWN_OPS:
        x_index, state_index, shared = _OWN_OPS[node.op_type]
        x, state = dims_of(x_index), dims_of(state_index) if state_index is not None else None
        if x is not None and state is not None:
            yield from ([x[axis], state[axis]] for axis in range(min(shared, len(x), len(state))))
        return
    if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return
    parts = [dims_of(i) for i in range(len(node.inputs))]
    if any(part is None for part in parts) or len({len(part) for part in parts}) != 1:  # type: ignore[arg-type]
        return
    rank = len(parts[0])  # type: ignore[arg-type]
    axis = node.attributes.get_int("axis", 0)
    axis = axis + rank if axis < 0 else axis
    for position in range(rank):
        if position != axis:
            yield [part[position] for part in parts]  # type: ignore[index]


class ProvenAliases(Mapping[ir.Value, Sequence[Dim] | None]):
    """Aliases for shape-tensor resolution in which no intermediate value's declared dims are evidence.

    ``known`` values map to the dims given (a rule's proven chain tensors); every other produced value to
    ``proven(value)``, its dims proven from the graph (None when not proven), so that a ``Shape`` of an
    intermediate value never reads that value's declared dims. Graph inputs and initializers are not
    aliased: their declared shapes are the model's interface. Only membership and lookup are meaningful
    (iteration lists the ``known`` values).
    """

    def __init__(
        self,
        proven: Callable[[ir.Value], Sequence[Dim] | None],
        known: Mapping[ir.Value, Sequence[Dim] | None] | None = None,
    ) -> None:
        self._proven = proven
        self._known = dict(known or {})

    def __contains__(self, value: object) -> bool:
        return isinstance(value, ir.Value) and (value in self._known or value.producer() is not None)

    def __getitem__(self, value: ir.Value) -> Sequence[Dim] | None:
        if value in self._known:
            return self._known[value]
        if value.producer() is None:
            raise KeyError(value)
        return self._proven(value)

    def __iter__(self) -> Iterator[ir.Value]:
        return iter(self._known)

    def __len__(self) -> int:
        return len(self._known)


def _int_list(node: ir.Node, attribute: str, input_index: int) -> list[int] | None:
    """Return an int list given as an attribute (older opsets) or as a constant input (newer ones)."""
    attr = node.attributes.get(attribute)
    if attr is not None:
        return [int(v) for v in attr.as_ints()]
    return _constant_ints(node.inputs[input_index] if input_index < len(node.inputs) else None)


def _constant_ints(value: ir.Value | None) -> list[int] | None:
    """Return a constant int tensor of at most one axis as a list, else None."""
    array = constant_array(value)
    if array is None or array.dtype.kind not in "iu" or array.ndim > 1:
        return None
    return [int(v) for v in array.reshape(-1)]


def _normalized_axes(axes: Sequence[int], rank: int) -> list[int] | None:
    normalized = [a + rank if a < 0 else a for a in axes]
    if any(a < 0 or a >= rank for a in normalized) or len(set(normalized)) != len(normalized):
        return None
    return normalized


def _tile_dims(source: list[Dim] | None, repeats: list[Dim] | None) -> list[Dim] | None:
    """Tile's output dims: each input dim times its (constant, non-negative) repeat count."""
    if source is None or repeats is None or len(repeats) != len(source):
        return None
    if not all(isinstance(repeat, int) and repeat >= 0 for repeat in repeats):
        return None
    products = [_product([dim, repeat]) for dim, repeat in zip(source, repeats, strict=True)]
    return [None if product is None else simplified(product) for product in products]


def _sum_dims(parts: Sequence[Dim]) -> Dim:
    total: _arith.QuasiAffine | None = _arith.QuasiAffine.constant(0)
    for part in parts:
        term = as_expression(part)
        total = None if term is None or total is None else _arith.add(total, term)
    return None if total is None else simplified(total)


def _infer_dims(
    node: ir.Node,
    index: int,
    dims_of: Callable[[ir.Value | None], list[Dim] | None],
    aliases: Mapping[ir.Value, Sequence[Dim] | None],
) -> list[Dim] | None:
    """Return the dims of output ``index`` of ``node`` from its inputs' dims (``dims_of``), or None.

    Each rule is the ONNX operator's shape function for the case it accepts, and assumes only that the node
    runs (an op whose inputs do not fit fails at run time instead of producing a tensor of another shape).
    """
    if node.domain == _OWN_DOMAIN:
        return _own_op_dims(node, index, dims_of)
    if node.domain == "com.microsoft":
        if node.op_type == "GroupQueryAttention":
            return _group_query_attention_dims(node, index, dims_of)
        if node.op_type == "MultiHeadAttention":
            return _multi_head_attention_dims(node, index, dims_of)
        if node.op_type in _CONTRIB_MATMULS:
            return _contrib_matmul_dims(node, index, dims_of)
        if node.op_type == "GatherBlockQuantized":
            return _gather_block_quantized_dims(node, index, dims_of)
        same = _CONTRIB_SAME_SHAPE.get(node.op_type, ())
        return dims_of(node.inputs[0]) if index in same and node.inputs else None
    if node.domain not in ("", "ai.onnx") or not node.outputs:
        return None
    op, inputs = node.op_type, node.inputs

    def dims(i: int) -> list[Dim] | None:
        return dims_of(inputs[i]) if i < len(inputs) else None

    if op == "Constant":
        array = constant_array(node.outputs[0])
        return None if array is None else [int(d) for d in array.shape]
    if not inputs:
        return None
    if op in _SAME_SHAPE:
        return dims(0) if index == 0 else None
    if op in _BROADCASTING:
        result = dims(0)
        for i in range(1, len(inputs)):
            result = _broadcast(result, dims(i))
        return result
    if op == "Transpose":
        source = dims(0)
        perm = node.attributes.get("perm")
        if source is None:
            return None
        order = list(perm.as_ints()) if perm is not None else list(reversed(range(len(source))))
        return [source[i] for i in order] if sorted(order) == list(range(len(source))) else None
    if op == "Reshape" and len(inputs) > 1:
        return _reshape_dims(node, lambda: dims(0), aliases)
    if op == "Slice":
        return _slice_dims(node, dims(0), aliases)
    if op == "Unsqueeze":
        source, axes = dims(0), _int_list(node, "axes", 1)
        if source is None or axes is None:
            return None
        rank = len(source) + len(axes)
        normalized = _normalized_axes(axes, rank)
        if normalized is None:
            return None
        rest = iter(source)
        return [1 if axis in normalized else next(rest) for axis in range(rank)]
    if op == "Squeeze":
        source, axes = dims(0), _int_list(node, "axes", 1)
        if source is not None and axes is None and len(inputs) < 2 and all(isinstance(d, int) for d in source):
            return [d for d in source if d != 1]  # no axes: every dim of size 1 goes
        if source is None or axes is None:
            return None  # no axes and a symbolic dim (is it 1?), or axes computed at run time
        normalized = _normalized_axes(axes, len(source))
        if normalized is None:
            return None
        return [dim for axis, dim in enumerate(source) if axis not in normalized]
    if op == "Expand" and len(inputs) > 1:
        shape = resolve_shape_tensor(inputs[1], aliases)
        return None if shape is None else _broadcast(dims(0), shape)
    if op == "Split":
        return _split_dims(node, index, dims(0))
    if op == "Concat":
        parts = [dims(i) for i in range(len(inputs))]
        if any(part is None for part in parts) or len({len(part) for part in parts}) != 1:  # type: ignore[arg-type]
            return None
        rank = len(parts[0])  # type: ignore[arg-type]
        axis = node.attributes.get_int("axis", 0)
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis < rank:
            return None
        result = list(parts[0])  # type: ignore[arg-type]
        for position in range(rank):  # the other axes are equal in every input (or the node fails): any is right,
            # and a number is the most that is proven (a cache's symbolic batch beside the step's batch of 1 is 1)
            known = [part[position] for part in parts if part[position] is not None]  # type: ignore[index]
            numbers = [dim for dim in known if isinstance(dim, int)]
            result[position] = numbers[0] if numbers else known[0] if known else None
        result[axis] = _sum_dims([part[axis] for part in parts])  # type: ignore[index]
        return result
    if op == "Tile" and len(inputs) > 1:
        return _tile_dims(dims(0), resolve_shape_tensor(inputs[1], aliases))
    if op == "TopK" and len(inputs) > 1:
        source, k = dims(0), resolve_shape_tensor(inputs[1], aliases)
        axis = node.attributes.get_int("axis", -1)
        if source is None or k is None or len(k) != 1 or not -len(source) <= axis < len(source):
            return None
        result = list(source)
        result[axis] = k[0]  # both outputs (values and indices); the node fails where k exceeds the dim
        return result
    if op == "Gemm" and len(inputs) > 1:
        a, b = dims(0), dims(1)
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            return None
        rows = a[1] if node.attributes.get_int("transA", 0) else a[0]
        cols = b[0] if node.attributes.get_int("transB", 0) else b[1]
        return [rows, cols]  # C only broadcasts to [M, N]
    if op == "Gather" and len(inputs) > 1:
        data, indices = dims(0), dims(1)
        if data is None or indices is None:
            return None
        axis = node.attributes.get_int("axis", 0)
        axis = axis + len(data) if axis < 0 else axis
        if not 0 <= axis < len(data):
            return None
        return [*data[:axis], *indices, *data[axis + 1 :]]
    if op == "MatMul" and len(inputs) > 1:
        left, right = dims(0), dims(1)
        if left is None or right is None or len(left) < 2 or len(right) < 2:
            return None  # 1-D operands: not needed here
        batch = _broadcast(left[:-2], right[:-2])
        return None if batch is None else [*batch, left[-2], right[-1]]
    if op == "Einsum":
        return _einsum_dims(node, [dims(i) for i in range(len(inputs))])
    if op == "Pad":
        return _pad_dims(node, dims(0), aliases)
    if op == "Conv" and len(inputs) > 1:
        return _conv_dims(node, dims(0), dims(1))
    if op in _REDUCTIONS:
        return _reduce_dims(node, dims(0))
    if op == "Shape":
        source = dims(0)
        if source is None:
            return None
        start = node.attributes.get_int("start", 0)
        end_attr = node.attributes.get("end")
        return [len(source[_normalized_slice(len(source), start, None if end_attr is None else end_attr.as_int())])]
    if op == "ConstantOfShape":
        return resolve_shape_tensor(inputs[0], aliases)
    if op == "OneHot" and len(inputs) == 3:
        return _one_hot_dims(node, dims(0), resolve_shape_tensor(inputs[1], aliases))
    if op == "Range" and len(inputs) == 3:
        return _range_dims(inputs, aliases)
    if op == "GatherND" and len(inputs) > 1:
        data, indices = dims(0), dims(1)
        batch = node.attributes.get_int("batch_dims", 0)
        if data is None or indices is None or not indices or not isinstance(indices[-1], int) or batch != 0:
            return None
        return [*indices[:-1], *data[indices[-1] :]] if indices[-1] <= len(data) else None
    if op == "SequenceAt" and len(inputs) > 1:
        return _sequence_at_dims(node, dims_of)
    return None


def _one_hot_dims(node: ir.Node, indices: list[Dim] | None, depth: list[Dim] | None) -> list[Dim] | None:
    """OneHot's output: the indices' dims with the (constant, positive) depth inserted at ``axis``."""
    if indices is None or depth is None or len(depth) != 1 or not isinstance(depth[0], int) or depth[0] < 1:
        return None
    rank = len(indices) + 1
    axis = node.attributes.get_int("axis", -1)
    if not -rank <= axis < rank:
        return None
    axis = axis + rank if axis < 0 else axis
    return [*indices[:axis], depth[0], *indices[axis:]]


def _own_op_dims(node: ir.Node, index: int, dims_of: Callable[[ir.Value | None], list[Dim] | None]) -> list[Dim] | None:
    """This project's fused ops, as their contracts (docs/) define their outputs (``_OWN_OPS``): output 0 has x's
    shape, and a decode op's present state the past state's with x's batch (the kernels reject another). The weight
    products are MatMul's and MatMulNBits' shapes (docs/decode_matmul.md)."""
    if node.op_type == "DecodeMatMulNBits":
        return _contrib_matmul_dims(node, index, dims_of) if index == 0 else None
    if node.op_type == "DecodeMatMul":
        left, right = dims_of(node.inputs[0]), dims_of(node.inputs[1]) if len(node.inputs) > 1 else None
        if index != 0 or left is None or right is None or not left or len(right) != 2:
            return None
        return [*left[:-1], right[1]]
    x_index, state_index, _ = _OWN_OPS.get(node.op_type, (None, None, 0))
    if x_index is None or len(node.inputs) <= x_index:
        return None
    x = dims_of(node.inputs[x_index])
    if index == 0:
        return x
    if index != 1 or state_index is None or len(node.inputs) <= state_index:
        return None  # an optional state left out (the prompt conv's initial state): no dims to give
    state = dims_of(node.inputs[state_index])
    if state is None or x is None or not state or not x:
        return state
    return [x[0] if isinstance(x[0], int) else state[0], *state[1:]]


#: ONNX Runtime's contrib matrix products that quantizers and ORT's fusions write in place of MatMul.
_CONTRIB_MATMULS = frozenset({"MatMulNBits", "FusedMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"})


def _contrib_matmul_dims(
    node: ir.Node, index: int, dims_of: Callable[[ir.Value | None], list[Dim] | None]
) -> list[Dim] | None:
    """The output of a contrib matrix product (ORT's schemas): ``MatMulNBits`` is ``[..., N]`` for A ``[..., K]``
    (N and K its attributes; the kernel rejects an A whose last dim is not K); ``FusedMatMul`` is MatMul of its
    operands with their last two axes swapped where ``transA`` / ``transB`` say (``transBatch*`` not followed);
    the dynamic-quantization products are MatMul's."""
    if index != 0 or len(node.inputs) < 2:
        return None
    left = dims_of(node.inputs[0])
    if node.op_type in ("MatMulNBits", "DecodeMatMulNBits"):
        n, k = node.attributes.get_int("N", 0), node.attributes.get_int("K", 0)
        if left is None or not left or n < 1 or k < 1 or (isinstance(left[-1], int) and left[-1] != k):
            return None
        return [*left[:-1], n]
    right = dims_of(node.inputs[1])
    if left is None or right is None or len(left) < 2 or len(right) < 2:
        return None
    if node.op_type == "FusedMatMul":
        if node.attributes.get_int("transBatchA", 0) or node.attributes.get_int("transBatchB", 0):
            return None
        if node.attributes.get_int("transA", 0):
            left = [*left[:-2], left[-1], left[-2]]
        if node.attributes.get_int("transB", 0):
            right = [*right[:-2], right[-1], right[-2]]
    batch = _broadcast(left[:-2], right[:-2])
    return None if batch is None else [*batch, left[-2], right[-1]]


def _gather_block_quantized_dims(
    node: ir.Node, index: int, dims_of: Callable[[ir.Value | None], list[Dim] | None]
) -> list[Dim] | None:
    """``GatherBlockQuantized`` (a quantized embedding): the indices' dims, then data's other dims, where a
    4-bit table packed two to a uint8 byte along its last axis unpacks to twice that width."""
    if index != 0 or len(node.inputs) < 2:
        return None
    data, indices = dims_of(node.inputs[0]), dims_of(node.inputs[1])
    if data is None or indices is None or not data or node.attributes.get_int("gather_axis", 0) != 0:
        return None
    rest = list(data[1:])
    if node.inputs[0].dtype == ir.DataType.UINT8 and node.attributes.get_int("bits", 4) == 4 and rest:
        rest[-1] = rest[-1] * 2 if isinstance(rest[-1], int) else None
    return [*indices, *rest]


def _group_query_attention_dims(
    node: ir.Node, index: int, dims_of: Callable[[ir.Value | None], list[Dim] | None]
) -> list[Dim] | None:
    """ORT's GroupQueryAttention, its output (not the present key and value): [batch, sequence, num_heads *
    head_size]. The query is [batch, sequence, num_heads * head_size], or with key and value packed into it
    (no key input) [batch, sequence, (num_heads + 2 kv_num_heads) * head_size]."""
    query = dims_of(node.inputs[0]) if index == 0 and node.inputs else None
    if query is None or len(query) != 3:
        return None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        return list(query)
    heads, kv_heads, width = (
        node.attributes.get_int("num_heads", 0),
        node.attributes.get_int("kv_num_heads", 0),
        query[2],
    )
    packed = heads + 2 * kv_heads
    if heads < 1 or kv_heads < 1 or not isinstance(width, int) or width % packed != 0:
        return None
    return [query[0], query[1], heads * (width // packed)]


def _multi_head_attention_dims(
    node: ir.Node, index: int, dims_of: Callable[[ir.Value | None], list[Dim] | None]
) -> list[Dim] | None:
    """ORT's MultiHeadAttention, its output (not the present key and value): [batch, sequence, v_hidden_size],
    for a 3-D query [batch, sequence, hidden] and a value [batch, kv_sequence, v_hidden_size] or, in BNSH,
    [batch, num_heads, kv_sequence, v_head_size] (v_hidden_size = num_heads * v_head_size). Packed query, key
    and value (no value input) are not followed."""
    query = dims_of(node.inputs[0]) if index == 0 and node.inputs else None
    value = dims_of(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    if query is None or len(query) != 3 or value is None:
        return None
    if len(value) == 3:
        return [query[0], query[1], value[2]]
    heads = node.attributes.get_int("num_heads", 0)
    if len(value) == 4 and heads > 0:
        # a symbolic head size leaves the width unknown; the rank and the leading dims are still the query's
        return [query[0], query[1], heads * value[3] if isinstance(value[3], int) else None]
    return None


def _sequence_at_dims(node: ir.Node, dims_of: Callable[[ir.Value | None], list[Dim] | None]) -> list[Dim] | None:
    """SequenceAt(SplitToSequence(x, constant sizes or part length), constant position): that part of x."""
    split = node.inputs[0].producer() if node.inputs[0] is not None else None
    position = constant_array(node.inputs[1])
    if split is None or split.op_type != "SplitToSequence" or split.domain not in ("", "ai.onnx"):
        return None
    if position is None or position.size != 1 or len(split.inputs) < 2:
        return None
    source, sizes = dims_of(split.inputs[0]), constant_array(split.inputs[1])
    if source is None or sizes is None or sizes.ndim > 1 or split.attributes.get_int("keepdims", 1) != 1:
        return None
    axis = split.attributes.get_int("axis", 0)
    axis = axis + len(source) if axis < 0 else axis
    if not 0 <= axis < len(source):
        return None
    if sizes.ndim == 0:  # parts of that length along a static axis, the last one what remains
        length, part = source[axis], int(sizes)
        if not isinstance(length, int) or part < 1:
            return None
        count = -(-length // part)
        sizes = np.array([part] * (count - 1) + [length - part * (count - 1)], np.int64)
    index = int(position.reshape(-1)[0])
    index = index + sizes.size if index < 0 else index
    if not 0 <= index < sizes.size:
        return None
    result = list(source)
    result[axis] = int(sizes[index])
    return result


def _range_dims(
    inputs: Sequence[ir.Value | None], aliases: Mapping[ir.Value, Sequence[Dim] | None]
) -> list[Dim] | None:
    """Range(start, limit, delta) with a positive constant delta: ceil((limit - start) / delta) elements, where
    that is provably >= 0 (otherwise ONNX gives 0)."""
    start, limit, delta = (resolve_scalar(v, aliases) for v in inputs)
    if not isinstance(delta, int) or delta < 1 or start in (None, _UNRESOLVED) or limit in (None, _UNRESOLVED):
        return None
    start_e, limit_e = as_expression(start), as_expression(limit)
    span = None if start_e is None or limit_e is None else _arith.add(limit_e, start_e, sign=-1)
    if span is None:
        return None
    count = _arith.floor_divide(
        _arith.add(span, _arith.QuasiAffine.constant(delta - 1)),  # type: ignore[arg-type]
        _arith.QuasiAffine.constant(delta),
    )
    low = None if count is None else count.lower_bound()
    if low is None or low < 0:
        return None
    return [simplified(count)]  # type: ignore[arg-type]


def _split_dims(node: ir.Node, index: int, source: list[Dim] | None) -> list[Dim] | None:
    if source is None:
        return None
    axis = node.attributes.get_int("axis", 0)
    axis = axis + len(source) if axis < 0 else axis
    if not 0 <= axis < len(source):
        return None
    sizes = _int_list(node, "split", 1)
    result = list(source)
    if sizes is not None:
        if len(sizes) != len(node.outputs):
            return None
        result[axis] = sizes[index]
        return result
    # Equal parts: only when the length is a proven multiple of the count.
    count = len(node.outputs)
    length = as_expression(source[axis])
    part = None if length is None else _arith.floor_divide(length, _arith.QuasiAffine.constant(count))
    back = None if part is None else _arith.multiply(part, _arith.QuasiAffine.constant(count))
    if back is None or not dims_equal(simplified(back), simplified(length)):  # type: ignore[arg-type]
        return None
    result[axis] = simplified(part)  # type: ignore[arg-type]
    return result


def _einsum_dims(node: ir.Node, operands: list[list[Dim] | None]) -> list[Dim] | None:
    """Explicit equations without ellipsis or repeated labels in one term. A label's dim is the one its
    operands provably share, size-1 dims aside: ONNX Runtime broadcasts a label of size 1 against the other
    operands' (and where it would not, the node fails), so a 1 beside a dim d gives d, whatever d is at run time
    (1 included). Two dims not provably equal, neither 1, give an unknown dim."""
    equation_attr = node.attributes.get("equation")
    if equation_attr is None:
        return None
    equation = equation_attr.as_string().replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    left, output = equation.split("->")
    terms = left.split(",")
    if len(terms) != len(operands):
        return None
    if any(operand is None or len(operand) != len(term) for operand, term in zip(operands, terms, strict=True)):
        return None
    if any(len(set(term)) != len(term) for term in [*terms, output]):
        return None
    sizes: dict[str, list[Dim]] = {}
    for term, operand in zip(terms, operands, strict=True):
        for label, dim in zip(term, operand, strict=True):  # type: ignore[arg-type]
            sizes.setdefault(label, []).append(dim)
    if any(label not in sizes for label in output):
        return None

    def label_dim(dims: list[Dim]) -> Dim:
        wide = [dim for dim in dims if dim != 1] or [1]
        return wide[0] if all(dims_equal(wide[0], dim) for dim in wide[1:]) else None

    return [label_dim(sizes[label]) for label in output]


def _pad_dims(
    node: ir.Node, source: list[Dim] | None, aliases: Mapping[ir.Value, Sequence[Dim] | None]
) -> list[Dim] | None:
    if source is None:
        return None
    pads_attr = node.attributes.get("pads")
    if pads_attr is not None:
        pads: list[Dim] | None = [int(v) for v in pads_attr.as_ints()]
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        pads = resolve_shape_tensor(node.inputs[1], aliases)
    else:
        return None
    axes: list[int] | None = list(range(len(source)))
    if len(node.inputs) > 3 and node.inputs[3] is not None:
        given = _constant_ints(node.inputs[3])
        axes = None if given is None else _normalized_axes(given, len(source))
    if pads is None or axes is None or len(pads) != 2 * len(axes):
        return None
    result = list(source)
    for i, axis in enumerate(axes):
        result[axis] = _sum_dims([source[axis], pads[i], pads[i + len(axes)]])
    return result


def _conv_dims(node: ir.Node, x: list[Dim] | None, w: list[Dim] | None) -> list[Dim] | None:
    if x is None or w is None or len(x) != len(w) or len(x) < 3:
        return None
    spatial = len(x) - 2
    if node.attributes.get_string("auto_pad", "NOTSET") != "NOTSET":
        return None
    kernel = [int(v) for v in node.attributes.get_ints("kernel_shape", [])] or w[2:]
    pads = [int(v) for v in node.attributes.get_ints("pads", [0] * 2 * spatial)]
    strides = [int(v) for v in node.attributes.get_ints("strides", [1] * spatial)]
    dilations = [int(v) for v in node.attributes.get_ints("dilations", [1] * spatial)]
    if len(kernel) != spatial or len(pads) != 2 * spatial or len(strides) != spatial or len(dilations) != spatial:
        return None
    result: list[Dim] = [x[0], w[0]]
    for i in range(spatial):
        k = kernel[i]
        if not isinstance(k, int) or strides[i] < 1:
            return None
        span = _sum_dims([x[2 + i], pads[i], pads[i + spatial], -dilations[i] * (k - 1) - 1])
        span_e = as_expression(span)
        steps = None if span_e is None else _arith.floor_divide(span_e, _arith.QuasiAffine.constant(strides[i]))
        result.append(None if steps is None else _sum_dims([simplified(steps), 1]))
    return result


def _reduce_dims(node: ir.Node, source: list[Dim] | None) -> list[Dim] | None:
    if source is None:
        return None
    keep = node.attributes.get_int("keepdims", 1) == 1
    axes = _int_list(node, "axes", 1)
    has_axes_input = len(node.inputs) > 1 and node.inputs[1] is not None
    if axes is None and has_axes_input:
        return None  # axes computed at run time
    if not axes:
        if node.attributes.get_int("noop_with_empty_axes", 0) == 1:
            return list(source)
        axes = list(range(len(source)))
    normalized = _normalized_axes(axes, len(source))
    if normalized is None:
        return None
    if keep:
        return [1 if axis in normalized else dim for axis, dim in enumerate(source)]
    return [dim for axis, dim in enumerate(source) if axis not in normalized]


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
        elif isinstance(a, int) or isinstance(b, int):
            # a number other than 1 beside a dim not proven equal to it: the node runs only where that dim is the
            # number or 1, and then the result is the number
            dims.append(a if isinstance(a, int) else b)
        else:
            return None
    return dims


def _product(dims: Sequence[Dim]) -> _arith.QuasiAffine | None:
    total = _arith.QuasiAffine.constant(1)
    for dim in dims:
        factor = as_expression(dim)
        total = None if factor is None or total is None else _arith.multiply(total, factor)
    return total


def _reshape_dims(
    reshape: ir.Node,
    input_dims_of: Callable[[], list[Dim] | None],
    aliases: Mapping[ir.Value, Sequence[Dim] | None],
) -> list[Dim] | None:
    """Return a Reshape's output dims; the input's dims are looked up only for 0 and -1 elements.

    The rank is the target's length; an element the rules cannot follow (an unknown target element, a 0
    copying an unproven input dim, a -1 whose size is not one expression) is an unknown dim, the others are
    what the target says: where the node runs, its output has exactly those.
    """
    target = resolve_shape_tensor(reshape.inputs[1], aliases)
    if target is None:
        return None
    input_dims = input_dims_of() if any(d in (0, -1) for d in target) else None
    allow_zero = reshape.attributes.get_int("allowzero", 0) == 1
    dims: list[Dim] = []
    for index, dim in enumerate(target):
        if dim == 0 and not allow_zero:
            dim = input_dims[index] if input_dims is not None and index < len(input_dims) else None
        dims.append(dim)
    if -1 in dims:
        if dims.count(-1) != 1:
            return None  # not a valid target: the node fails
        position = dims.index(-1)
        dims[position] = None
        known = [d for i, d in enumerate(dims) if i != position]
        total, rest = _product(input_dims) if input_dims is not None else None, _product(known)
        missing = _arith.floor_divide(total, rest) if total is not None and rest is not None else None
        back = _arith.multiply(missing, rest) if missing is not None else None
        if back is not None and dims_equal(simplified(back), simplified(total)):  # type: ignore[arg-type]
            dims[position] = simplified(missing)  # type: ignore[arg-type]
    return dims


def _slice_dims(
    node: ir.Node, input_dims: list[Dim] | None, aliases: Mapping[ir.Value, Sequence[Dim] | None]
) -> list[Dim] | None:
    """Slices with step 1 on constant axes: any constant bounds of a static dim (ONNX's clamping); of a
    symbolic dim, [s, end) from a constant s >= 0 to a non-negative end, to -b (all but the last b) or past
    any size, where the length is provably >= 0, and [-a, end) with an end past any size (the last a)."""
    inputs = node.inputs
    if input_dims is None or len(inputs) < 3:
        return None
    starts = resolve_shape_tensor(inputs[1], aliases)
    ends = resolve_shape_tensor(inputs[2], aliases)
    axes_array = constant_array(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else None
    if len(inputs) > 3 and inputs[3] is not None and axes_array is None:
        return None
    steps = constant_array(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else None
    if len(inputs) > 4 and inputs[4] is not None and steps is None:
        return None
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = [int(a) for a in axes_array.reshape(-1)] if axes_array is not None else list(range(len(starts)))
    if steps is not None and any(int(s) != 1 for s in steps.reshape(-1)):
        return None
    normalized = _normalized_axes(axes, len(input_dims))
    if normalized is None or len(normalized) != len(starts):
        return None
    dims = list(input_dims)
    for axis, start, end in zip(normalized, starts, ends, strict=True):
        size = dims[axis]
        if isinstance(size, int) and isinstance(start, int) and isinstance(end, int):
            kept = _normalized_slice(size, start, end)
            dims[axis] = max(0, kept.stop - kept.start)
            continue
        size_e, start_e, end_e = as_expression(size), as_expression(start), as_expression(end)
        if size_e is None or start_e is None or end_e is None:
            return None
        first, last = start_e.as_constant(), end_e.as_constant()
        if first is not None and first < 0 and last is not None and last >= 1 << 62:
            clipped = _arith.minimum(_arith.QuasiAffine.constant(-first), size_e)  # the last -first elements
        elif first is not None and first >= 0:
            if last is not None and last < 0:  # up to all but the last -last elements
                stop = _arith.add(size_e, end_e)
            elif last is not None and last >= 1 << 62:
                stop = size_e
            else:
                low = end_e.lower_bound()
                stop = _arith.minimum(end_e, size_e) if low is not None and low >= 0 else None
            clipped = None if stop is None else _arith.add(stop, start_e, sign=-1)
            low = None if clipped is None else clipped.lower_bound()
            if low is None or low < 0:  # where start passes the stop ONNX gives 0: not one expression
                return None
        else:
            return None
        if clipped is None:
            return None
        dims[axis] = simplified(clipped)
    return dims


def format_dims(dims: Iterable[Dim] | None) -> str:
    """Return dims as a readable list: ints, names, '?' for anything unnamed or unknown."""
    if dims is None:
        return "[unknown]"
    return "[" + ", ".join(str(d) if isinstance(d, int | str) else "?" for d in dims) + "]"
