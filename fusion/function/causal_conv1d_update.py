"""The model-local function of ``ai.mambafuse::CausalConv1dUpdate`` in stock ONNX ops.

A fused model carries it so that ONNX Runtime without the mambafuse library inlines the body (with the
library registered, the kernel shadows it). The body is type-generic (T is x's type)::

    window        = Concat(conv_state, x, axis=-1)                  # (B, C, S + L)
    present_state = window[:, :, L:]                                # the last S columns
    v[b, c, t]    = sum_k window[b, c, S - K + 1 + t + k] * w[c, k] + bias[c]   # one MatMul in T
    y             = activation == "silu" ? v * Sigmoid(v) : v        # in T

The depthwise convolution is a MatMul of the gathered windows (B, C, L, K) with the weight (C, K, 1):
the exported graphs' Conv needs its ``group`` attribute, which the op does not have. ONNX Runtime's CPU
Conv runs a depthwise Conv as a K-long dot product per output, as its MatMul does, and the tests compare
the two bit for bit. ``activation`` is a string; the body picks the SiLU or the plain value with a
LabelEncoder (ai.onnx.ml) of it, because string Equal needs opset 19. Every input is required: a rule
that finds a Conv without bias writes a -0.0 bias (v + -0.0 is v exactly).
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import int64_scalar, int64s, node_with_refs, op_function, require_opset
from fusion.reference.causal_conv1d_update import OP_TYPE

INPUTS = ("x", "conv_state", "weight", "bias")
OUTPUTS = ("y", "present_state")
#: Optional attributes and the defaults the function declares.
OPTIONAL_ATTRIBUTES = {"activation": "silu"}
#: Lowest ONNX opset the body is written for (Unsqueeze/Squeeze/Slice with input axes: opset 13).
MIN_OPSET = 13
#: The ai.onnx.ml opset the body imports (LabelEncoder with string keys and int64 values: version 2).
ML_OPSET = 2


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of CausalConv1dUpdate for a model whose ONNX opset is ``onnx_opset``."""
    require_opset(OP_TYPE, onnx_opset, MIN_OPSET)
    node = helper.make_node
    nodes = [
        int64s("zero", [0]),
        int64s("one", [1]),
        int64s("two", [2]),
        int64s("three", [3]),
        int64s("minus_one", [-1]),
        int64s("end", [2**62]),
        int64s("weight_column", [0, -1, 1]),
        int64_scalar("zero_scalar", 0),
        int64_scalar("one_scalar", 1),
        node("Concat", ["conv_state", "x"], ["window"], axis=-1),
        # present_state: the window less its first L columns
        node("Shape", ["x"], ["x_shape"]),
        node("Slice", ["x_shape", "two", "three"], ["new_columns"]),
        node("Slice", ["window", "new_columns", "end", "two"], ["present_state"]),
        # window columns S - K + 1 + t + k for t < L, k < K: (L, K) indices, gathered to (B, C, L, K)
        node("Shape", ["conv_state"], ["state_shape"]),
        node("Slice", ["state_shape", "two", "three"], ["state_len"]),
        node("Shape", ["weight"], ["weight_shape"]),
        node("Slice", ["weight_shape", "minus_one", "end"], ["width"]),
        node("Sub", ["state_len", "width"], ["before_first"]),
        node("Add", ["before_first", "one"], ["first"]),
        node("Squeeze", ["new_columns", "zero"], ["new_scalar"]),
        node("Squeeze", ["width", "zero"], ["width_scalar"]),
        node("Range", ["zero_scalar", "new_scalar", "one_scalar"], ["t"]),
        node("Range", ["zero_scalar", "width_scalar", "one_scalar"], ["k"]),
        node("Unsqueeze", ["t", "one"], ["t_column"]),
        node("Add", ["t_column", "k"], ["offsets"]),
        node("Add", ["offsets", "first"], ["indices"]),
        node("Gather", ["window", "indices"], ["windows"], axis=2),
        # v = windows @ w (C, K, 1) + bias, in T
        node("Reshape", ["weight", "weight_column"], ["w"]),
        node("MatMul", ["windows", "w"], ["dot"]),
        node("Squeeze", ["dot", "three"], ["dot3"]),
        node("Unsqueeze", ["bias", "one"], ["bias_column"]),
        node("Add", ["dot3", "bias_column"], ["v"]),
        # y = silu(v) = v * Sigmoid(v) in T, or v
        node("Sigmoid", ["v"], ["gate"]),
        node("Mul", ["v", "gate"], ["silu"]),
        node_with_refs(
            "Constant", [], ["activation_name"], {"value_string": ("activation", onnx.AttributeProto.STRING)}
        ),
        node(
            "LabelEncoder",
            ["activation_name"],
            ["is_silu_int"],
            domain="ai.onnx.ml",
            keys_strings=["silu"],
            values_int64s=[1],
            default_int64=0,
        ),
        node("Cast", ["is_silu_int"], ["is_silu"], to=onnx.TensorProto.BOOL),
        node("Where", ["is_silu", "silu", "v"], ["y"]),
    ]
    return op_function(
        OP_TYPE,
        inputs=INPUTS,
        outputs=OUTPUTS,
        nodes=nodes,
        opset_imports={"": onnx_opset, "ai.onnx.ml": ML_OPSET},
        optional_attributes=OPTIONAL_ATTRIBUTES,
    )
