"""The model-local function of ``ai.mambafuse::MambaChunkScan`` in stock ONNX ops (docs/mamba_chunk_scan.md).

The body is the chunked SSD algorithm, as the exported graphs compute it, so that a fused model run without the
mambafuse library is as fast as the graph it replaced (ONNX Runtime runs it as the Einsums and masks of the
export), and it meets the op's budget because the contract is written for any chunking. T is x's type; the time
step's roundings are Casts to dt's type (T, or float) through ``CastLike``::

    d1 = CastLike(f32(dt) + f32(dt_bias), dt)              # round_T
    d2 = dt_softplus ? Where(d1 > 20, d1, CastLike(Softplus(f32(d1)), dt)) : d1
    d  = Min(Max(f32(d2), f32(CastLike(dt_min, dt))), f32(CastLike(dt_max, dt)))
    a  = f32(A) * d;  u = f32(x) * d;  B, C to float32, from G groups to H heads
    zero-pad the prompt to a multiple of CHUNK tokens (a padded token decays by exp(0) and adds nothing), then per
    chunk of Q tokens with the cumulative sums s of a:
      Y_diag = (exp(s_l - s_j) for j <= l, else 0) * (C_l . B_j) applied to u      # within the chunk
      S_c    = sum_j exp(s_Q - s_j) u_j (x) B_j                                    # the chunk's own state
      the states at the chunk starts: sum over earlier chunks z of exp(sum of the totals between) S_z, from the
      initial state (chunk 0)
      Y_off  = exp(s_l) * C_l . (the state at the chunk's start)
    out = (Y_diag + Y_off)[:T] + f32(D) * f32(x);  final_state = the state after the last chunk

With ``state_layout`` 1 the initial state is transposed from (B, H, N, P) on the way in and the final state back on
the way out (an If on the attribute, which an optimizer folds once the attribute is a constant).

Every input is required (a body cannot test for a missing one): a caller without dt_bias passes -0.0s, without D
zeros, without an initial state zeros.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import helper

from fusion.function._common import in_layout, int64_scalar, int64s, node_with_refs, op_function, require_opset
from fusion.reference.mamba_chunk_scan import OP_TYPE, SOFTPLUS_THRESHOLD

INPUTS = ("x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state")
OUTPUTS = ("out", "final_state")
#: Optional attributes and the defaults the function declares.
OPTIONAL_ATTRIBUTES = {"dt_softplus": 1, "dt_min": 0.0, "dt_max": float("inf"), "state_layout": 0}
#: Lowest ONNX opset the body is written for (CastLike: opset 15).
MIN_OPSET = 15

_FLOAT = onnx.TensorProto.FLOAT
_BOOL = onnx.TensorProto.BOOL
#: The body's chunk length: the (Q, Q) blocks of the exported graphs (transformers' models use 128 or 256); 64 keeps
#: the (B, H, chunks, Q, Q) intermediates a quarter of a 128-token chunk's.
CHUNK = 64


def _lower_mask(size: int, diagonal: int) -> onnx.TensorProto:
    """A (size, size) boolean Constant: True on and below ``diagonal``."""
    mask = np.tril(np.ones((size, size), dtype=bool), diagonal)
    return onnx.numpy_helper.from_array(mask, f"lower_{diagonal}")


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
        # d: dt + dt_bias rounded to dt's type, torch's softplus rounded to it, the limits in it; then float32
        node("Cast", ["dt"], ["dt_f"], to=_FLOAT),
        node("Cast", ["dt_bias"], ["bias_f"], to=_FLOAT),
        node("Add", ["dt_f", "bias_f"], ["d1_sum"]),
        node("CastLike", ["d1_sum", "dt"], ["d1"]),
        node("Cast", ["d1"], ["d1_f"], to=_FLOAT),
        node("Softplus", ["d1_f"], ["soft_f"]),
        node("CastLike", ["soft_f", "dt"], ["soft"]),
        node("Cast", ["soft"], ["soft_t_f"], to=_FLOAT),
        node("Constant", [], ["threshold"], value=helper.make_tensor("t", _FLOAT, [], [SOFTPLUS_THRESHOLD])),
        node("Greater", ["d1_f", "threshold"], ["above"]),
        node("Where", ["above", "d1_f", "soft_t_f"], ["d_soft"]),
        node_with_refs("Constant", [], ["softplus_flag"], {"value_int": ("dt_softplus", constant.INT)}),
        node("Cast", ["softplus_flag"], ["softplus_on"], to=onnx.TensorProto.BOOL),
        node("Where", ["softplus_on", "d_soft", "d1_f"], ["d2"]),
        node_with_refs("Constant", [], ["lo_f"], {"value_float": ("dt_min", constant.FLOAT)}),
        node_with_refs("Constant", [], ["hi_f"], {"value_float": ("dt_max", constant.FLOAT)}),
        node("CastLike", ["lo_f", "dt"], ["lo_t"]),
        node("CastLike", ["hi_f", "dt"], ["hi_t"]),
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
        node("Cast", ["initial_state"], ["state0_laid"], to=_FLOAT),
        # state_layout 1: the states are (B, H, N, P); the body computes in (B, H, P, N)
        node_with_refs("Constant", [], ["layout_flag"], {"value_int": ("state_layout", constant.INT)}),
        node("Cast", ["layout_flag"], ["is_np"], to=onnx.TensorProto.BOOL),
        in_layout("state0_laid", "state0", "is_np", perm=(0, 1, 3, 2)),
        int64s("big", [2**62]),
        # zero-pad the prompt to whole chunks: pad = (CHUNK - T % CHUNK) % CHUNK tokens at the end of axis 1
        int64s("chunk", [CHUNK]),
        int64s("one", [1]),
        int64s("minus_one", [-1]),
        int64s("zeros2", [0, 0]),
        node("Slice", ["x_shape", "one", "two"], ["length"]),
        node("Slice", ["x_shape", "zero", "one"], ["batch"]),
        node("Mod", ["length", "chunk"], ["tail"]),
        node("Sub", ["chunk", "tail"], ["short"]),
        node("Mod", ["short", "chunk"], ["pad"]),
        node("Concat", ["zeros2", "zero", "zero", "pad", "zero"], ["pads3"], axis=0),  # (B, T, H)
        node("Concat", ["zeros2", "zeros2", "zero", "pad", "zeros2"], ["pads4"], axis=0),  # (B, T, H, P|N)
        node("Pad", ["a", "pads3"], ["a_pad"]),
        node("Pad", ["u", "pads4"], ["u_pad"]),
        node("Pad", ["B_heads", "pads4"], ["B_pad"]),
        node("Pad", ["C_heads", "pads4"], ["C_pad"]),
        # chunks: (B, c, Q, H[, P|N])
        node("Slice", ["x_shape", "two", "four"], ["heads_dim"]),
        node("Concat", ["batch", "minus_one", "chunk", "heads"], ["chunk_shape3"], axis=0),
        node("Concat", ["batch", "minus_one", "chunk", "heads_dim"], ["chunk_shape_x"], axis=0),
        node("Concat", ["batch", "minus_one", "chunk", "heads", "state_size"], ["chunk_shape_n"], axis=0),
        node("Reshape", ["a_pad", "chunk_shape3"], ["a_c"]),
        node("Reshape", ["u_pad", "chunk_shape_x"], ["u_c"]),
        node("Reshape", ["B_pad", "chunk_shape_n"], ["B_c"]),
        node("Reshape", ["C_pad", "chunk_shape_n"], ["C_c"]),
        # cumulative sums of a within each chunk: (B, H, c, Q)
        node("Transpose", ["a_c"], ["a_h"], perm=[0, 3, 1, 2]),
        int64_scalar("last_axis", -1),
        node("CumSum", ["a_h", "last_axis"], ["s"]),
        # within a chunk: exp(s_l - s_j) for j <= l, else 0
        node("Unsqueeze", ["s", "minus_one"], ["s_rows"]),
        int64s("minus_two", [-2]),
        node("Unsqueeze", ["s", "minus_two"], ["s_cols"]),
        node("Sub", ["s_rows", "s_cols"], ["s_diff"]),  # (B, H, c, Q, Q): [l, j] = s_l - s_j
        node("Constant", [], ["lower"], value=_lower_mask(CHUNK, 0)),
        node("Constant", [], ["minus_inf"], value=helper.make_tensor("minus_inf", _FLOAT, [], [float("-inf")])),
        node("Where", ["lower", "s_diff", "minus_inf"], ["s_masked"]),
        node("Exp", ["s_masked"], ["decay_in"]),
        node("Einsum", ["C_c", "B_c"], ["scores"], equation="bclhn,bcshn->bhcls"),
        node("Mul", ["scores", "decay_in"], ["weights"]),
        node("Einsum", ["weights", "u_c"], ["y_diag"], equation="bhcls,bcshp->bclhp"),
        # each chunk's own state: sum_j exp(s_Q - s_j) u_j (x) B_j -> (B, c, H, P, N)
        node("Slice", ["s", "minus_one", "big", "minus_one"], ["s_total"]),
        node("Sub", ["s_total", "s"], ["to_end"]),
        node("Exp", ["to_end"], ["decay_out"]),  # (B, H, c, Q)
        node("Transpose", ["decay_out"], ["decay_out_l"], perm=[0, 2, 3, 1]),  # (B, c, Q, H)
        node("Unsqueeze", ["decay_out_l", "minus_one"], ["decay_out_5"]),
        node("Mul", ["B_c", "decay_out_5"], ["B_decayed"]),
        node("Einsum", ["B_decayed", "u_c"], ["chunk_states"], equation="bclhn,bclhp->bchpn"),
        # the states at the chunk starts: chunk z's state carried to chunk c decays by exp(t_c - t_z), t the
        # cumulative chunk totals after a leading 0 (the initial state's position)
        node("Squeeze", ["s_total", "minus_one"], ["totals"]),  # (B, H, c)
        int64s("pad_front", [0, 0, 1, 0, 0, 0]),
        node("Pad", ["totals", "pad_front"], ["totals_0"]),  # (B, H, c + 1)
        node("CumSum", ["totals_0", "last_axis"], ["t"]),
        node("Unsqueeze", ["t", "minus_one"], ["t_rows"]),
        node("Unsqueeze", ["t", "minus_two"], ["t_cols"]),
        node("Sub", ["t_rows", "t_cols"], ["t_diff"]),  # (B, H, c + 1, c + 1): [c, z] = t_c - t_z
        node("Shape", ["t_diff"], ["t_shape"]),
        node("Slice", ["t_shape", "minus_two", "big"], ["square"]),
        node(
            "ConstantOfShape", ["square"], ["ones"], value=helper.make_tensor("one", onnx.TensorProto.BOOL, [1], [True])
        ),
        int64_scalar("zero_scalar", 0),
        node("Trilu", ["ones", "zero_scalar"], ["earlier"], upper=0),
        node("Where", ["earlier", "t_diff", "minus_inf"], ["t_masked"]),
        node("Exp", ["t_masked"], ["carry"]),
        node("Unsqueeze", ["state0", "one"], ["state0_c"]),  # (B, 1, H, P, N)
        node("Concat", ["state0_c", "chunk_states"], ["states_from"], axis=1),
        node("Einsum", ["carry", "states_from"], ["states_at"], equation="bhcz,bzhpn->bchpn"),
        node("Slice", ["states_at", "zero", "minus_one", "one"], ["starts"]),  # (B, c, H, P, N)
        node("Gather", ["states_at", "last_axis"], ["final_state_pn"], axis=1),  # (B, H, P, N)
        in_layout("final_state_pn", "final_state_gathered", "is_np", perm=(0, 1, 3, 2)),
        # from the chunk's start state: exp(s_l) C_l . S
        node("Einsum", ["C_c", "starts"], ["read"], equation="bclhn,bchpn->bclhp"),
        node("Exp", ["s"], ["decay_start"]),
        node("Transpose", ["decay_start"], ["decay_start_l"], perm=[0, 2, 3, 1]),
        node("Unsqueeze", ["decay_start_l", "minus_one"], ["decay_start_5"]),
        node("Mul", ["read", "decay_start_5"], ["y_off"]),
        node("Add", ["y_diag", "y_off"], ["y_chunks"]),
        node("Concat", ["batch", "minus_one", "heads_dim"], ["token_shape"], axis=0),
        node("Reshape", ["y_chunks", "token_shape"], ["y_padded"]),
        node("Slice", ["y_padded", "zero", "length", "one"], ["y"]),
        # the skip: f32(D) * f32(x)
        node("Cast", ["D"], ["D_f"], to=_FLOAT),
        node("Unsqueeze", ["D_f", "axes013"], ["D4"]),  # (1, 1, H, 1)
        node("Mul", ["D4", "x_f"], ["skip"]),
        node("Add", ["y", "skip"], ["out_sum"]),
        # out has x's shape and final_state the initial state's: said by a Reshape to them (no data moves), so that a
        # graph whose optimizer inlined this body still proves the shapes after it (docs/shapes.md)
        node("Reshape", ["out_sum", "x_shape"], ["out"]),
        node("Shape", ["initial_state"], ["state_dims"]),
        node("Reshape", ["final_state_gathered", "state_dims"], ["final_state"]),
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
