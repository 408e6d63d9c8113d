"""Fuse the squared ReLU, ``Relu`` then a square, into ``ai.mambafuse::SquaredRelu``.

Nemotron-H's MLP is ``down_proj(relu(up_proj(h))^2)`` (transformers' ``relu2``). torch's exporters write the
square as ``Pow(Relu(h), 2)``, mobius' builder and ``mambafuse optimize``'s squares pass as ``Mul(r, r)``.
ONNX Runtime runs either as two passes over the MLP's (tokens × intermediate) activations; the op is one
(docs/squared_relu.md: on an H100, 2048 tokens × 21504, Relu + Mul 139.8 µs, one pass 59.8 µs).

What is proven from the graph, each refusal naming what failed:

- ``r = Relu(x)`` (ONNX's, whose every version is ``max(x, 0)``), read by nothing but the square (not a graph
  output): the fused node replaces both, so another reader would keep the Relu and save nothing.
- The square: ``Mul(r, r)`` (the same value twice), or ``Pow(r, e)`` with ``e`` a constant holding exactly 2 whose
  rank cannot widen the output (``fusion.rules.square.is_constant_two``).
- x is float32, float16 or bfloat16 (the op's types; float64 stays as it is), and the model's ONNX opset is 14
  or later (the function body's Relu on bfloat16).

The op's value is the once-rounded square of ``max(x, 0)``, NaN kept: what ``Relu`` and ``Mul(r, r)`` compute on
ONNX Runtime's CPU and CUDA providers, and ``Pow(r, 2)`` too except on the CUDA provider for float32 (``powf``, off by
an ulp on 6 % of values there; the fused op gives the correctly rounded square the squares pass gives).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.function.squared_relu import MIN_OPSET
from fusion.reference._common import DOMAIN
from fusion.rules._decode import DecodeShapes, PlannedRule, Refusal, apply_with_log, dtype_name
from fusion.rules._log import FusionLog
from fusion.rules.square import is_constant_two

#: The forms, by how the square is written.
MUL_FORM = "Relu + Mul"
POW_FORM = "Relu + Pow"
_ONNX_DOMAINS = ("", "ai.onnx")
_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    leftovers: list[ir.Value]
    attributes: dict[str, Any]


def _prove(relu: ir.Node, square: ir.Node, x: ir.Value) -> _Plan:
    graph = relu.graph
    opset = None if graph is None else graph.opset_imports.get("", graph.opset_imports.get("ai.onnx"))
    if opset is None or opset < MIN_OPSET:
        raise Refusal(f"the model's ONNX opset {opset} is below {MIN_OPSET}, which SquaredRelu's function needs", relu)
    r = relu.outputs[0]
    if r.is_graph_output():
        raise Refusal("the ReLU's output is a graph output", r)
    others = sorted({use.node.name or use.node.op_type for use in r.uses() if use.node is not square})
    if others:
        raise Refusal(f"the ReLU's output is also read by {', '.join(others)}", r)
    # Relu's output and Mul's or Pow's (its base's type) are x's type by their schemas: whichever the graph types
    dtype = next((v.dtype for v in (x, r, square.outputs[0]) if v.dtype is not None), None)
    if dtype not in _TYPES:
        raise Refusal(f"x is {dtype_name(dtype)}: the op takes float32, float16 and bfloat16", x)
    return _Plan(anchor=relu, leftovers=list(square.outputs), attributes={"dtype": dtype_name(dtype)})


class _SquaredReluFusion(PlannedRule):
    """A rule whose chain is ``Relu`` then the square that produces ``y``."""

    def check(self, context, x, y, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        square = y.producer()
        relu = square.inputs[0].producer() if square is not None and square.inputs[0] is not None else None
        if square is None or relu is None:
            return result.fail("no producer")
        try:
            self.prove_square(square)
            self._plan = _prove(relu, square, x)
        except Refusal as refusal:
            return self.refused(result, relu, refusal)
        return result

    def prove_square(self, square: ir.Node) -> None:
        """Refuse a square that is not proven to be one (the Mul form needs no proof: its pattern is ``r * r``)."""

    def rewrite(self, op, x, **_: Any):
        self.take_plan()
        return op.SquaredRelu(x, _domain=DOMAIN, _version=1)


class ReluMulFusion(_SquaredReluFusion):
    """Rewrites ``Mul(Relu(x), Relu(x))`` (one Relu read twice) into a SquaredRelu node."""

    FORM = MUL_FORM

    def pattern(self, op, x):
        r = op.Relu(x)
        return op.Mul(r, r, _outputs=["y"])


class ReluPowFusion(_SquaredReluFusion):
    """Rewrites ``Pow(Relu(x), 2)`` into a SquaredRelu node."""

    FORM = POW_FORM

    def pattern(self, op, x, exponent):
        return op.Pow(op.Relu(x), exponent, _outputs=["y"])

    def prove_square(self, square: ir.Node) -> None:
        r, exponent = square.inputs
        if self._shapes is None:  # one per pass (PlannedRule.setup), built on its first query
            self._shapes = DecodeShapes(square.graph)
        if r is None or exponent is None or not is_constant_two(exponent, r, self._shapes):
            raise Refusal("the exponent is not proven to be a constant 2 that keeps the ReLU's shape", exponent)


squared_relu_rules = pattern.RewriteRuleSet(
    [ReluMulFusion.rule("SquaredRelu (Relu + Mul)"), ReluPowFusion.rule("SquaredRelu (Relu + Pow)")]
)
squared_relu_rules.remove_unused_nodes = False


def fuse_squared_relu(model: ir.Model, log: FusionLog | None = None) -> int:
    """Replace every proven squared ReLU of ``model`` in place; return how many were fused."""
    return apply_with_log(squared_relu_rules, model, log)


def _squares(node: ir.Node) -> list[ir.Node]:
    """The readers of ``node``'s output that square it (``Mul(r, r)``, or ``Pow(r, _)`` of any exponent)."""
    r = node.outputs[0]
    readers = {id(use.node): use.node for use in r.uses()}.values()
    return [
        reader
        for reader in readers
        if reader.domain in _ONNX_DOMAINS
        and len(reader.inputs) == 2
        and reader.inputs[0] is r
        and (reader.op_type == "Pow" or (reader.op_type == "Mul" and reader.inputs[1] is r))
    ]


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every ONNX Relu of ``graph`` whose output is squared (after fusing: the squared ReLUs left)."""
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(graph)
        if node.op_type == "Relu" and node.domain in _ONNX_DOMAINS and _squares(node)
    ]


def form_of(anchor: ir.Node) -> str:
    """The form of the squared ReLU at ``anchor`` (a Relu): how its square is written."""
    squares = _squares(anchor)
    return POW_FORM if squares and squares[0].op_type == "Pow" else MUL_FORM


__all__ = [
    "MUL_FORM",
    "POW_FORM",
    "ReluMulFusion",
    "ReluPowFusion",
    "find_anchors",
    "form_of",
    "fuse_squared_relu",
    "squared_relu_rules",
]
