"""Fuse the gated group-RMSNorm chain of Mamba-2 mixers into ``ai.mambafuse::GatedGroupRMSNorm``.

The chain (docs/forms.md; forms A–J differ in the spellings in brackets)::

    y    = [Cast(to=f32)](y_in)              z = [Cast(to=f32)](z_in)
    silu = Mul(z, Sigmoid(z)) | com.microsoft QuickGelu(z, alpha=1)
    h    = [Cast(to=gated_dtype)](Mul(y, silu))        # rounding point 0 (mobius half builds)
    hg   = Reshape(h, [..., G, gs])                     # absent when ungrouped (one group, gs = C)
    n    = hg * rsqrt(ReduceMean(hg^2, -1) + eps)      # or SimplifiedLayerNormalization / RMSNormalization
           rsqrt: Reciprocal(Sqrt) | Div(1, Sqrt) | Pow(-0.5) | Div(hg, Sqrt); square: Pow(2) | Mul(hg, hg)
    f    = Reshape(n, shape of h)
    nc   = [Cast(to=norm_dtype)](f)                     # first rounding point
    o    = Mul(W, nc)                                   # W maybe Cast(W_half -> f32)
    out  = [Cast(to=output_dtype)](o)                   # absorbed only when o is fp32

    form I (mobius):    f = Reshape(RMSNormalization(hg, scale=Reshape(W, [G, gs])), shape of h); no Mul
    form J (Falcon-H1): f = Reshape(Mul(W as [G, gs], n), shape of h) in float32, then [Cast]

Commutative Muls and Adds match in either operand order. One rule class covers everything; its
constructor picks the inner norm, the operand order of the final weight Mul, whether a trailing Cast is
absorbed (a pattern's returned value cannot be an ``OrValue``), grouped or not, and where the weight
enters (after the norm, as its scale, or inside the groups). The rules that absorb a trailing Cast run
first (``fuse_gated_group_rms_norm``): otherwise the chain would already be fused at its weight Mul
before the Cast is reached; the weight-as-scale rules run last.

Only what the graph proves is fused: group sizes from constant Reshape targets or shape arithmetic that
``_graph.resolve_shape_tensor`` follows exactly, never from declared shapes of intermediate values (a
``Shape`` of one reads its proven dims, ``ForwardShapes``; y's leading dims are a graph input's or proven,
``_evidence_dims``). A second Reshape whose target is not proven to be y's shape but ends in C is kept
after the fused node (``_restore_target``). A
width of y (or the gate) that the graph does not prove is read through ``Expand`` to the other input's
shape (the broadcast guard), so the fused node computes the original's product for every width.

Widening input Casts are not part of the pattern: ``y``, ``z`` and ``W`` are variables and ``check``
looks at their producers. A Cast that widens to fp32 and feeds only the chain is bypassed (the kernel
widens exactly) and removed once dead; any other Cast stays and its output feeds the fused node.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion._graph import remove_dead_producers, value_info_preserved
from fusion.reference import DOMAIN
from fusion.rules._decode import type_untyped_values
from fusion.rules._log import FusionLog, location
from fusion.shapes.dims import (
    Dim,
    ForwardShapes,
    constant_array,
    constant_scalar,
    dims_equal,
    format_dims,
    forward_dims,
    resolve_shape_tensor,
    value_dims,
)

InnerNorm = Literal["decomposed", "simplified_layer_norm", "rms_normalization"]
INNER_NORMS: tuple[InnerNorm, ...] = ("decomposed", "simplified_layer_norm", "rms_normalization")

#: Element types the op reads and writes (docs/op.md).
SUPPORTED_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_ONNX_DOMAINS = ("", "ai.onnx")
#: ORT registers SimplifiedLayerNormalization in the ONNX domain; some tools write com.microsoft.
_MS_DOMAIN = "com.microsoft"
#: SimplifiedLayerNormalization's and RMSNormalization's default epsilon.
_DEFAULT_NORM_EPSILON = 1e-5


_ACTIVE_LOG: contextvars.ContextVar[FusionLog | None] = contextvars.ContextVar("mambafuse_log", default=None)
#: The user's opt-in (``--assume-equal-widths``): an unproven width of y or the gate is taken to be C
#: without the broadcast guard. Faster where exporters do not prove it (dynamo prefill); a width of 1
#: is then rejected by the kernel at run time instead of being broadcast.
_ASSUME_EQUAL_WIDTHS: contextvars.ContextVar[bool] = contextvars.ContextVar("mambafuse_equal_widths", default=False)


class _Refusal(Exception):
    """A check failure: the reason and the node or value it is about."""

    def __init__(self, reason: str, culprit: ir.Node | ir.Value | None = None, *, logged: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.culprit = culprit
        #: False when another rule explains this chain better (it is not this rule's form at all).
        self.logged = logged


def _dtype_name(dtype: ir.DataType | int | None) -> str:
    return "unknown" if dtype is None else ir.DataType(dtype).name.lower()


@dataclasses.dataclass
class _Plan:
    """Everything ``rewrite`` needs, worked out by ``check``."""

    anchor: ir.Node
    form: str
    y: ir.Value
    z: ir.Value
    weight: ir.Value
    epsilon: float
    group_size: int
    norm_dtype: ir.DataType
    output_dtype: ir.DataType
    gated_dtype: ir.DataType
    leftovers: list[ir.Value]
    rewire: list[tuple[ir.Node, int, ir.Value]]
    #: "y" or "z" when that input's last axis is not proven C wide (it may be 1 and broadcast in the
    #: original product): the fused node then reads it through Expand to the other input's shape.
    broadcast: str | None = None
    #: the weight is a constant [G, gs] scale: the node reads it flattened to [C]
    flatten_weight: bool = False
    #: the second Reshape's target and allowzero, when the graph does not prove that it gives back y's shape:
    #: the fused node's output (y's shape, the same elements in the same order) is reshaped to it
    restore_to: tuple[ir.Value, int] | None = None


# --- the rule ---------------------------------------------------------------------------------------


class GatedGroupRMSNormFusion(pattern.RewriteRuleClassBase):
    """Rewrites one gated group-RMSNorm chain into a GatedGroupRMSNorm node.

    Args:
        inner: how the per-group RMS norm between the two Reshapes is spelled.
        weight_first: the final Mul is ``Mul(W, normed)`` (else ``Mul(normed, W)``).
        trailing_cast: match (and absorb into ``output_dtype``) a Cast after the weight Mul.
        float_cast_first: with ``trailing_cast``, the trailing Cast follows a Cast of the float32 product to
            float32 (TorchScript writes the norm's ``.to(float32)`` so, before the model's Cast to half).
        grouped: the norm works on ``Reshape(h, [..., G, gs])`` and is reshaped back; else it normalizes
            h over its last axis directly (one group, group_size = C).
        weight_as_scale: the weight is the RMSNormalization's scale (mobius builds: ``W[C]``, or
            ``Reshape(W, [G, gs])`` when grouped) and nothing multiplies after the norm.
        weight_in_group: the weight multiplies the normalized groups before the second Reshape, as
            ``[G, gs]`` (Falcon-H1: ``weight.view(G, gs) * normed``, in float32).
    """

    def __init__(
        self,
        name: str,
        *,
        inner: InnerNorm,
        weight_first: bool = True,
        trailing_cast: bool = False,
        float_cast_first: bool = False,
        grouped: bool = True,
        weight_as_scale: bool = False,
        weight_in_group: bool = False,
    ) -> None:
        # The matcher's own removability test would refuse any chain whose product also feeds a
        # Shape node (every dynamic-shape export does that), and without a reason. check does the
        # test instead, and the dead chain is removed by cleanup.
        super().__init__(name, remove_nodes=False)
        self._inner = inner
        self._weight_first = weight_first
        self._trailing_cast = trailing_cast
        self._float_cast_first = float_cast_first
        self._grouped = grouped
        self._weight_as_scale = weight_as_scale
        self._weight_in_group = weight_in_group
        self._plan: _Plan | None = None
        self._leftovers: list[ir.Value] = []
        self._shapes: ForwardShapes | None = None  # per rewrite pass (setup)
        self._saved: list[tuple[list[ir.Value], ForwardShapes | None]] = []  # outer graphs' state (setup)

    # pattern ----------------------------------------------------------------------------------------

    def pattern(
        self,
        op,
        y,
        z,
        shape_in,
        shape_out,
        weight,
        epsilon,
        exponent,
        numerator,
        rsqrt_exponent,
        scale,
        alpha,
        norm_to,
        out_to,
        float_to,
        gated_to,
        widen_to,
        negate,
        one,
        norm_widen_to,
    ):
        # z / (1 + exp(-z)): the spelling of mambafuse's own function body (it avoids ORT's Sigmoid), so
        # that a fused model whose function an optimizer inlined fuses again.
        minus_z = pattern.OrValue([op.Neg(z), op.Mul(z, negate), op.Mul(negate, z)])
        exp_minus_z = op.Exp(minus_z)
        silu = pattern.OrValue(
            [
                op.Mul(z, op.Sigmoid(z)),
                op.Mul(op.Sigmoid(z), z),
                op.QuickGelu(z, alpha=alpha, _domain=_MS_DOMAIN),
                op.Div(z, op.Add(exp_minus_z, one)),
                op.Div(z, op.Add(one, exp_minus_z)),
            ],
            name="silu",
            tag_var="silu_form",
            tag_values=("sigmoid", "sigmoid", "quick_gelu", "exp", "exp"),
        )
        gated = pattern.OrValue([op.Mul(y, silu), op.Mul(silu, y)], name="gated")
        # The third rounding point: mobius rounds h to the model's half type before the norm (a Cast to
        # float32 there is TorchScript's no-op); the function body rounds and widens back to float32.
        rounded = pattern.OrValue(
            [op.Cast(op.Cast(gated, to=gated_to), to=widen_to), op.Cast(gated, to=gated_to), gated],
            name="rounded",
            tag_var="rounded_form",
            tag_values=("widened", "cast", "none"),
        )
        groups = op.Reshape(rounded, shape_in, _outputs=["groups"]) if self._grouped else rounded
        if self._weight_as_scale:
            normed_groups = op.RMSNormalization(groups, weight, _outputs=["inner"])
            return op.Reshape(normed_groups, shape_out, _outputs=["flat"]) if self._grouped else normed_groups
        if self._inner == "decomposed":
            normed_groups = self._decomposed_norm(op, groups, epsilon, exponent, numerator, rsqrt_exponent)
        elif self._inner == "simplified_layer_norm":
            normed_groups = pattern.OrValue(
                [
                    op.SimplifiedLayerNormalization(groups, scale),
                    op.SimplifiedLayerNormalization(groups, scale, _domain=_MS_DOMAIN),
                ],
                name="inner",
            )
        else:
            normed_groups = op.RMSNormalization(groups, scale, _outputs=["inner"])
        if self._weight_in_group:
            pair = (weight, normed_groups) if self._weight_first else (normed_groups, weight)
            weighted = op.Reshape(op.Mul(*pair, _outputs=["weighted"]), shape_out, _outputs=["flat"])
            return self._trailing(op, weighted, out_to, float_to) if self._trailing_cast else weighted
        flat = op.Reshape(normed_groups, shape_out, _outputs=["flat"]) if self._grouped else normed_groups
        # The first rounding point; the function body widens the rounded value back to float32, so that
        # the weight Mul runs in float32 and the trailing Cast is the second rounding point.
        normed = pattern.OrValue(
            [op.Cast(op.Cast(flat, to=norm_to), to=norm_widen_to), op.Cast(flat, to=norm_to), flat],
            name="normed",
            tag_var="normed_form",
            tag_values=("widened", "cast", "none"),
        )
        if self._weight_first:
            weighted = op.Mul(weight, normed, _outputs=["weighted"])
        else:
            weighted = op.Mul(normed, weight, _outputs=["weighted"])
        if self._trailing_cast:
            return self._trailing(op, weighted, out_to, float_to)
        return weighted

    def _trailing(self, op, weighted, out_to, float_to):
        # check requires the first Cast of float_cast_first to be to float32: a no-op on the product
        if self._float_cast_first:
            return op.Cast(op.Cast(weighted, to=float_to, _outputs=["float_cast"]), to=out_to)
        return op.Cast(weighted, to=out_to)

    @staticmethod
    def _decomposed_norm(op, groups, epsilon, exponent, numerator, rsqrt_exponent):
        square = pattern.OrValue(
            [op.Pow(groups, exponent), op.Mul(groups, groups)],
            tag_var="square_form",
            tag_values=("pow", "mul"),
        )
        # The axes (input or attribute) and keepdims are read in check, so that a wrong one is
        # refused with a reason instead of silently not matching.
        mean_square = op.ReduceMean(square, _allow_other_inputs=True, _outputs=["mean_square"])
        variance = pattern.OrValue([op.Add(mean_square, epsilon), op.Add(epsilon, mean_square)])
        rms = op.Sqrt(variance)
        inv_rms = pattern.OrValue(
            [op.Reciprocal(rms), op.Div(numerator, rms), op.Pow(variance, rsqrt_exponent)],
            tag_var="rsqrt_form",
            tag_values=("reciprocal", "div", "pow"),
        )
        return pattern.OrValue(
            [op.Mul(groups, inv_rms), op.Mul(inv_rms, groups), op.Div(groups, rms)],
            name="normalized",
            tag_var="normalize_form",
            tag_values=("mul", "mul", "div"),
        )

    # check ------------------------------------------------------------------------------------------

    def check(self, context, **bindings: Any) -> pattern.MatchResult:
        """Return success when the matched chain computes exactly GatedGroupRMSNorm, else why not."""
        result = pattern.MatchResult()
        anchor = self._anchor(bindings)
        form = classify(
            bindings, self._inner, weight_as_scale=self._weight_as_scale, weight_in_group=self._weight_in_group
        )
        try:
            self._plan = self._make_plan(context, anchor, form, bindings)
        except _Refusal as refusal:
            log = _ACTIVE_LOG.get()
            if log is not None and refusal.logged:
                log.record(anchor, form, reason=refusal.reason)
            return result.fail(refusal.reason, refusal.culprit)
        return result

    def _anchor(self, b: dict[str, Any]) -> ir.Node:
        """Return the node a chain is known by: its first Reshape, or the norm's first node if ungrouped."""
        if self._grouped:
            return b["groups"].producer()
        if self._inner == "decomposed":
            return b["mean_square"].producer().inputs[0].producer()  # the square
        return b["inner"].producer()

    def _make_plan(self, context, anchor: ir.Node, form: str, b: dict[str, Any]) -> _Plan:
        chain_nodes = set(context.nodes)
        y, z, weight = b["y"], b["z"], b["weight"]
        if b.get("silu_form") == "quick_gelu":
            alpha = b["alpha"].as_float()
            if abs(alpha - 1.0) > 1e-6:
                raise _Refusal(f"QuickGelu(alpha={alpha:g}) is x*sigmoid({alpha:g}x), not silu", b["silu"])
        if b.get("silu_form") == "exp":
            _check_exp_silu(b)
        for name, value in (("y", y), ("gate", z)):
            if value.dtype != ir.DataType.FLOAT:
                raise _Refusal(
                    f"{name} enters the gated product as {_dtype_name(value.dtype)}; the op computes it "
                    "in float32 (only an fp32 product, or a widening Cast before it, can be fused)",
                    value,
                )
        y_input, y_shape_readers = _bypass_widening_cast(y, chain_nodes)
        z_input, z_shape_readers = _bypass_widening_cast(z, chain_nodes)

        flatten_weight = False
        if self._weight_as_scale:
            weight, channels, flatten_weight = _scale_as_weight(weight, self._grouped)
        elif self._weight_in_group:
            if weight.dtype != ir.DataType.FLOAT:
                raise _Refusal(f"the weight multiplies the groups in {_dtype_name(weight.dtype)}, not float32", weight)
            weight, channels, flatten_weight = _group_weight(weight)
        else:
            channels = _weight_channels(weight)
        if self._shapes is None:  # one pass over the graph, the first time a check needs it in this rewrite
            self._shapes = ForwardShapes(y.graph)
        y_dims = _proven_dims(y, self._shapes) or _proven_dims(y_input, self._shapes)
        z_dims = _proven_dims(z, self._shapes) or _proven_dims(z_input, self._shapes)
        if y_dims is None or z_dims is None:
            raise _Refusal("the shapes of y and the gate are unknown (run shape inference first)", y)
        y_dims, z_dims, broadcast = _last_axis_as_channels(y_dims, z_dims, channels)
        if _ASSUME_EQUAL_WIDTHS.get():
            broadcast = None
        if len(y_dims) != len(z_dims) or not all(map(dims_equal, y_dims, z_dims)):
            raise _Refusal(
                f"y {format_dims(y_dims)} and the gate {format_dims(z_dims)} are not provably the same "
                "shape; the op does not broadcast",
                z,
            )
        if not dims_equal(y_dims[-1], channels):
            raise _Refusal(f"the last axis of y {format_dims(y_dims)} is not the weight's length C = {channels}", y)
        # The Reshape proofs below compare targets with y's leading dims: those must be y's real dims.
        y_dims = _evidence_dims(y_dims, (y, y_input), self._shapes)
        # The chain's tensors all have y's dims (y and z are equal, the product is elementwise).
        rounded: ir.Value = b["rounded"]
        # Shape tensors read these tensors' dims as y's, and any other intermediate's as the graph proves them.
        aliases = self._shapes.aliases(dict.fromkeys((y, z, y_input, z_input, b["silu"], b["gated"], rounded), y_dims))

        gated_dtype = ir.DataType.FLOAT
        if rounded is not b["gated"]:  # a Cast of the product before the norm: rounding point 0
            gated_dtype = ir.DataType(b["gated_to"].as_int())
            if gated_dtype not in SUPPORTED_DTYPES:
                raise _Refusal(f"the gated product is cast to {_dtype_name(gated_dtype)} before the norm", rounded)
            widened = b.get("rounded_form") == "widened"
            if widened and b["widen_to"].as_int() != ir.DataType.FLOAT:
                raise _Refusal(
                    f"the gated product is rounded to {_dtype_name(gated_dtype)} and then cast to "
                    f"{_dtype_name(b['widen_to'].as_int())}, not back to float32",
                    rounded,
                )
            if gated_dtype != ir.DataType.FLOAT and not self._weight_as_scale and not widened:
                raise _Refusal(
                    f"the gated product is rounded to {_dtype_name(gated_dtype)} and then normalized in that "
                    "type, not in float32",
                    rounded,
                )

        if self._grouped:
            group_dims = _target_dims(anchor, b["shape_in"], y_dims, aliases)
            group_size = _group_size(group_dims, y_dims, channels, anchor)
            group_rank = len(group_dims) if group_dims is not None else None
        else:
            group_dims, group_size, group_rank = y_dims, channels, len(y_dims)

        if self._inner == "decomposed":
            epsilon = _check_decomposed(b, group_rank)
        else:
            epsilon = _check_inner_norm(
                b["inner"].producer(), group_rank, group_size, channels, weight_as_scale=self._weight_as_scale
            )

        flat: ir.Value = b["flat"] if self._grouped else b["normalized" if self._inner == "decomposed" else "inner"]
        restore_to = None
        if self._grouped:
            restored = _target_dims(flat.producer(), b["shape_out"], group_dims, aliases)
            if not _restores(restored, y_dims):
                restore_to = _restore_target(flat.producer(), b["shape_out"], restored, y_dims, channels, aliases)

        if self._weight_in_group:
            # The weight Mul runs in float32 on the unrounded norm: no rounding before it (norm_dtype
            # float); a trailing Cast is then the single rounding of the product.
            norm_dtype, weight_input, w_shape_readers = ir.DataType.FLOAT, weight, []
            output_dtype = self._trailing_output_dtype(b, y_input, z_input, weight_input)
        elif self._weight_as_scale:
            # RMSNormalization's output has the scale's type; ONNX Runtime's kernel multiplies the scale in
            # float32 and rounds once (not the ONNX function body, which rounds before the scale).
            norm_dtype = ir.DataType.FLOAT
            weight_input, w_shape_readers = weight, []
            if weight_input.dtype not in SUPPORTED_DTYPES:
                raise _Refusal(f"the norm's scale is {_dtype_name(weight_input.dtype)}", weight_input)
            output_dtype = ir.DataType(b["weight"].dtype)  # the scale's own type (W may be cast up to it)
        else:
            norm_dtype, output_dtype, weight_input, w_shape_readers = self._weight_dtypes(
                b, flat, weight, chain_nodes, y_input, z_input
            )
        shape_readers = _outside_readers(context, anchor, flat.producer() if self._grouped else None)
        # Shape(x) of a bypassed Cast's output is Shape of its input: reroute so the Cast can go.
        rewire = [(node, index, y_input) for node, index in shape_readers + y_shape_readers]
        rewire += [(node, index, z_input) for node, index in z_shape_readers]
        rewire += [(node, index, weight_input) for node, index in w_shape_readers]
        leftovers = [
            *context.output_values,
            y,
            z,
            b["weight"],
            b.get("shape_in"),
            b.get("shape_out"),
            b.get("epsilon"),
            b.get("exponent"),
            b.get("numerator"),
            b.get("rsqrt_exponent"),
            b.get("scale"),
        ]
        return _Plan(
            anchor=anchor,
            form=form,
            y=y_input,
            z=z_input,
            weight=weight_input,
            epsilon=epsilon,
            group_size=group_size,
            norm_dtype=norm_dtype,
            output_dtype=output_dtype,
            gated_dtype=gated_dtype,
            leftovers=[v for v in leftovers if v is not None],
            rewire=rewire,
            broadcast=broadcast,
            flatten_weight=flatten_weight,
            restore_to=restore_to,
        )

    def _weight_dtypes(
        self, b: dict[str, Any], flat: ir.Value, weight: ir.Value, chain_nodes: set[ir.Node], y_input, z_input
    ) -> tuple[ir.DataType, ir.DataType, ir.Value, list[tuple[ir.Node, int]]]:
        """Return norm_dtype, output_dtype, the weight the node reads and Shape readers of a bypassed Cast."""
        normed: ir.Value = b["normed"]
        norm_dtype = ir.DataType.FLOAT
        if normed is not flat:  # a Cast after the second Reshape: the first rounding point
            norm_dtype = ir.DataType(b["norm_to"].as_int())
            if norm_dtype not in SUPPORTED_DTYPES:
                raise _Refusal(f"the normalized value is cast to {_dtype_name(norm_dtype)}", normed)
        # Rounded and widened back (the function body): the weight Mul runs in float32, as after no Cast.
        widened = b.get("normed_form") == "widened"
        if widened and b["norm_widen_to"].as_int() != ir.DataType.FLOAT:
            raise _Refusal(
                f"the normalized value is rounded to {_dtype_name(norm_dtype)} and then cast to "
                f"{_dtype_name(b['norm_widen_to'].as_int())}, not back to float32",
                normed,
            )
        multiply_dtype = ir.DataType.FLOAT if widened else norm_dtype
        if weight.dtype != multiply_dtype:
            raise _Refusal(
                f"the weight is {_dtype_name(weight.dtype)} but the normalized value is {_dtype_name(norm_dtype)}",
                weight,
            )
        # A widening Cast on W is exact only when the weight Mul runs in fp32 anyway.
        weight_input, w_shape_readers = (
            _bypass_widening_cast(weight, chain_nodes) if multiply_dtype == ir.DataType.FLOAT else (weight, [])
        )
        if weight_input.dtype not in SUPPORTED_DTYPES:
            raise _Refusal(f"the weight is {_dtype_name(weight_input.dtype)}", weight_input)

        if self._trailing_cast and multiply_dtype != ir.DataType.FLOAT:
            raise _Refusal(
                f"the weight Mul already rounds to {_dtype_name(norm_dtype)}; the Cast after it "
                "would be a second rounding the op does not have, so it stays in the graph",
                b["weighted"],
            )
        output_dtype = (
            self._trailing_output_dtype(b, y_input, z_input, weight_input) if self._trailing_cast else multiply_dtype
        )
        return norm_dtype, output_dtype, weight_input, w_shape_readers

    def _trailing_output_dtype(self, b: dict[str, Any], y_input, z_input, weight_input) -> ir.DataType:
        """Return the output type: float32, or the trailing Cast's type (after a float32 weight Mul)."""
        if not self._trailing_cast:
            return ir.DataType.FLOAT
        output_dtype = ir.DataType(b["out_to"].as_int())
        if self._float_cast_first and b["float_to"].as_int() != ir.DataType.FLOAT:
            raise _Refusal(
                f"the product is cast to {_dtype_name(b['float_to'].as_int())} and then to "
                f"{_dtype_name(output_dtype)}: two roundings the op does not have",
                b["weighted"],
                logged=False,  # the one-Cast rules fuse the chain with the first Cast as its rounding
            )
        if output_dtype not in SUPPORTED_DTYPES:
            raise _Refusal(
                f"the trailing Cast is to {_dtype_name(output_dtype)}, not an output type of the op",
                b["weighted"],
            )
        all_float = all(v.dtype == ir.DataType.FLOAT for v in (y_input, z_input, weight_input))
        if all_float and output_dtype != ir.DataType.FLOAT:
            # The op's output is float32 whenever Y, Z and W all are (that is how ONNX Runtime's CPU
            # fp16 fallback retypes a node it widened); the half-precision Cast stays after it.
            raise _Refusal(
                "Y, Z and W are float32, so the fused output is float32: the trailing Cast to "
                f"{_dtype_name(output_dtype)} stays in the graph",
                b["weighted"],
            )
        return output_dtype

    # rewrite ----------------------------------------------------------------------------------------

    def rewrite(self, op, **_: Any):
        """Return the fused node's output, built from the plan that check just made."""
        plan = self._plan
        assert plan is not None, "rewrite runs right after a successful check"
        log = _ACTIVE_LOG.get()
        if log is not None:
            log.record(plan.anchor, plan.form, **attributes_of(plan))
        self._leftovers.extend(plan.leftovers)
        for node, index, value in plan.rewire:
            node.replace_input_with(index, value)
        y, z = plan.y, plan.z
        if plan.broadcast == "y":
            y = op.Expand(y, op.Shape(z))
        elif plan.broadcast == "z":
            z = op.Expand(z, op.Shape(y))
        weight = plan.weight
        if plan.flatten_weight:  # a constant [G, gs] scale: the same data as W[C], row by row
            data = plan.weight.const_value.numpy().reshape(-1)
            weight = op.initializer(ir.tensor(data, name=f"{plan.weight.name}_flat"), name=f"{plan.weight.name}_flat")
        extra = {"gated_dtype": int(plan.gated_dtype)} if plan.gated_dtype != ir.DataType.FLOAT else {}
        fused = op.GatedGroupRMSNorm(
            y,
            z,
            weight,
            _domain=DOMAIN,
            _version=1,
            epsilon=plan.epsilon,
            group_size=plan.group_size,
            norm_dtype=int(plan.norm_dtype),
            output_dtype=int(plan.output_dtype),
            **extra,
        )
        if plan.restore_to is None:
            return fused
        target, allowzero = plan.restore_to
        # allowzero only where the original set it (Reshape-13 has no such attribute)
        return op.Reshape(fused, target, **({"allowzero": 1} if allowzero else {}))

    def setup(self) -> None:
        # onnxscript calls setup / cleanup around every graph it visits, and visits a node's subgraphs
        # (Scan, Loop, If bodies) in the middle of the outer graph: the outer graph's state is saved here
        # and restored by cleanup, so chains fused before a subgraph are still cleaned up after it.
        self._saved.append((self._leftovers, self._shapes))
        self._leftovers = []
        self._shapes = None

    def cleanup(self) -> None:
        # The replaced chains, and the constants, shape arithmetic and bypassed Casts that fed only
        # them, are dead now.
        remove_dead_producers(self._leftovers)
        self._leftovers, self._shapes = self._saved.pop() if self._saved else ([], None)


