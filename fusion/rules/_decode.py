"""Proofs shared by the decode-step rules (CausalConv1dUpdate, SelectiveStateUpdate).

The layout proof: a value reached from a few "leaf" values through layout ops only (Reshape, Expand,
Unsqueeze, Squeeze, Transpose, Identity) is emulated on index arrays: each leaf becomes
``arange(numel).reshape(dims)`` (ints, proven from the graph) and each op is applied as ONNX defines it.
The result says, element by element, which leaf element the value holds, so a rule can compare it with
the op's own indexing (repeat_interleave of groups, the (B, H) rows of a batched MatMul, ...). An op that
would fail on those shapes (a Reshape whose element count does not match) fails the emulation too: the
original graph does not run there.

A symbolic batch (``Batch``): a value whose leading non-1 dim is the batch symbol is emulated at batch
sizes 1, 2 and 3, each time with the symbol bound to that size in every shape tensor (a Reshape target
from ``Shape(x)[0]``, or a -1 that the element count pins). Only the symbol itself or ``c * symbol`` is
bound, so every dim on the way is ``c`` or ``c * batch``, a monomial of the batch: its values at 1, 2 and 3
say which. ``batch_blocked`` then requires, at every step, exactly one dim ``c * batch`` with only 1s
before it: such a value is ``batch`` blocks of the same length one after another, and a layout op between
two of them (row-major Reshape, a Transpose that keeps the batch axis, an Expand along the other axes,
Unsqueeze / Squeeze of other axes) maps block ``b`` to block ``b`` by the same map for every batch size. The
emulation at the three sizes then proves the layout for every batch size.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion._graph import NameSource, remove_dead_producers, value_info_preserved
from fusion.rules._log import FusionLog
from fusion.shapes import arith as _arith
from fusion.shapes.dims import Dim, ForwardShapes, constant_array, resolve_shape_tensor

_ONNX_DOMAINS = ("", "ai.onnx")
#: Ops that move elements without computing: the layout proof follows them.
LAYOUT_OPS = frozenset({"Reshape", "Expand", "Unsqueeze", "Squeeze", "Transpose", "Identity"})
_MAX_DEPTH = 16
_MAX_ELEMENTS = 1 << 22
#: The batch sizes a symbolic batch is emulated at (a monomial of the batch is known from two of them).
BATCH_SAMPLES = (1, 2, 3)
#: The log the decode rules record into while ``apply_with_log`` runs them (None: nothing is recorded).
ACTIVE_LOG: contextvars.ContextVar[FusionLog | None] = contextvars.ContextVar("mambafuse_decode_log", default=None)
_OWN_DOMAIN = "ai.mambafuse"


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


def prove_standard_version(anchor: ir.Node, since: int) -> None:
    """Refuse ``anchor``, an op of ONNX's default domain, unless the model's ONNX opset defines it as the version
    added at opset ``since``: the one whose meaning the rule was proven against (not before it, when the op does
    not exist, nor at an opset where a later version, or one the installed onnx does not know, may apply)."""
    graph = anchor.graph
    opset = None if graph is None else graph.opset_imports.get("", graph.opset_imports.get("ai.onnx"))
    if opset is None or opset < since:
        raise Refusal(
            f"the model's ONNX opset {opset} has no standard {anchor.op_type} (opset {since} and later)", anchor
        )
    known = onnx.defs.onnx_opset_version()
    if opset > known:
        raise Refusal(
            f"the model's ONNX opset {opset} is newer than the installed onnx's ({known}): its {anchor.op_type} may "
            f"not be opset {since}'s",
            anchor,
        )
    version = onnx.defs.get_schema(anchor.op_type, opset, "").since_version
    if version != since:
        raise Refusal(f"{anchor.op_type} at ONNX opset {opset} is its version {version}, not opset {since}'s", anchor)


def producer_op(value: ir.Value | None) -> str | None:
    producer = value.producer() if value is not None else None
    if producer is None or producer.domain not in _ONNX_DOMAINS:
        return None
    return producer.op_type


@dataclasses.dataclass(frozen=True)
class Batch:
    """A symbolic batch dim (a named or opaque symbol of the graph) bound to one size for an emulation."""

    symbol: Any
    size: int

    def bind(self, dim: Dim) -> int | None:
        """Return ``dim`` at this size: an int as it is, the symbol or ``c * symbol`` (c >= 1) bound; else None."""
        if isinstance(dim, int):
            return dim
        if isinstance(dim, _arith.QuasiAffine):
            if dim.symbol == self.symbol and dim.period == 1 and len(dim.pieces) == 1:
                slope, offset = dim.pieces[0]
                return slope * self.size if slope >= 1 and offset == 0 else None
            return None
        return self.size if dim is not None and dim == self.symbol else None

    def label(self) -> str:
        name = repr(self.symbol) if isinstance(self.symbol, str) else "the symbolic batch"
        return f"batch size {self.size} of {name}"


def is_batch_symbol(dim: Dim) -> bool:
    """Whether ``dim`` can be a symbolic batch: a named or opaque symbol (not an int, not an expression)."""
    return isinstance(dim, str | tuple)


def int_dims(value: ir.Value, shapes: ForwardShapes, what: str, batch: Batch | None = None) -> list[int]:
    """Return the proven dims of ``value``, all ints (``batch`` bound), or refuse naming ``what``."""
    dims = shapes(value)
    bound = None if dims is None else [batch.bind(d) if batch is not None else d for d in dims]
    if bound is None or not all(isinstance(d, int) for d in bound):
        shown = (
            "unknown" if dims is None else "[" + ", ".join(str(d) if isinstance(d, int) else "?" for d in dims) + "]"
        )
        raise Refusal(f"{what}'s shape is not proven static by the graph ({shown})", value)
    return [int(d) for d in bound]  # type: ignore[arg-type]


def shape_ints(
    value: ir.Value | None, aliases: Mapping[ir.Value, Sequence[Dim]], batch: Batch | None = None
) -> list[int] | None:
    """Return a shape tensor's elements when every one is a proven int (``batch`` bound), else None."""
    dims = resolve_shape_tensor(value, aliases)
    if dims is None:
        return None
    bound = [batch.bind(d) if batch is not None else d for d in dims]
    if not all(isinstance(d, int) for d in bound):
        return None
    return [int(d) for d in bound]  # type: ignore[arg-type]


