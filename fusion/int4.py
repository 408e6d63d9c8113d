"""int4 weight products and ONNX Runtime's ``accuracy_level`` (docs/models.md, int4): which nodes are 4-bit
``MatMulNBits`` / ``DecodeMatMulNBits``, setting their level (``--int4-accuracy-level``), and the hint for those that
multiply float activations on the CPU."""

from __future__ import annotations

import onnx_ir as ir

from fusion.hints import CPU_INT4, Hint
from fusion.reference import DOMAIN

#: ``accuracy_level`` of MatMulNBits at which ONNX Runtime's CPU kernel rounds A to int8 per block before the products.
INT8_ACTIVATIONS_LEVEL = 4


#: MatMulNBits' accuracy levels (0 unset, 1 float32, 2 float16, 3 bfloat16, 4 int8 activations).
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
_INT4_PRODUCTS = {("MatMulNBits", "com.microsoft"), ("DecodeMatMulNBits", DOMAIN)}


def _int4_products(model: ir.Model) -> list[ir.Node]:
    """The model's 4-bit weight products: MatMulNBits with bits = 4, and DecodeMatMulNBits."""
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if (node.op_type, node.domain) in _INT4_PRODUCTS and node.attributes.get_int("bits", 4) == 4
    ]


def set_int4_accuracy_level(model: ir.Model, level: int) -> int:
    """Set ``accuracy_level`` = ``level`` on every 4-bit weight product of ``model`` (in place); return how many
    had another level (absent counts as 0)."""
    changed = 0
    for node in _int4_products(model):
        if node.attributes.get_int("accuracy_level", 0) != level:
            node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", level)
            changed += 1
    return changed


def float_activation_hint(model: ir.Model) -> Hint | None:
    """Return a hint when the model has 4-bit weight products below accuracy_level 4 (the quantizer's default):
    ONNX Runtime's CPU kernel then multiplies in float32, 2-3x slower at a decode step (benchmarks/RESULTS.md)."""
    count = sum(
        1 for node in _int4_products(model) if node.attributes.get_int("accuracy_level", 0) < INT8_ACTIVATIONS_LEVEL
    )
    if not count:
        return None
    return Hint(
        f"{count} int4 MatMulNBits at accuracy_level < {INT8_ACTIVATIONS_LEVEL}: on the CPU ONNX Runtime multiplies "
        f"them in float32, 2-3x slower at a decode step than at accuracy_level {INT8_ACTIVATIONS_LEVEL} (A rounded "
        f"to int8 per block, what onnxruntime-genai's builder writes for the CPU; the CUDA kernel ignores the "
        f"level). Quantize with --accuracy_level {INT8_ACTIVATIONS_LEVEL}, or rewrite with --int4-accuracy-level "
        f"{INT8_ACTIVATIONS_LEVEL}, for a CPU deployment (docs/models.md)",
        CPU_INT4,
    )