def attributes_of(plan: _Plan) -> dict[str, Any]:
    """Return the fused node's attributes (dtype names for readability) from a plan."""
    return {
        "epsilon": plan.epsilon,
        "group_size": plan.group_size,
        "norm_dtype": _dtype_name(plan.norm_dtype),
        "output_dtype": _dtype_name(plan.output_dtype),
        "gated_dtype": _dtype_name(plan.gated_dtype),
    }


# --- check helpers ----------------------------------------------------------------------------------


def _is_shape_node(node: ir.Node) -> bool:
    return node.op_type == "Shape" and node.domain in _ONNX_DOMAINS


def _proven_dims(value: ir.Value, shapes: ForwardShapes) -> list[Dim] | None:
    """Return the dims of ``value``, its last one proven from the graph where it is not a number.

    A declared symbolic width is only a hint; when the graph's own shape arithmetic proves the width
    (``ForwardShapes``: each op's output dims from its inputs', from the graph inputs on), that is the width.
    A value with no declared shape takes its proven dims.
    """
    dims = value_dims(value, {})
    proven = shapes(value)
    if dims is None:
        return proven if proven and isinstance(proven[-1], int) and proven[-1] > 0 else None
    if not proven or len(proven) != len(dims):
        return dims
    # Proven numbers over declared symbols (a decode step's batch of 1 that the export declares as the cache's
    # symbol), and proven leading dims where the declared ones are unnamed.
    leading = [
        p if isinstance(p, int) or (not isinstance(d, int | str) and p is not None) else d
        for d, p in zip(dims, proven, strict=True)
    ]
    width = proven[-1] if isinstance(proven[-1], int) and proven[-1] > 0 else dims[-1]
    return [*leading[:-1], width]


