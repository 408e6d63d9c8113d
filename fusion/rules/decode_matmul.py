"""Run a model's weight products as ``ai.mambafuse::DecodeMatMul`` / ``DecodeMatMulNBits``.

A decode step's projections (in_proj, out_proj, the MLPs, attention's, the LM head) are products of a few rows
(the batch) with a large constant weight: GEMVs whose time is the weight's bytes over memory bandwidth. The ops
are the same products (docs/decode_matmul.md); the library's CUDA kernels run them as a GEMV that fills the GPU
at up to 8 rows and as cuBLAS' GEMM above that (a prompt), where ONNX Runtime's MatMul and MatMulNBits take one
path for both. Each model-local function is the node it replaces, so elsewhere nothing changes.

What the rules prove from the graph, each refusal naming what failed:

- ``MatMul(A, B)`` with B a constant (an initializer or a Constant) of rank 2 and a floating type the kernels take
  (float32, float16, bfloat16): ONNX's MatMul with a 2-D B is the op's math for every rank of A (a 1-D A gives
  (N,), a higher rank broadcasts nothing). A MatMul of two computed values (attention's scores) is not a weight
  product and is not an anchor.
- ``com.microsoft::MatMulNBits(A, B, scales[, zero_points])``: ``bits`` = 4, ``block_size`` a power of two
  >= 16, ``K`` and ``N`` set, no attribute the op does not know, no ``g_idx`` or ``bias`` input, B uint8,
  zero points (if any) packed uint8, scales of A's type. Other widths (a k-quant model's 8-bit layers) stay
  MatMulNBits.

The rules run after every other fusion (``Fusion.after_rounds``): the Mamba-2 rules prove their chains' shapes
through the in_proj's MatMul or MatMulNBits, which must still be there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.reference._common import DOMAIN
from fusion.reference.decode_matmul import BITS
from fusion.rules._decode import PlannedRule, Refusal, apply_with_log, dtype_name
from fusion.rules._log import FusionLog

FORM = "MatMul"
NBITS_FORM = "MatMulNBits"
CONTRIB_DOMAIN = "com.microsoft"
_ONNX_DOMAINS = ("", "ai.onnx")
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
#: MatMulNBits' attributes the op carries; any other is refused rather than dropped.
_NBITS_ATTRIBUTES = ("K", "N", "bits", "block_size", "accuracy_level")


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    leftovers: list[ir.Value]
    attributes: dict[str, Any]
    inputs: list[ir.Value] = dataclasses.field(default_factory=list)
    node_attributes: dict[str, int] = dataclasses.field(default_factory=dict)


def _present(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) and node.inputs[index] is not None else None


class _ProductFusion(PlannedRule):
    """A rule whose chain is one product node (``y``'s producer), proven by ``prove(anchor, a, b)``."""

    @staticmethod
    def prove(anchor: ir.Node, a: ir.Value, b: ir.Value) -> _Plan:
        raise NotImplementedError

    def check(self, context, a, b, y, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        anchor = y.producer()
        if anchor is None:
            return result.fail("no producer")
        try:
            self._plan = self.prove(anchor, a, b)
        except Refusal as refusal:
            return self.refused(result, anchor, refusal)
        return result


class DecodeMatMulFusion(_ProductFusion):
    """Rewrites ``MatMul(A, constant 2-D B)`` into a DecodeMatMul node."""

    FORM = FORM

    @staticmethod
    def prove(anchor: ir.Node, a: ir.Value, b: ir.Value) -> _Plan:
        return _prove_matmul(anchor, a, b)

    def pattern(self, op, a, b):
        return op.MatMul(a, b, _outputs=["y"])

    def rewrite(self, op, a, b, **_: Any):
        self.take_plan()
        return op.DecodeMatMul(a, b, _domain=DOMAIN, _version=1)


class DecodeMatMulNBitsFusion(_ProductFusion):
    """Rewrites a 4-bit ``com.microsoft::MatMulNBits`` into a DecodeMatMulNBits node."""

    FORM = NBITS_FORM

    @staticmethod
    def prove(anchor: ir.Node, a: ir.Value, b: ir.Value) -> _Plan:
        return _prove_nbits(anchor, a, b)

    def pattern(self, op, a, b):
        return op.MatMulNBits(
            a, b, _domain=CONTRIB_DOMAIN, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["y"]
        )

    def rewrite(self, op, **_: Any):
        plan: _Plan = self.take_plan()
        return op.DecodeMatMulNBits(*plan.inputs, _domain=DOMAIN, _version=1, **plan.node_attributes)


def _prove_matmul(anchor: ir.Node, a: ir.Value, b: ir.Value) -> _Plan:
    if b.const_value is None:
        # a product of two computed values (attention's scores and weights): not a weight product, not reported
        raise Refusal("B is not a constant weight", b, logged=False)
    shape = list(b.const_value.shape)
    if len(shape) != 2:
        raise Refusal(f"the weight's shape {shape} is not (K, N)", b)
    dtype = b.const_value.dtype
    if dtype not in _FLOATS:
        raise Refusal(f"the weight is {dtype_name(dtype)}: the op takes float32, float16 and bfloat16", b)
    if a.dtype is not None and a.dtype != dtype:
        raise Refusal(f"A is {dtype_name(a.dtype)} and the weight {dtype_name(dtype)}", a)
    return _Plan(
        anchor=anchor,
        leftovers=list(anchor.outputs),
        attributes={"K": int(shape[0]), "N": int(shape[1]), "dtype": dtype_name(dtype)},
    )


def _prove_nbits(anchor: ir.Node, a: ir.Value, b: ir.Value) -> _Plan:
    for name, attribute in anchor.attributes.items():
        if name not in _NBITS_ATTRIBUTES:
            raise Refusal(f"MatMulNBits' attribute {name!r} is not one DecodeMatMulNBits carries", anchor)
        if attribute.type != ir.AttributeType.INT:
            raise Refusal(f"MatMulNBits' attribute {name!r} is not an integer", anchor)
    values = {name: anchor.attributes.get_int(name, 0) for name in _NBITS_ATTRIBUTES}
    values["bits"] = anchor.attributes.get_int("bits", BITS)  # MatMulNBits' default width
    if values["bits"] != BITS:
        raise Refusal(f"MatMulNBits has {values['bits']}-bit weights; DecodeMatMulNBits takes 4-bit ones", anchor)
    block = values["block_size"]
    if block < 16 or block & (block - 1):
        raise Refusal(f"MatMulNBits' block_size {block} is not a power of two >= 16", anchor)
    if values["K"] < 1 or values["N"] < 1:
        raise Refusal("MatMulNBits' K and N are not both set", anchor)
    if _present(anchor, 4) is not None:
        raise Refusal("MatMulNBits has a g_idx input (act-order); DecodeMatMulNBits reads blocks in order", anchor)
    if _present(anchor, 5) is not None:
        raise Refusal("MatMulNBits has a bias input; DecodeMatMulNBits has none", anchor)
    scales = _present(anchor, 2)
    zero_points = _present(anchor, 3)
    if scales is None:
        raise Refusal("MatMulNBits has no scales", anchor)
    dtype = a.dtype if a.dtype is not None else scales.dtype  # MatMulNBits' schema: one T for A and the scales
    if dtype not in _FLOATS:
        raise Refusal(f"A is {dtype_name(dtype)}: the op takes float32, float16 and bfloat16", a)
    if scales.dtype is not None and scales.dtype != dtype:
        raise Refusal(f"the scales are {dtype_name(scales.dtype)}, A {dtype_name(dtype)}", scales)
    if b.dtype != ir.DataType.UINT8:
        raise Refusal(f"B is {dtype_name(b.dtype)}, not packed uint8", b)
    if zero_points is not None and zero_points.dtype != ir.DataType.UINT8:
        raise Refusal(f"the zero points are {dtype_name(zero_points.dtype)}, not packed uint8", zero_points)
    node_attributes = {name: values[name] for name in ("K", "N", "bits", "block_size")}
    if values["accuracy_level"]:
        node_attributes["accuracy_level"] = values["accuracy_level"]
    return _Plan(
        anchor=anchor,
        leftovers=list(anchor.outputs),
        attributes={
            "K": values["K"],
            "N": values["N"],
            "block_size": block,
            "zero_points": zero_points is not None,
            "dtype": dtype_name(dtype),
        },
        inputs=[a, b, scales, *([zero_points] if zero_points is not None else [])],
        node_attributes=node_attributes,
    )


decode_matmul_rules = pattern.RewriteRuleSet([DecodeMatMulFusion.rule("DecodeMatMul")])
decode_matmul_rules.remove_unused_nodes = False
decode_matmul_nbits_rules = pattern.RewriteRuleSet([DecodeMatMulNBitsFusion.rule("DecodeMatMulNBits")])
decode_matmul_nbits_rules.remove_unused_nodes = False


def fuse_decode_matmul(model: ir.Model, log: FusionLog | None = None) -> int:
    """Replace every proven weight MatMul of ``model`` in place; return how many were replaced."""
    return apply_with_log(decode_matmul_rules, model, log)


def fuse_decode_matmul_nbits(model: ir.Model, log: FusionLog | None = None) -> int:
    """Replace every proven 4-bit MatMulNBits of ``model`` in place; return how many were replaced."""
    return apply_with_log(decode_matmul_nbits_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every MatMul left in ``graph`` whose B is a constant (a weight product)."""
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(graph)
        if node.op_type == "MatMul"
        and node.domain in _ONNX_DOMAINS
        and len(node.inputs) == 2
        and node.inputs[1] is not None
        and node.inputs[1].const_value is not None
    ]


def find_nbits_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every MatMulNBits left in ``graph``."""
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(graph)
        if node.op_type == "MatMulNBits" and node.domain == CONTRIB_DOMAIN
    ]


__all__ = [
    "DecodeMatMulFusion",
    "DecodeMatMulNBitsFusion",
    "decode_matmul_nbits_rules",
    "decode_matmul_rules",
    "find_anchors",
    "find_nbits_anchors",
    "fuse_decode_matmul",
    "fuse_decode_matmul_nbits",
]
