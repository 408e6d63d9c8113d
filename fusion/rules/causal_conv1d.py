"""Fuse the Mamba-2 prompt's causal conv into ``ai.mambafuse::CausalConv1d`` (docs/causal_conv1d.md).

The chain every exporter writes for transformers' ``causal_conv1d_forward`` over a prompt (docs/causal_conv1d.md,
"Forms in exported graphs")::

    x_cf = Transpose(x (B, L, C), [0, 2, 1])                               # T
    v    = Slice(Conv(x_cf, W (C, 1, K), [bias], group=C, pads=[K-1, p]), 0, L, axis 2)
    y    = Transpose(Mul(v, Sigmoid(v)), [0, 2, 1])                       # (B, L, C)  <- the root

The Conv is depthwise (``group`` = C = the weight's rows, one input channel each), with stride and dilation 1, a
left padding of K - 1 zeros and any right padding (the slice keeps the first L columns: output t reads inputs
t - K + 1 .. t). The slice's end is proven to be the prompt's length L. Without the Transpose back (a graph that
keeps (B, C, L)) the node is written channels-first; without the SiLU with ``activation = "none"``. The state
Slice some exporters add (``x_cf[..., -K:]``) stays: it reads the input, not the conv, and at L < K it returns L
columns where the op's state would hold K. The node starts from zeros (the exported prefill graphs have no initial
state): the function body takes every input, so the rule passes -0.0 for a missing bias and a (B, C, K - 1) zero
state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.rules._decode import (
    PlannedRule,
    Refusal,
    apply_with_log,
    dtype_name,
)
from fusion.rules._log import FusionLog
from fusion.rules._prefill import (
    ONNX_DOMAINS,
    SUPPORTED_DTYPES,
    axis_of,
    causal_conv1d_node,
    const_ints,
    mul_operands,
    perm_of,
    producer_of,
    same,
    strip,
    type_prefill_values,
)
from fusion.shapes.dims import ForwardShapes, dims_equal, resolve_shape_tensor

FORM = "prefill"


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    x: ir.Value
    weight: ir.Value
    bias: ir.Value | None
    channels: int
    width: int
    channels_last: int
    activation: str
    leftovers: list[ir.Value]
    attributes: dict[str, Any]


class CausalConv1dFusion(PlannedRule):
    """Rewrites one prompt conv (Transpose, depthwise Conv, Slice, SiLU, Transpose back) into a CausalConv1d node.

    ``root``: "Transpose" (the output back in (B, L, C)), "Mul" (channels-first, SiLU) or "Slice" (channels-first,
    no activation).
    """

    FORM = FORM

    def __init__(self, name: str, *, root: str) -> None:
        super().__init__(name)
        self._root = root

    def pattern(self, op, y, extra):
        if self._root == "Transpose":
            return op.Transpose(y, _allow_other_attributes=True, _outputs=["out"])
        if self._root == "Mul":
            return op.Mul(y, extra, _outputs=["out"])
        return op.Slice(y, extra, _allow_other_inputs=True, _outputs=["out"])

    def check(self, context, y, out, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if _conv_of(out.producer(), self._root) is None:
            return result.fail("not a prompt conv's output")
        if self._shapes is None:
            # typed before the chain's end is decided: a later node continues it through Casts to the type a value
            # already has (TorchScript's copies between the SiLU and the Transpose back), seen only once typed
            type_prefill_values(out.graph)
            self._shapes = ForwardShapes(out.graph)
        conv = _conv_behind(out.producer(), self._root)
        if conv is None:
            return result.fail("not a prompt conv's output")
        try:
            self._plan = _prove(self._shapes, conv, out.producer(), self._root)
        except Refusal as refusal:
            return self.refused(result, conv, refusal)
        return result

    def rewrite(self, op, **_: Any):
        plan: _Plan = self.take_plan()
        y, _final_state = causal_conv1d_node(
            op,
            plan.x,
            plan.weight,
            plan.bias,
            None,
            channels=plan.channels,
            width=plan.width,
            activation=plan.activation,
            channels_last=plan.channels_last,
            dtype=plan.x.dtype,
            name=plan.anchor.name or "causal_conv1d",
        )
        return y


def _conv_of(root: ir.Node, kind: str) -> ir.Node | None:
    """The depthwise Conv that a root of ``kind`` ends, else None (op types only)."""
    value = root.outputs[0]
    if kind == "Transpose":
        value = root.inputs[0]
        mul = producer_of(value, "Mul")
        value = _silu_input(mul) if mul is not None else value
    elif kind == "Mul":
        value = _silu_input(root)
    sliced = producer_of(value, "Slice")
    if sliced is None:
        return None
    conv = producer_of(sliced.inputs[0], "Conv")
    if conv is None or conv.attributes.get_int("group", 1) == 1:
        return None
    return conv


def _conv_behind(root: ir.Node, kind: str) -> ir.Node | None:
    """The Conv a candidate root ends, where no later node continues the chain (that node's rule fuses it)."""
    conv = _conv_of(root, kind)
    if conv is None or kind == "Transpose":
        return conv
    for user in _readers(root.outputs[0]):
        if user.domain not in ONNX_DOMAINS or user.op_type not in ("Transpose", "Mul"):
            continue
        if _conv_of(user, user.op_type) is conv:
            return None
        if user.op_type == "Mul" and any(
            later.op_type == "Transpose" and _conv_of(later, "Transpose") is conv for later in _readers(user.outputs[0])
        ):
            return None
    return conv


def _readers(value: ir.Value) -> list[ir.Node]:
    """The nodes that read ``value``, seen through its copies (Identity, a Cast to the type it has: ``strip``)."""
    readers = []
    for user, _ in value.uses():
        if user.domain in ONNX_DOMAINS and user.op_type in ("Identity", "Cast") and strip(user.outputs[0]) is value:
            readers.extend(_readers(user.outputs[0]))
        else:
            readers.append(user)
    return readers


def _silu_input(mul: ir.Node | None) -> ir.Value | None:
    """v for Mul(v, Sigmoid(v)) (either order), else None."""
    if mul is None or mul.op_type != "Mul" or len(mul.inputs) != 2:
        return None
    for first, second in mul_operands(mul):
        sigmoid = producer_of(second, "Sigmoid")
        if sigmoid is not None and same(sigmoid.inputs[0], first):
            return first
    return None


def _prove(shapes: ForwardShapes, conv: ir.Node, root: ir.Node, kind: str) -> _Plan:
    aliases = shapes.aliases({})
    x_cf, weight = conv.inputs[0], conv.inputs[1]
    bias = conv.inputs[2] if len(conv.inputs) > 2 else None
    t = x_cf.dtype
    if t not in SUPPORTED_DTYPES:
        raise Refusal(f"the conv's input is {dtype_name(t)}, not float, float16 or bfloat16", x_cf)
    for value, name in ((weight, "weight"), (bias, "bias")):
        if value is not None and value.dtype != t:
            raise Refusal(f"the conv's {name} is {dtype_name(value.dtype)}, not its input's {dtype_name(t)}", value)
    x_dims = shapes(x_cf)
    w_dims = shapes(weight)
    if x_dims is None or len(x_dims) != 3 or not isinstance(x_dims[1], int):
        raise Refusal(f"the conv's input dims {x_dims} are not (B, C, L) with C proven", x_cf)
    channels = x_dims[1]
    if w_dims is None or len(w_dims) != 3 or w_dims[:2] != [channels, 1] or not isinstance(w_dims[2], int):
        raise Refusal(f"the conv's weight dims {w_dims} are not (C, 1, K) with C = {channels}", weight)
    width = w_dims[2]
    if bias is not None and shapes(bias) != [channels]:
        raise Refusal(f"the conv's bias dims {shapes(bias)} are not (C)", bias)
    attrs = conv.attributes
    if attrs.get_int("group", 1) != channels:
        raise Refusal(
            f"the conv has group {attrs.get_int('group', 1)}, not one per channel ({channels})", conv.outputs[0]
        )
    for name, expected in (("strides", [1]), ("dilations", [1])):
        got = attrs.get(name)
        if got is not None and list(got.as_ints()) != expected:
            raise Refusal(f"the conv's {name} are {list(got.as_ints())}, not {expected}", conv.outputs[0])
    kernel = attrs.get("kernel_shape")
    if kernel is not None and list(kernel.as_ints()) != [width]:
        raise Refusal(
            f"the conv's kernel_shape {list(kernel.as_ints())} is not the weight's [{width}]", conv.outputs[0]
        )
    if attrs.get_string("auto_pad", "NOTSET") != "NOTSET":
        raise Refusal("the conv pads automatically (auto_pad), not K - 1 zeros on the left", conv.outputs[0])
    pads = attrs.get("pads")
    pads = list(pads.as_ints()) if pads is not None else [0, 0]
    if len(pads) != 2 or pads[0] != width - 1 or pads[1] < 0:
        raise Refusal(f"the conv's pads {pads} are not K - 1 = {width - 1} on the left", conv.outputs[0])
    # the slice back to L columns
    sliced = next(user for user, _ in conv.outputs[0].uses() if user.op_type == "Slice")
    inputs = list(sliced.inputs) + [None] * (5 - len(sliced.inputs))
    ends = resolve_shape_tensor(inputs[2], aliases)
    if (
        const_ints(inputs[1]) != [0]
        or axis_of(inputs[3], 3) != 2
        or (inputs[4] is not None and const_ints(inputs[4]) != [1])
        or ends is None
        or len(ends) != 1
        or not dims_equal(ends[0], x_dims[2])
    ):
        raise Refusal(
            "the conv's output is not sliced to its first L columns (L proven the prompt's)", sliced.outputs[0]
        )
    if len(conv.outputs[0].uses()) != 1:
        raise Refusal("the conv's output is also read elsewhere than the slice", conv.outputs[0])
    activation = "silu" if kind != "Slice" and (kind == "Mul" or producer_of(root.inputs[0], "Mul")) else "none"
    # the layout: x_cf = Transpose(x (B, L, C)) and the output transposed back, or both channels-first
    channels_last = 0
    x = x_cf
    if kind == "Transpose":
        if perm_of(root) != [0, 2, 1]:
            raise Refusal(f"the conv's output is transposed by {perm_of(root)}, not back to (B, L, C)", root.outputs[0])
        into = producer_of(x_cf, "Transpose")
        if into is None or perm_of(into) != [0, 2, 1]:
            raise Refusal("the conv's input is not Transpose(x (B, L, C)): the output's layout is not x's", x_cf)
        x, channels_last = into.inputs[0], 1
    return _Plan(
        anchor=conv,
        x=x,
        weight=weight,
        bias=bias,
        channels=channels,
        width=width,
        channels_last=channels_last,
        activation=activation,
        leftovers=[root.outputs[0]],
        attributes={"channels": channels, "width": width, "activation": activation, "dtype": dtype_name(t)},
    )


def _rules() -> list[pattern.RewriteRule]:
    return [CausalConv1dFusion.rule(f"CausalConv1d[{root}]", root=root) for root in ("Transpose", "Mul", "Slice")]


causal_conv1d_rules = pattern.RewriteRuleSet(_rules())
causal_conv1d_rules.remove_unused_nodes = False


def fuse_causal_conv1d(model: ir.Model, log: FusionLog | None = None) -> int:
    """Fuse every prompt conv of ``model`` in place; return how many were fused."""
    return apply_with_log(causal_conv1d_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every prompt conv left in ``graph``: a depthwise 1-D Conv (group > 1, a 3-D weight) whose output is
    sliced (the decode step's conv is CausalConv1dUpdate's)."""
    anchors = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type != "Conv" or node.domain not in ONNX_DOMAINS or node.attributes.get_int("group", 1) == 1:
            continue
        if any(user.op_type == "Slice" for user, _ in node.outputs[0].uses()):
            anchors.append(node)
    return anchors


__all__ = ["CausalConv1dFusion", "causal_conv1d_rules", "find_anchors", "fuse_causal_conv1d"]