def _evidence_dims(dims: list[Dim], values: Sequence[ir.Value], shapes: ForwardShapes) -> list[Dim]:
    """Return y's dims as evidence for the Reshape proofs: each leading dim as a graph input declares it (the
    model's interface) or as the graph proves it (``ForwardShapes``). A leading dim that only an intermediate
    value's declared shape gives is a hint, not checked at run time: it becomes a placeholder equal to
    itself alone, so that only targets built from y's own shape (``0``, ``Shape`` of a chain tensor) prove
    anything about it. The width stays as checked against the weight (the kernel checks it at run time).
    """
    if any(value.producer() is None for value in values):
        return dims
    proven = next((p for p in map(shapes, values) if p is not None and len(p) == len(dims)), None)
    leading = [
        proven[i] if proven is not None and proven[i] is not None else ("unproven", id(values[0]), i)
        for i in range(len(dims) - 1)
    ]
    return [*leading, dims[-1]]


def _last_axis_as_channels(
    y_dims: list[Dim], z_dims: list[Dim], channels: int | None
) -> tuple[list[Dim], list[Dim], str | None]:
    """Return the dims with an unproven last axis taken as C when the other input's is C, and which one.

    Dynamic-sequence exports record y's width as an expression of the sequence length or leave it unknown;
    where ``ForwardShapes`` does not prove it either (TorchScript's prefill: run-time pads), in the product
    y * silu(z) such an axis is C or 1 (broadcast): the fused node reads that input through
    Expand(x, Shape(other)), which is a copy when it is C and the original's broadcast when it is 1, so
    the fused model computes what the original does for every width. The third value names that input.
    """
    if not isinstance(channels, int) or not y_dims or not z_dims:
        return y_dims, z_dims, None
    y_last, z_last = y_dims[-1], z_dims[-1]
    if not isinstance(y_last, int) and z_last == channels:
        return [*y_dims[:-1], channels], z_dims, "y"
    if not isinstance(z_last, int) and y_last == channels:
        return y_dims, [*z_dims[:-1], channels], "z"
    return y_dims, z_dims, None


