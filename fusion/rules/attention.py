"""Fuse a decode step's grouped-query attention into ONNX Runtime's ``com.microsoft::GroupQueryAttention``.

Used by ``mambafuse optimize`` only (the op is ONNX Runtime's contrib op, with no model-local function:
a model using it needs ONNX Runtime). The chain, as torch's dynamo exporter writes an attention layer
without rotary embedding (Nemotron-H) for one new token, after onnxscript's ORT fusions::

    q       = Transpose(Reshape(MatMul(h, Wq) (B, 1, Hq*D), [B, 1, Hq, D]), [0, 2, 1, 3])   # k, v alike, Hkv
    present = Concat(past (B, Hkv, P, D), k, axis=2)                                   # a graph output
    k_rep   = Reshape(Expand(Unsqueeze(present_k, 2), [B, Hkv, n, T, D]), [B, Hkv*n, T, D])  # v_rep alike
    scores  = Mul(MatMul(q, Transpose(k_rep, [0, 1, 3, 2])), scale)    [or FusedMatMul(q, k_rep, transB=1)]
    mask    = Where(LessOrEqual(Range(0, P + 1, 1), 0 + P), 0, min)    [through layout ops]
    y       = Reshape(Transpose(MatMul(Softmax(Add(scores, mask)), v_rep), [0, 2, 1, 3]), [B, 1, Hq*D])

What ``check`` proves from the graph (declared shapes of intermediate values are never read; the graph
inputs' declared shapes are the model's interface):

* the head split: q/k/v's projections (MatMul by a 2-D weight, or an int4 model's MatMulNBits, or either as
  DecodeMatMul / DecodeMatMulNBits) are (B, 1, Hq*D) / (B, 1, Hkv*D) with S = 1 and Hq*D, Hkv*D ints,
  their Reshapes proven (B, 1, H, D), so the row-major Reshape is the split of the last axis into heads;
  the three projections read the same h (one batch for all);
* the cache: each present is Concat(past, new) along axis 2, past a graph input, present a graph output
  that nothing else reads; the Concat proves the past's (B, Hkv, D) to be the new key's;
* the group mapping: Unsqueeze at axis 2, Expand to (B, Hkv, n, T, D), Reshape to (B, Hkv*n, T, D)
  (shape tensors resolved with the cache's proven dims) is repeat_interleave: query head h reads kv
  head h // n, GroupQueryAttention's mapping; any other spelling (tile) is refused;
* the mask: every element 0 for every P: ``Range(0, P + 1, 1) <= 0 + P`` with one P value on both sides
  (integers, constant start 0 and step 1, constant 1 and all-zero offsets), Where's chosen branch a
  constant 0, and its proven dims 1 except the last, so adding it leaves the scores as they are;
* the scale: a one-element constant (times FusedMatMul's alpha);
* the output merge: Transpose [0, 2, 1, 3] then a Reshape proven (B, 1, Hq*D);
* the type: float16 or bfloat16 throughout. float32 is refused: ONNX Runtime's CUDA GroupQueryAttention
  has no float32 kernel, so under CUDA the fused node would run on the CPU.

The fused node reads the MatMul outputs as packed (B, 1, H*D) query/key/value, the past caches as BNSH,
seqlens_k = P and total_sequence_length = P + 1 (int32, from Shape(past_key)), and writes the present
caches under their graph output names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.rules._decode import PlannedRule, Refusal, apply_with_log, dtype_name, layout_source, replace_graph_output
from fusion.rules._log import FusionLog
from fusion.shapes import arith as _arith
from fusion.shapes.dims import (
    Dim,
    ForwardShapes,
    as_expression,
    constant_array,
    dims_equal,
    format_dims,
    resolve_shape_tensor,
)

FORM = "decode attention"
CONTRIB_DOMAIN = "com.microsoft"
HALF_DTYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_ONNX = ("", "ai.onnx")
_INT_DTYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    query: ir.Value
    key: ir.Value
    value: ir.Value
    past_key: ir.Value
    past_value: ir.Value
    present_key: ir.Value
    present_value: ir.Value
    num_heads: int
    kv_num_heads: int
    scale: float
    leftovers: list[ir.Value]
    attributes: dict[str, Any]


def _op(value: ir.Value | None, *op_types: str, domain: tuple[str, ...] = _ONNX) -> ir.Node | None:
    producer = value.producer() if value is not None else None
    if producer is None or producer.domain not in domain or producer.op_type not in op_types:
        return None
    return producer


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return None if attr is None else [int(v) for v in attr.as_ints()]


def _axes(node: ir.Node) -> list[int] | None:
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        return None if array is None else [int(v) for v in array.reshape(-1)]
    attr = node.attributes.get("axes")
    return None if attr is None else [int(v) for v in attr.as_ints()]


def _constant_equal(value: ir.Value | None, number: float) -> bool:
    """Whether ``value`` is a constant (of any size but 0) whose every element is ``number``."""
    array = constant_array(value)
    return array is not None and array.size >= 1 and bool(np.all(array == number))


#: Ops whose output 0 has input 0's shape (ONNX's, and ORT's normalizations with their contrib schemas).
_SAME_SHAPE_OPS = frozenset({"Cast", "Identity", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"})


#: The weight products a projection is written as: ONNX's MatMul by a 2-D weight, ORT's 4-bit MatMulNBits (an
#: int4-quantized model's), and this project's DecodeMatMul / DecodeMatMulNBits (the same products).
_PROJECTIONS = {("MatMul", ""), ("MatMul", "ai.onnx"), ("MatMulNBits", CONTRIB_DOMAIN)}
_PROJECTIONS |= {("DecodeMatMul", "ai.mambafuse"), ("DecodeMatMulNBits", "ai.mambafuse")}


def _projection_columns(node: ir.Node | None, shapes: ForwardShapes) -> Dim | None:
    """Return N when ``node`` is a product of its input 0 by a (K, N) weight (``_PROJECTIONS``), else None."""
    if node is None or (node.op_type, node.domain) not in _PROJECTIONS or len(node.inputs) < 2:
        return None
    if node.op_type.endswith("NBits"):
        columns = node.attributes.get_int("N", 0)
        return columns if columns > 0 else None
    weight = shapes(node.inputs[1])
    return weight[1] if weight is not None and len(weight) == 2 else None


def _partial_dims(value: ir.Value | None, shapes: ForwardShapes, depth: int = 0) -> list[Dim] | None:
    """Return ``value``'s dims where ForwardShapes proves them, else per axis through a few ops: a dim is kept
    (None when not proven) where ForwardShapes gives up on the whole value.

    Broadcasting Add/Sub/Mul: an axis is d when both are d, or when one is an int above 1 (the other is that
    or 1, or the op fails); else unknown. MatMul by a 2-D weight (N columns): the input's leading dims, N.
    """
    dims = shapes(value)
    if dims is not None or value is None or depth > 24:
        return dims
    producer = value.producer()
    if producer is None or value.index() != 0:
        return None
    op = producer.op_type
    if op in _SAME_SHAPE_OPS and producer.domain in (*_ONNX, CONTRIB_DOMAIN):
        return _partial_dims(producer.inputs[0], shapes, depth + 1)
    columns = _projection_columns(producer, shapes)
    if columns is not None:
        source = _partial_dims(producer.inputs[0], shapes, depth + 1)
        return None if source is None or len(source) < 2 else [*source[:-1], columns]
    if producer.domain not in _ONNX:
        return None
    if op in ("Add", "Sub", "Mul") and len(producer.inputs) == 2:
        left, right = (_partial_dims(v, shapes, depth + 1) for v in producer.inputs)
        if left is None or right is None:
            return None
        rank = max(len(left), len(right))
        left, right = [1] * (rank - len(left)) + left, [1] * (rank - len(right)) + right
        merged: list[Dim] = []
        for a, b in zip(left, right, strict=True):
            if dims_equal(a, b) or (isinstance(a, int) and a > 1):
                merged.append(a)
            elif isinstance(b, int) and b > 1:
                merged.append(b)
            else:
                merged.append(None)
        return merged
    return None


class GroupQueryAttentionFusion(PlannedRule):
    """Rewrites one decode attention (no rotary, one new token) into a GroupQueryAttention node."""

    FORM = FORM

    def __init__(self, name: str, *, fused_matmul: bool, scaled: bool) -> None:
        super().__init__(name)
        self._fused_matmul = fused_matmul
        #: a Mul by the scale after the product (else the scale is FusedMatMul's alpha, or 1)
        self._scaled = scaled

    def pattern(self, op, q, k_rep, v_rep, scale, mask, out_shape):
        if self._fused_matmul:
            scores = op.FusedMatMul(q, k_rep, _domain=CONTRIB_DOMAIN, _outputs=["scores"])
        else:
            scores = op.MatMul(q, op.Transpose(k_rep, _outputs=["k_t"]), _outputs=["scores"])
        scaled = op.Mul(scores, scale, _outputs=["scaled"]) if self._scaled else scores
        probs = op.Softmax(op.Add(scaled, mask, _outputs=["masked"]), _outputs=["probs"])
        ctx = op.MatMul(probs, v_rep, _outputs=["ctx"])
        return op.Reshape(op.Transpose(ctx, _outputs=["ctx_t"]), out_shape, _outputs=["y"])

    def check(self, context, q, k_rep, v_rep, mask, out_shape, scores, masked, probs, ctx, ctx_t, y, **b):
        result = pattern.MatchResult()
        anchor = scores.producer()
        scale, scaled = (b.get("scale"), b.get("scaled")) if self._scaled else (None, scores)
        try:
            self._plan = self._make_plan(
                anchor, q, k_rep, v_rep, scale, mask, scores, scaled, masked, probs, ctx, ctx_t, y
            )
        except Refusal as refusal:
            return self.refused(result, anchor, refusal)
        return result

    # --- the proof ---------------------------------------------------------------------------------

    def _make_plan(self, anchor, q, k_rep, v_rep, scale, mask, scores, scaled, masked, probs, ctx, ctx_t, y) -> _Plan:
        if self._shapes is None:
            self._shapes = ForwardShapes(anchor.graph)
        shapes = self._shapes
        t = q.dtype
        if t == ir.DataType.FLOAT:
            raise Refusal(
                "the attention runs in float32: ONNX Runtime's CUDA GroupQueryAttention has no float32 kernel, "
                "so under CUDA the fused node would run on the CPU (float16 and bfloat16 are fused)",
                q,
            )
        if t not in HALF_DTYPES:
            raise Refusal(f"the attention runs in {dtype_name(t)}, not float16/bfloat16", q)
        for name, value in (("k", k_rep), ("v", v_rep), ("the scores", scores), ("the mask", mask), ("y", y)):
            if value.dtype != t:
                raise Refusal(f"{name} is {dtype_name(value.dtype)}, q is {dtype_name(t)}", value)
        softmax = probs.producer()
        if softmax.attributes.get_int("axis", -1) not in (-1, 3):
            raise Refusal("the Softmax is not along the last axis", softmax)
        alpha = self._scores(anchor)
        scale_value = alpha
        if scale is not None:
            scale_data = constant_array(scale)
            if scale_data is None or scale_data.size != 1:
                raise Refusal("the scores' scale is not a one-element constant", scale)
            scale_value *= float(scale_data.reshape(-1)[0].astype(np.float32))
        if not np.isfinite(scale_value) or scale_value == 0:
            raise Refusal(f"the scale {scale_value} is not a finite non-zero number", scale)

        q_lin, num_heads, head_size, batch = self._heads(q, shapes, "q")
        present_key, past_key, k_lin, kv_num_heads = self._cache(k_rep, q_lin, head_size, shapes, "key")
        present_value, past_value, v_lin, kv_heads_v = self._cache(v_rep, q_lin, head_size, shapes, "value")
        if batch is None:
            # q, k and v project one hidden state (one batch), and each Concat proves its past's batch to be
            # its new key's: the past key's batch dim (the model's interface) is the batch of them all
            past_dims = ForwardShapes(None)(past_key)
            batch = past_dims[0] if past_dims else None
            if batch is None:
                raise Refusal("the batch is not proven: neither the projections' nor the past key's", past_key)
        if kv_heads_v != kv_num_heads:
            raise Refusal(f"the value cache has {kv_heads_v} heads, the key cache {kv_num_heads}", v_rep)
        if num_heads % kv_num_heads:
            raise Refusal(f"{num_heads} query heads are not a multiple of {kv_num_heads} kv heads", q)
        group = num_heads // kv_num_heads
        for name, rep, present, past in (("k", k_rep, present_key, past_key), ("v", v_rep, present_value, past_value)):
            self._repeat(rep, present, past, batch, kv_num_heads, group, head_size, name)
        self._mask(mask, batch, shapes)
        self._output(ctx_t, y, batch, num_heads, head_size, shapes)

        chain_values = [scores, scaled, masked, probs, ctx, ctx_t, k_rep, v_rep, q]
        if anchor.op_type == "MatMul":
            chain_values.append(anchor.inputs[1])
        for value in chain_values:
            if value.is_graph_output() or len(value.uses()) != 1:
                raise Refusal(f"{value.name!r} is also read outside the attention", value)
        return _Plan(
            anchor=anchor,
            query=q_lin,
            key=k_lin,
            value=v_lin,
            past_key=past_key,
            past_value=past_value,
            present_key=present_key,
            present_value=present_value,
            num_heads=num_heads,
            kv_num_heads=kv_num_heads,
            scale=scale_value,
            leftovers=[present_key, present_value, scores, ctx, y, q],
            attributes={
                "num_heads": num_heads,
                "kv_num_heads": kv_num_heads,
                "head_size": head_size,
                "dtype": dtype_name(t),
            },
        )

    def _scores(self, node: ir.Node) -> float:
        """Check the scores product is q times k_rep transposed on its last two axes; return its alpha."""
        if node.op_type == "MatMul":
            transpose = node.inputs[1].producer()
            if _perm(transpose) != [0, 1, 3, 2]:
                raise Refusal(f"k is transposed by {_perm(transpose)}, not [0, 1, 3, 2]", transpose)
            return 1.0
        attrs = node.attributes
        flags = {name: attrs.get_int(name, 0) for name in ("transA", "transB", "transBatchA", "transBatchB")}
        if flags != {"transA": 0, "transB": 1, "transBatchA": 0, "transBatchB": 0}:
            raise Refusal(f"the FusedMatMul's transposes are {flags}, not q times k transposed", node)
        return float(attrs.get_float("alpha", 1.0))

    def _heads(self, q: ir.Value, shapes: ForwardShapes, what: str) -> tuple[ir.Value, int, int, Dim]:
        """Prove ``q = Transpose(Reshape(lin (B, 1, H*D), (B, 1, H, D)), [0, 2, 1, 3])``; return lin, H, D, B."""
        producer = q.producer()
        if producer is not None and producer.op_type == "RotaryEmbedding":
            raise Refusal(
                f"{what} has a rotary embedding: this rule fuses attention without rotary (do_rotary=0); "
                "onnxscript's GroupQueryAttention rule covers rotary attention",
                q,
            )
        transpose = _op(q, "Transpose")
        if transpose is None or _perm(transpose) != [0, 2, 1, 3]:
            made_by = "a graph input" if producer is None else f"made by {producer.op_type}"
            raise Refusal(
                f"{what} is {made_by}, not a Transpose [0, 2, 1, 3] of its projection's heads (an unfused rotary "
                "embedding, when there is one, is not fused: GroupQueryAttention is written with do_rotary=0)",
                q,
            )
        split = transpose.inputs[0]
        reshape = _op(split, "Reshape")
        if reshape is None:
            raise Refusal(f"{what}'s heads are not a Reshape of its projection", split)
        lin = reshape.inputs[0]
        lin_dims, split_dims = _partial_dims(lin, shapes), shapes(split)
        if lin_dims is None or len(lin_dims) != 3 or lin_dims[1] != 1 or not isinstance(lin_dims[2], int):
            raise Refusal(f"{what}'s projection is not proven (B, 1, H*D): {format_dims(lin_dims)}", lin)
        if (
            split_dims is None
            or len(split_dims) != 4
            or split_dims[1] != 1
            or not all(isinstance(d, int) for d in split_dims[2:])
        ):
            raise Refusal(f"{what}'s heads are not proven (B, 1, H, D): {format_dims(split_dims)}", split)
        heads, head_size = int(split_dims[2]), int(split_dims[3])
        if heads * head_size != lin_dims[2]:
            raise Refusal(f"{what}'s heads {heads} x {head_size} are not its width {lin_dims[2]}", split)
        # A row-major Reshape of (B, 1, H*D) to (R, 1, H, D) keeps the element count: R = B, the head split.
        return lin, heads, head_size, lin_dims[0]

    def _cache(self, rep, q_lin, head_size, shapes, what):
        """Prove the present cache the repeat chain reads: Concat(past, new, axis 2), a graph output."""
        present = layout_source(rep)
        concat = _op(present, "Concat")
        if concat is None or len(concat.inputs) != 2 or concat.attributes.get_int("axis", 0) not in (2, -2):
            raise Refusal(f"the {what} heads are not read from Concat(past, new, axis=2)", rep)
        past, new = concat.inputs
        if not past.is_graph_input():
            raise Refusal(f"the past {what} is not a graph input", past)
        if not present.is_graph_output():
            raise Refusal(f"the present {what} is not a graph output", present)
        if len(present.uses()) != 1:
            raise Refusal(f"the present {what} is read by other nodes too", present)
        lin, heads, new_head_size, _ = self._heads(new, shapes, f"the new {what}")
        if new_head_size != head_size:
            raise Refusal(f"the {what} head size is {new_head_size}, the query's {head_size}", new)
        if not _same_input_projection(lin, q_lin):
            raise Refusal(f"the {what} and the query are not projections of the same hidden state", lin)
        if len(new.uses()) != 1 or len(lin.uses()) != 1:
            raise Refusal(f"the new {what} is read outside the attention", new)
        return present, past, lin, heads

    def _repeat(self, rep, present, past, batch, kv_heads, group, head_size, what) -> None:
        """Prove ``rep`` is repeat_interleave of the present's heads by ``group`` along axis 1."""
        reshape = _op(rep, "Reshape")
        expand = _op(reshape.inputs[0], "Expand") if reshape is not None else None
        unsqueeze = _op(expand.inputs[0], "Unsqueeze") if expand is not None else None
        if unsqueeze is None or unsqueeze.inputs[0] is not present:
            raise Refusal(f"{what}'s heads are not Reshape(Expand(Unsqueeze(present)))", rep)
        axes = _axes(unsqueeze)
        if axes not in ([2], [-3]):
            raise Refusal(
                f"{what}'s heads are repeated by Unsqueeze at {axes}, not at axis 2: query head h would "
                "not read kv head h // n (repeat_interleave), GroupQueryAttention's mapping",
                unsqueeze,
            )
        # the present's dims: the Concat proves the past's (B, Hkv, -, D) to be the new key's
        past_dims = ForwardShapes(None)(past)
        if past_dims is None or len(past_dims) != 4:
            raise Refusal(f"the past {what} is not 4-D", past)
        length = as_expression(past_dims[2])
        total = None if length is None else _arith.add(length, as_expression(1))
        if total is None:
            raise Refusal(f"the past {what}'s length is not a dim", past)
        aliases = {
            past: [batch, kv_heads, past_dims[2], head_size],
            present: [batch, kv_heads, total, head_size],
            unsqueeze.outputs[0]: [batch, kv_heads, 1, total, head_size],
        }
        proven = self._shapes.aliases(aliases)
        target = resolve_shape_tensor(expand.inputs[1], proven)
        source = aliases[unsqueeze.outputs[0]]
        if target is None or len(target) != 5:
            raise Refusal(f"{what}'s Expand target is not proven: {format_dims(target)}", expand)
        expanded = []
        for axis, (s, d) in enumerate(zip(source, target, strict=True)):
            if axis == 2:
                expanded.append(d)
            elif dims_equal(d, 1) or dims_equal(d, s):
                expanded.append(s)
            else:
                raise Refusal(f"{what}'s Expand target {format_dims(target)} changes axis {axis}", expand)
        if expanded[2] != group:
            raise Refusal(f"{what}'s heads are repeated {format_dims([expanded[2]])} times, not {group}", expand)
        out = resolve_shape_tensor(reshape.inputs[1], proven)
        allowzero = reshape.attributes.get_int("allowzero", 0)
        if out is not None and not allowzero:
            out = [expanded[i] if dims_equal(d, 0) else d for i, d in enumerate(out)]
        wanted = [batch, kv_heads * group, total, head_size]
        if out is None or len(out) != 4 or not all(dims_equal(a, b) for a, b in zip(out, wanted, strict=True)):
            raise Refusal(f"{what}'s heads are reshaped to {format_dims(out)}, not {format_dims(wanted)}", reshape)
        for value in (unsqueeze.outputs[0], expand.outputs[0]):
            if value.is_graph_output() or len(value.uses()) != 1:
                raise Refusal(f"{value.name!r} is also read outside the attention", value)

    def _mask(self, mask: ir.Value, batch: Dim, shapes: ForwardShapes) -> None:
        """Prove the mask is 0 everywhere for every past length, and cannot broadcast the scores wider."""
        dims = shapes(mask)
        if (
            dims is None
            or len(dims) != 4
            or not (dims_equal(dims[0], 1) or dims_equal(dims[0], batch))
            or not all(dims_equal(d, 1) for d in dims[1:3])
        ):
            raise Refusal(f"the mask's dims are not proven (1 or B, 1, 1, T): {format_dims(dims)}", mask)
        where = _op(layout_source(mask), "Where")
        if where is None:
            raise Refusal("the mask is not a Where", mask)
        condition, chosen, _ = where.inputs
        if not _constant_equal(chosen, 0) or constant_array(chosen).size != 1:
            raise Refusal("the mask's kept positions are not a constant 0", where)
        compare = _op(layout_source(condition), "LessOrEqual")
        if compare is None:
            raise Refusal("the mask's condition is not LessOrEqual(kv index, query position)", where)
        kv_index, position = (layout_source(v) for v in compare.inputs)
        arange = _op(kv_index, "Range")
        if arange is None or kv_index.dtype not in _INT_DTYPES:
            raise Refusal("the mask's kv index is not an integer Range", compare)
        start, limit, delta = arange.inputs
        if not (_constant_equal(start, 0) and _constant_equal(delta, 1)):
            raise Refusal("the mask's kv index Range does not start at 0 with step 1", arange)
        past_len = _plus_constant(limit, 1)
        if past_len is None:
            raise Refusal("the mask's kv index Range does not end at P + 1", arange)
        if _plus_constant(position, 0) is not past_len:
            raise Refusal(
                "the mask's query position is not 0 + P with the Range's own P: it can mask positions", compare
            )

    def _output(self, ctx_t, y, batch, num_heads, head_size, shapes) -> None:
        transpose = ctx_t.producer()
        if _perm(transpose) != [0, 2, 1, 3]:
            raise Refusal(f"the heads are merged after Transpose {_perm(transpose)}, not [0, 2, 1, 3]", transpose)
        reshape = y.producer()
        dims = shapes(y)
        ctx = transpose.inputs[0]
        aliases = shapes.aliases({ctx: [batch, num_heads, 1, head_size], ctx_t: [batch, 1, num_heads, head_size]})
        target = resolve_shape_tensor(reshape.inputs[1], aliases)
        if target is not None and not reshape.attributes.get_int("allowzero", 0):
            target = [([batch, 1, num_heads][i] if dims_equal(d, 0) else d) for i, d in enumerate(target)]
        width = num_heads * head_size
        if (
            target is not None
            and [dims_equal(d, w) for d, w in zip(target, [batch, 1, -1], strict=False)] == [True] * 3
        ):
            target = [batch, 1, width]  # -1 is the element count's rest: Hq*D when the other two are B and 1
        wanted = [batch, 1, width]
        proven = [target, dims]
        if not any(p is not None and len(p) == 3 and all(map(dims_equal, p, wanted)) for p in proven):
            raise Refusal(f"the heads are merged to {format_dims(target)}, not {format_dims(wanted)}", reshape)

    # --- the rewrite ------------------------------------------------------------------------------

    def rewrite(self, op, **_: Any):
        plan = self.take_plan()
        past_len = op.Shape(plan.past_key, start=2, end=3)  # (1,) int64: P
        batch = op.Shape(plan.query, start=0, end=1)
        seqlens_k = op.Cast(op.Expand(past_len, batch), to=ir.DataType.INT32)  # (B,): total - 1
        one = op.Constant(value=ir.tensor(np.array([1], dtype=np.int64)))
        total = op.Cast(op.Squeeze(op.Add(past_len, one)), to=ir.DataType.INT32)  # scalar: P + 1
        output, present_key, present_value = op.GroupQueryAttention(
            plan.query,
            plan.key,
            plan.value,
            plan.past_key,
            plan.past_value,
            seqlens_k,
            total,
            _domain=CONTRIB_DOMAIN,
            _version=1,
            _outputs=3,
            num_heads=plan.num_heads,
            kv_num_heads=plan.kv_num_heads,
            scale=plan.scale,
            do_rotary=0,
        )
        replace_graph_output(plan.present_key, present_key)
        replace_graph_output(plan.present_value, present_value)
        return output