def _attribute_ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(v) for v in attr.as_ints()]


def emulate(
    value: ir.Value,
    leaves: Mapping[ir.Value, np.ndarray],
    aliases: Mapping[ir.Value, Sequence[Dim]],
    depth: int = 0,
    *,
    batch: Batch | None = None,
    trace: list[tuple[object, tuple[int, ...]]] | None = None,
) -> np.ndarray | None:
    """Return the index array that ``value`` holds, following layout ops back to ``leaves``; None if not.

    ``batch`` binds a symbolic batch in the shape tensors; ``trace`` receives each leaf's and each step's
    shape (for ``batch_blocked``).
    """
    if value in leaves:
        if trace is not None:
            trace.append((value, leaves[value].shape))
        return leaves[value]
    producer = value.producer()
    if depth > _MAX_DEPTH or producer is None or producer.domain not in _ONNX_DOMAINS:
        return None
    result = _emulate_step(producer, leaves, aliases, depth, batch, trace)
    if result is not None and trace is not None:
        trace.append((producer, result.shape))
    return result


def is_identity_cast(node: ir.Node) -> bool:
    """Whether ``node`` is a Cast / CastLike to the type its input already has (the op's own body casts a
    float32 A and D to float32): it moves nothing and rounds nothing."""
    if node.op_type not in ("Cast", "CastLike") or node.domain not in _ONNX_DOMAINS or not node.inputs:
        return False
    source = node.inputs[0]
    return source is not None and source.dtype is not None and node.outputs[0].dtype == source.dtype


