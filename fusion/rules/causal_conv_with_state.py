"""Run a mobius build's conv as ``ai.mambafuse::CausalConv1d`` where it runs ORT's ``CausalConvWithState`` (or
ONNX's own, opset 27).

Microsoft's mobius builder writes each Mamba-2 mixer's causal conv as one
``com.microsoft::CausalConvWithState(activation="silu")`` node that serves the prompt and every decode step, between
two Transposes of the in_proj's xBC part::

    xt           = Transpose(xBC, perm=[0, 2, 1])                            # (B, L, C) -> (B, C, L)
    y, present   = CausalConvWithState(xt, weight, bias, past_conv_state)    # weight (C, 1, K), state (B, C, K - 1)
    out          = Transpose(y, perm=[0, 2, 1])

ORT's op is CausalConv1d's math (docs/causal_conv1d.md) with ``state_width = K - 1``: the window of the state's
K - 1 columns and the input, the depthwise sums plus the bias, the activation, and the window's last K - 1 columns
as the next state. The rule proves what the two ops share from the graph: ORT's defaults for every attribute but
``activation`` (1-D, undilated, no state window, channels-first, no speculative capture), an activation both know
("swish" is ORT's other name for SiLU), a constant (C, 1, K) weight, no reader of ORT's optional third output,
and float32, float16 or bfloat16 values. In 16 bits ORT's kernel computes the sum, the bias and the activation in
float32 and rounds its output once to the type: the node is then written with ``round_once = 1``, CausalConv1d's
rounding of the same computation (by default it rounds the conv, the sigmoid and the product each, as the exported
graphs do; the two differ in the last bit of a third of the outputs). With the Transposes on both sides (each with no
other reader) the node reads and writes the (B, L, C) values themselves (``channels_last = 1``) and the Transposes go;
otherwise it takes ORT's layout (``channels_last = 0``). genai's inputs and outputs keep their names and layout:
the state is (B, C, K - 1) in both ops.

ONNX's own ``CausalConvWithState`` (the default domain, added at opset 27) is ORT's op cut to those defaults: input
and output (B, C, L) channels-first, weight (C, 1, K), bias (C), state (B, C, K - 1) (zeros when absent),
``activation`` silu, swish or none (the default), two outputs and no other attribute. The specification defines it
by a function body: Concat(past_state, input) on the last axis, a depthwise Conv(group = C) with the bias, SiLU as
Sigmoid and Mul in float32 (the Conv's output cast up, the product cast back), and the concatenation's last K - 1
columns as the present state; that is CausalConv1d's math in float32, and ONNX Runtime 1.32 runs the op on the CPU
as that body. The rule takes it, in both forms, where the model's opset defines the op's version 27 (a model at an
opset the installed onnx does not know is refused), with ``activation`` its only attribute (ORT's others, even at
their defaults, are not in the standard's schema) and float32 values: at float16 the body rounds the Conv's sum to the
type and SiLU once from float32, CausalConv1d at each exported step.

On the CPU the kernel is 3.9-9.2x faster than ORT's node and its Transposes on a prompt at Nemotron-H and Zamba2
widths, and 1.3-1.5x faster on a decode step; on CUDA, with the scan's rule, the Nemotron-H-8B-shaped build's
2048-token prompt ~10 % faster and its decode step ~1.5 % (benchmarks/RESULTS.md). ``optimize`` and ``rewrite`` do
not know where a model runs, so for them the rule is opt-in (``fusion.rules.registry.OPT_IN_FUSIONS``: ``--opt-in
causal_conv_with_state``); ``mambafuse genai`` runs it on a folder for the CPU or CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.function.causal_conv1d import MIN_OPSET
from fusion.rules._decode import (
    PlannedRule,
    Refusal,
    apply_with_log,
    dtype_name,
    prove_standard_version,
    type_untyped_values,
)
from fusion.rules._log import FusionLog
from fusion.rules._prefill import SIXTEEN_BIT_DTYPES, SUPPORTED_DTYPES, causal_conv1d_node

FORM = "CausalConvWithState"
BUILDER_DOMAIN = "com.microsoft"
#: ONNX's own op (the default domain), and the opset that added it
STANDARD_DOMAIN = ""
STANDARD_SINCE = 27
#: ORT's attributes other than ``activation`` and the values that keep its op CausalConv1d's math: any other value
#: (a dilation, a state window, a channels-last state, a channel slice) is refused rather than translated.
_DEFAULTS: dict[str, tuple[int, ...]] = {
    "ndim": (1,),
    "dilation": (1,),
    "state_window": (0,),
    "state_update_capacity": (0,),
    "channels_last": (0,),
    "state_channels_last": (-1, 0),
    "input_channel_offset": (0,),
    "input_channels": (0,),
}
#: The attributes each spelling may carry besides ``activation``: ONNX's op has no other, ORT's the ones above.
_ATTRIBUTES_BY_DOMAIN: dict[str, dict[str, tuple[int, ...]]] = {BUILDER_DOMAIN: _DEFAULTS, STANDARD_DOMAIN: {}}
#: The types each spelling is CausalConv1d's computation in. ORT's kernel computes the conv, the bias and SiLU in
#: float32 and rounds its output once: CausalConv1d with ``round_once = 1`` in float16 and bfloat16 too. ONNX's
#: function body rounds the conv to the type and then SiLU once from float32, which neither of CausalConv1d's
#: roundings is, so its 16-bit nodes are refused.
_TYPES = {BUILDER_DOMAIN: SUPPORTED_DTYPES, STANDARD_DOMAIN: frozenset({ir.DataType.FLOAT})}
#: The activations both ops name and CausalConv1d's names for them ("none" is the default of both)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "none": "none"}
_TRANSPOSED = [0, 2, 1]


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    x: ir.Value
    weight: ir.Value
    bias: ir.Value | None
    past: ir.Value | None
    channels: int
    width: int
    activation: str
    channels_last: int
    dtype: ir.DataType
    round_once: int
    leftovers: list[ir.Value]
    attributes: dict[str, Any]


class CausalConvWithStateFusion(PlannedRule):
    """Rewrites one ``CausalConvWithState`` of ``domain`` (ORT's or ONNX's) into a CausalConv1d node;
    ``transposed``: the form between Transposes (rewritten channels-last, the Transposes dropped)."""

    FORM = FORM

    def __init__(self, name: str, *, transposed: bool, domain: str) -> None:
        super().__init__(name)
        self._transposed = transposed
        self._domain = domain
        self._typed = False

    def setup(self) -> None:
        super().setup()
        self._typed = False

    def pattern(self, op, x, weight):
        conv_input = op.Transpose(x, perm=_TRANSPOSED) if self._transposed else x
        y, present = op.CausalConvWithState(
            conv_input,
            weight,
            _domain=self._domain,
            _allow_other_attributes=True,
            _allow_other_inputs=True,
            _outputs=["y", "present"],
        )
        if self._transposed:
            return op.Transpose(y, perm=_TRANSPOSED, _outputs=["out"]), present
        return y, present

    def check(self, context, x, weight, present, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        anchor = present.producer()
        if anchor is None or anchor.op_type != "CausalConvWithState":
            return result.fail("not a CausalConvWithState")
        if not self._transposed and _between_transposes(anchor):
            # the channels-last rule takes it (it comes later in the graph's order, at the Transpose after)
            return result.fail("left to the form between Transposes")
        try:
            if not self._typed:  # once a pass: the types the proof reads do not change between matches
                type_untyped_values(present.graph)
                self._typed = True
            self._plan = _prove(anchor, x, weight, self._transposed)
        except Refusal as refusal:
            return self.refused(result, anchor, refusal)
        return result

    def rewrite(self, op, **_: Any):
        plan: _Plan = self.take_plan()
        # ORT's op starts from zeros without a state, as the zero state written for the function does
        return causal_conv1d_node(
            op,
            plan.x,
            plan.weight,
            plan.bias,
            plan.past,
            channels=plan.channels,
            width=plan.width,
            activation=plan.activation,
            channels_last=plan.channels_last,
            dtype=plan.dtype,
            name=plan.anchor.name or "causal_conv",
            round_once=plan.round_once,
        )


def _between_transposes(node: ir.Node) -> bool:
    """Whether ``node`` is the form between Transposes: its input a Transpose swapping the last two axes that
    nothing else reads, its output read by such a Transpose alone (neither value a graph output)."""

    def swaps(transpose: ir.Node | None) -> bool:
        if transpose is None or transpose.op_type != "Transpose" or transpose.domain not in ("", "ai.onnx"):
            return False
        perm = transpose.attributes.get("perm")
        return perm is not None and list(perm.as_ints()) == _TRANSPOSED

    def only_reader(value: ir.Value | None) -> ir.Node | None:
        users = [] if value is None else [user for user, _ in value.uses()]
        return users[0] if value is not None and len(users) == 1 and not value.is_graph_output() else None

    conv_input = node.inputs[0] if node.inputs else None
    return (
        conv_input is not None
        and swaps(conv_input.producer())
        and only_reader(conv_input) is node
        and swaps(only_reader(node.outputs[0]))
    )


def _prove(anchor: ir.Node, x: ir.Value, weight: ir.Value, transposed: bool) -> _Plan:
    if anchor.domain == STANDARD_DOMAIN:
        prove_standard_version(anchor, STANDARD_SINCE)
    defaults = _ATTRIBUTES_BY_DOMAIN[anchor.domain]
    for name, attribute in anchor.attributes.items():
        if name == "activation":
            continue
        if name not in defaults:
            raise Refusal(f"CausalConvWithState's attribute {name!r} is not one the rule knows", anchor)
        if attribute.type != ir.AttributeType.INT or attribute.as_int() not in defaults[name]:
            raise Refusal(f"CausalConvWithState's {name} is not ORT's default (CausalConv1d's math)", anchor)
    activation = anchor.attributes.get_string("activation", "none")
    if activation not in _ACTIVATIONS:
        raise Refusal(f"CausalConvWithState's activation {activation!r} is not silu, swish or none", anchor)
    if len(anchor.outputs) > 2 and (anchor.outputs[2].uses() or anchor.outputs[2].is_graph_output()):
        raise Refusal("CausalConvWithState's state_update output is read (CausalConv1d has none)", anchor)
    opset = anchor.graph.opset_imports.get("", anchor.graph.opset_imports.get("ai.onnx")) if anchor.graph else None
    if opset is None or opset < MIN_OPSET:
        raise Refusal(f"the model's ONNX opset {opset} is below {MIN_OPSET}, which CausalConv1d's function needs")
    dtype = x.dtype
    if dtype not in _TYPES[anchor.domain]:
        raise Refusal(
            f"{x.name} is {dtype_name(dtype)}: "
            + (
                "ONNX's function body rounds the conv to the type and SiLU once from float32, which is neither of "
                "CausalConv1d's roundings"
                if dtype in SIXTEEN_BIT_DTYPES
                else "not float, float16 or bfloat16"
            ),
            x,
        )
    for value in anchor.inputs[1:4]:
        if value is not None and value.dtype != dtype:
            raise Refusal(f"{value.name} is {dtype_name(value.dtype)}, not the input's {dtype_name(dtype)}", value)
    if weight.const_value is None:
        raise Refusal("the conv weight is not a constant", weight)
    shape = list(weight.const_value.shape)
    if len(shape) != 3 or shape[1] != 1 or shape[0] < 1 or shape[2] < 1:
        raise Refusal(f"the conv weight's shape {shape} is not (C, 1, K)", weight)
    bias = anchor.inputs[2] if len(anchor.inputs) > 2 else None
    past = anchor.inputs[3] if len(anchor.inputs) > 3 else None
    return _Plan(
        anchor=anchor,
        x=x,
        weight=weight,
        bias=bias,
        past=past,
        channels=int(shape[0]),
        width=int(shape[2]),
        activation=_ACTIVATIONS[activation],
        channels_last=1 if transposed else 0,
        dtype=dtype,
        # ORT's kernel rounds a 16-bit output once (float32 has no rounding to choose)
        round_once=1 if dtype in SIXTEEN_BIT_DTYPES else 0,
        # ORT's node, then the Transposes around it, once nothing reads them
        leftovers=[*anchor.outputs, *(user.outputs[0] for user, _ in anchor.outputs[0].uses())],
        attributes={
            "channels": int(shape[0]),
            "kernel": int(shape[2]),
            "activation": _ACTIVATIONS[activation],
            "channels_last": 1 if transposed else 0,
        },
    )


causal_conv_with_state_rules = pattern.RewriteRuleSet(
    [
        CausalConvWithStateFusion.rule(f"{prefix}CausalConvWithState{suffix}", transposed=transposed, domain=domain)
        for prefix, domain in (("", BUILDER_DOMAIN), ("onnx::", STANDARD_DOMAIN))
        for suffix, transposed in (("[Transposed]", True), ("", False))
    ]
)


def fuse_causal_conv_with_state(model: ir.Model, log: FusionLog | None = None) -> int:
    """Replace every proven CausalConvWithState of ``model`` in place; return how many were replaced."""
    return apply_with_log(causal_conv_with_state_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every CausalConvWithState (ORT's or ONNX's) left in ``graph``."""
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(graph)
        if node.op_type == "CausalConvWithState" and node.domain in _ATTRIBUTES_BY_DOMAIN
    ]


__all__ = [
    "CausalConvWithStateFusion",
    "causal_conv_with_state_rules",
    "find_anchors",
    "fuse_causal_conv_with_state",
]
