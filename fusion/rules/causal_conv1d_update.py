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

``CausalConv1dUpdateBodyFusion`` fuses the op's own model-local body, which an optimizer that inlines
functions (onnx-ir's InlinePass, onnxscript's optimize_for_ort) leaves in place of a fused node, back into
the same node (docs/forms.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.reference.causal_conv1d_update import DOMAIN
from fusion.rules._decode import (
    DecodeShapes,
    PlannedRule,
    Refusal,
    apply_with_log,
    dtype_name,
    emulate,
    int_dims,
    layout_source,
    leaf_indices,
    negative_zeros,
    producer_op,
    replace_graph_output,
    same_tensor_source,
    type_untyped_values,
)
from fusion.rules._log import FusionLog
from fusion.shapes import arith as _arith
from fusion.shapes.dims import ForwardShapes, as_expression, constant_array, format_dims, resolve_shape_tensor

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
    activation: str = "silu"


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


class CausalConv1dUpdateFusion(PlannedRule):
    """Rewrites one decode conv update into a CausalConv1dUpdate node."""

    def __init__(self, name: str, *, sigmoid_first: bool, widened: bool) -> None:
        super().__init__(name)
        self._sigmoid_first = sigmoid_first
        #: transformers' exporter with a half model and a float32 weight: the window is widened to float32 for
        #: the Conv and its output rounded back (Cast) before the Slice: the op's one rounding of the sum
        self._widened = widened

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
            return self.refused(result, anchor, refusal)
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
        if weight_data is None:
            weight = same_tensor_source(weight, shapes)
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
        if bias is not None and bias_data is None:
            bias = same_tensor_source(bias, shapes)
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
        _check_closed(chain, (window, conv, v, present_slice.outputs[0], *extra), present)
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
        plan = self.take_plan()
        bias, weight = plan.bias, plan.weight
        # a float32 constant narrowed to T, or (the op's inlined body, folded by an optimizer) the constant
        # laid out back as the op's input
        if plan.weight_data is not None:
            name = f"{plan.weight.name if plan.weight else plan.present.name + '_weight'}_{plan.x.dtype.name.lower()}"
            weight = op.initializer(ir.tensor(plan.weight_data, name=name), name=name)
        if plan.bias_data is not None:
            name = f"{plan.bias.name if plan.bias else plan.present.name + '_bias'}_{plan.x.dtype.name.lower()}"
            bias = op.initializer(ir.tensor(plan.bias_data, name=name), name=name)
        if bias is None and plan.bias_data is None:
            name = f"{plan.present.name}_bias"
            zeros = negative_zeros(name, plan.channels, plan.x.dtype)
            bias = op.initializer(zeros.const_value, name=name)
        y, present = op.CausalConv1dUpdate(
            plan.x, plan.conv_state, weight, bias, _domain=DOMAIN, _version=1, _outputs=2, activation=plan.activation
        )
        replace_graph_output(plan.present, present)
        return y


def _check_closed(chain: set[ir.Node], values, present: ir.Value) -> None:
    """Refuse when a value of the chain (``values``; the present state aside) is a graph output or read by a
    node outside ``chain``, or when the present state is read outside it: the fused node replaces them all."""
    for value in values:
        if value is present:
            continue
        if value.is_graph_output() or any(user not in chain for user, _ in value.uses()):
            raise Refusal(f"{value.name!r} is also read outside the chain", value)
    if any(user not in chain for user, _ in present.uses()):
        raise Refusal("the present conv state is read by other nodes too", present)


def _prove_columns(indices, conv_state, state_len, new, width, shapes, aliases) -> None:
    """Prove ``indices`` = (S - K + 1) + t + k (t < L, k < K): the window's last L + K - 1 columns."""
    want = np.arange(new)[:, None] + np.arange(width)[None, :]
    data = _int_array(indices, shapes)
    if data is not None:
        if (
            not isinstance(state_len, int)
            or data.shape != want.shape
            or not (data == want + state_len - width + 1).all()
        ):
            raise Refusal("the body's Gather does not read the window's last L + K - 1 columns", indices)
        return
    add = indices.producer() if producer_op(indices) == "Add" else None
    for offsets, first in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])) if add else ():
        grid = _int_array(offsets, shapes)
        start = resolve_shape_tensor(first, aliases)
        if grid is None or start is None or len(start) != 1 or grid.shape != want.shape:
            continue
        shift = grid - want
        expr, state = as_expression(start[0]), as_expression(state_len)
        if (shift == shift.flat[0]).all() and expr is not None and state is not None:
            total = _arith.add(
                _arith.add(expr, state, sign=-1), _arith.QuasiAffine.constant(int(shift.flat[0]) + width - 1)
            )
            if total is not None and total.as_constant() == 0:
                return
    raise Refusal("the body's Gather is not proven to read the window's last L + K - 1 columns", indices)


