"""The model-local function of ``ai.mambafuse::CausalConv1d`` in stock ONNX ops.

A fused model carries it so that ONNX Runtime without the mambafuse library inlines the body (with the library
registered, a kernel will shadow it). One body serves every prompt length L >= 1 and every T::

    x_cf        = channels_last ? Transpose(x, [0, 2, 1]) : x          # (B, C, L)
    window      = Concat(initial_state, x_cf, axis=-1)                 # (B, C, S + L)
    final_state = window[:, :, L:]                                     # the last S columns
    v[b, c, t]  = round_T(sum_k f32(window[b, c, S - K + 1 + t + k]) * f32(w[c, k]) + f32(bias[c]))
    y_cf        = activation == "silu" ? round_T(v * round_T(1 / (1 + Exp(-v)))) : v
    y           = channels_last ? Transpose(y_cf, [0, 2, 1]) : y_cf

The exported graphs' depthwise Conv needs ``group = C`` as a static attribute, which the op cannot pass to its
body (C is a shape, not an attribute), so the convolution is a MatMul of the gathered windows (B, C, L, K) with
the weight (C, K, 1), as CausalConv1dUpdate's body does it (one K-long float32 dot product per output, as ONNX
Runtime's CPU runs a depthwise Conv). The arithmetic is float32 with the contract's rounding points as CastLike
to x's type: float16 and bfloat16 need no kernel of their own (ONNX Runtime's CPU has no bfloat16 MatMul,
Sigmoid or Mul, and Conv takes bfloat16 only from opset 22), and a product of two float16 or bfloat16 values is
exact in float32, so Mul in float32 then one rounding is Mul in T. ``activation`` is picked with a LabelEncoder
(ai.onnx.ml) of the string (string Equal needs opset 19) and ``channels_last`` with an If, its branches the two
layouts.

Every input is required, because a function cannot test for a missing one: a rule that finds a Conv without
bias writes a -0.0 bias (v + -0.0 is v exactly), one without an initial state zeros of (B, C, state_width).
The body takes S from the initial state's shape and does not read ``state_width``; the kernels check the two agree.
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import int64_scalar, int64s, node_with_refs, op_function, require_opset
from fusion.reference.causal_conv1d import OP_TYPE

INPUTS = ("x", "weight", "bias", "initial_state")
OUTPUTS = ("y", "final_state")
#: Attributes every node sets.
ATTRIBUTES = ("state_width",)
#: Optional attributes and the defaults the function declares.
OPTIONAL_ATTRIBUTES = {"activation": "silu", "channels_last": 1}
#: Lowest ONNX opset the body is written for (CastLike: opset 15).
MIN_OPSET = 15
#: The ai.onnx.ml opset the body imports (LabelEncoder with string keys and int64 values: version 2).
ML_OPSET = 2

_FLOAT = onnx.TensorProto.FLOAT


def _layout_branch(name: str, source: str, output: str, transpose: bool) -> onnx.GraphProto:
    """Return an If branch whose one output ``output`` is ``source`` (an outer value), transposed or not; its type
    is left to inference (the branch serves every T)."""
    if transpose:
        body = helper.make_node("Transpose", [source], [output], perm=[0, 2, 1])
    else:
        body = helper.make_node("Identity", [source], [output])
    return helper.make_graph([body], name, [], [helper.make_value_info(output, onnx.TypeProto())])


def _in_layout(source: str, output: str, condition: str) -> onnx.NodeProto:
    """Return an If node: ``output`` is ``source`` transposed (B, X, Y) -> (B, Y, X) where ``condition``, else it."""
    return helper.make_node(
        "If",
        [condition],
        [output],
        then_branch=_layout_branch(f"{output}_transposed", source, f"{output}_then", transpose=True),
        else_branch=_layout_branch(f"{output}_as_is", source, f"{output}_else", transpose=False),
    )


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of CausalConv1d for a model whose ONNX opset is ``onnx_opset``."""
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
        # the prompt channels-first, (B, C, L)
        node_with_refs(
            "Constant", [], ["channels_last_int"], {"value_int": ("channels_last", onnx.AttributeProto.INT)}
        ),
        node("Cast", ["channels_last_int"], ["is_channels_last"], to=onnx.TensorProto.BOOL),
        _in_layout("x", "x_cf", "is_channels_last"),
        node("Concat", ["initial_state", "x_cf"], ["window"], axis=-1),
        # final_state: the window less its first L columns
        node("Shape", ["x_cf"], ["x_shape"]),
        node("Slice", ["x_shape", "two", "three"], ["length"]),
        node("Slice", ["window", "length", "end", "two"], ["final_state"]),
        # window columns S - K + 1 + t + k for t < L, k < K: (L, K) indices, gathered to (B, C, L, K)
        node("Shape", ["initial_state"], ["state_shape"]),
        node("Slice", ["state_shape", "two", "three"], ["state_columns"]),
        node("Shape", ["weight"], ["weight_shape"]),
        node("Slice", ["weight_shape", "minus_one", "end"], ["width"]),
        node("Sub", ["state_columns", "width"], ["before_first"]),
        node("Add", ["before_first", "one"], ["first"]),
        node("Squeeze", ["length", "zero"], ["length_scalar"]),
        node("Squeeze", ["width", "zero"], ["width_scalar"]),
        node("Range", ["zero_scalar", "length_scalar", "one_scalar"], ["t"]),
        node("Range", ["zero_scalar", "width_scalar", "one_scalar"], ["k"]),
        node("Unsqueeze", ["t", "one"], ["t_column"]),
        node("Add", ["t_column", "k"], ["offsets"]),
        node("Add", ["offsets", "first"], ["indices"]),
        node("Gather", ["window", "indices"], ["windows"], axis=2),
        # v = round_T(windows @ w (C, K, 1) + bias), the sum in float32
        node("Cast", ["windows"], ["windows_f"], to=_FLOAT),
        node("Reshape", ["weight", "weight_column"], ["w"]),
        node("Cast", ["w"], ["w_f"], to=_FLOAT),
        node("MatMul", ["windows_f", "w_f"], ["dot"]),
        node("Squeeze", ["dot", "three"], ["dot3"]),
        node("Cast", ["bias"], ["bias_f"], to=_FLOAT),
        node("Unsqueeze", ["bias_f", "one"], ["bias_column"]),
        node("Add", ["dot3", "bias_column"], ["sum_f"]),
        node("CastLike", ["sum_f", "x"], ["v"]),
        node("Cast", ["v"], ["v_f"], to=_FLOAT),
        # silu(v) = round_T(v * round_T(sigmoid(v))): the exports' Sigmoid and Mul, each rounded to T. The sigmoid
        # as 1 / (1 + exp(-v)): ONNX Runtime's CPU Sigmoid (MLAS) is accurate in absolute terms only (2e-5
        # relative at v = -5.5), its Exp to a few ulps; exp(-v) = inf below v = -88 gives 0, the limit.
        node("Constant", [], ["one_f"], value=helper.make_tensor("one_f", _FLOAT, [], [1.0])),
        node("Neg", ["v_f"], ["minus_v"]),
        node("Exp", ["minus_v"], ["exp_minus_v"]),
        node("Add", ["exp_minus_v", "one_f"], ["denominator"]),
        node("Div", ["one_f", "denominator"], ["gate_f"]),
        node("CastLike", ["gate_f", "x"], ["gate"]),
        node("Cast", ["gate"], ["gate_t_f"], to=_FLOAT),
        node("Mul", ["v_f", "gate_t_f"], ["silu_f"]),
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
        # v_f holds a value of T, so the one rounding below leaves it as it is
        node("Where", ["is_silu", "silu_f", "v_f"], ["y_cf_f"]),
        node("CastLike", ["y_cf_f", "x"], ["y_cf"]),
        _in_layout("y_cf", "y", "is_channels_last"),
    ]
    return op_function(
        OP_TYPE,
        inputs=INPUTS,
        outputs=OUTPUTS,
        nodes=nodes,
        opset_imports={"": onnx_opset, "ai.onnx.ml": ML_OPSET},
        attributes=ATTRIBUTES,
        optional_attributes=OPTIONAL_ATTRIBUTES,
        contract="docs/causal_conv1d.md",
    )