def _bypass_widening_cast(value: ir.Value, chain_nodes: set[ir.Node]) -> tuple[ir.Value, list[tuple[ir.Node, int]]]:
    """Return the input of ``value``'s Cast when that Cast widens to fp32 and feeds only the chain.

    Also returns the Shape nodes outside the chain that read ``value`` (to reroute to the input).
    Otherwise returns ``value`` itself and no Shape nodes.
    """
    unchanged: tuple[ir.Value, list[tuple[ir.Node, int]]] = (value, [])
    producer = value.producer()
    if producer is None or producer.op_type != "Cast" or producer.domain not in _ONNX_DOMAINS:
        return unchanged
    source = producer.inputs[0]
    if source is None or source.dtype not in SUPPORTED_DTYPES:
        return unchanged  # a narrowing Cast (from double) is a rounding of its own: it stays
    if producer.attributes.get_int("to", 0) != ir.DataType.FLOAT:
        return unchanged
    shape_readers = [(user, i) for user, i in value.uses() if user not in chain_nodes and _is_shape_node(user)]
    if value.is_graph_output() or any(user not in chain_nodes and not _is_shape_node(user) for user, _ in value.uses()):
        return unchanged  # someone else reads the fp32 copy: keep the Cast, feed its output
    return source, shape_readers


