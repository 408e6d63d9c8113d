"""The model-local function of ``ai.mambafuse::SelectiveStateUpdate`` in stock ONNX ops.

A fused model carries it so that ONNX Runtime without the mambafuse library inlines the body (with the
library registered, the kernel shadows it). The body is type-generic: T is x's type, S the state's, and
the roundings are Casts to them through ``CastLike``, so one definition serves every type combination.
The ops are those transformers' torch fallback exports (dynamo and transformers' exporter), in the same
types, so that the function's values are the original graph's bit for bit::

    d1  = dt + dt_bias                                  # Add in T
    d   = dt_softplus ? Where(d1 > 20, d1, Softplus(d1)) : d1
    dA  = Exp(f32(d) * A)                               # float32
    dB  = d * B[group of h]                             # Mul in T
    dBx = dB * x                                        # Mul in T
    s   = f32(state) * dA + f32(dBx)                    # float32
    present_state = CastLike(s, state)
    y   = MatMul(CastLike(present_state, x), C[group of h])       # in T, 3-D over (b, h) rows
    out = y + CastLike(f32(x) * f32(D), x)             # round_T(x * D); D of type T or float

Head h reads group h // (H / G) (repeat_interleave): Unsqueeze, Expand and Reshape of B and C. Every input
is required (a body cannot test for a missing one): the rules refuse a chain without dt_bias or D (no
export has one); a caller without dt_bias can pass -0.0s (x + -0.0 is x exactly).
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import int64s, node_with_refs, op_function, require_opset
from fusion.reference.selective_state_update import OP_TYPE, SOFTPLUS_THRESHOLD

INPUTS = ("state", "x", "dt", "dt_bias", "A", "B", "C", "D")
OUTPUTS = ("out", "present_state")
#: Optional attributes and the defaults the function declares.
OPTIONAL_ATTRIBUTES = {"dt_softplus": 1}
#: Lowest ONNX opset the body is written for (CastLike: opset 15).
MIN_OPSET = 15

_FLOAT = onnx.TensorProto.FLOAT


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of SelectiveStateUpdate for a model whose ONNX opset is ``onnx_opset``."""
    require_opset(OP_TYPE, onnx_opset, MIN_OPSET)
    node = helper.make_node
    nodes = [
        int64s("axis1", [1]),
        int64s("axis2", [2]),
        int64s("axis3", [3]),
        int64s("axes23", [2, 3]),
        int64s("axes12", [1, 2]),
        int64s("zero", [0]),
        int64s("one", [1]),
        int64s("two", [2]),
        int64s("three", [3]),
        int64s("four", [4]),
        int64s("minus_one", [-1]),
        # d: dt + dt_bias in T, then torch's softplus (threshold 20) in T, as the graph spells it.
        node("Add", ["dt", "dt_bias"], ["d1"]),
        node("Softplus", ["d1"], ["d1_softplus"]),
        node("Constant", [], ["threshold_f"], value=helper.make_tensor("t", _FLOAT, [], [SOFTPLUS_THRESHOLD])),
        node("CastLike", ["threshold_f", "d1"], ["threshold"]),
        node("Greater", ["d1", "threshold"], ["above"]),
        node("Where", ["above", "d1", "d1_softplus"], ["d_softplus"]),
        node_with_refs("Constant", [], ["softplus_flag"], {"value_int": ("dt_softplus", onnx.AttributeProto.INT)}),
        node("Cast", ["softplus_flag"], ["softplus_on"], to=onnx.TensorProto.BOOL),
        node("Where", ["softplus_on", "d_softplus", "d1"], ["d"]),
        node("Unsqueeze", ["d", "axes23"], ["d4"]),  # (B, H, 1, 1)
        # dA = exp(f32(d) * A), float32
        node("Cast", ["d4"], ["d4_f32"], to=_FLOAT),
        node("Cast", ["A"], ["A_f32"], to=_FLOAT),
        node("Unsqueeze", ["A_f32", "axes12"], ["A3"]),  # (H, 1, 1)
        node("Mul", ["d4_f32", "A3"], ["dt_A"]),
        node("Exp", ["dt_A"], ["dA"]),
        # B and C from G groups to H heads: (B, G, N) -> (B, G, 1, N) -> (B, G, H/G, N) -> (B, H, N)
        node("Shape", ["B"], ["group_shape"]),
        node("Shape", ["x"], ["x_shape"]),
        node("Slice", ["group_shape", "zero", "one"], ["batch"]),
        node("Slice", ["group_shape", "one", "two"], ["groups"]),
        node("Slice", ["group_shape", "two", "three"], ["state_size"]),
        node("Slice", ["x_shape", "one", "two"], ["heads"]),
        node("Div", ["heads", "groups"], ["heads_per_group"]),
        node("Concat", ["batch", "groups", "heads_per_group", "state_size"], ["expanded_shape"], axis=0),
        node("Concat", ["batch", "heads", "state_size"], ["head_shape"], axis=0),
        node("Unsqueeze", ["B", "axis2"], ["B4"]),
        node("Expand", ["B4", "expanded_shape"], ["B_expanded"]),
        node("Reshape", ["B_expanded", "head_shape"], ["B_heads"]),
        node("Unsqueeze", ["C", "axis2"], ["C4"]),
        node("Expand", ["C4", "expanded_shape"], ["C_expanded"]),
        node("Reshape", ["C_expanded", "head_shape"], ["C_heads"]),
        # dBx = (d * B) * x in T
        node("Unsqueeze", ["B_heads", "axis2"], ["B_column"]),  # (B, H, 1, N)
        node("Mul", ["d4", "B_column"], ["dB"]),
        node("Unsqueeze", ["x", "axis3"], ["x4"]),  # (B, H, P, 1)
        node("Mul", ["dB", "x4"], ["dBx"]),
        # s = f32(state) * dA + f32(dBx), float32 Mul then Add; present_state rounded to S
        node("Cast", ["state"], ["state_f32"], to=_FLOAT),
        node("Mul", ["state_f32", "dA"], ["decayed"]),
        node("Cast", ["dBx"], ["dBx_f32"], to=_FLOAT),
        node("Add", ["decayed", "dBx_f32"], ["s"]),
        node("CastLike", ["s", "state"], ["present_state"]),
        # y = round_T(s) @ C over N, in T
        node("CastLike", ["present_state", "x"], ["s_t"]),
        # As the exporters spell it: a 3-D batched MatMul over the (b, h) rows (B*H, P, N) @ (B*H, N, 1).
        # ONNX Runtime's CPU MatMul gives other bits for the same product spelled 4-D (seen: 1 fp16 ulp).
        node("Shape", ["s_t"], ["state_shape"]),
        node("Slice", ["state_shape", "two", "four"], ["row_shape"]),
        node("Concat", ["minus_one", "row_shape"], ["rows_shape"], axis=0),
        node("Reshape", ["s_t", "rows_shape"], ["s_rows"]),
        node("Concat", ["minus_one", "state_size", "one"], ["c_rows_shape"], axis=0),
        node("Reshape", ["C_heads", "c_rows_shape"], ["C_rows"]),
        node("MatMul", ["s_rows", "C_rows"], ["y_rows"]),  # (B*H, P, 1)
        node("Reshape", ["y_rows", "x_shape"], ["y"]),
        # out = y + round_T(x * D)
        node("Cast", ["x"], ["x_f32"], to=_FLOAT),
        node("Cast", ["D"], ["D_f32"], to=_FLOAT),
        node("Unsqueeze", ["D_f32", "axis1"], ["D2"]),  # (H, 1)
        node("Mul", ["x_f32", "D2"], ["xD_f32"]),
        node("CastLike", ["xD_f32", "x"], ["xD"]),
        node("Add", ["y", "xD"], ["out"]),
    ]
    return op_function(
        OP_TYPE,
        inputs=INPUTS,
        outputs=OUTPUTS,
        nodes=nodes,
        opset_imports={"": onnx_opset},
        optional_attributes=OPTIONAL_ATTRIBUTES,
    )
