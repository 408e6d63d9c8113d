"""Fuse the Mamba-2 decode conv update into ``ai.mambafuse::CausalConv1dUpdate``.

The chain, as transformers' ``causal_conv1d_update`` torch fallback exports it (every exporter the project
covers writes the same ops; docs/forms.md)::

    window  = Concat(conv_state (B, C, S), x (B, C, L), axis=-1)
    present = Slice(window, starts=-S | L, ends=big, axes=-1)   [CastLike to the same type]   # a graph output
    v       = Slice(Conv(window, weight (C, 1, K), [bias], group=C, no padding), starts=-L, axes=-1)
    y       = Mul(v, Sigmoid(v))                                 <- the pattern's root

``check`` proves the depthwise Conv (group = C from the weight's proven shape, pads 0, stride and dilation
1), that the output Slice keeps the last L columns and the present Slice the last S, and the types (one T
throughout). A Conv without bias gets a -0.0 bias (v + -0.0 is v exactly). The present state keeps its
graph output name; the fused node writes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.reference.causal_conv1d_update import DOMAIN
from fusion.rules import _arith
from fusion.rules._decode import (
    ACTIVE_LOG,
    DecodeShapes,
    Refusal,
    apply_with_log,
    dtype_name,
    int_dims,
    negative_zeros,
    producer_op,
    replace_graph_output,
)
from fusion.rules._graph import (
    ForwardShapes,
    as_expression,
    constant_array,
    format_dims,
    remove_dead_producers,
    resolve_shape_tensor,
)
from fusion.rules.gated_group_rms_norm import FusionLog

FORM = "decode"
SUPPORTED_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
#: A Slice end at or past this keeps every column to the end.
_BIG_END = 2**31 - 1


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    x: ir.Value
    conv_state: ir.Value
    weight: ir.Value
    bias: ir.Value | None
    channels: int
    present: ir.Value
    #: the weight and bias as T constants, when the graph holds them in float32 (widened form)
    weight_data: np.ndarray | None
    bias_data: np.ndarray | None
    leftovers: list[ir.Value]
    attributes: dict[str, Any]


def _ints(value: ir.Value | None) -> list[int] | None:
    array = constant_array(value)
    return None if array is None or array.dtype.kind not in "iu" else [int(v) for v in array.reshape(-1)]


def _last_axis_slice(node: ir.Node, rank: int) -> list[int]:
    """Return the Slice's starts (one), refusing anything but a slice of the last axis to its end, step 1."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    ends, axes, steps = _ints(inputs[2]), _ints(inputs[3]), _ints(inputs[4]) if inputs[4] is not None else [1]
    if axes is None or len(axes) != 1 or axes[0] % rank != rank - 1:
        raise Refusal(f"the Slice is not along the last axis (axes {axes})", node)
    if steps != [1]:
        raise Refusal(f"the Slice's step is {steps}, not 1", node)
    if ends is None or ends[0] < _BIG_END:
        raise Refusal(f"the Slice does not run to the end (ends {ends})", node)
    return [0]


def _narrowed(value: ir.Value, t: ir.DataType, what: str) -> np.ndarray:
    """Return a float32 constant as T values, refusing one that T does not hold exactly."""
    if value.dtype != ir.DataType.FLOAT:
        raise Refusal(f"{what} is {dtype_name(value.dtype)} in a float32 Conv", value)
    data = constant_array(value)
    if data is None:
        raise Refusal(f"{what} is not a constant: the op reads it in x's type, {dtype_name(t)}", value)
    narrow = ir.tensor(data).numpy().astype(t.numpy())
    if not np.array_equal(narrow.astype(np.float32), data, equal_nan=True):
        raise Refusal(f"{what} holds float32 values that {dtype_name(t)} does not (the op reads it in x's type)", value)
    return narrow