def _outside_readers(context, anchor: ir.Node, restore: ir.Node | None) -> list[tuple[ir.Node, int]]:
    """Return the Shape nodes outside the chain that read a chain tensor of y's shape.

    Those read only the shape, which the fused node's Y input has too, so they are rerouted to it.
    Refuses when any other node outside the chain (or a graph output) reads an intermediate.
    """
    chain_nodes = set(context.nodes)
    outputs = set(context.output_values)
    # Between the two Reshapes the tensors are [..., G, gs]: a Shape of those is not Shape(y).
    grouped_nodes = {anchor}
    frontier = [anchor]
    while frontier:
        for output in frontier.pop().outputs:
            for user, _ in output.uses():
                if user in chain_nodes and user is not restore and user not in grouped_nodes:
                    grouped_nodes.add(user)
                    frontier.append(user)
    readers: list[tuple[ir.Node, int]] = []
    for node in context.nodes:
        for value in node.outputs:
            if value in outputs:
                continue
            if value.is_graph_output():
                raise _Refusal(f"intermediate {value.name!r} ({node.op_type}) is a graph output", value)
            for user, index in value.uses():
                if user in chain_nodes:
                    continue
                if _is_shape_node(user) and node not in grouped_nodes:
                    readers.append((user, index))
                    continue
                raise _Refusal(
                    f"intermediate {value.name!r} ({node.op_type}) is also read by {location(user)!r} "
                    "outside the chain",
                    user,
                )
    return readers


def _scale_as_weight(scale: ir.Value, grouped: bool) -> tuple[ir.Value, int, bool]:
    """Return (the weight W[C] behind a norm's scale, C, whether W is the [G, gs] scale to flatten).

    Ungrouped, the scale is W[C] itself. Grouped, it is ``Reshape(W[C], [G, gs])`` (a constant target)
    or a constant [G, gs]: either way row g of the scale weights group g, as W[g*gs:(g+1)*gs] does.
    """
    ones = constant_array(scale)
    if ones is not None and ones.size and np.all(ones == 1):
        # An all-ones scale is a plain norm whose weight multiplies after it (forms F, H): those rules
        # explain the chain, this one does not apply.
        raise _Refusal("the norm's scale is all ones: not the weight", scale, logged=False)
    if not grouped:
        return scale, _weight_channels(scale), False
    return _group_weight(scale, as_scale=True)


def _group_weight(weight: ir.Value, *, as_scale: bool = False) -> tuple[ir.Value, int, bool]:
    """Return (the weight W[C] behind a [G, gs] weight, C, whether it is a constant [G, gs] to flatten).

    Looks through widening Casts to float32 (the kernel widens W exactly) and one Reshape of W[C] to a
    constant [G, gs], in either order: row g of the [G, gs] weight is W[g*gs:(g+1)*gs].
    """
    value, source = weight, None
    for _ in range(4):
        producer = value.producer()
        if producer is None or producer.domain not in _ONNX_DOMAINS or not producer.inputs:
            break
        inner = producer.inputs[0]
        if producer.op_type == "Cast" and inner is not None:
            if inner.dtype not in SUPPORTED_DTYPES or producer.attributes.get_int("to", 0) != ir.DataType.FLOAT:
                break
            value = inner
        elif producer.op_type == "Reshape" and source is None and inner is not None and len(producer.inputs) > 1:
            dims = resolve_shape_tensor(producer.inputs[1], {})  # a constant, or Concat of constants
            if dims is None or inner.shape is None or inner.shape.rank() != 1:
                break
            if len(dims) != 2 or not all(isinstance(d, int) and d > 0 for d in dims):
                break
            if dims[0] * dims[1] != _weight_channels(inner):  # type: ignore[operator]
                break
            value = source = inner
        else:
            break
    if source is not None:
        return value, _weight_channels(value), False
    shape = value.shape
    if value.const_value is not None and shape is not None and shape.rank() == 2 and shape.is_static():
        return value, int(shape[0]) * int(shape[1]), True
    shape_text = _shape_text(weight.shape)
    forms = "(Reshape(W[C], [G, gs]) or a constant [G, gs])"
    if as_scale:
        raise _Refusal(f"the norm's scale has shape {shape_text}: not the weight reshaped to [G, gs] {forms}", weight)
    raise _Refusal(f"the weight inside the groups has shape {shape_text}: not W[C] reshaped to [G, gs] {forms}", weight)


