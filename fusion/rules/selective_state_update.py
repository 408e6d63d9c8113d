"""Fuse the Mamba-2 decode state update into ``ai.mambafuse::SelectiveStateUpdate``.

The chain, as transformers' ``mamba2_selective_state_update`` torch fallback exports it (dynamo optimized
and not, transformers' exporter with and without ORT's fusions; docs/forms.md)::

    dt_e  = Expand(Transpose(dt_src (B, 1, H)), [.., P])            # (B, H, P), layout ops only
    v     = Add(dt_e, dt_bias as (H, P))                             # T
    d     = Where(v > 20, v, Softplus(v))                            # T; [Mul(v, 1)], [Div(.., 1)] seen through
    dt_u  = Unsqueeze(d, -1)                                         # (B, H, P, 1)
    dA    = Exp(Mul([Cast f32](dt_u), A as (H, P, N)))               # float32
    dB    = Mul(dt_u, B_h)            B_h = groups of B_src to heads (Reshape/Expand/Reshape)  # T
    dBx   = Mul(dB, Unsqueeze(x, -1))                                # T
    new   = Add(Mul([Cast f32](state), dA), [Cast f32](dBx))         # float32
    present = new | Cast(new, S) | CastLike(new, state)              # a graph output, dtype S
    s_t   = [Cast T](present or new)
    y     = Reshape(MatMul(rows of s_t (B*H, P, N), rows of C_h (B*H, N, 1)), (B, H, P))   # T
    out   = Add(y, Mul(x, D as (H, P)))                              # T  <- the pattern's root

The pattern is the readout's tail (Reshape(MatMul) + skip); ``check`` walks the rest and proves it:
every layout (dt's broadcast, the group mapping of B and C, the MatMul rows, the output Reshape) by
emulating it on index arrays (``_decode.emulate``), A / dt_bias / D constant per head, the rounding points
from the graph's Casts and dtypes. The op's own model-local body, inlined by an optimizer, is proven the
same way: its d is (B, H) with a constant ``dt_softplus`` flag choosing softplus(v) or v, its skip is
round_T(f32(x) * f32(D)), and its same-type Casts are identities. Anything else is refused with the
reason. The present state keeps its graph output name; the fused node writes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.reference.selective_state_update import DOMAIN, SOFTPLUS_THRESHOLD
from fusion.rules._decode import (
    BATCH_SAMPLES,
    LAYOUT_OPS,
    Batch,
    DecodeShapes,
    PlannedRule,
    Refusal,
    apply_with_log,
    batch_blocked,
    dtype_name,
    emulate,
    int_dims,
    is_batch_symbol,
    layout_source,
    leaf_indices,
    outside_readers,
    per_head,
    producer_op,
    replace_graph_output,
    type_untyped_values,
)
from fusion.rules._log import FusionLog, location
from fusion.shapes.dims import ForwardShapes, constant_array, constant_scalar

FORM = "decode"
SUPPORTED_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
#: Lowest ONNX opset of a model whose chains are fused (the function body's CastLike).
MIN_OPSET = 15
_F32 = ir.DataType.FLOAT


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    state: ir.Value
    x: ir.Value
    dt_src: ir.Value
    dt_bias: tuple[ir.Value | None, np.ndarray | None]
    A: tuple[ir.Value | None, np.ndarray | None]
    B_src: ir.Value
    C_src: ir.Value
    D: tuple[ir.Value | None, np.ndarray | None]
    #: D's type: x's, or float32 where the op's own body reads a float D widened
    D_type: ir.DataType
    dt_softplus: int
    heads: int
    groups: int
    state_size: int
    present: ir.Value
    leftovers: list[ir.Value]
    attributes: dict[str, Any]


class _SymbolicBatch(Exception):
    """x's batch is a symbol: the proof is run at ``BATCH_SAMPLES`` with it bound."""

    def __init__(self, symbol: object) -> None:
        super().__init__(symbol)
        self.symbol = symbol


def _producer(value: ir.Value | None, *ops: str) -> ir.Node | None:
    return value.producer() if producer_op(value) in ops else None


def _operands(node: ir.Node) -> tuple[ir.Value, ir.Value]:
    return node.inputs[0], node.inputs[1]


def _through_casts(value: ir.Value, allowed: set[ir.DataType], limit: int = 2) -> tuple[ir.Value, list[ir.Node]]:
    """Follow Cast/CastLike producers (each to a type in ``allowed``) back; return the source and the Casts."""
    casts = []
    while len(casts) < limit:
        node = _producer(value, "Cast", "CastLike")
        if node is None:
            break
        if value.dtype not in allowed:
            raise Refusal(f"a Cast to {dtype_name(value.dtype)} between the new state and the readout", node)
        casts.append(node)
        value = node.inputs[0]
    return value, casts