def _is_minus_state_len(value: ir.Value | None, conv_state: ir.Value) -> bool:
    """Whether ``value`` is -S computed from ``Shape(conv_state)``'s last dim (dynamo: Neg of the Squeezed
    Shape slice, made 1-D by Reshape / Unsqueeze, maybe through an int64 Cast)."""
    negated = False
    for _ in range(12):
        op = producer_op(value)
        node = value.producer() if op is not None else None
        if node is None:
            return False
        if op in ("Reshape", "Unsqueeze", "Squeeze", "Identity") or (
            op == "Cast" and node.attributes.get_int("to", 0) == ir.DataType.INT64
        ):
            value = node.inputs[0]
        elif op == "Neg" and not negated:
            negated, value = True, node.inputs[0]
        elif op == "Shape":
            if node.inputs[0] is not conv_state:
                return False
            start = node.attributes.get_int("start", 0)
            end_attr = node.attributes.get("end")
            end = None if end_attr is None else end_attr.as_int()
            return negated and start in (2, -1) and end in (3, None)
        else:
            return False
    return False


class CausalConv1dUpdateFusion(pattern.RewriteRuleClassBase):
    """Rewrites one decode conv update into a CausalConv1dUpdate node."""

    def __init__(self, name: str, *, sigmoid_first: bool, widened: bool) -> None:
        super().__init__(name, remove_nodes=False)
        self._sigmoid_first = sigmoid_first
        #: transformers' exporter with a half model and a float32 weight: the window is widened to float32 for
        #: the Conv and its output rounded back (Cast) before the Slice: the op's one rounding of the sum
        self._widened = widened
        self._plan: _Plan | None = None
        self._leftovers: list[ir.Value] = []
        self._shapes: ForwardShapes | None = None

    def pattern(self, op, conv_state, x, weight, starts, ends, wide_to, narrow_to):
        window = op.Concat(conv_state, x, _outputs=["window"])
        conv_in = op.Cast(window, to=wide_to, _outputs=["conv_in"]) if self._widened else window
        conv = op.Conv(conv_in, weight, _allow_other_inputs=True, _outputs=["conv"])
        rounded = op.Cast(conv, to=narrow_to, _outputs=["rounded"]) if self._widened else conv
        v = op.Slice(rounded, starts, ends, _allow_other_inputs=True, _outputs=["v"])
        gate = op.Sigmoid(v)
        return op.Mul(gate, v, _outputs=["y"]) if self._sigmoid_first else op.Mul(v, gate, _outputs=["y"])

    def check(self, context, conv_state, x, weight, starts, window, conv, v, y, **b: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        anchor = window.producer()
        try:
            widened = (b["conv_in"], b["rounded"]) if self._widened else None
            self._plan = self._make_plan(anchor, conv_state, x, weight, starts, window, conv, v, widened)
            self._plan.leftovers.append(y)
        except Refusal as refusal:
            log = ACTIVE_LOG.get()
            if log is not None and refusal.logged:
                log.record(anchor, FORM, reason=refusal.reason)
            return result.fail(refusal.reason, refusal.culprit)
        return result

    def _make_plan(self, anchor, conv_state, x, weight, starts, window, conv, v, widened) -> _Plan:
        if self._shapes is None:
            self._shapes = DecodeShapes(window.graph)
        shapes = self._shapes
        t = x.dtype
        if t not in SUPPORTED_DTYPES:
            raise Refusal(f"the conv runs in {dtype_name(t)}, not float/float16/bfloat16", x)
        typed = [("conv_state", conv_state), ("window", window)]
        if widened is None:
            typed += [("weight", weight), ("conv", conv)]
        else:
            # f32(window) is exact; the float32 Conv's sum rounded once to T by the Cast is the op's v, when
            # the float32 weight holds T values (then it is the same weight in T).
            conv_in, rounded = widened
            if conv_in.dtype != ir.DataType.FLOAT or conv.dtype != ir.DataType.FLOAT:
                raise Refusal(f"the Conv runs in {dtype_name(conv.dtype)}, widened from {dtype_name(t)}", conv)
            typed.append(("the Conv's rounded output", rounded))
        for name, value in typed:
            if value.dtype != t:
                raise Refusal(f"{name} is {dtype_name(value.dtype)}, x is {dtype_name(t)}", value)
        weight_data = None if widened is None else _narrowed(weight, t, "the conv weight")
        concat_axis = anchor.attributes.get_int("axis", 0)
        if concat_axis not in (-1, 2) or len(anchor.inputs) != 2:
            raise Refusal(f"the window is not Concat(state, x) along the last axis (axis {concat_axis})", anchor)
        weight_dims = int_dims(weight, shapes, "the conv weight")
        if len(weight_dims) != 3 or weight_dims[1] != 1:
            raise Refusal(f"the conv weight is {weight_dims}, not depthwise (C, 1, K)", weight)
        channels, _, width = weight_dims
        conv_node = conv.producer()
        attrs = conv_node.attributes
        group = attrs.get_int("group", 1)
        if group != channels:
            raise Refusal(f"the Conv's group is {group}, not its {channels} channels (not depthwise)", conv_node)
        pads = attrs.get("pads")
        if pads is not None and any(p != 0 for p in pads.as_ints()):
            raise Refusal(f"the Conv pads {list(pads.as_ints())}: the op convolves the window unpadded", conv_node)
        if attrs.get("auto_pad") is not None and attrs.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise Refusal(f"the Conv's auto_pad is {attrs.get_string('auto_pad')}", conv_node)
        for name in ("strides", "dilations"):
            value = attrs.get(name)
            if value is not None and any(s != 1 for s in value.as_ints()):
                raise Refusal(f"the Conv's {name} are {list(value.as_ints())}, not 1", conv_node)
        kernel = attrs.get("kernel_shape")
        if kernel is not None and list(kernel.as_ints()) != [width]:
            raise Refusal(f"the Conv's kernel_shape {list(kernel.as_ints())} is not the weight's {width}", conv_node)
        bias = conv_node.inputs[2] if len(conv_node.inputs) > 2 else None
        bias_data = None if bias is None or widened is None else _narrowed(bias, t, "the conv bias")
        if bias is not None and widened is None and bias.dtype != t:
            raise Refusal(f"the conv bias is {dtype_name(bias.dtype)}, x is {dtype_name(t)}", bias)
        if bias is not None and int_dims(bias, shapes, "the conv bias") != [channels]:
            raise Refusal(f"the conv bias is not ({channels},)", bias)
        # x's batch may be symbolic (or unproven): no layout op touches it, and the Concat with the state
        # proves the state's batch to be x's (the op checks it too)
        x_dims = shapes(x)
        if x_dims is None or len(x_dims) != 3 or not all(isinstance(d, int) for d in x_dims[1:]):
            raise Refusal(f"x's (C, L) are not proven static by the graph ({format_dims(x_dims)})", x)
        if x_dims[1] != channels:
            raise Refusal(f"x is {x_dims}, not (B, {channels}, L)", x)
        new = x_dims[2]
        state_dims = shapes(conv_state)
        if state_dims is None or len(state_dims) != 3:
            raise Refusal("the conv state is not proven 3-D (B, C, S)", conv_state)
        if isinstance(state_dims[1], int) and state_dims[1] != channels:
            raise Refusal(f"the conv state has {state_dims[1]} channels, the weight {channels}", conv_state)
        state_len = state_dims[2]
        # The output Slice keeps the last L columns: starts = -L. With L = 1 the Conv itself fails where S < K - 1;
        # with L > 1 the state must be proven long enough for the conv output to have L columns.
        slice_node = v.producer()
        _last_axis_slice(slice_node, 3)
        if _ints(starts) != [-new]:
            raise Refusal(
                f"the conv output's Slice starts at {_ints(starts)}, not at -{new} (the last L columns)", slice_node
            )
        if new > 1 and not (isinstance(state_len, int) and state_len >= width - 1):
            raise Refusal("L > 1 and the state is not proven at least K - 1 long", conv_state)
        present, present_slice = self._present(window, conv_state, state_len, new, shapes)
        # nothing in the chain is read elsewhere
        chain = {anchor, conv_node, slice_node, present_slice, v.producer()}
        extra = [] if widened is None else list(widened)
        chain |= {value.producer() for value in extra}
        chain |= {user for user, _ in v.uses()}
        if present is not present_slice.outputs[0]:
            chain.add(present.producer())
        for value in (window, conv, v, present_slice.outputs[0], *extra):
            if value is present:
                continue
            if value.is_graph_output() or any(user not in chain for user, _ in value.uses()):
                raise Refusal(f"{value.name!r} is also read outside the chain", value)
        if any(user not in chain for user, _ in present.uses()):
            raise Refusal("the present conv state is read by other nodes too", present)
        return _Plan(
            anchor=anchor,
            x=x,
            conv_state=conv_state,
            weight=weight,
            bias=bias,
            channels=channels,
            present=present,
            weight_data=weight_data,
            bias_data=bias_data,
            leftovers=[present, window, conv],
            attributes={
                "channels": channels,
                "width": width,
                "new": new,
                "dtype": dtype_name(t),
                "bias": bias is not None,
            },
        )

    @staticmethod
    def _present(window, conv_state, state_len, new, shapes) -> tuple[ir.Value, ir.Node]:
        """Return the present state (a graph output) and the Slice that keeps the window's last S columns."""
        aliases = shapes.aliases({})
        for user, index in window.uses():
            if user.op_type != "Slice" or index != 0 or user.domain not in ("", "ai.onnx"):
                continue
            try:
                _last_axis_slice(user, 3)
            except Refusal:
                continue
            start = resolve_shape_tensor(user.inputs[1], aliases)
            if start is None or len(start) != 1:
                raise Refusal("the present state's Slice start is not proven", user)
            start_expr, state_expr = as_expression(start[0]), as_expression(state_len)
            total = None if start_expr is None or state_expr is None else _arith.add(start_expr, state_expr)
            keeps_last_s = (total is not None and total.as_constant() == 0) or _is_minus_state_len(
                user.inputs[1], conv_state
            )
            if not keeps_last_s and start[0] != new:
                raise Refusal("the present state's Slice does not keep the window's last S columns", user)
            out = user.outputs[0]
            if out.is_graph_output():
                return out, user
            casts = [
                u.outputs[0]
                for u, _ in out.uses()
                if u.op_type in ("CastLike", "Cast")
                and u.outputs[0].dtype == out.dtype
                and u.outputs[0].is_graph_output()
            ]
            if len(casts) == 1:
                return casts[0], user
            raise Refusal("the window's last S columns are not a graph output (the present state)", user)
        raise Refusal("no Slice of the window keeps its last S columns (the present state)", window)

    def rewrite(self, op, **_: Any):
        plan = self._plan
        assert plan is not None
        log = ACTIVE_LOG.get()
        if log is not None:
            log.record(plan.anchor, FORM, **plan.attributes)
        self._leftovers.extend(plan.leftovers)
        bias, weight = plan.bias, plan.weight
        if plan.weight_data is not None:
            name = f"{plan.weight.name}_{plan.x.dtype.name.lower()}"
            weight = op.initializer(ir.tensor(plan.weight_data, name=name), name=name)
        if plan.bias_data is not None:
            name = f"{plan.bias.name}_{plan.x.dtype.name.lower()}"
            bias = op.initializer(ir.tensor(plan.bias_data, name=name), name=name)
        if bias is None:
            name = f"{plan.present.name}_bias"
            zeros = negative_zeros(name, plan.channels, plan.x.dtype)
            bias = op.initializer(zeros.const_value, name=name)
        y, present = op.CausalConv1dUpdate(
            plan.x, plan.conv_state, weight, bias, _domain=DOMAIN, _version=1, _outputs=2, activation="silu"
        )
        replace_graph_output(plan.present, present)
        return y

    def setup(self) -> None:
        self._leftovers = []
        self._shapes = None

    def cleanup(self) -> None:
        remove_dead_producers(self._leftovers)
        self._leftovers = []


causal_conv1d_update_rules = pattern.RewriteRuleSet(
    [
        CausalConv1dUpdateFusion.rule(
            f"CausalConv1dUpdate[{'Sigmoid(v) * v' if first else 'v * Sigmoid(v)'}{', float32 Conv' if wide else ''}]",
            sigmoid_first=first,
            widened=wide,
        )
        for wide in (False, True)
        for first in (False, True)
    ]
)
causal_conv1d_update_rules.remove_unused_nodes = False


def fuse_causal_conv1d_update(model: ir.Model, log: FusionLog | None = None) -> int:
    """Fuse every decode conv update of ``model`` in place; return how many were fused."""
    return apply_with_log(causal_conv1d_update_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every conv update left in ``graph``: a Concat of a graph input that a Conv reads."""
    anchors = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or not node.outputs:
            continue
        if any(v is not None and v.is_graph_input() for v in node.inputs) and any(
            user.op_type == "Conv" for user, _ in node.outputs[0].uses()
        ):
            anchors.append(node)
    return anchors


__all__ = ["CausalConv1dUpdateFusion", "causal_conv1d_update_rules", "find_anchors", "fuse_causal_conv1d_update"]