def _weight_channels(weight: ir.Value) -> int:
    shape = weight.shape
    if shape is None:
        # Untyped (an inlined body): the dims the graph proves, from the constant through its Casts.
        dims = forward_dims(weight)
        if dims is not None and len(dims) == 1 and isinstance(dims[0], int):
            return dims[0]
    if shape is None or shape.rank() != 1 or not isinstance(shape[0], int):
        raise _Refusal(f"the weight has shape {_shape_text(shape)}, not [C]", weight)
    return shape[0]


def _shape_text(shape: ir.Shape | None) -> str:
    return "unknown" if shape is None else format_dims(value_dims(ir.Value(shape=shape), {}))


def _rank(value: ir.Value) -> int | None:
    return value.shape.rank() if value.shape is not None else None


def _target_dims(
    reshape: ir.Node,
    shape: ir.Value,
    input_dims: Sequence[Dim] | None,
    aliases: Mapping[ir.Value, Sequence[Dim] | None],
) -> list[Dim] | None:
    """Return a Reshape's target dims with ONNX's ``0`` (copy the input dim) resolved."""
    dims = resolve_shape_tensor(shape, aliases)
    if dims is None:
        return None
    if reshape.attributes.get_int("allowzero", 0) == 1:
        return dims
    resolved: list[Dim] = []
    for index, dim in enumerate(dims):
        if dim == 0:
            dim = input_dims[index] if input_dims is not None and index < len(input_dims) else None
        resolved.append(dim)
    return resolved


def _group_size(group_dims: list[Dim] | None, y_dims: list[Dim], channels: int, reshape: ir.Node) -> int:
    """Return the group width that the first Reshape's target proves, else refuse.

    Groups are contiguous runs of the flattened product. A constant last element gs with C % gs == 0
    makes every run lie inside one row, whatever the leading elements are (known or not: torch writes
    the group count from the padded length, ``(8 * ceil(L / 8)) // L``). A last element -1 leaves the
    width to the element count: it is C / G only when the leading elements are provably y's own leading
    dims (otherwise, for example [B, G, -1] on [B, L, C], rows and channels are grouped together). A last
    element the rule cannot follow is pinned the same way: whatever it is at run time (-1, 0 or a size),
    the node runs only where rows * G * last = rows * C, so with those leading elements it is C / G.
    Declared shapes of the grouped tensor are not evidence: they are not checked at run time.
    """
    if group_dims is None or not group_dims:
        raise _Refusal(
            f"the group Reshape's target {format_dims(group_dims)} is not a constant or shape arithmetic "
            "the rule can follow, so the group size is not proven",
            reshape,
        )
    last = group_dims[-1]
    if isinstance(last, int) and last > 0:
        if channels % last != 0:
            raise _Refusal(f"C = {channels} is not divisible by the group size {last}", reshape)
        return last
    groups = group_dims[-2] if len(group_dims) >= 2 else None
    if last in (-1, None) and isinstance(groups, int) and groups > 0 and channels % groups == 0:
        leading, y_leading = group_dims[:-2], y_dims[:-1]
        same_rows = len(leading) == len(y_leading) and all(map(dims_equal, leading, y_leading))
        static = all(isinstance(d, int) and d > 0 for d in [*leading, *y_leading])
        if same_rows or (static and math.prod(leading) == math.prod(y_leading)):  # type: ignore[arg-type]
            return channels // groups
        ending = "-1" if last == -1 else "an element the rule cannot follow"
        raise _Refusal(
            f"the group Reshape's target {format_dims(group_dims)} ends in {ending} and its leading dims are "
            f"not provably y's {format_dims(y_leading)}: its groups could span rows",
            reshape,
        )
    raise _Refusal(
        f"the group Reshape's target {format_dims(group_dims)} does not prove the group size",
        reshape,
    )


def _is_last_axis(axis: int, rank: int | None) -> bool:
    return axis == -1 or (rank is not None and axis == rank - 1)


def _check_exp_silu(b: dict[str, Any]) -> None:
    """Check that ``Div(z, Add(Exp(-z), one))`` is silu: ``-z`` a Neg or a Mul by -1, and ``one`` is 1."""
    negate = b.get("negate")
    if negate is not None and constant_scalar(negate) != -1.0:
        raise _Refusal("z / (1 + exp(c * z)) with c not the constant -1 is not silu", negate)
    if constant_scalar(b["one"]) != 1.0:
        raise _Refusal("z / (c + exp(-z)) with c not the constant 1 is not silu", b["one"])


def _check_decomposed(b: dict[str, Any], group_rank: int | None) -> float:
    """Check the decomposed inner norm and return its epsilon."""
    if b.get("square_form") == "pow":
        exponent = constant_scalar(b["exponent"])
        if exponent != 2.0:
            raise _Refusal(
                f"the square is Pow(x, {exponent if exponent is not None else 'non-constant'}), not Pow(x, 2)",
                b["exponent"],
            )
    mean_node: ir.Node = b["mean_square"].producer()
    axes_value = mean_node.inputs[1] if len(mean_node.inputs) > 1 else None
    if axes_value is not None:
        axes_array = constant_array(axes_value)
        if axes_array is None:
            raise _Refusal("ReduceMean's axes are not a constant", mean_node)
        axes = [int(a) for a in axes_array.reshape(-1)]
    else:
        axes_attr = mean_node.attributes.get("axes")
        axes = list(axes_attr.as_ints()) if axes_attr is not None else []
    if len(axes) != 1 or not _is_last_axis(axes[0], group_rank):
        what = "all axes" if not axes else f"axes {axes}"
        raise _Refusal(f"ReduceMean reduces over {what}, not the last (group) axis only", mean_node)
    if mean_node.attributes.get_int("keepdims", 1) != 1:
        raise _Refusal("ReduceMean has keepdims=0; the chain needs keepdims=1", mean_node)

    epsilon_value: ir.Value = b["epsilon"]
    epsilon_array = constant_array(epsilon_value)
    if epsilon_array is None:
        raise _Refusal("epsilon is not a constant", epsilon_value)
    if epsilon_array.size != 1 or epsilon_array.ndim > 1:
        raise _Refusal(f"epsilon has shape {list(epsilon_array.shape)}, not a scalar", epsilon_value)
    epsilon = float(epsilon_array.reshape(()))
    if not np.isfinite(epsilon) or epsilon < 0:
        raise _Refusal(f"epsilon is {epsilon}", epsilon_value)

    rsqrt_form = b.get("rsqrt_form")
    if b.get("normalize_form") == "mul" and rsqrt_form == "div":
        numerator = constant_scalar(b["numerator"])
        if numerator != 1.0:
            raise _Refusal(f"rsqrt is Div({numerator}, Sqrt(..)), not Div(1, Sqrt(..))", b["numerator"])
    if b.get("normalize_form") == "mul" and rsqrt_form == "pow":
        exponent = constant_scalar(b["rsqrt_exponent"])
        if exponent != -0.5:
            raise _Refusal(f"rsqrt is Pow(x, {exponent}), not Pow(x, -0.5)", b["rsqrt_exponent"])
    return epsilon