def _scalar(value: ir.Value | None) -> float | None:
    """Return a one-element constant, also through Cast / CastLike (20 and 1 are exact in every float type)."""
    node = _producer(value, "Cast", "CastLike")
    if node is not None:
        inner = _scalar(node.inputs[0])
        return inner if inner in (1.0, SOFTPLUS_THRESHOLD) else None
    return constant_scalar(value)


def _is_one(value: ir.Value | None) -> bool:
    """Whether ``value`` is the constant 1 (also through Cast / CastLike: 1 in every float type)."""
    return _scalar(value) == 1.0


def _identity_of(value: ir.Value) -> ir.Value:
    """See through Mul(v, 1) and Div(v, 1) (dynamo's softplus with beta = 1): exact identities."""
    node = _producer(value, "Mul", "Div")
    if node is not None and len(node.inputs) == 2:
        a, b = _operands(node)
        if _is_one(b):
            return a
        if node.op_type == "Mul" and _is_one(a):
            return b
    return value


class SelectiveStateUpdateFusion(PlannedRule):
    """Rewrites one decode state update (and its readout) into a SelectiveStateUpdate node."""

    def __init__(self, name: str, *, skip_first: bool) -> None:
        super().__init__(name)
        self._skip_first = skip_first
        #: while a symbolic batch is proven: its size in this run, and the layout steps emulated
        self._batch: Batch | None = None
        self._trace: list[tuple[object, tuple[int, ...]]] | None = None

    def pattern(self, op, s_rows, c_rows, y_shape, skip):
        y = op.Reshape(op.MatMul(s_rows, c_rows, _outputs=["bmm"]), y_shape, _outputs=["y"])
        return op.Add(skip, y) if self._skip_first else op.Add(y, skip)

    def check(self, context, s_rows, c_rows, skip, bmm, y, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        try:
            self._plan = self._make_plan(s_rows, c_rows, skip, bmm, y)
        except Refusal as refusal:
            return self.refused(result, getattr(refusal, "anchor", None), refusal)
        return result

    # the proof --------------------------------------------------------------------------------------

    def _make_plan(self, s_rows, c_rows, skip, bmm, y) -> _Plan:
        graph = y.graph
        if self._shapes is None:
            type_untyped_values(graph)
            self._shapes = DecodeShapes(graph)
        shapes = self._shapes
        # Find the state update behind the readout: the float32 Add of the decayed state and dBx.
        s_t = layout_source(s_rows)
        t = s_t.dtype
        new, readout_casts = _through_casts(s_t, {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
        add = _producer(new, "Add")
        decayed, dbx32, exp_node = None, None, None
        if add is not None:
            for first, second in (_operands(add), _operands(add)[::-1]):
                mul = _producer(first, "Mul")
                if mul is None:
                    continue
                for a, b in (_operands(mul), _operands(mul)[::-1]):
                    if producer_op(b) == "Exp":
                        decayed, dbx32, exp_node, state32 = first, second, b.producer(), a
                        break
                if decayed is not None:
                    break
        if decayed is None:
            raise Refusal(
                "the readout's MatMul does not read a state update new = state * exp(..) + dBx", s_rows, logged=False
            )
        anchor = add
        try:
            return self._prove_every_batch(
                anchor,
                graph,
                shapes,
                s_rows,
                c_rows,
                skip,
                bmm,
                y,
                s_t,
                t,
                new,
                readout_casts,
                decayed,
                dbx32,
                exp_node,
                state32,
            )
        except Refusal as refusal:
            refusal.anchor = anchor  # type: ignore[attr-defined]
            raise

    def _prove_every_batch(self, anchor, *args) -> _Plan:
        """``_prove`` for x's batch; a symbolic batch at each of ``BATCH_SAMPLES``, with the emulated layouts
        batch-blocked (``_decode.batch_blocked``): then they hold for every batch size."""
        self._batch, self._trace = None, None
        try:
            return self._prove(anchor, *args)
        except _SymbolicBatch as symbolic:
            symbol = symbolic.symbol
        traces, plan = [], None
        try:
            for size in BATCH_SAMPLES:
                self._batch, self._trace = Batch(symbol, size), []
                try:
                    plan = self._prove(anchor, *args)
                except Refusal as refusal:
                    raise Refusal(
                        f"{refusal.reason} (at {self._batch.label()})", refusal.culprit, logged=refusal.logged
                    ) from None
                traces.append(self._trace)
        finally:
            self._batch, self._trace = None, None
        why = batch_blocked(traces, BATCH_SAMPLES)
        if why is not None:
            raise Refusal(f"the layout is not proven for every batch size: {why}", anchor)
        assert plan is not None
        return plan

    def _prove(
        self,
        anchor,
        graph,
        shapes,
        s_rows,
        c_rows,
        skip,
        bmm,
        y,
        s_t,
        t,
        new,
        readout_casts,
        decayed,
        dbx32,
        exp_node,
        state32,
    ) -> _Plan:
        if t not in SUPPORTED_DTYPES:
            raise Refusal(f"the readout runs in {dtype_name(t)}, not float/float16/bfloat16", s_t)
        if new.dtype != _F32:
            raise Refusal(f"the state update runs in {dtype_name(new.dtype)}, the op in float32", new)
        opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 0))
        if opset and opset < MIN_OPSET:
            raise Refusal(f"ONNX opset {opset}: the op's function needs opset {MIN_OPSET}", anchor)
        # state: S = its dtype, read in float32 (through a widening Cast unless it is float)
        state_cast = _producer(state32, "Cast", "CastLike")
        state = _before_identities(state_cast.inputs[0] if state_cast is not None else state32)
        if state32.dtype != _F32:
            raise Refusal(f"the decay multiplies the state in {dtype_name(state32.dtype)}, not float32", state32)
        s = state.dtype
        if s not in (_F32, t):
            raise Refusal(f"the state is {dtype_name(s)}: the op keeps it in float32 or in x's type", state)
        # present: the graph output of the new state, in S
        present_candidates = _cast_users(new)
        outputs = [v for v in present_candidates if v.is_graph_output()]
        if len(outputs) != 1:
            raise Refusal("the new state is not one graph output (the present state)", new)
        present = outputs[0]
        # the Casts between new and present (torch's ``state.copy_(new.to(state.dtype))`` into a clone of the
        # past state: two same-type CastLikes); each rounds to its own type, the last to S
        present_casts = []
        value = present
        while value is not new:
            present_casts.append(value.producer())
            value = value.producer().inputs[0]
        if any(c.outputs[0].dtype not in (s, _F32) for c in present_casts[1:]):
            raise Refusal("the present state is rounded through another type before S", present)
        if present.dtype != s:
            raise Refusal(
                f"the present state is {dtype_name(present.dtype)} but the past state {dtype_name(s)}", present
            )
        for cast in readout_casts:  # s_t = round_T(round_S(s)) = round_T(s) for S in {float, T}
            if cast.outputs[0].dtype not in (s, t):
                raise Refusal(f"the readout rounds the state to {dtype_name(cast.outputs[0].dtype)}", cast)
        # x: the value the skip multiplies by D, whose column (B, H, P, 1) dBx reads
        x_u = self._x_column(dbx32)
        mul_d, widened_skip = _skip_product(skip, t)
        if mul_d is None or skip.dtype != t or mul_d.inputs[0] is mul_d.inputs[1]:
            raise Refusal("the skip is not x * D in x's type", skip)
        skip_operands = [_widened_source(c) for c in mul_d.inputs] if widened_skip else list(mul_d.inputs)
        x = next((c for c in skip_operands if c is x_u or c in _layout_ancestors(x_u)), None)
        if x is None:
            raise Refusal("the skip's x * D and dBx read different x", mul_d)
        x_shape = shapes(x)
        if (
            self._batch is None
            and x_shape is not None
            and len(x_shape) == 3
            and is_batch_symbol(x_shape[0])
            and all(isinstance(d, int) for d in x_shape[1:])
        ):
            raise _SymbolicBatch(x_shape[0])
        x_dims = int_dims(x, shapes, "x", self._batch)
        if len(x_dims) != 3 or x.dtype != t:
            raise Refusal(f"x is not (B, H, P) of the readout's type (proven shape {x_dims})", x)
        batch, heads, head_dim = x_dims
        # The state's (H, P, N): proven where the graph has them; a graph input of symbolic dims is the cache
        # that the previous step's present output (this chain's (B, H, P, N) result) fills, and a state of
        # another shape is rejected by the op at run time (never broadcast as the original Mul would).
        state_dims = shapes(state)
        if state_dims is None or len(state_dims) != 4:
            raise Refusal("the state is not proven to be 4-D (B, H, P, N)", state)
        state_size = self._state_size(exp_node, state_dims, heads, head_dim, shapes, dbx32)
        if not state.is_graph_input() and state_dims[1:] != [heads, head_dim, state_size]:
            raise Refusal(f"the state is not proven (B, {heads}, {head_dim}, {state_size})", state)
        for index, (dim, want) in enumerate(zip(state_dims[1:], (heads, head_dim, state_size), strict=False), start=1):
            if isinstance(dim, int) and dim != want:
                raise Refusal(f"the state's dim {index} is {dim}, the chain's {want}", state)
        aliases = shapes.aliases({})
        full = (batch, heads, head_dim, state_size)
        x_idx = leaf_indices(x_dims)
        self._expect(x_u, {x: x_idx}, aliases, np.broadcast_to(x_idx[..., None], full), "x's column", broadcast_to=full)
        # dt: d = softplus(dt_e + dt_bias), dt_e a broadcast of dt_src along P
        mul_a = _producer(exp_node.inputs[0], "Mul")
        if mul_a is None:
            raise Refusal("exp's argument is not dt * A", exp_node)
        dt32, a_b = None, None
        for p, q in (_operands(mul_a), _operands(mul_a)[::-1]):
            if _is_dt(p, t):
                dt32, a_b = p, q
                break
        if dt32 is None:
            raise Refusal("exp's argument is not f32(dt) * A", mul_a)
        dt_u = dt32
        if dt32.dtype != _F32:
            raise Refusal(f"dt * A runs in {dtype_name(dt32.dtype)}, the op in float32", dt32)
        cast = _producer(dt32, "Cast")
        if t != _F32 and cast is None:
            raise Refusal("dt is not widened to float32 before dt * A", dt32)
        if cast is not None and cast.inputs[0].dtype == t:  # in float32 the op's body's Cast is the identity
            dt_u = cast.inputs[0]
        d = layout_source(dt_u)
        if d.dtype != t:
            raise Refusal(f"softplus(dt) is {dtype_name(d.dtype)}, the op rounds it to {dtype_name(t)}", d)
        # softplus(dt)'s dims: proven, or (B, H, P) as dt's broadcast and dt_bias (H, P) prove below
        # (the op's own body keeps it (B, H), one per row, and broadcasts it over P with dA and dB)
        d_dims = self._bound(shapes(d))
        if d_dims is None or not all(isinstance(dim, int) for dim in d_dims):
            d_dims = [batch, heads, head_dim]
        per_row = d_dims == [batch, heads]
        if d_dims != [batch, heads, head_dim] and not per_row:
            raise Refusal(f"softplus(dt) ({d_dims}) is not (B, H, P) = {[batch, heads, head_dim]} nor (B, H)", d)
        d_idx = leaf_indices(d_dims)
        d_full = np.broadcast_to(d_idx[..., None, None] if per_row else d_idx[..., None], full)
        self._expect(dt_u, {d: d_idx}, aliases, d_full, "dt's column", broadcast_to=full)
        v, dt_softplus = self._softplus_input(d)
        v_node = _producer(v, "Add")
        if v_node is None:
            raise Refusal("softplus reads no dt + dt_bias", v)
        dt_e, bias_b = None, None
        for p, q in (_operands(v_node), _operands(v_node)[::-1]):
            src = layout_source(p)
            if src.producer() is not None and src is not p and not _is_constant_like(src):
                dt_e, bias_b = p, q
                break
        if dt_e is None and per_row:  # the body's Add(dt, dt_bias): dt is the operand read from the graph
            for p, q in (_operands(v_node), _operands(v_node)[::-1]):
                if not _is_constant_like(layout_source(p)) and _is_constant_like(layout_source(q)):
                    dt_e, bias_b = p, q
                    break
        if dt_e is None:
            raise Refusal("dt + dt_bias: no broadcast of dt found", v_node)
        dt_src = _proven_leaf(dt_e, shapes, self._batch)
        dt_dims = int_dims(dt_src, shapes, "dt", self._batch)
        if int(np.prod(dt_dims)) != batch * heads or dt_src.dtype != t:
            raise Refusal(f"dt ({dt_dims}, {dtype_name(dt_src.dtype)}) is not B * H values of x's type", dt_src)
        dt_rows = np.arange(batch)[:, None] * heads + np.arange(heads)
        expected_dt = dt_rows if per_row else np.broadcast_to(dt_rows[..., None], (batch, heads, head_dim))
        self._expect(dt_e, {dt_src: leaf_indices(dt_dims)}, aliases, expected_dt, "dt's broadcast over P")
        bias_dims = (heads,) if per_row else (heads, head_dim)
        dt_bias = per_head(bias_b, heads, bias_dims, aliases, graph, "dt_bias", t)
        a = per_head(a_b, heads, (heads, head_dim, state_size), aliases, graph, "A", _F32)
        # dBx = (dt_u * B_h) * x_u in T, then widened
        dbx = dbx32
        cast = _producer(dbx32, "Cast")
        if t != _F32 and (cast is None or dbx32.dtype != _F32):
            raise Refusal("dBx is not widened to float32 before the state update", dbx32)
        if cast is not None and cast.inputs[0].dtype == t:  # in float32 the op's body's Cast is the identity
            dbx = cast.inputs[0]
        if dbx.dtype != t:
            raise Refusal(f"dBx is {dtype_name(dbx.dtype)}: the op rounds dt * B and dBx to {dtype_name(t)}", dbx)
        mul_dbx = _producer(dbx, "Mul")
        db = next((p for p in (mul_dbx.inputs if mul_dbx else []) if p is not x_u), None)
        mul_db = _producer(db, "Mul")
        if mul_db is None or db.dtype != t:
            raise Refusal(f"dB is not a product dt * B in {dtype_name(t)}", db or dbx)
        b_h = next((p for p in mul_db.inputs if p is not dt_u), None)
        if b_h is None or dt_u not in mul_db.inputs:
            raise Refusal("dB does not multiply the same rounded dt as dA", mul_db)
        b_src = _proven_leaf(b_h, shapes, self._batch)
        groups = self._groups(b_h, b_src, batch, heads, head_dim, state_size, aliases, shapes, t, "B", 2)
        # readout: rows of s_t and of C_h, MatMul, Reshape back to (B, H, P)
        c_src = _proven_leaf(c_rows, shapes, self._batch)
        s_leaf = leaf_indices(full)
        rows_s = self._emulate(s_rows, {s_t: s_leaf}, aliases)
        if rows_s is None or rows_s.shape[-2:] != (head_dim, state_size) or rows_s.size != s_leaf.size:
            raise Refusal("the readout's state rows are not (.., P, N) of the state", s_rows)
        if not np.array_equal(rows_s.reshape(-1, head_dim, state_size), s_leaf.reshape(-1, head_dim, state_size)):
            raise Refusal("the readout's state rows are not the state's (b, h) rows in order", s_rows)
        c_groups = self._groups(
            c_rows, c_src, batch, heads, 1, state_size, aliases, shapes, t, "C", -1, rows=rows_s.shape[:-2]
        )
        if c_groups != groups:
            raise Refusal(f"B has {groups} groups and C {c_groups}", c_src)
        bmm_dims = (*rows_s.shape[:-2], head_dim, 1)
        bmm_idx = leaf_indices(bmm_dims)
        self._expect(y, {bmm: bmm_idx}, aliases, bmm_idx.reshape(batch, heads, head_dim), "the readout's Reshape")
        if bmm.dtype != t or s_rows.dtype != t or c_rows.dtype != t:
            raise Refusal(f"the readout MatMul is not in {dtype_name(t)}", bmm)
        # state batch: a symbolic batch must be x's symbol; another batch than x's must make the original fail
        if self._batch is not None:
            if state_dims[0] != self._batch.symbol:
                raise Refusal("the state's batch is not proven to be x's", state)
        elif state_dims[0] != batch:
            # the original fails with another batch: the state's rows (the MatMul fails where they do not
            # broadcast against C's rows, proven from x's batch), or (the op's body) the readout's Reshape of
            # their products to x's shape
            wider = emulate(s_rows, {s_t: leaf_indices((batch + 1, heads, head_dim, state_size))}, aliases)
            c_dims = self._bound(shapes(c_rows))
            products = None
            if wider is not None:
                products = _broadcast_batch(list(wider.shape[:-2]), c_dims[:-2] if c_dims is not None else None)
            if products is not None and (
                emulate(y, {bmm: leaf_indices((*products, head_dim, 1))}, aliases) is not None
            ):
                raise Refusal("the state's batch is not proven to be x's", state)
        # D skip: out = y + x * D in T
        d_b = next(p for p, source in zip(mul_d.inputs, skip_operands, strict=True) if source is not x)
        d_type = t
        if widened_skip:  # round_T(f32(x) * D32): the op's round_T(x * D) for D32 = D of type T or float
            d_type = _F32
            d_skip = per_head(d_b, heads, (heads, head_dim), aliases, graph, "D", _F32)
            data = d_skip[1]
            if data is not None and np.array_equal(data.astype(t.numpy()).astype(np.float32), data, equal_nan=True):
                d_type = t  # D's values are T's: the op's D in x's type, as the rewriter writes it
        else:
            d_skip = per_head(d_b, heads, (heads, head_dim), aliases, graph, "D", t)
        # nothing between the inputs and the output may be read elsewhere
        leaves = {state, x, dt_src, b_src, c_src}
        chain_nodes = _data_nodes(_root(skip, y), leaves)
        chain_nodes.update(present_casts)  # the Casts that write the present state
        inner = [o for n in chain_nodes for o in n.outputs if o is not present]
        root_out = _root(skip, y).outputs[0]
        readers = [v for v in outside_readers([o for o in inner if o is not root_out], chain_nodes)]
        present_readers = [u for u, _ in present.uses() if u not in chain_nodes]
        if readers or present_readers:
            value = readers[0] if readers else present
            raise Refusal(f"{value.name!r} is also read outside the chain", value)
        return _Plan(
            anchor=anchor,
            state=state,
            x=x,
            dt_src=dt_src,
            dt_bias=dt_bias,
            A=a,
            B_src=b_src,
            C_src=c_src,
            D=d_skip,
            D_type=d_type,
            dt_softplus=dt_softplus,
            heads=heads,
            groups=groups,
            state_size=state_size,
            present=present,
            leftovers=[root_out, present, new],
            attributes={
                "heads": heads,
                "head_dim": head_dim,
                "state_size": state_size,
                "groups": groups,
                "x_dtype": dtype_name(t),
                "state_dtype": dtype_name(s),
                "dt_softplus": dt_softplus,
            },
        )

    @staticmethod
    def _state_size(
        exp_node: ir.Node, state_dims, heads: int, head_dim: int, shapes: ForwardShapes, dbx32: ir.Value
    ) -> int:
        """Return N: the state's last dim where proven, else dBx's or dA's (each covers (B, H, P, N); the
        op's own body keeps dA (B, H, 1, 1))."""
        if isinstance(state_dims[3], int):
            return state_dims[3]
        dbx_dims = shapes(dbx32)
        if (
            dbx_dims is not None
            and len(dbx_dims) == 4
            and dbx_dims[1:3] == [heads, head_dim]
            and isinstance(dbx_dims[3], int)
        ):
            return dbx_dims[3]
        da_dims = shapes(exp_node.outputs[0])
        if da_dims is None or not isinstance(da_dims[-1], int):
            mul = exp_node.inputs[0].producer()
            da_dims = next(
                (shapes(v) for v in (mul.inputs if mul else []) if v is not None and v.const_value is not None), None
            )
            da_dims = [None, *da_dims] if da_dims is not None and len(da_dims) == 3 else da_dims
        if da_dims is None or len(da_dims) != 4 or not isinstance(da_dims[3], int) or da_dims[1:3] != [heads, head_dim]:
            raise Refusal("the state size N is proven neither by the state nor by the decay", exp_node)
        return da_dims[3]

    @staticmethod
    def _x_column(dbx32: ir.Value) -> ir.Value:
        """Return the operand of dBx = dB * x_column that is not the product dB."""
        dbx = dbx32
        cast = _producer(dbx32, "Cast")
        if cast is not None:
            dbx = cast.inputs[0]
        mul = _producer(dbx, "Mul")
        if mul is None and producer_op(dbx) in ("Cast", "CastLike"):
            types, value = [], dbx
            while producer_op(value) in ("Cast", "CastLike"):
                value = value.producer().inputs[0]
                types.append(dtype_name(value.dtype))
            raise Refusal(
                f"dBx is rounded through {' and '.join(types[:-1]) or types[-1]} before the state update: a "
                "rounding point the op does not have",
                dbx,
            )
        if mul is None:
            raise Refusal("the state update's addend is not dB * x", dbx32)
        columns = [p for p in mul.inputs if producer_op(p) != "Mul"]
        if len(columns) != 1:
            raise Refusal("dBx is not dB * (a column of x)", mul)
        return columns[0]

    @classmethod
    def _softplus_input(cls, d: ir.Value) -> tuple[ir.Value, int]:
        """Return (v, dt_softplus): d = softplus(v), or the op's body's Where(flag, softplus(v), v) with a
        constant flag (the inlined dt_softplus attribute)."""
        where = _producer(d, "Where")
        flag = constant_array(where.inputs[0]) if where is not None and len(where.inputs) == 3 else None
        if flag is not None and flag.dtype == np.bool_ and flag.size == 1:
            _, softplus, plain = where.inputs
            if cls._softplus_of(softplus) is not plain:
                raise Refusal("dt_softplus picks between the softplus of one value and another value", where)
            return plain, int(bool(flag.reshape(-1)[0]))
        return cls._softplus_of(d), 1

    @staticmethod
    def _softplus_of(d: ir.Value) -> ir.Value:
        where = _producer(d, "Where")
        if where is None or len(where.inputs) != 3:
            raise Refusal("dt is not softplus(dt + dt_bias) spelled Where(v > 20, v, Softplus(v))", d)
        condition, v, soft = where.inputs
        greater = _producer(condition, "Greater")
        softplus = _producer(_identity_of(soft), "Softplus")
        if greater is None or softplus is None:
            raise Refusal("dt's softplus is not Where(v > 20, v, Softplus(v))", where)
        if _identity_of(greater.inputs[0]) is not v or _identity_of(softplus.inputs[0]) is not v:
            raise Refusal("dt's softplus tests or transforms another value than it keeps", where)
        threshold = _scalar(greater.inputs[1])
        if threshold != SOFTPLUS_THRESHOLD:
            raise Refusal(f"dt's softplus threshold is {threshold}, the op's {SOFTPLUS_THRESHOLD}", greater)
        return v

    def _groups(self, value, source, batch, heads, head_dim, state_size, aliases, shapes, t, name, axis, rows=None):
        dims = int_dims(source, shapes, name, self._batch)
        if source.dtype != t:
            raise Refusal(f"{name} is {dtype_name(source.dtype)}, not x's type", source)
        per_batch = int(np.prod(dims)) // max(batch, 1)
        if per_batch * batch != int(np.prod(dims)) or per_batch % state_size:
            raise Refusal(f"{name} ({dims}) is not B * G * N values", source)
        groups = per_batch // state_size
        if groups < 1 or heads % groups:
            raise Refusal(f"{name} has {groups} groups, which do not divide {heads} heads", source)
        rep = heads // groups
        h = np.arange(heads)
        expected = (
            np.arange(batch)[:, None, None] * per_batch
            + (h // rep)[None, :, None] * state_size
            + np.arange(state_size)[None, None, :]
        )  # (B, H, N): head h reads group h // (H / G) (repeat_interleave)
        got = self._emulate(value, {source: leaf_indices(dims)}, aliases)
        if got is None:
            raise Refusal(f"{name}'s heads are not a layout of {name} that the graph proves", value)
        if rows is None:  # B_h, broadcast against (B, H, P, N) with a P axis of 1
            full = (batch, heads, head_dim, state_size)
            try:
                got = np.broadcast_to(got, full)
            except ValueError:
                raise Refusal(
                    f"{name}'s heads (shape {list(got.shape)}) do not broadcast to {list(full)}", value
                ) from None
            want = np.broadcast_to(expected[:, :, None, :], full)
        else:  # C rows (.., N, 1) for the batched MatMul
            if got.shape != (*rows, state_size, 1):
                raise Refusal(f"C's rows (shape {list(got.shape)}) are not {[*rows, state_size, 1]}", value)
            got = got.reshape(-1, state_size)
            want = expected.reshape(-1, state_size)
        if not np.array_equal(got, want):
            raise Refusal(
                f"{name}'s groups are not mapped to heads as repeat_interleave (head h reads group h // {rep})", value
            )
        return groups

    def _emulate(self, value, leaves, aliases):
        return emulate(value, leaves, aliases, batch=self._batch, trace=self._trace)

    def _bound(self, dims):
        """Return dims with the symbolic batch bound (unchanged when none is)."""
        if dims is None or self._batch is None:
            return dims
        return [self._batch.bind(d) for d in dims]

    def _expect(self, value, leaves, aliases, expected, what, broadcast_to=None):
        got = self._emulate(value, leaves, aliases)
        if got is None:
            raise Refusal(f"{what} is not a layout that the graph proves", value)
        if broadcast_to is not None:
            try:
                got = np.broadcast_to(got, broadcast_to)
            except ValueError:
                raise Refusal(f"{what} (shape {list(got.shape)}) does not broadcast to the op's", value) from None
        if got.shape != expected.shape or not np.array_equal(got, expected):
            raise Refusal(f"{what} does not hold the elements the op reads", value)

    # rewrite ----------------------------------------------------------------------------------------

    def rewrite(self, op, **_: Any):
        plan = self.take_plan()
        t = plan.x.dtype

        def per_head_input(source, name, dtype):
            value, data = source
            if data is not None:
                tensor = ir.tensor(data.astype(dtype.numpy()), name=name)
                return op.initializer(tensor, name=name)
            return op.Reshape(value, op.Constant(value_ints=[plan.heads]))

        base = plan.anchor.name or plan.present.name or "ssu"
        dt = op.Reshape(plan.dt_src, op.Constant(value_ints=[-1, plan.heads]))
        rows = op.Constant(value_ints=[-1, plan.groups, plan.state_size])
        out, present = op.SelectiveStateUpdate(
            plan.state,
            plan.x,
            dt,
            per_head_input(plan.dt_bias, f"{base}_dt_bias", t),
            per_head_input(plan.A, f"{base}_A", _F32),
            op.Reshape(plan.B_src, rows),
            op.Reshape(plan.C_src, rows),
            per_head_input(plan.D, f"{base}_D", plan.D_type),
            _domain=DOMAIN,
            _version=1,
            _outputs=2,
            dt_softplus=plan.dt_softplus,
        )
        replace_graph_output(plan.present, present)
        return out

    def setup(self) -> None:
        super().setup()
        self._batch, self._trace = None, None


def _proven_leaf(value: ir.Value, shapes: ForwardShapes, batch: Batch | None = None) -> ir.Value:
    """Return the farthest value ``value`` is made from by layout ops whose shape the graph proves static
    (but for a symbolic ``batch``)."""
    best = value
    for ancestor in _layout_ancestors(value):
        dims = shapes(ancestor)
        if dims is not None and batch is not None:
            dims = [batch.bind(d) for d in dims]
        if dims is not None and all(isinstance(d, int) for d in dims):
            best = ancestor
    return best


def _before_identities(value: ir.Value) -> ir.Value:
    """Return the value an ``Identity`` chain copies (torch's ``clone()`` of the past state), else ``value``."""
    while (node := _producer(value, "Identity")) is not None and node.inputs and node.inputs[0] is not None:
        value = node.inputs[0]
    return value


def _cast_users(value: ir.Value, depth: int = 2) -> list[ir.Value]:
    """Return ``value`` and what Casts / CastLikes of it make, up to ``depth`` in a row."""
    values = [value]
    if depth:
        for user, index in value.uses():
            if user.op_type in ("Cast", "CastLike") and user.domain in ("", "ai.onnx") and index == 0:
                values += _cast_users(user.outputs[0], depth - 1)
    return values


def _broadcast_batch(rows: list[int], other: list | None) -> list[int] | None:
    """The MatMul batch dims of state rows ``rows`` against C's rows ``other`` (None: C's unproven, taken to
    broadcast), or None where the two do not broadcast and the MatMul fails."""
    if other is None or not all(isinstance(d, int) for d in other):
        return rows
    try:
        return list(np.broadcast_shapes(tuple(rows), tuple(other)))
    except ValueError:
        return None


def _layout_ancestors(value: ir.Value) -> list[ir.Value]:
    """Return the values ``value`` is made from through layout ops, nearest first."""
    found = []
    while True:
        producer = value.producer()
        if producer is None or producer.op_type not in LAYOUT_OPS or not producer.inputs or producer.inputs[0] is None:
            return found
        value = producer.inputs[0]
        found.append(value)


def _skip_product(skip: ir.Value, t: ir.DataType) -> tuple[ir.Node | None, bool]:
    """Return the skip's product x * D and whether it is the op's body's round_T(f32(x) * f32(D))."""
    mul = _producer(skip, "Mul")
    if mul is not None:
        return mul, False
    cast = _producer(skip, "Cast", "CastLike")
    product = cast.inputs[0] if cast is not None else None
    mul = _producer(product, "Mul")
    if mul is None or product.dtype != _F32 or any(p.dtype != _F32 for p in mul.inputs):
        return None, False
    return mul, True


def _widened_source(value: ir.Value) -> ir.Value:
    """Return what a Cast to float32 widens (exactly, from float32 or a half type), else ``value``."""
    cast = _producer(value, "Cast")
    if cast is not None and value.dtype == _F32 and cast.inputs[0].dtype in SUPPORTED_DTYPES:
        return cast.inputs[0]
    return value


def _is_constant_like(value: ir.Value) -> bool:
    return value.const_value is not None or producer_op(value) == "Constant"


def _is_dt(value: ir.Value, t: ir.DataType) -> bool:
    """Whether ``value`` is the (widened) column of softplus(dt): its layout source is a Where or its Cast."""
    source = layout_source(value)
    cast = _producer(source, "Cast")
    if cast is not None:
        source = layout_source(cast.inputs[0])
    return producer_op(source) == "Where"


def _root(skip: ir.Value, y: ir.Value) -> ir.Node:
    user = next(u for u, _ in y.uses() if u.op_type == "Add" and skip in u.inputs)
    return user


def _data_nodes(root: ir.Node, leaves: set[ir.Value]) -> set[ir.Node]:
    """Return the nodes on a path from ``leaves`` to ``root`` (those that read the chain's inputs).

    A ``Shape`` of a leaf reads no data (with a symbolic batch, exporters take the batch from the state's
    shape for other layers too): it and the shape arithmetic on it stay, and are not the chain's.
    """
    memo: dict[ir.Node, bool] = {}

    def reads_leaves(node: ir.Node) -> bool:
        if node in memo:
            return memo[node]
        memo[node] = False
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.inputs and node.inputs[0] in leaves:
            return False
        hit = False
        for value in node.inputs:
            if value is None:
                continue
            if value in leaves:
                hit = True
                continue
            producer = value.producer()
            if producer is not None and reads_leaves(producer):
                hit = True
        memo[node] = hit
        return hit

    reads_leaves(root)
    return {node for node, hit in memo.items() if hit}


def _rules() -> list[pattern.RewriteRule]:
    return [
        SelectiveStateUpdateFusion.rule(
            f"SelectiveStateUpdate[{'skip + y' if first else 'y + skip'}]", skip_first=first
        )
        for first in (False, True)
    ]


selective_state_update_rules = pattern.RewriteRuleSet(_rules())
selective_state_update_rules.remove_unused_nodes = False


def fuse_selective_state_update(model: ir.Model, log: FusionLog | None = None) -> int:
    """Fuse every decode state update of ``model`` in place; return how many were fused."""
    return apply_with_log(selective_state_update_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every state update left in ``graph``: Add(Mul(state, Exp(..)), ..) whose result is a graph output
    (directly or through one Cast)."""
    anchors = []
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        decays = [
            v
            for v in node.inputs
            if producer_op(v) == "Mul" and any(producer_op(p) == "Exp" for p in v.producer().inputs)
        ]
        is_output = any(v.is_graph_output() for v in _cast_users(node.outputs[0]))
        if decays and is_output:
            anchors.append(node)
    return anchors


__all__ = [
    "SelectiveStateUpdateFusion",
    "find_anchors",
    "fuse_selective_state_update",
    "location",
    "selective_state_update_rules",
]