def _plus_constant(value: ir.Value, number: int) -> ir.Value | None:
    """Return P when ``value`` is Add(P, c) or Add(c, P) with c an integer constant, every element ``number``."""
    add = _op(value, "Add")
    if add is None or value.dtype not in _INT_DTYPES:
        return None
    left, right = add.inputs
    if _constant_equal(right, number) and constant_array(left) is None:
        return layout_source(left)
    if _constant_equal(left, number) and constant_array(right) is None:
        return layout_source(right)
    return None


def _same_input_projection(a: ir.Value, b: ir.Value) -> bool:
    """Whether ``a`` and ``b`` are weight products (``_PROJECTIONS``) of one input (so their leading dims are
    one)."""
    nodes = [a.producer(), b.producer()]
    if any(_projection_columns(node, ForwardShapes(None)) is None for node in nodes):
        return False
    return nodes[0].inputs[0] is nodes[1].inputs[0]  # type: ignore[union-attr]


group_query_attention_rules = pattern.RewriteRuleSet(
    [
        GroupQueryAttentionFusion.rule(
            f"GroupQueryAttention[{product}{' * scale' if scaled else ''}]", fused_matmul=fused, scaled=scaled
        )
        for product, fused in (("MatMul", False), ("FusedMatMul", True))
        for scaled in (True, False)
    ],
    commute=True,
)
group_query_attention_rules.remove_unused_nodes = False


def fuse_group_query_attention(model: ir.Model, log: FusionLog | None = None) -> int:
    """Fuse every decode attention of ``model`` in place; return how many were fused."""
    return apply_with_log(group_query_attention_rules, model, log)


__all__ = ["GroupQueryAttentionFusion", "fuse_group_query_attention", "group_query_attention_rules"]