def _check_inner_norm(
    node: ir.Node, group_rank: int | None, group_size: int, channels: int, *, weight_as_scale: bool = False
) -> float:
    """Check a SimplifiedLayerNormalization / RMSNormalization inner norm; return its epsilon.

    Its scale must be all ones (the weight comes after the norm), unless ``weight_as_scale`` (the caller
    has checked that the scale is the weight).
    """
    axis = node.attributes.get_int("axis", -1)
    if not _is_last_axis(axis, group_rank):
        raise _Refusal(f"{node.op_type} normalizes from axis {axis}, not over the last axis only", node)
    if node.attributes.get_int("stash_type", 1) != ir.DataType.FLOAT:
        raise _Refusal(f"{node.op_type} does not compute in float32 (stash_type)", node)
    epsilon_attr = node.attributes.get("epsilon")
    epsilon = float(epsilon_attr.as_float()) if epsilon_attr is not None else _DEFAULT_NORM_EPSILON
    if weight_as_scale:
        return epsilon
    scale_value = node.inputs[1]
    scale = constant_array(scale_value)
    if scale is None:
        raise _Refusal(f"{node.op_type}'s scale is not a constant", scale_value)
    groups = channels // group_size
    allowed = {(group_size,), (1, group_size), (groups, group_size)}
    if scale.shape not in allowed or not np.all(scale == 1):
        raise _Refusal(
            f"{node.op_type}'s scale is not all ones of shape [gs] or [G, gs] (got shape "
            f"{list(scale.shape)}); the weight must come after the second Reshape",
            scale_value,
        )
    return epsilon


def _restores(restored: list[Dim] | None, y_dims: list[Dim]) -> bool:
    """Whether the second Reshape provably gives back y's shape."""
    if restored is None or len(restored) != len(y_dims):
        return False
    unproven = [i for i, (r, d) in enumerate(zip(restored, y_dims, strict=True)) if not dims_equal(r, d)]
    # One -1, or one element the rule cannot follow (torch's group_count * group_size, from the padded
    # length), is forced to the missing size by the element count once every other dim is proven equal.
    return not unproven or (len(unproven) == 1 and restored[unproven[0]] in (-1, None))


def _restore_target(
    reshape: ir.Node,
    shape: ir.Value,
    restored: list[Dim] | None,
    y_dims: list[Dim],
    channels: int,
    aliases: Mapping[ir.Value, Sequence[Dim] | None],
) -> tuple[ir.Value, int]:
    """Return the second Reshape's target and allowzero, to reshape the fused output to, or refuse.

    Where the graph does not prove that the target is y's shape (y's leading dims unproven, a target of
    constants or of other values' dims), the original's output still has the target's shape and the
    chain's elements in order; the fused node's output has the same elements in the same order, so the
    same Reshape after it gives the original's output exactly. The weight multiplies along the target's last
    axis, so that must be C; and a 0 that copies a dim of the grouped tensor (allowzero = 0) would copy
    another dim of the fused output, so the target may not have one.
    """
    allowzero = reshape.attributes.get_int("allowzero", 0)
    raw = resolve_shape_tensor(shape, aliases)
    if raw and raw[-1] == channels and (allowzero == 1 or 0 not in raw):
        return shape, allowzero
    raise _Refusal(
        f"the second Reshape's target {format_dims(restored)} does not provably restore the shape "
        f"{format_dims(y_dims)} of y, and does not end in C = {channels}",
        reshape,
    )


# --- forms ------------------------------------------------------------------------------------------


def _producer_op(value: ir.Value | None) -> str | None:
    producer = value.producer() if value is not None else None
    return producer.op_type if producer is not None else None


def _cast_source_dtype(value: ir.Value | None) -> ir.DataType | None:
    producer = value.producer() if value is not None else None
    if producer is None or producer.op_type != "Cast" or producer.inputs[0] is None:
        return None
    return producer.inputs[0].dtype


def classify(
    b: dict[str, Any], inner: InnerNorm, *, weight_as_scale: bool = False, weight_in_group: bool = False
) -> str:
    """Return the form letter of a matched chain (the catalog in docs/forms.md).

    Forms overlap (G is "any form after an optimizer": ORT's, or one that inlined mambafuse's own function
    body, whose silu is z / (1 + exp(-z))), so the most specific marker wins, in the
    order I, J, G, F, H, E, D, C, B, A. I is mobius's: the weight is the RMSNormalization's scale; J is
    Falcon-H1's: the weight multiplies the groups before the second Reshape.
    """
    if weight_as_scale:
        return "I"
    if weight_in_group:
        return "J"
    if b.get("silu_form") in ("quick_gelu", "exp") or b.get("normalize_form") == "div":
        return "G"
    if inner == "simplified_layer_norm":
        return "F"
    if inner == "rms_normalization" or b.get("square_form") == "mul" or b.get("rsqrt_form") == "pow":
        return "H"
    mean_square = b.get("mean_square")
    mean_node = mean_square.producer() if mean_square is not None else None
    if (mean_node is not None and len(mean_node.inputs) < 2) or b.get("rsqrt_form") == "div":
        return "E"
    scalars = (b.get("epsilon"), b.get("exponent"), b.get("shape_in"), b.get("shape_out"))
    if any(_producer_op(v) == "Constant" for v in scalars) or _producer_op(b.get("weight")) == "Cast":
        return "D"
    normed, flat = b.get("normed"), b.get("flat")
    if normed is not None and normed is not flat and normed.dtype != ir.DataType.FLOAT:
        return "C"
    out_to = b.get("out_to")
    half = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    if (out_to is not None and out_to.as_int() in half) or _cast_source_dtype(b.get("z")) in half:
        return "B"
    return "A"


# --- rule set ---------------------------------------------------------------------------------------


def _rules(trailing_cast: bool, float_cast_first: bool = False) -> list[pattern.RewriteRule]:
    suffix = (", float32 Cast" if float_cast_first else "") + (", trailing Cast" if trailing_cast else "")
    rules = [
        GatedGroupRMSNormFusion.rule(
            f"GatedGroupRMSNorm[{inner}{', W first' if weight_first else ''}"
            f"{suffix}{'' if grouped else ', ungrouped'}]",
            inner=inner,
            weight_first=weight_first,
            trailing_cast=trailing_cast,
            float_cast_first=float_cast_first,
            grouped=grouped,
        )
        for grouped in (True, False)
        for inner in INNER_NORMS
        for weight_first in (True, False)
    ]
    rules += [
        GatedGroupRMSNormFusion.rule(
            f"GatedGroupRMSNorm[{inner}, weight in the groups{', W first' if weight_first else ''}{suffix}]",
            inner=inner,
            weight_first=weight_first,
            trailing_cast=trailing_cast,
            float_cast_first=float_cast_first,
            weight_in_group=True,
        )
        for inner in INNER_NORMS
        for weight_first in (True, False)
    ]
    return rules


def _scale_rules() -> list[pattern.RewriteRule]:
    return [
        GatedGroupRMSNormFusion.rule(
            f"GatedGroupRMSNorm[weight as RMSNormalization scale{'' if grouped else ', ungrouped'}]",
            inner="rms_normalization",
            grouped=grouped,
            weight_as_scale=True,
        )
        for grouped in (True, False)
    ]


def _rule_set(rules: list[pattern.RewriteRule]) -> pattern.RewriteRuleSet:
    rule_set = pattern.RewriteRuleSet(rules)
    # Rules that keep their matched nodes make the set run a model-wide dead-code pass, which would
    # also delete dead code that has nothing to do with the chains. Our cleanup removes exactly the
    # fused chains' leftovers instead.
    rule_set.remove_unused_nodes = False
    return rule_set


