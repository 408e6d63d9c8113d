"""The model-local function of ``ai.mambafuse::GatedGroupRMSNorm``: docs/op.md in stock ONNX ops.

A fused model carries this function so that it runs anywhere: ONNX Runtime without the mambafuse
library (and providers that cannot host custom ops, CoreML) inlines the body; with the library
registered, the kernel shadows it. One function serves every fused node of a model: its body is
type-generic (ONNX functions are untyped) and ``epsilon``, ``group_size``, ``norm_dtype`` and
``output_dtype`` are function attributes that each call node sets, so every type combination and
attribute set is covered by one definition. ``gated_dtype`` is optional, with the default FLOAT (no
rounding) declared in the function, so call nodes written before it existed keep their meaning.

The body follows the contract's rounding points exactly::

    h  = f32(Y) * (f32(Z) / (1 + Exp(-f32(Z))))     # silu without ORT's inexact Sigmoid
    h  = f32(Cast(h, gated_dtype))                    # third rounding point (FLOAT: a no-op)
    hg = Reshape(h, [..., -1, group_size])            # leading dims from Shape(h): any rank works
    n  = hg * Reciprocal(Sqrt(ReduceMean(hg * hg, -1) + epsilon))
    O  = Cast(f32(W) * f32(Cast(Reshape(n, Shape(h)), norm_dtype)), output_dtype)
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import (
    OPSET_VERSION,
    import_domain,
    int64s,
    model_onnx_opset,
    node_with_refs,
    op_function,
    put_function,
    require_opset,
)
from fusion.reference.gated_group_rms_norm import DOMAIN, OP_TYPE

#: Attributes every call node sets explicitly.
ATTRIBUTES = ("epsilon", "group_size", "norm_dtype", "output_dtype")
#: Optional attributes and the defaults the function declares for them (FLOAT: h is not rounded).
OPTIONAL_ATTRIBUTES = {"gated_dtype": onnx.TensorProto.FLOAT}
#: Lowest ONNX opset the body is written for (Shape/Slice/Unsqueeze with input axes: opset 13).
MIN_OPSET = 13


_INT_ATTR = onnx.AttributeProto.INT
_FLOAT_ATTR = onnx.AttributeProto.FLOAT


def _node(op_type: str, inputs: list[str], outputs: list[str], **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op_type, inputs, outputs, **attrs)


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of GatedGroupRMSNorm for a model whose ONNX opset is ``onnx_opset``.

    The function imports the model's own ONNX opset version (the checker requires a function and its
    model to agree on it); only ``ReduceMean`` changes shape across versions (axes became an input in
    opset 18).
    """
    require_opset(OP_TYPE, onnx_opset, MIN_OPSET)
    FLOAT = onnx.TensorProto.FLOAT
    nodes = [
        # Widening to float32 is exact for float16/bfloat16 and a no-op for float32.
        _node("Cast", ["Y"], ["y32"], to=FLOAT),
        _node("Cast", ["Z"], ["z32"], to=FLOAT),
        _node("Cast", ["W"], ["w32"], to=FLOAT),
        # silu(z) = z / (1 + exp(-z)): ORT CPU's Sigmoid (MLAS) is off by far more than the op's
        # budget where sigmoid is tiny (measured: 5x relative at z = -30, 3e-5 at z = -6), its Exp is
        # not (1.7e-7 over [-30, 30]). exp(-z) = inf for z < -88 gives -0, the correct limit.
        # (Mul by -1 rather than Neg, and Div(1, x) rather than Reciprocal below: the same values, in ops
        # that CoreML's MLProgram builder takes exactly — see contrib_ops/APPLE.md.)
        _node("Constant", [], ["one"], value=helper.make_tensor("one", FLOAT, [], [1.0])),
        _node("Constant", [], ["minus_one_f"], value=helper.make_tensor("minus_one_f", FLOAT, [], [-1.0])),
        _node("Mul", ["z32", "minus_one_f"], ["minus_z"]),
        _node("Exp", ["minus_z"], ["exp_minus_z"]),
        _node("Add", ["exp_minus_z", "one"], ["denominator"]),
        _node("Div", ["z32", "denominator"], ["silu"]),
        # y * silu(z) in this multiplication order, as the contract and the HF module do.
        _node("Mul", ["y32", "silu"], ["gated_exact"]),
        # Third rounding point: h in gated_dtype (default FLOAT: two no-op Casts), widened back.
        node_with_refs("Cast", ["gated_exact"], ["gated_rounded"], {"to": ("gated_dtype", _INT_ATTR)}),
        _node("Cast", ["gated_rounded"], ["gated"], to=FLOAT),
        # [..., C] -> [..., C / group_size, group_size], keeping every leading dim of the input.
        _node("Shape", ["gated"], ["shape"]),
        int64s("zero", [0]),
        int64s("minus_one", [-1]),
        _node("Slice", ["shape", "zero", "minus_one"], ["leading"]),
        int64s("end", [2**62]),
        _node("Slice", ["shape", "minus_one", "end"], ["channels"]),
        node_with_refs("Constant", [], ["group_size_scalar"], {"value_int": ("group_size", _INT_ATTR)}),
        _node("Unsqueeze", ["group_size_scalar", "zero"], ["group_size_1d"]),
        # C / group_size spelled out instead of -1: CoreML's Reshape builder refuses -1 in a target.
        _node("Div", ["channels", "group_size_1d"], ["groups_1d"]),
        _node("Concat", ["leading", "groups_1d", "group_size_1d"], ["group_shape"], axis=0),
        _node("Reshape", ["gated", "group_shape"], ["groups"]),
        _node("Mul", ["groups", "groups"], ["square"]),
    ]
    if onnx_opset >= 18:
        nodes.append(_node("ReduceMean", ["square", "minus_one"], ["mean_square"], keepdims=1))
    else:
        nodes.append(_node("ReduceMean", ["square"], ["mean_square"], axes=[-1], keepdims=1))
    nodes += [
        node_with_refs("Constant", [], ["epsilon_value"], {"value_float": ("epsilon", _FLOAT_ATTR)}),
        _node("Add", ["mean_square", "epsilon_value"], ["variance"]),
        _node("Sqrt", ["variance"], ["rms"]),
        _node("Div", ["one", "rms"], ["inv_rms"]),
        _node("Mul", ["groups", "inv_rms"], ["normed_groups"]),
        _node("Reshape", ["normed_groups", "shape"], ["normed32"]),
        # First rounding point: the normalized value in norm_dtype, before the weight multiply.
        node_with_refs("Cast", ["normed32"], ["normed"], {"to": ("norm_dtype", _INT_ATTR)}),
        _node("Cast", ["normed"], ["normed_wide"], to=FLOAT),
        _node("Mul", ["w32", "normed_wide"], ["weighted"]),
        # Second rounding point: the product in output_dtype.
        node_with_refs("Cast", ["weighted"], ["O"], {"to": ("output_dtype", _INT_ATTR)}),
    ]
    return op_function(
        OP_TYPE,
        inputs=["Y", "Z", "W"],
        outputs=["O"],
        nodes=nodes,
        opset_imports={"": onnx_opset},
        attributes=ATTRIBUTES,
        optional_attributes=OPTIONAL_ATTRIBUTES,
        contract="docs/op.md",
    )


def attach_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add (or replace) the GatedGroupRMSNorm function in ``model`` in place and return it.

    Also makes sure the model imports the ``ai.mambafuse`` domain at OPSET_VERSION.
    """
    put_function(model, make_function(model_onnx_opset(model)))
    import_domain(model, DOMAIN, OPSET_VERSION)
    return model