def _emulate_step(producer, leaves, aliases, depth, batch, trace) -> np.ndarray | None:
    op = producer.op_type
    if (op not in LAYOUT_OPS and not is_identity_cast(producer)) or not producer.inputs or producer.inputs[0] is None:
        return None
    source = emulate(producer.inputs[0], leaves, aliases, depth + 1, batch=batch, trace=trace)
    if source is None:
        return None
    second = producer.inputs[1] if len(producer.inputs) > 1 else None
    try:
        if op in ("Identity", "Cast", "CastLike"):  # a Cast here is an identity (is_identity_cast)
            return source
        if op == "Transpose":
            perm = _attribute_ints(producer, "perm")
            return np.transpose(source, perm) if perm is not None else np.transpose(source)
        if op == "Reshape":
            target = shape_ints(second, aliases, batch)
            if target is None:
                return None
            allowzero = producer.attributes.get_int("allowzero", 0)
            if not allowzero:
                target = [source.shape[i] if d == 0 else d for i, d in enumerate(target)]
            elif 0 in target and source.size != 0:
                return None
            return source.reshape(target)
        if op == "Expand":
            target = shape_ints(second, aliases, batch)
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
                # every axis of size 1: with a symbolic batch that is the batch axis at size 1 only, which the
                # traced shapes show (another rank at size 1)
                return np.squeeze(source)
            axes = [a % source.ndim for a in axes]
            if any(source.shape[a] != 1 for a in axes):
                return None
            return np.squeeze(source, axis=tuple(axes))
    except (ValueError, IndexError):
        return None  # the op fails on these shapes: the original does not run there
    return None


def batch_blocked(traces: Sequence[Sequence[tuple[object, tuple[int, ...]]]], sizes: Sequence[int]) -> str | None:
    """Return why emulations at batch ``sizes`` (one trace each) are not batch-blocked, or None when they are.

    Every traced step must have the same nodes and rank at every size and exactly one dim ``c * size``
    (the others the same at every size), with only 1s before it (module docstring).
    """
    first = traces[0]
    if any(len(t) != len(first) or any(a[0] is not b[0] for a, b in zip(t, first, strict=True)) for t in traces):
        return "the layout takes other steps at other batch sizes"
    for step in zip(*traces, strict=True):
        shapes = [shape for _, shape in step]
        if len({len(shape) for shape in shapes}) != 1:
            return f"a layout step has another rank at another batch size ({[list(s) for s in shapes]})"
        batch_axes = []
        for axis, column in enumerate(zip(*shapes, strict=True)):
            if len(set(column)) == 1:
                continue
            slope = column[0] // sizes[0]
            if slope < 1 or any(d != slope * n for d, n in zip(column, sizes, strict=True)):
                return f"a layout step's dim {axis} is not a multiple of the batch ({list(column)} at {list(sizes)})"
            batch_axes.append(axis)
        if len(batch_axes) != 1:
            return f"a layout step does not keep one batch axis ({[list(s) for s in shapes]})"
        if any(d != 1 for shape in shapes for d in shape[: batch_axes[0]]):
            return f"a layout step moves the batch behind another axis ({[list(s) for s in shapes]})"
    return None


def leaf_indices(dims: Sequence[int]) -> np.ndarray:
    """Return ``arange(numel).reshape(dims)``: each element's flat index."""
    return np.arange(int(np.prod(dims, dtype=np.int64)), dtype=np.int64).reshape(tuple(dims))


def _upstream(value: ir.Value, ops: frozenset[str], depth: int = 0) -> Iterator[ir.Value]:
    """Yield the values ``value`` is made from through ``ops`` (and identity Casts) only, nearest first."""
    for _ in range(depth, _MAX_DEPTH):
        producer = value.producer()
        if (
            producer is None
            or producer.domain not in _ONNX_DOMAINS
            or not (producer.op_type in ops or is_identity_cast(producer))
            or not producer.inputs
            or producer.inputs[0] is None
        ):
            return
        value = producer.inputs[0]
        yield value


