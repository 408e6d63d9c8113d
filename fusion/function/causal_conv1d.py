"""The model-local function of ``ai.mambafuse::CausalConv1d`` in stock ONNX ops.

A fused model carries it so that ONNX Runtime without the mambafuse library inlines the body (with the library
registered, a kernel will shadow it). One body serves every prompt length L >= 1 and every T. It computes
channels-last, the layout of the prompt in every export, so a channels-last node transposes no prompt-sized
tensor::

    x_cl        = channels_last ? x : Transpose(x, [0, 2, 1])            # (B, L, C)
    window      = Concat(Transpose(initial_state, [0, 2, 1]), x_cl, axis=1)   # (B, S + L, C), never built
    final_state = Transpose(window[:, L:, :], [0, 2, 1])                  # from the state and x's last S rows
    for each batch row b and chunk of R output rows [t0, t0 + R):         # a Loop, one iteration a chunk
        taps[t, k, c] = f32(window[b, S - K + 1 + t + k, c])                # Gather of the chunk's rows, (R, K, C)
        v[t, c]       = round_T(ReduceSum_k(taps * f32(w[c, k])) + f32(bias[c]))
        y[t, c]       = activation == "silu" ? round_T(v * round_T(1 / (1 + Exp(-v)))) : v
    y           = channels_last ? y_cl : Transpose(y_cl, [0, 2, 1])

With ``round_once`` the SiLU reads the float32 sum and the float32 sigmoid (a Where on the attribute picks them over
their T roundings) and y is the one rounding; without the activation v is the one rounding either way.

Speed is the point of the chunks. The exported graphs' depthwise Conv needs ``group = C`` as a static
attribute, which the op cannot pass to its body (C is a shape, not an attribute), so the taps are elementwise
ops, and a whole-prompt tensor per op would make each a pass over memory (C = 10240, L = 512: 21 MB in
float32): about a dozen of them cost twice the exported chain. A chunk of about ``CHUNK_ELEMENTS`` outputs
keeps its window, taps and SiLU in the core's cache; only the chunk's rows of x are read from memory and its
outputs written. The Loop stacks the chunks to (B * chunks, 1, R, C); the last chunk of a batch row is padded (its
taps past the window's end read the last row) and the padding sliced off.

The arithmetic is float32 with the contract's rounding points as CastLike to x's type: float16 and bfloat16
need no kernel of their own (ONNX Runtime's CPU has no bfloat16 Sigmoid or Mul, and Conv takes bfloat16 only
from opset 22), and a product of two float16 or bfloat16 values is exact in float32, so Mul in float32 then one
rounding is Mul in T. ``activation`` is picked with a LabelEncoder (ai.onnx.ml) of the string (string Equal
needs opset 19), feeding an If between two Loops (with and without the SiLU), and ``channels_last`` with an If,
its branches the two layouts.

Every input is required, because a function cannot test for a missing one: a rule that finds a Conv without
bias writes a -0.0 bias (v + -0.0 is v exactly), one without an initial state zeros of (B, C, state_width).
The body takes S from the initial state's shape and does not read ``state_width``; the kernels check the two agree.
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import in_layout, int64_scalar, int64s, node_with_refs, op_function, require_opset
from fusion.reference.causal_conv1d import OP_TYPE

INPUTS = ("x", "weight", "bias", "initial_state")
OUTPUTS = ("y", "final_state")
#: Attributes every node sets.
ATTRIBUTES = ("state_width",)
#: Optional attributes and the defaults the function declares.
OPTIONAL_ATTRIBUTES = {"activation": "silu", "channels_last": 1, "round_once": 0}
#: Lowest ONNX opset the body is written for (CastLike: opset 15).
MIN_OPSET = 15
#: The ai.onnx.ml opset the body imports (LabelEncoder with string keys and int64 values: version 2).
ML_OPSET = 2

_FLOAT = onnx.TensorProto.FLOAT


#: Outputs per chunk (R = max(1, CHUNK_ELEMENTS // C) rows, at most L): 256 KiB of float32, so that the chunk's
#: taps (K times that) and SiLU stay in a core's L2 cache. Measured at C = 10240 (R = 6): 16384 is slower
#: (more iterations), 262144 too (the taps leave the cache); 65536 and 131072 are level.
CHUNK_ELEMENTS = 65536


def _chunk_body(silu: bool) -> onnx.GraphProto:
    """Return the Loop body of iteration i: one batch row's output rows [row0, row0 + R), every channel, from the
    window rows [row0 + S - K + 1, row0 + S + R) that the tables of the outer scope give for i."""
    node = helper.make_node
    nodes = [
        node("Gather", ["state_starts", "i"], ["state_start"], axis=0),
        node("Gather", ["state_ends", "i"], ["state_end"], axis=0),
        node("Gather", ["x_starts", "i"], ["x_start"], axis=0),
        node("Gather", ["x_ends", "i"], ["x_end"], axis=0),
        node("Gather", ["tap_indices", "i"], ["tap_index"], axis=0),
        # the chunk's window rows: those in the state (none after the first chunks), then those in x
        node("Slice", ["state_cl", "state_start", "state_end", "axes01"], ["state_part"]),
        node("Slice", ["x_cl", "x_start", "x_end", "axes01"], ["x_part"]),
        node("Concat", ["state_part", "x_part"], ["chunk_window"], axis=1),
        node("Cast", ["chunk_window"], ["chunk_window_f"], to=_FLOAT),
        # (1, R, K, C): row t, tap k is the chunk window's row t + k; the K products summed in float32
        node("Gather", ["chunk_window_f", "tap_index"], ["taps"], axis=1),
        node("Mul", ["taps", "w_f"], ["products"]),
        node("ReduceSum", ["products", "two"], ["dot"], keepdims=0),
        node("Add", ["dot", "bias_f"], ["sum_f"]),
        node("CastLike", ["sum_f", "x"], ["v"]),
    ]
    if silu:
        # silu(v) = round_T(v * round_T(sigmoid(v))): the exports' Sigmoid and Mul, each rounded to T. The sigmoid
        # as 1 / (1 + exp(-v)): ONNX Runtime's CPU Sigmoid (MLAS) is accurate in absolute terms only (2e-5
        # relative at v = -5.5), its Exp to a few ulps; exp(-v) = inf below v = -88 gives 0, the limit.
        # (round_once: the float32 sum and sigmoid instead of their roundings to T)
        nodes += [
            node("Cast", ["v"], ["v_t_f"], to=_FLOAT),
            node("Where", ["once", "sum_f", "v_t_f"], ["v_f"]),
            node("Neg", ["v_f"], ["minus_v"]),
            node("Exp", ["minus_v"], ["exp_minus_v"]),
            node("Add", ["exp_minus_v", "one_f"], ["denominator"]),
            node("Div", ["one_f", "denominator"], ["gate_f"]),
            node("CastLike", ["gate_f", "x"], ["gate"]),
            node("Cast", ["gate"], ["gate_t_f"], to=_FLOAT),
            node("Where", ["once", "gate_f", "gate_t_f"], ["gate_used"]),
            node("Mul", ["v_f", "gate_used"], ["y_f"]),
            node("CastLike", ["y_f", "x"], ["y_chunk"]),
        ]
    else:
        nodes.append(node("Identity", ["v"], ["y_chunk"]))
    nodes.append(node("Identity", ["keep_going"], ["keep_going_out"]))
    info = helper.make_tensor_value_info
    return helper.make_graph(
        nodes,
        "silu_chunk" if silu else "chunk",
        [info("i", onnx.TensorProto.INT64, []), info("keep_going", onnx.TensorProto.BOOL, [])],
        [info("keep_going_out", onnx.TensorProto.BOOL, []), helper.make_value_info("y_chunk", onnx.TypeProto())],
    )


def _loop_branch(silu: bool) -> onnx.GraphProto:
    """Return an If branch whose one output is the Loop's chunks stacked, (B * chunks, 1, R, C)."""
    out = "y_chunks_silu" if silu else "y_chunks_none"
    # an explicit condition (always true: the trip count ends the Loop): an empty one is dropped by serializers that
    # trim trailing empty inputs (ONNX Runtime's optimized-model writer), leaving a Loop the checker rejects
    always = f"loop_always_{'silu' if silu else 'none'}"
    condition = helper.make_node(
        "Constant", [], [always], value=helper.make_tensor(always, onnx.TensorProto.BOOL, [], [True])
    )
    loop = helper.make_node("Loop", ["iterations_scalar", always], [out], body=_chunk_body(silu))
    return helper.make_graph([condition, loop], out, [], [helper.make_value_info(out, onnx.TypeProto())])


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of CausalConv1d for a model whose ONNX opset is ``onnx_opset``."""
    require_opset(OP_TYPE, onnx_opset, MIN_OPSET)
    node = helper.make_node
    nodes = [
        int64s("zero", [0]),
        int64s("one", [1]),
        int64s("two", [2]),
        int64s("minus_one", [-1]),
        int64s("end", [2**62]),
        int64s("axes01", [0, 1]),
        int64s("weight_rows", [0, -1]),
        int64s("chunk_elements", [CHUNK_ELEMENTS]),
        node_with_refs(
            "Constant", [], ["channels_last_int"], {"value_int": ("channels_last", onnx.AttributeProto.INT)}
        ),
        node("Cast", ["channels_last_int"], ["is_channels_last"], to=onnx.TensorProto.BOOL),
        node("Not", ["is_channels_last"], ["is_channels_first"]),
        in_layout("x", "x_cl", "is_channels_first"),
        node("Transpose", ["initial_state"], ["state_cl"], perm=[0, 2, 1]),
        node("Shape", ["x_cl"], ["x_shape"]),
        node("Slice", ["x_shape", "zero", "one"], ["batch"]),
        node("Slice", ["x_shape", "one", "two"], ["length"]),
        node("Slice", ["x_shape", "two", "end"], ["channels"]),
        node("Shape", ["initial_state"], ["state_shape"]),
        node("Slice", ["state_shape", "two", "end"], ["state_columns"]),
        node("Shape", ["weight"], ["weight_shape"]),
        node("Slice", ["weight_shape", "minus_one", "end"], ["width"]),
        node("Sub", ["state_columns", "width"], ["before_first"]),
        node("Add", ["before_first", "one"], ["first"]),
        # final state: the last S rows of concat(state, x), from a window of at most 2 S rows
        node("Neg", ["state_columns"], ["minus_state_columns"]),
        node("Slice", ["x_cl", "minus_state_columns", "end", "one"], ["x_tail"]),
        node("Concat", ["state_cl", "x_tail"], ["tail_window"], axis=1),
        node("Slice", ["tail_window", "minus_state_columns", "end", "one"], ["final_cl"]),
        node("Transpose", ["final_cl"], ["final_state_laid"], perm=[0, 2, 1]),
        # R rows a chunk, ceil(L / R) chunks a batch row; iteration i is batch row i // chunks, chunk i % chunks.
        # Its window rows [w_start, w_end) are tabled here, so the body is a few Gathers, not scalar arithmetic
        node("Div", ["chunk_elements", "channels"], ["rows_wanted"]),
        node("Max", ["rows_wanted", "one"], ["rows_at_least_one"]),
        node("Min", ["rows_at_least_one", "length"], ["rows"]),
        node("Add", ["length", "rows"], ["length_plus_rows"]),
        node("Sub", ["length_plus_rows", "one"], ["length_round_up"]),
        node("Div", ["length_round_up", "rows"], ["chunks"]),
        node("Mul", ["batch", "chunks"], ["iterations"]),
        node("Squeeze", ["iterations", "zero"], ["iterations_scalar"]),
        node("Add", ["rows", "width"], ["rows_plus_width"]),
        node("Sub", ["rows_plus_width", "one"], ["span"]),
        node("Squeeze", ["rows", "zero"], ["rows_scalar"]),
        node("Squeeze", ["width", "zero"], ["width_scalar"]),
        int64_scalar("zero_scalar", 0),
        int64_scalar("one_scalar", 1),
        node("Range", ["zero_scalar", "iterations_scalar", "one_scalar"], ["i_all"]),
        node("Unsqueeze", ["i_all", "one"], ["i_column"]),
        node("Div", ["i_column", "chunks"], ["b"]),
        node("Mod", ["i_column", "chunks"], ["chunk"]),
        node("Add", ["b", "one"], ["b_end"]),
        node("Mul", ["chunk", "rows"], ["row0"]),
        node("Add", ["row0", "first"], ["w_start"]),
        node("Add", ["w_start", "span"], ["w_end"]),
        node("Concat", ["b", "w_start"], ["state_starts"], axis=1),
        node("Concat", ["b_end", "w_end"], ["state_ends"], axis=1),
        node("Sub", ["w_start", "state_columns"], ["x_start_raw"]),
        node("Max", ["x_start_raw", "zero"], ["x_start_column"]),
        node("Sub", ["w_end", "state_columns"], ["x_end_raw"]),
        node("Max", ["x_end_raw", "zero"], ["x_end_column"]),
        node("Concat", ["b", "x_start_column"], ["x_starts"], axis=1),
        node("Concat", ["b_end", "x_end_column"], ["x_ends"], axis=1),
        # the window's last row is S + L - 1; a tap past it (the last chunk's padding rows) reads that row
        node("Add", ["state_columns", "length"], ["window_rows"]),
        node("Min", ["w_end", "window_rows"], ["w_end_clipped"]),
        node("Sub", ["w_end_clipped", "w_start"], ["chunk_rows"]),
        node("Sub", ["chunk_rows", "one"], ["last_row"]),
        node("Range", ["zero_scalar", "rows_scalar", "one_scalar"], ["t"]),
        node("Range", ["zero_scalar", "width_scalar", "one_scalar"], ["k"]),
        node("Unsqueeze", ["t", "one"], ["t_column"]),
        node("Add", ["t_column", "k"], ["tap_rows"]),
        node("Unsqueeze", ["last_row", "two"], ["last_row_3d"]),
        node("Min", ["tap_rows", "last_row_3d"], ["tap_indices"]),
        node("Reshape", ["weight", "weight_rows"], ["w_ck"]),
        node("Transpose", ["w_ck"], ["w_kc"], perm=[1, 0]),
        node("Cast", ["w_kc"], ["w_f"], to=_FLOAT),
        node("Cast", ["bias"], ["bias_f"], to=_FLOAT),
        node("Constant", [], ["one_f"], value=helper.make_tensor("one_f", _FLOAT, [], [1.0])),
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
        node_with_refs("Constant", [], ["round_once_int"], {"value_int": ("round_once", onnx.AttributeProto.INT)}),
        node("Cast", ["round_once_int"], ["once"], to=onnx.TensorProto.BOOL),
        # one Loop each way, so that "none" computes no SiLU and "silu" selects none with a Where
        node("If", ["is_silu"], ["y_chunks"], then_branch=_loop_branch(True), else_branch=_loop_branch(False)),
        node("Concat", ["batch", "minus_one", "channels"], ["padded_shape"], axis=0),
        node("Reshape", ["y_chunks", "padded_shape"], ["y_padded"]),  # (B, chunks * R, C)
        node("Slice", ["y_padded", "zero", "length", "one"], ["y_cl"]),
        in_layout("y_cl", "y_laid", "is_channels_first"),
        # y has x's shape and final_state the initial state's: said by a Reshape to them (no data moves), so that a
        # graph whose optimizer inlined this body still proves the shapes after it (docs/shapes.md)
        node("Shape", ["x"], ["x_dims"]),
        node("Reshape", ["y_laid", "x_dims"], ["y"]),
        node("Shape", ["initial_state"], ["state_dims"]),
        node("Reshape", ["final_state_laid", "state_dims"], ["final_state"]),
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
