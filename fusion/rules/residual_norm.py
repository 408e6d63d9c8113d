"""Fold a half-precision model's float32-weighted RMSNorms, and the residual Add before them, into one node.

Used by ``mambafuse optimize`` only: the fused node is ONNX Runtime's contrib op
``com.microsoft::SkipSimplifiedLayerNormalization`` (or ONNX Runtime's ``SimplifiedLayerNormalization`` when no
residual Add precedes it), which has no model-local function.

Nemotron-H's RMSNorm (and every model whose norm multiplies by ``weight.to(float32)`` before casting back) exports
in float16 as, after onnxscript's RMSNorm fusion::

    s  = Add(a, b)                                              # the residual stream, float16
    y  = Cast(SimplifiedLayerNormalization(s, w32), to=float16)  # w32: float32 constant, y float32 before the Cast

onnxscript's residual fusion then writes ``SkipSimplifiedLayerNormalization(a, b, w32)`` with a float16 input and a
float32 weight, which ONNX Runtime refuses (``mambafuse optimize`` undoes it and says so), so each layer keeps
three kernels: the Add, the norm and the Cast. This pass writes the form ONNX Runtime runs::

    y, _, _, s = SkipSimplifiedLayerNormalization(a, b, w16, epsilon)   # every type float16

What is proven from the graph before fusing:

* the norm normalizes the last axis (``axis`` -1, or rank - 1 with the rank proven) with float32 statistics
  (``stash_type`` 1), and its weight is a 1-D constant (the norm itself requires it to be that axis's width);
* every weight value is a float16 value (``w32`` is a widened float16 weight: the fused node multiplies by the
  same numbers);
* ``a`` and ``b`` are float16 with the same proven dims (the fused node does not broadcast as Add does), of
  rank 2 or 3 (ONNX Runtime's kernel takes those). ``optimize`` runs this pass after the mambafuse fusions, whose
  nodes carry a symbolic batch past the Reshapes of ``Shape``-built targets that the unfused mixer has. Where the
  dims are still not proven the Add stays and only the Cast is folded: ``SimplifiedLayerNormalization(s, w16)``;
* the Cast goes back to float16, and nothing else reads the norm's float32 output.

Readers of ``s`` (the next layer's residual Add) read the fused node's sum output, which is the same float16
Add. What changes is rounding inside the norm, as with onnxscript's own fusions: ONNX Runtime's kernel
accumulates the mean square in float32 in its own order and rounds its float32 product to float16 once, where
the unfused graph rounded the float32 product in a Cast (measured on ONNX Runtime's CPU kernels: 47 of 81,920
float16 outputs differ from the unfused norm's, each by one unit in the last place). ``--verify`` compares the
whole model.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx_ir as ir

from fusion._graph import NameSource, value_info_preserved
from fusion.rules._decode import DecodeShapes, Refusal, dtype_name, take_over, type_untyped_values
from fusion.shapes.dims import ForwardShapes, dims_equal, format_dims

CONTRIB_DOMAIN = "com.microsoft"
_ONNX = ("", "ai.onnx")
#: The activation types ONNX Runtime's CPU and CUDA SkipSimplifiedLayerNormalization kernels were checked with.
_HALF = ir.DataType.FLOAT16


@dataclasses.dataclass
class _Plan:
    cast: ir.Node
    norm: ir.Node
    add: ir.Node | None
    weight: np.ndarray
    epsilon: float


def _single_reader(value: ir.Value) -> bool:
    return len(value.uses()) == 1 and not value.is_graph_output()


def _plan(cast: ir.Node, shapes: ForwardShapes) -> _Plan | None:
    """The fusion of the RMSNorm ``cast`` ends, or None when ``cast`` does not end one; Refusal when one is refused."""
    norm = cast.inputs[0].producer() if cast.inputs and cast.inputs[0] is not None else None
    if norm is None or norm.op_type != "SimplifiedLayerNormalization" or norm.domain not in _ONNX:
        return None
    x = norm.inputs[0]
    to = cast.attributes.get("to")
    if x is None or x.dtype != _HALF or to is None or to.as_int() != _HALF:
        return None  # not the mixed-precision form: onnxscript's own fusions handle the others
    if len(norm.inputs) < 2 or norm.inputs[1] is None or norm.inputs[1].dtype != ir.DataType.FLOAT:
        return None
    if len(norm.outputs) != 1 or not _single_reader(norm.outputs[0]):
        raise Refusal("the norm's float32 output has readers besides the Cast", norm)
    stash = norm.attributes.get("stash_type")
    if stash is not None and stash.as_int() != 1:
        raise Refusal(f"the norm's statistics are in {dtype_name(stash.as_int())}, not float32", norm)
    # The norm's own checks (ONNX Runtime's) already tie the weight to the normalized axis: it is the last
    # axis (-1, or rank - 1 with the rank proven) and the weight a 1-D constant.
    dims = shapes(x)
    axis_attribute = norm.attributes.get("axis")
    axis = -1 if axis_attribute is None else axis_attribute.as_int()
    if axis != -1 and (dims is None or axis != len(dims) - 1):
        raise Refusal(f"it normalizes axis {axis} of {format_dims(dims)}, not proven the last", norm)
    tensor = norm.inputs[1].const_value
    weight = None if tensor is None else tensor.numpy()
    if weight is None or weight.ndim != 1:
        shape = "not a constant" if weight is None else f"of shape {list(weight.shape)}"
        raise Refusal(f"its weight is {shape}, not a 1-D constant", norm)
    narrowed = weight.astype(np.float16)
    if not np.array_equal(narrowed.astype(np.float32), weight, equal_nan=True):
        raise Refusal("its float32 weight has values float16 does not hold", norm)
    epsilon_attribute = norm.attributes.get("epsilon")
    epsilon = 1e-5 if epsilon_attribute is None else epsilon_attribute.as_float()
    return _Plan(cast, norm, _residual_add(x, shapes), narrowed, epsilon)


def _residual_add(x: ir.Value, shapes: ForwardShapes) -> ir.Node | None:
    """The Add that makes ``x`` when the fused node can take it: float16 operands of the same proven dims, of
    rank 2 or 3 (the fused node does not broadcast as Add does; ONNX Runtime's kernel takes those ranks).
    None otherwise: the Add stays and only the Cast is folded."""
    add = x.producer()
    if add is None or add.op_type != "Add" or add.domain not in _ONNX or len(add.inputs) != 2:
        return None
    a, b = add.inputs
    if a is None or b is None or a.dtype != _HALF or b.dtype != _HALF:
        return None
    a_dims, b_dims = shapes(a), shapes(b)
    if a_dims is None or b_dims is None or len(a_dims) != len(b_dims) or len(a_dims) not in (2, 3):
        return None
    return add if all(map(dims_equal, a_dims, b_dims)) else None


def _fuse(plan: _Plan, fresh: NameSource) -> None:
    graph = plan.cast.graph
    assert graph is not None
    name = plan.norm.name or "norm"
    weight_name = fresh(f"{name}_weight_f16")
    weight = ir.Value(name=weight_name, const_value=ir.tensor(plan.weight, name=weight_name))
    graph.register_initializer(weight)
    y_old = plan.cast.outputs[0]
    if plan.add is None:
        node = ir.Node(
            "",
            "SimplifiedLayerNormalization",
            [plan.norm.inputs[0], weight],
            attributes=[
                ir.AttrFloat32("epsilon", plan.epsilon),
                ir.AttrInt64("axis", -1),
                ir.AttrInt64("stash_type", 1),
            ],
            num_outputs=1,
            name=fresh(f"{name}_f16"),
        )
        graph.insert_before(plan.norm, node)
        replaced = [(y_old, node.outputs[0])]
        dead = [plan.cast, plan.norm]
    else:
        node = ir.Node(
            CONTRIB_DOMAIN,
            "SkipSimplifiedLayerNormalization",
            [plan.add.inputs[0], plan.add.inputs[1], weight],
            attributes=[ir.AttrFloat32("epsilon", plan.epsilon)],
            num_outputs=4,
            name=fresh(f"{name}_skip"),
        )
        # At the Add's place: a and b are ready there, and every reader of the sum or the norm comes later.
        graph.insert_before(plan.add, node)
        node.outputs[1].name, node.outputs[2].name = "", ""
        replaced = [(y_old, node.outputs[0]), (plan.add.outputs[0], node.outputs[3])]
        dead = [plan.cast, plan.norm, plan.add]
    for old, new in replaced:
        take_over(old, new)
    old_weight = plan.norm.inputs[1]
    graph.remove(dead, safe=True)
    unused = old_weight is not None and not old_weight.uses() and not old_weight.is_graph_output()
    if unused and old_weight.name in graph.initializers and not old_weight.is_graph_input():
        del graph.initializers[old_weight.name]


def fuse_residual_norms(model: ir.Model) -> tuple[dict[str, int], list[str]]:
    """Fuse every half-precision RMSNorm with a float32 weight in ``model``'s main graph, in place.

    Returns how many norms were fused, by the op they became, and for each one refused, where and why.
    """
    with value_info_preserved(model):
        # The rounding points are read from the types: ONNX's inference may have left values untyped.
        type_untyped_values(model.graph)
        plans, refused = _plans(model.graph)
        fresh = NameSource(model)
        for plan in plans:
            _fuse(plan, fresh)
    counts = Counter(
        "SimplifiedLayerNormalization" if plan.add is None else "SkipSimplifiedLayerNormalization" for plan in plans
    )
    if "SkipSimplifiedLayerNormalization" in counts:
        model.opset_imports.setdefault(CONTRIB_DOMAIN, 1)
    return dict(counts), refused


def _plans(graph: ir.Graph) -> tuple[list[_Plan], list[str]]:
    """The norms of ``graph`` to fuse, and where and why each one matched is refused."""
    # DecodeShapes: after ``rewrite_model`` the mixer's chains are fused nodes whose output dims are their
    # inputs', which carries a symbolic batch past the Reshapes of shape tensors the chains were built from.
    shapes = DecodeShapes(graph)
    plans: list[_Plan] = []
    refused: list[str] = []
    for node in list(graph):
        if node.op_type != "Cast" or node.domain not in _ONNX:
            continue
        try:
            plan = _plan(node, shapes)
        except Refusal as refusal:
            culprit = refusal.culprit
            where = getattr(culprit, "name", None) or node.name
            refused.append(f"{where}: {refusal.reason}")
            continue
        if plan is not None:
            if plan.add is not None and any(other.add is plan.add for other in plans):
                plan.add = None  # a sum two norms read: the first folds the Add, this one reads its sum
            plans.append(plan)
    return plans, refused


__all__ = ["fuse_residual_norms"]