def _int_array(value: ir.Value | None, shapes: ForwardShapes, depth: int = 0) -> np.ndarray | None:
    """Return the ints ``value`` holds, evaluated through the index arithmetic of the op's own body (Shape of a
    proven dim, Slice, Squeeze, Unsqueeze, Range, Add, Sub); None where a dim it reads is not a proven int."""
    data = constant_array(value)
    if data is not None and value is not None and value.producer() is not None and value.const_value is None:
        data = None if producer_op(value) != "Constant" else data  # constant_array flattens through Casts
    if data is not None:
        return data if data.dtype.kind in "iu" else None
    op = producer_op(value)
    if op is None or depth > 24:
        return None
    node = value.producer()
    if op == "Shape":
        dims = shapes(node.inputs[0])
        if dims is None:
            return None
        start = node.attributes.get_int("start", 0)
        end_attr = node.attributes.get("end")
        # a dim that is not a proven int is None: the arithmetic on it fails (TypeError), a Slice may drop it
        picked = dims[start : None if end_attr is None else end_attr.as_int()]
        return np.array([d if isinstance(d, int) else None for d in picked], dtype=object)
    args = [_int_array(v, shapes, depth + 1) if v is not None else None for v in node.inputs]
    if not args or any(a is None for a in args):
        return None
    result = _int_step(op, args)
    if result is None or result.dtype != object:
        return result
    return None if any(not isinstance(v, int | np.integer) for v in result.reshape(-1)) else result.astype(np.int64)


def _int_step(op: str, args: list[np.ndarray]) -> np.ndarray | None:
    try:
        if op == "Add":
            return args[0] + args[1]
        if op == "Sub":
            return args[0] - args[1]
        if op == "Unsqueeze" and len(args) == 2:
            result = args[0]
            rank = result.ndim + args[1].size
            for axis in sorted(int(a) % rank for a in args[1].reshape(-1)):
                result = np.expand_dims(result, axis)
            return result
        if op == "Squeeze" and len(args) == 2:
            return np.squeeze(args[0], axis=tuple(int(a) for a in args[1].reshape(-1)))
        if op == "Range" and len(args) == 3 and all(a.size == 1 for a in args):
            start, limit, delta = (int(a.reshape(-1)[0]) for a in args)
            return np.arange(start, limit, delta, dtype=np.int64) if delta != 0 else None
        if op == "Slice" and len(args) in (3, 4, 5) and args[0].ndim == 1:
            starts, ends = args[1].reshape(-1), args[2].reshape(-1)
            axes = args[3].reshape(-1) if len(args) > 3 else [0]
            steps = args[4].reshape(-1) if len(args) > 4 else [1]
            if len(starts) != 1 or list(axes) not in ([0], [-1]):
                return None
            return args[0][slice(int(starts[0]), int(ends[0]), int(steps[0]))]
    except (ValueError, IndexError, TypeError):
        return None
    return None


def _label_encoded(value: ir.Value) -> np.ndarray | None:
    """Return the body's activation condition Cast(LabelEncoder(Constant(name)), BOOL) as a bool, else None."""
    cast = value.producer() if producer_op(value) == "Cast" else None
    if cast is None or cast.attributes.get_int("to", 0) != ir.DataType.BOOL:
        return None
    encoder = cast.inputs[0].producer()
    if encoder is None or encoder.op_type != "LabelEncoder" or encoder.domain != "ai.onnx.ml":
        return None
    source = encoder.inputs[0]
    name = source.producer() if source is not None else None
    if name is not None and name.op_type == "Constant" and name.attributes.get("value_string") is not None:
        activation = name.attributes["value_string"].as_string()
    elif name is None and source is not None and source.const_value is not None and source.const_value.size == 1:
        activation = source.const_value.numpy().reshape(-1)[0]  # an optimizer made the Constant an initializer
        activation = activation.decode() if isinstance(activation, bytes) else str(activation)
    else:
        return None
    keys, values = encoder.attributes.get("keys_strings"), encoder.attributes.get("values_int64s")
    if keys is None or values is None or len(encoder.attributes) != 3:
        return None
    default = encoder.attributes.get_int("default_int64", -1)
    table = dict(zip(keys.as_strings(), values.as_ints(), strict=True))
    return np.array([table.get(activation, default) != 0])