#: Rules that absorb a trailing Cast after a Cast of the product to float32: first, or the rules below would
#: take that float32 Cast as the trailing one (they meet it first) and leave the Cast to half after the node.
float_cast_rules = _rule_set(_rules(trailing_cast=True, float_cast_first=True))
#: Rules that absorb a trailing Cast: before the plain ones, so a chain is not fused at its weight Mul first.
cast_absorbing_rules = _rule_set(_rules(trailing_cast=True))
#: Rules that end at the weight Mul.
plain_rules = _rule_set(_rules(trailing_cast=False))
#: Rules whose weight is the RMSNormalization's scale (mobius): last, so that a norm with an all-ones
#: scale followed by the weight Mul (form H) is fused with its Mul, not up to the norm alone.
scale_rules = _rule_set(_scale_rules())
#: The phases, in the order they must run.
gated_group_rms_norm_rule_sets = (float_cast_rules, cast_absorbing_rules, plain_rules, scale_rules)


def fuse_gated_group_rms_norm(
    model: ir.Model, log: FusionLog | None = None, *, assume_equal_widths: bool = False
) -> int:
    """Fuse every gated group-RMSNorm chain of ``model`` in place; return how many were fused.

    ``log`` (optional) receives, per chain, its form and the fused attributes or the refusal reason.
    ``assume_equal_widths`` drops the broadcast guard of widths the graph does not prove (see
    ``_ASSUME_EQUAL_WIDTHS``).
    """
    token = _ACTIVE_LOG.set(log)
    widths = _ASSUME_EQUAL_WIDTHS.set(assume_equal_widths)
    try:
        with value_info_preserved(model):
            # The rounding points are read from the types: give the values ONNX's inference left untyped (an
            # inlined body after an op it cannot type) the type their producer's schema gives them.
            type_untyped_values(model.graph)
            return sum(rule_set.apply_to_model(model) for rule_set in gated_group_rms_norm_rule_sets)
    finally:
        _ASSUME_EQUAL_WIDTHS.reset(widths)
        _ACTIVE_LOG.reset(token)


# --- chains that did not fuse: find them and say why ------------------------------------------------


def find_chain_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return the anchor of every gated-norm chain left in ``graph``: one per (unfused) chain.

    Grouped chains: the Reshape whose output is squared and mean-reduced, or is the normalized input of
    SimplifiedLayerNormalization / RMSNormalization (not their scale: mobius reshapes the weight too).
    Ungrouped chains: the norm's first node (the square, or the norm op) when it reads y * silu(gate)
    (through a Cast) directly. Nodes inside subgraphs are included.
    """
    anchors = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if not node.outputs:
            continue
        if node.op_type in ("SimplifiedLayerNormalization", "RMSNormalization"):
            if node.inputs and _is_gated_product(node.inputs[0]):
                anchors.append(node)
            continue
        if node.op_type in ("Pow", "Mul") and node.inputs and _is_gated_product(node.inputs[0]):
            if _feeds_mean(node) and (node.op_type == "Pow" or node.inputs[0] is node.inputs[-1]):
                anchors.append(node)
            continue
        if node.op_type != "Reshape":
            continue
        for user, index in node.outputs[0].uses():
            if user.op_type in ("SimplifiedLayerNormalization", "RMSNormalization") and index == 0:
                anchors.append(node)
                break
            if user.op_type in ("Pow", "Mul") and _feeds_mean(user):
                anchors.append(node)
                break
    return anchors


def _feeds_mean(node: ir.Node) -> bool:
    return any(consumer.op_type == "ReduceMean" for consumer, _ in node.outputs[0].uses())


def _is_gated_product(value: ir.Value | None) -> bool:
    """Return whether ``value`` is y * silu(gate), possibly through Casts."""
    producer = value.producer() if value is not None else None
    while producer is not None and producer.op_type == "Cast" and producer.inputs[0] is not None:
        producer = producer.inputs[0].producer()
    return producer is not None and producer.op_type == "Mul" and any(map(_is_silu, producer.inputs))


def coarse_form(anchor: ir.Node) -> str:
    """Return a best-effort form letter for a chain that no rule matched."""
    users = {user.op_type for user, _ in anchor.outputs[0].uses()} | {anchor.op_type}
    if "SimplifiedLayerNormalization" in users:
        return "F"
    if "RMSNormalization" in users:
        return "H"
    return "?"


def _chain_region(anchor: ir.Node) -> Iterator[ir.Node]:
    """Yield the nodes after ``anchor`` that can still belong to its chain.

    The norm (up to 10 nodes), its restoring Reshape, and at most 3 nodes after that (Cast, the weight
    Mul, and a gate Mul when the gate comes after the norm): never the next layer.
    """
    frontier, seen = [(anchor, 10)], {anchor}
    while frontier:
        current, budget = frontier.pop(0)
        for output in current.outputs:
            for user, _ in output.uses():
                if user in seen:
                    continue
                seen.add(user)
                yield user
                left = min(3, budget - 1) if user.op_type == "Reshape" else budget - 1
                if left > 0:
                    frontier.append((user, left))


def _is_silu(value: ir.Value | None) -> bool:
    producer = value.producer() if value is not None else None
    if producer is None:
        return False
    if producer.op_type == "QuickGelu":
        return True
    if producer.op_type == "Div":  # z / (1 + exp(-z)), the function body's spelling
        z, denominator = producer.inputs[0], producer.inputs[1]
        if _producer_op(denominator) != "Add":
            return False
        exps = [v for v in denominator.producer().inputs if _producer_op(v) == "Exp"]
        negated = [v.producer().inputs[0] for v in exps]
        return any(_producer_op(v) in ("Neg", "Mul") and z in v.producer().inputs for v in negated if v is not None)
    if producer.op_type != "Mul":
        return False
    a, b = producer.inputs[0], producer.inputs[1]
    return (_producer_op(b) == "Sigmoid" and b.producer().inputs[0] is a) or (
        _producer_op(a) == "Sigmoid" and a.producer().inputs[0] is b
    )


def explain_unfused(model: ir.Model, anchor: ir.Node) -> str:
    """Return why the chain at ``anchor`` was not fused, for chains that no check refused.

    Two cases: the gate is applied after the norm (a different op); otherwise the matcher's reason at
    the deepest partial match that contains the anchor.
    """
    gated_first = _is_gated_product(anchor.inputs[0] if anchor.inputs else None)
    if not gated_first:
        for node in _chain_region(anchor):
            if node.op_type == "Mul" and any(map(_is_silu, node.inputs)):
                return (
                    "norm(y) * silu(z): the gate is applied after the norm (norm_before_gate), a "
                    "different op; not fused"
                )
        return "the grouped tensor is not y * silu(gate)"
    graph = anchor.graph
    best: tuple[int, str] = (-1, "does not match any chain form")
    token = _ACTIVE_LOG.set(None)
    try:
        for root in _chain_region(anchor):
            for rule_set in gated_group_rms_norm_rule_sets:
                for rule in rule_set:
                    match = rule.match(model, graph, root, check_nodes_are_removable=False)
                    if match is None or match:
                        continue  # refused by check (then logged), or fused
                    if anchor in match.nodes and len(match.nodes) > best[0]:
                        best = (len(match.nodes), match.reason or best[1])
    finally:
        _ACTIVE_LOG.reset(token)
    return best[1]
