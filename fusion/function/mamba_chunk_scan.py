"""The model-local function of ``ai.mambafuse::MambaChunkScan`` in stock ONNX ops (draft: no rule writes the op
yet, docs/mamba_chunk_scan.md).

The body computes the contract's recurrence token by token with ONNX's ``Scan`` (state carried in float32), so it
serves every prompt length, one token included; it is portable, not fast (a kernel chooses chunks). T is x's
type; the time step's roundings are Casts to it through ``CastLike``::

    d1 = CastLike(f32(dt) + f32(dt_bias), x)               # round_T
    d2 = dt_softplus ? Where(d1 > 20, d1, CastLike(Softplus(f32(d1)), x)) : d1
    d  = Min(Max(f32(d2), f32(CastLike(dt_min, x))), f32(CastLike(dt_max, x)))
    a  = f32(A) * d;  u = f32(x) * d;  B, C to float32, from G groups to H heads
    Scan over t: S = Exp(a_t) * S + u_t ⊗ B_t;  y_t = ReduceSum(S * C_t, n)
    out = y + f32(D) * f32(x);  final_state = S

Every input is required (a body cannot test for a missing one): a caller without dt_bias passes -0.0s, without D
zeros, without an initial state zeros.
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import int64s, node_with_refs, op_function, require_opset
from fusion.reference.mamba_chunk_scan import OP_TYPE, SOFTPLUS_THRESHOLD

INPUTS = ("x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state")
OUTPUTS = ("out", "final_state")
#: Optional attributes and the defaults the function declares.
OPTIONAL_ATTRIBUTES = {"dt_softplus": 1, "dt_min": 0.0, "dt_max": float("inf")}
#: Lowest ONNX opset the body is written for (CastLike: opset 15).
MIN_OPSET = 15

_FLOAT = onnx.TensorProto.FLOAT


def _scan_body() -> onnx.GraphProto:
    """One token: state (B, H, P, N); a (B, H), u (B, H, P), b and c (B, H, N) -> state, y (B, H, P)."""
    node = helper.make_node
    nodes = [
        int64s("token_axes23", [2, 3]),
        int64s("token_axis3", [3]),
        int64s("token_axis2", [2]),
        int64s("token_last", [-1]),
        node("Exp", ["a_t"], ["decay"]),
        node("Unsqueeze", ["decay", "token_axes23"], ["decay4"]),
        node("Mul", ["state_in", "decay4"], ["kept"]),
        node("Unsqueeze", ["u_t", "token_axis3"], ["u4"]),  # (B, H, P, 1)
        node("Unsqueeze", ["b_t", "token_axis2"], ["b4"]),  # (B, H, 1, N)
        node("Mul", ["u4", "b4"], ["added"]),
        node("Add", ["kept", "added"], ["state_out"]),
        node("Unsqueeze", ["c_t", "token_axis2"], ["c4"]),
        node("Mul", ["state_out", "c4"], ["read"]),
        node("ReduceSum", ["read", "token_last"], ["y_t"], keepdims=0),
    ]
    shapes = {
        "state_in": ["B", "H", "P", "N"],
        "a_t": ["B", "H"],
        "u_t": ["B", "H", "P"],
        "b_t": ["B", "H", "N"],
        "c_t": ["B", "H", "N"],
        "state_out": ["B", "H", "P", "N"],
        "y_t": ["B", "H", "P"],
    }
    value = helper.make_tensor_value_info
    return helper.make_graph(
        nodes,
        "mamba_chunk_scan_token",
        [value(name, _FLOAT, shapes[name]) for name in ("state_in", "a_t", "u_t", "b_t", "c_t")],
        [value(name, _FLOAT, shapes[name]) for name in ("state_out", "y_t")],
    )


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of MambaChunkScan for a model whose ONNX opset is ``onnx_opset``."""
    require_opset(OP_TYPE, onnx_opset, MIN_OPSET)
    node = helper.make_node
    constant = onnx.AttributeProto
    nodes = [
        int64s("zero", [0]),
        int64s("two", [2]),
        int64s("three", [3]),
        int64s("four", [4]),
        int64s("axis3", [3]),
        int64s("axes01", [0, 1]),
        int64s("axes013", [0, 1, 3]),
        # d: dt + dt_bias rounded to T, torch's softplus rounded to T, the limits in T; then float32
        node("Cast", ["dt"], ["dt_f"], to=_FLOAT),
        node("Cast", ["dt_bias"], ["bias_f"], to=_FLOAT),
        node("Add", ["dt_f", "bias_f"], ["d1_sum"]),
        node("CastLike", ["d1_sum", "x"], ["d1"]),
        node("Cast", ["d1"], ["d1_f"], to=_FLOAT),
        node("Softplus", ["d1_f"], ["soft_f"]),
        node("CastLike", ["soft_f", "x"], ["soft"]),
        node("Cast", ["soft"], ["soft_t_f"], to=_FLOAT),
        node("Constant", [], ["threshold"], value=helper.make_tensor("t", _FLOAT, [], [SOFTPLUS_THRESHOLD])),
        node("Greater", ["d1_f", "threshold"], ["above"]),
        node("Where", ["above", "d1_f", "soft_t_f"], ["d_soft"]),
        node_with_refs("Constant", [], ["softplus_flag"], {"value_int": ("dt_softplus", constant.INT)}),
        node("Cast", ["softplus_flag"], ["softplus_on"], to=onnx.TensorProto.BOOL),
        node("Where", ["softplus_on", "d_soft", "d1_f"], ["d2"]),
        node_with_refs("Constant", [], ["lo_f"], {"value_float": ("dt_min", constant.FLOAT)}),
        node_with_refs("Constant", [], ["hi_f"], {"value_float": ("dt_max", constant.FLOAT)}),
        node("CastLike", ["lo_f", "x"], ["lo_t"]),
        node("CastLike", ["hi_f", "x"], ["hi_t"]),
        node("Cast", ["lo_t"], ["lo"], to=_FLOAT),
        node("Cast", ["hi_t"], ["hi"], to=_FLOAT),
        node("Max", ["d2", "lo"], ["d_low"]),
        node("Min", ["d_low", "hi"], ["d"]),  # (B, T, H) float32
        # a = A * d, u = x * d (float32)
        node("Cast", ["A"], ["A_f"], to=_FLOAT),
        node("Unsqueeze", ["A_f", "axes01"], ["A3"]),  # (1, 1, H)
        node("Mul", ["A3", "d"], ["a"]),
        node("Cast", ["x"], ["x_f"], to=_FLOAT),
        node("Unsqueeze", ["d", "axis3"], ["d4"]),
        node("Mul", ["x_f", "d4"], ["u"]),
        # B and C to float32, from G groups to H heads: (B, T, G, N) -> (B, T, G, 1, N) -> (B, T, G, H/G, N)
        node("Shape", ["B"], ["group_shape"]),
        node("Shape", ["x"], ["x_shape"]),
        node("Slice", ["group_shape", "zero", "two"], ["batch_length"]),
        node("Slice", ["group_shape", "two", "three"], ["groups"]),
        node("Slice", ["group_shape", "three", "four"], ["state_size"]),
        node("Slice", ["x_shape", "two", "three"], ["heads"]),
        node("Div", ["heads", "groups"], ["per_group"]),
        node("Concat", ["batch_length", "groups", "per_group", "state_size"], ["expanded_shape"], axis=0),
        node("Concat", ["batch_length", "heads", "state_size"], ["head_shape"], axis=0),
        node("Cast", ["B"], ["B_f"], to=_FLOAT),
        node("Cast", ["C"], ["C_f"], to=_FLOAT),
        node("Unsqueeze", ["B_f", "axis3"], ["B5"]),
        node("Unsqueeze", ["C_f", "axis3"], ["C5"]),
        node("Expand", ["B5", "expanded_shape"], ["B_expanded"]),
        node("Expand", ["C5", "expanded_shape"], ["C_expanded"]),
        node("Reshape", ["B_expanded", "head_shape"], ["B_heads"]),
        node("Reshape", ["C_expanded", "head_shape"], ["C_heads"]),
        # the recurrence, token by token
        node("Cast", ["initial_state"], ["state0"], to=_FLOAT),
        node(
            "Scan",
            ["state0", "a", "u", "B_heads", "C_heads"],
            ["final_state", "y"],
            body=_scan_body(),
            num_scan_inputs=4,
            scan_input_axes=[1, 1, 1, 1],
            scan_output_axes=[1],
        ),
        # the skip: f32(D) * f32(x)
        node("Cast", ["D"], ["D_f"], to=_FLOAT),
        node("Unsqueeze", ["D_f", "axes013"], ["D4"]),  # (1, 1, H, 1)
        node("Mul", ["D4", "x_f"], ["skip"]),
        node("Add", ["y", "skip"], ["out"]),
    ]
    return op_function(
        OP_TYPE,
        inputs=INPUTS,
        outputs=OUTPUTS,
        nodes=nodes,
        opset_imports={"": onnx_opset},
        optional_attributes=OPTIONAL_ATTRIBUTES,
        contract="docs/mamba_chunk_scan.md",
    )