class CausalConv1dUpdateBodyFusion(CausalConv1dUpdateFusion):
    """Fuses the op's own model-local body (docs/forms.md), which an optimizer left inlined::

        window  = Concat(conv_state, x, axis=-1);  present = Slice(window, L, end, axes=2)
        windows = Gather(window, (S - K + 1) + t + k for t < L, k < K, axis=2)          # (B, C, L, K)
        v       = Squeeze(MatMul(windows, Reshape(weight, (C, K, 1))), 3) + Unsqueeze(bias, 1)
        y       = Where(activation == "silu", v * Sigmoid(v), v)

    ``check`` proves the gathered columns (the index arithmetic evaluated, S symbolic where the state's
    length is), the weight's and the bias' layouts, the types, and reads the activation from the inlined
    condition: the fused node is the one the body was.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name, sigmoid_first=False, widened=False)

    def pattern(self, op, conv_state, x, w, bias_column, indices, squeeze_axes, is_silu):
        window = op.Concat(conv_state, x, _outputs=["window"])
        windows = op.Gather(window, indices, _outputs=["windows"])
        dot = op.MatMul(windows, w, _outputs=["dot"])
        v = op.Add(op.Squeeze(dot, squeeze_axes, _outputs=["dot3"]), bias_column, _outputs=["v"])
        silu = op.Mul(v, op.Sigmoid(v, _outputs=["gate"]), _outputs=["silu"])
        return op.Where(is_silu, silu, v, _outputs=["y"])

    def check(self, context, conv_state, x, indices, squeeze_axes, is_silu, window, y, **b: Any):
        result = pattern.MatchResult()
        anchor = window.producer()
        try:
            self._plan = self._body_plan(anchor, conv_state, x, indices, squeeze_axes, is_silu, window, y, b)
            self._plan.leftovers.append(y)
        except Refusal as refusal:
            return self.refused(result, anchor, refusal)
        return result

    @staticmethod
    def _operand(value: ir.Value, dims: list[int], want: np.ndarray, t: ir.DataType, what: str, shapes, aliases):
        """Return (the graph value, None) or (None, its data) that ``value`` is a layout of, proven to hold its
        elements as ``want`` (indices into ``dims``); an optimizer may have folded the layout into a constant."""
        source = layout_source(value)
        if source.dtype != t or value.dtype not in (t, None):
            raise Refusal(f"the {what} is {dtype_name(source.dtype)}, x is {dtype_name(t)}", source)
        if source is value:
            data = constant_array(value) if value.const_value is not None else None
            if data is None or data.shape != want.shape:
                raise Refusal(f"the {what} is not a layout of a ({', '.join(map(str, dims))}) tensor", value)
            return None, data.reshape(-1)[np.argsort(want.reshape(-1))].reshape(dims)
        if shapes(source) != dims:
            raise Refusal(f"the {what} is not a ({', '.join(map(str, dims))}) tensor of the model", source)
        got = emulate(value, {source: leaf_indices(dims)}, aliases)
        if got is None or got.shape != want.shape or not np.array_equal(got, want):
            raise Refusal(f"the {what} is not laid out as the op's body reads it", value)
        return source, None

    def _body_plan(self, anchor, conv_state, x, indices, squeeze_axes, is_silu, window, y, b) -> _Plan:
        if self._shapes is None:
            type_untyped_values(window.graph)
            self._shapes = DecodeShapes(window.graph)
        shapes = self._shapes
        t = x.dtype
        if t not in SUPPORTED_DTYPES:
            raise Refusal(f"the conv runs in {dtype_name(t)}, not float/float16/bfloat16", x)
        if conv_state.dtype != t:
            raise Refusal(f"conv_state is {dtype_name(conv_state.dtype)}, x is {dtype_name(t)}", conv_state)
        if anchor.attributes.get_int("axis", 0) not in (-1, 2) or len(anchor.inputs) != 2:
            raise Refusal("the window is not Concat(state, x) along the last axis", anchor)
        gather = b["windows"].producer()
        if gather.attributes.get_int("axis", 0) not in (2, -1):
            raise Refusal("the body's Gather is not along the window's columns", gather)
        # the weight (C, K, 1) and the bias column (C, 1): their dims from the proven MatMul operand
        w_dims = shapes(b["w"])
        if w_dims is None or len(w_dims) != 3 or w_dims[2] != 1 or not all(isinstance(d, int) for d in w_dims):
            raise Refusal(f"the MatMul's weight is not proven (C, K, 1) ({format_dims(w_dims)})", b["w"])
        channels, width = int(w_dims[0]), int(w_dims[1])
        aliases = shapes.aliases({})
        weight_want = leaf_indices([channels, width]).reshape(channels, width, 1)
        weight, weight_data = self._operand(
            b["w"], [channels, 1, width], weight_want, t, "conv weight", shapes, aliases
        )
        bias_want = leaf_indices([channels]).reshape(channels, 1)
        bias, bias_data = self._operand(b["bias_column"], [channels], bias_want, t, "conv bias", shapes, aliases)
        x_dims = shapes(x)
        if x_dims is None or len(x_dims) != 3 or not all(isinstance(d, int) for d in x_dims[1:]):
            raise Refusal(f"x's (C, L) are not proven static by the graph ({format_dims(x_dims)})", x)
        if x_dims[1] != channels:
            raise Refusal(f"x is {x_dims}, not (B, {channels}, L)", x)
        new = x_dims[2]
        state_dims = shapes(conv_state)
        if state_dims is None or len(state_dims) != 3:
            raise Refusal("the conv state is not proven 3-D (B, C, S)", conv_state)
        if (_ints(squeeze_axes) or []) not in ([3], [-1]):
            raise Refusal("the MatMul's output is not squeezed along its last axis", squeeze_axes)
        _prove_columns(indices, conv_state, state_dims[2], new, width, shapes, aliases)
        flag = constant_array(is_silu)
        if flag is None or flag.dtype != np.bool_ or flag.size != 1:
            flag = _label_encoded(is_silu)
        if flag is None:
            raise Refusal("the activation's condition is not a constant", is_silu)
        activation = "silu" if bool(np.asarray(flag).reshape(-1)[0]) else "none"
        present, present_slice = self._present(window, conv_state, state_dims[2], new, shapes)
        chain = {anchor, present_slice, y.producer()}
        chain |= {b[name].producer() for name in ("windows", "dot", "dot3", "v", "gate", "silu")}
        if present is not present_slice.outputs[0]:
            chain.add(present.producer())
        _check_closed(chain, (value for node in chain for value in node.outputs if value is not y), present)
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
            leftovers=[present, window, b["dot"], b["w"], b["bias_column"]],
            attributes={"channels": channels, "width": width, "new": new, "dtype": dtype_name(t), "bias": True},
            activation=activation,
        )


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
    + [CausalConv1dUpdateBodyFusion.rule("CausalConv1dUpdate[the op's own body]")]
)
causal_conv1d_update_rules.remove_unused_nodes = False


def fuse_causal_conv1d_update(model: ir.Model, log: FusionLog | None = None) -> int:
    """Fuse every decode conv update of ``model`` in place; return how many were fused."""
    return apply_with_log(causal_conv1d_update_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every conv update left in ``graph``: a Concat of a graph input that a Conv reads, or that the
    op's inlined body reads (a Gather along the columns into a MatMul)."""

    def body_gather(user: ir.Node) -> bool:
        return (
            user.op_type == "Gather"
            and user.attributes.get_int("axis", 0) in (2, -1)
            and any(reader.op_type == "MatMul" for reader, _ in user.outputs[0].uses())
        )

    anchors = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or not node.outputs:
            continue
        if any(v is not None and v.is_graph_input() for v in node.inputs) and any(
            user.op_type == "Conv" or body_gather(user) for user, _ in node.outputs[0].uses()
        ):
            anchors.append(node)
    return anchors


__all__ = ["CausalConv1dUpdateFusion", "causal_conv1d_update_rules", "find_anchors", "fuse_causal_conv1d_update"]