def layout_source(value: ir.Value, depth: int = 0) -> ir.Value:
    """Return the value ``value`` is made from through layout ops (and identity Casts) only (itself when none)."""
    return [value, *_upstream(value, LAYOUT_OPS, depth)][-1]


#: Ops that keep a tensor's elements in row-major order and change at most its dims.
_VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def same_tensor_source(value: ir.Value, shapes: ForwardShapes) -> ir.Value:
    """Return the earliest value that ``value`` is a re-view of with the same proven dims (itself when none).

    Each op between them keeps the elements in row-major order (Reshape, Squeeze, Unsqueeze, Flatten, Identity,
    identity Casts), so a value with the same dims holds the same tensor and can feed a fused node in
    ``value``'s place; the re-views are left without users. An exporter's ``Unsqueeze(Squeeze(w, 1), 1)`` of a
    conv weight (dynamo without its optimizer) would otherwise stay in the fused graph: two kernels a layer and
    step.
    """
    dims = shapes(value)
    if dims is None or not all(isinstance(d, int) for d in dims):
        return value
    found = value
    for source in _upstream(value, _VIEW_OPS):
        if source.dtype == value.dtype and shapes(source) == dims:
            found = source
    return found


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


def take_over(old: ir.Value, new: ir.Value, old_suffix: str = "_unfused") -> None:
    """Make ``new`` stand where ``old`` stood: a graph output under its name, type and shape, else ``old``'s
    name, type and shape (its readers see the name they read before); then every reader of ``old`` reads it."""
    if old.is_graph_output():
        replace_graph_output(old, new)
    else:
        new.type, new.shape = old.type, old.shape
        new.name, old.name = old.name, f"{old.name}{old_suffix}"
    ir.convenience.replace_all_uses_with(old, new)


def rewrite_each(
    model: ir.Model,
    op_type: str,
    replacement: Callable[[ir.Node, DecodeShapes, NameSource], ir.Node | None],
    old_suffix: str,
) -> int:
    """Put ``replacement(node, shapes, fresh)`` in place of every ONNX ``op_type`` node of ``model``'s main graph
    for which it returns a node (one output, which takes over the old node's: ``take_over``, the old value renamed
    with ``old_suffix``); return how many were replaced. ``shapes`` proves dims, ``fresh`` names new values."""
    graph = model.graph
    shapes = DecodeShapes(graph)
    fresh = NameSource(model)
    count = 0
    for node in list(graph):
        if node.op_type != op_type or node.domain not in ("", "ai.onnx") or not node.inputs or None in node.inputs:
            continue
        new = replacement(node, shapes, fresh)
        if new is None:
            continue
        graph.insert_before(node, new)
        take_over(node.outputs[0], new.outputs[0], old_suffix)
        graph.remove(node, safe=True)
        count += 1
    return count


def negative_zeros(name: str, count: int, dtype: ir.DataType) -> ir.Value:
    """Return an initializer-ready value of ``count`` -0.0s (adding -0.0 is the identity, even for -0.0)."""
    return ir.Value(name=name, const_value=ir.tensor(np.full(count, -0.0, dtype=dtype.numpy()), name=name))


#: ``ForwardShapes`` knows the decode ops' outputs (out has x's dims, present the state's with x's batch: each
#: kernel rejects another), so that a later pass proves the next layer's chain through a pass's fused nodes.
DecodeShapes = ForwardShapes


