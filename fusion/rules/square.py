"""Write ``Pow(x, 2)`` as ``Mul(x, x)``.

Used by ``mambafuse optimize``. Nemotron-H's MLP is a squared ReLU, which torch exports as ``Pow(Relu(h), 2)``
over the prompt's (tokens × 21504) activations. ONNX Runtime's CUDA provider computes a float16 or float32 Pow
with ``powf`` in float32: three of them take 554 µs of a 2048-token prefill of the Nemotron-H-8B-shaped model on an H100
(benchmarks/RESULTS.md), where a product of the same bytes runs at the copy rate. The square of a floating-point
value rounded once to its type is what ``Mul(x, x)`` computes: exact, for float, float16, bfloat16 and double
alike (the product of two p-bit significands fits in float32 or float64 before the one rounding ORT's kernels
make), and it is ``Pow``'s value too; ONNX Runtime's CPU ``Pow`` gives those same bits for every float16 value
and for a million float32 ones (``tests/test_optimize_passes.py``). The CUDA provider's Pow goes through
``powf``, documented to a few units in the last place of float32: on an H100 (onnxruntime-gpu 1.31,
``contrib_ops/cuda/tools/pow_square_gpu.py``) it gives the once-rounded square for every float16 value, and misses
it for 6.2 % of 2^24 float32 ones, where the product misses none; there the rewrite moves those float32 squares to
the correctly rounded value. NaN, ±Inf and -0 square alike.

What is proven from the graph: the exponent is a constant (an initializer or a ``Constant``) holding one value,
exactly 2, and its rank cannot widen the output (rank 0, or no more than ``x``'s proven rank: ``Pow``'s output
takes the broadcast of both shapes); ``x`` is of a floating-point type.
"""

from __future__ import annotations

import onnx_ir as ir

from fusion._graph import NameSource
from fusion.rules._decode import DecodeShapes, rewrite_each
from fusion.shapes.dims import constant_array

_ONNX = ("", "ai.onnx")
_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def _constant_rank(value: ir.Value) -> int | None:
    """The rank of a constant's own tensor (an initializer or a Constant node's), else None."""
    if value.const_value is not None:
        return len(value.const_value.shape)
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or producer.domain not in _ONNX:
        return None
    attribute = next(iter(producer.attributes.values()), None)
    if attribute is None:
        return None
    if attribute.name == "value":
        return len(attribute.as_tensor().shape)
    return 0 if attribute.name in ("value_float", "value_int") else None


def is_constant_two(exponent: ir.Value, base: ir.Value, shapes: DecodeShapes) -> bool:
    """Whether ``exponent`` is a constant (an initializer or a Constant) holding one value, exactly 2, of a rank
    that cannot widen ``Pow(base, exponent)`` past ``base``'s shape (0, or no more than base's proven rank)."""
    values = constant_array(exponent)
    rank = _constant_rank(exponent)
    if values is None or values.size != 1 or rank is None or float(values.reshape(-1)[0]) != 2.0:
        return False
    if rank > 0:
        dims = shapes(base)
        if dims is None or len(dims) < rank:
            return False
    return True


def is_square_exponent(x: ir.Value, exponent: ir.Value, shapes: DecodeShapes) -> bool:
    """Whether ``Pow(x, exponent)`` is proven to be x's square, with x's shape: as the module says."""
    return x.dtype in _FLOAT_TYPES and is_constant_two(exponent, x, shapes)


def _product(node: ir.Node, shapes: DecodeShapes, fresh: NameSource) -> ir.Node | None:
    """``Mul(x, x)`` for a ``Pow(x, 2)`` proven as above, else None."""
    if len(node.inputs) != 2 or not is_square_exponent(*node.inputs, shapes):
        return None
    x = node.inputs[0]
    return ir.Node("", "Mul", [x, x], num_outputs=1, name=fresh(f"{node.name or 'pow'}_as_mul"))


def squares_to_products(model: ir.Model) -> int:
    """Replace every ``Pow(x, 2)`` of ``model``'s main graph whose square is proven as above; return how many."""
    return rewrite_each(model, "Pow", _product, "_pow")


__all__ = ["is_constant_two", "is_square_exponent", "squares_to_products"]