#: Ops whose output 0 has the type of one input (by their ONNX schemas): op -> that input's index.
_SAME_TYPE_AS = {
    **dict.fromkeys(
        (
            "Add",
            "Sub",
            "Mul",
            "Div",
            "Neg",
            "Exp",
            "Softplus",
            "Sigmoid",
            "MatMul",
            "Identity",
            "Reshape",
            "Expand",
            "Unsqueeze",
            "Squeeze",
            "Transpose",
            "Gather",
            "Slice",
            "Concat",
            "Range",
        ),
        0,
    ),
    "Where": 1,
    "CastLike": 1,
}
_BOOL_OPS = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal", "Not", "And", "Or"})


def type_untyped_values(graph: ir.Graph) -> None:
    """Give the values that ONNX inference left untyped the type their producer's schema gives them.

    ONNX's inference stops at an op it cannot type, and an inliner does not type the inlined bodies' values;
    the decode rules read the rounding points from the types. Each type here follows from the op's schema
    and its typed inputs (a Cast's ``to``, a Mul's operand type, ...); the rules run inside
    ``value_info_preserved``, which takes the annotations back.
    """
    for node in graph:
        if node.domain not in _ONNX_DOMAINS:
            continue
        output = node.outputs[0] if node.outputs else None
        if output is None or output.dtype is not None:
            continue
        dtype = None
        if node.op_type == "Cast":
            to = node.attributes.get("to")
            dtype = None if to is None else ir.DataType(to.as_int())
        elif node.op_type in _BOOL_OPS:
            dtype = ir.DataType.BOOL
        elif node.op_type == "Shape":
            dtype = ir.DataType.INT64
        elif node.op_type in _SAME_TYPE_AS:
            index = _SAME_TYPE_AS[node.op_type]
            source = node.inputs[index] if len(node.inputs) > index else None
            dtype = None if source is None else source.dtype
        if dtype is not None:
            output.type = ir.TensorType(dtype)


class PlannedRule(pattern.RewriteRuleClassBase):
    """The shape the decode-step and attention rules share: ``check`` proves a plan (refusing with a
    ``Refusal``), ``rewrite`` carries it out, and the chain's values left without readers are removed after
    the pass. Fused chains and refusals are recorded into ``ACTIVE_LOG`` under the rule's ``FORM``.

    A plan has ``anchor`` (the node the log names), ``attributes`` (what the log records of a fused chain)
    and ``leftovers`` (values whose producers go once nothing reads them).
    """

    #: what the log calls the chain
    FORM = "decode"

    def __init__(self, name: str) -> None:
        super().__init__(name, remove_nodes=False)
        self._plan: Any = None
        self._leftovers: list[ir.Value] = []
        self._shapes: ForwardShapes | None = None

    def refused(self, result: pattern.MatchResult, anchor: ir.Node | None, refusal: Refusal) -> pattern.MatchResult:
        """Record ``refusal`` for ``anchor`` (when it is to be logged) and fail the match with its reason."""
        log = ACTIVE_LOG.get()
        if log is not None and refusal.logged and anchor is not None:
            log.record(anchor, self.FORM, reason=refusal.reason)
        return result.fail(refusal.reason, refusal.culprit)

    def take_plan(self) -> Any:
        """Return the plan ``check`` proved, recorded as fused, its leftovers kept for ``cleanup``."""
        plan = self._plan
        assert plan is not None
        log = ACTIVE_LOG.get()
        if log is not None:
            log.record(plan.anchor, self.FORM, **plan.attributes)
        self._leftovers.extend(plan.leftovers)
        return plan

    def setup(self) -> None:
        self._leftovers = []
        self._shapes = None

    def cleanup(self) -> None:
        remove_dead_producers(self._leftovers)
        self._leftovers = []


def apply_with_log(rules: pattern.RewriteRuleSet, model: ir.Model, log: FusionLog | None) -> int:
    """Apply a decode rule set to ``model`` in place with ``log`` as ``ACTIVE_LOG``; return how many fused."""
    token = ACTIVE_LOG.set(log)
    try:
        with value_info_preserved(model):
            return rules.apply_to_model(model)
    finally:
        ACTIVE_LOG.reset(token)
