"""Run a mobius build's prompt scan as ``ai.mambafuse::MambaChunkScan`` where it runs ORT's ``LinearAttention``
(or ONNX's own, opset 27).

Microsoft's mobius builder writes the Mamba-2 recurrence as ``com.microsoft::LinearAttention(update_rule="gated")``,
one node per layer that serves the prompt and every decode step, its state genai's past / present tensor in
LinearAttention's (B, H, N, P) layout. Per layer, with d the time step::

    d     = Softplus(dt + dt_bias)  or  Clip(Softplus(dt + dt_bias), lo)    # lo >= 0 (Nemotron-H, Zamba2: 0.001)
    A     = Neg(Exp(A_log))                                                 # (H,), float32
    decay = A * d                                                           # (B, T, H): LinearAttention's log gate
    v     = Reshape(Unsqueeze(d, -1) * x, [0, 0, H P])                     # x (B, T, H, P)
    q, k  = C, B repeated from G groups to H heads: Reshape(Expand(Reshape(., [0, 0, G, 1, N]), [1, 1, 1, H/G, 1]),
            [0, 0, H N]), or already (B, T, H N)
    o, present = LinearAttention(q, k, v, past, decay, q_num_heads = kv_num_heads = H, scale = 1)

LinearAttention computes S_t = exp(decay_t) S_{t-1} + k_t ⊗ v_t and o_t = q_t S_t: MambaChunkScan's recurrence
(docs/mamba_chunk_scan.md) with ``dt_softplus = 0`` fed the graph's own d, so that a = A·d and u = x·d are the same
float32 products, bit for bit, as the graph's decay and v (no second softplus: ORT's float32 Softplus is up to 4
ulp from a correctly rounded one), and ``dt_min = 0`` a no-op because d >= 0 is proven (a softplus, clipped below
at a non-negative constant). The rule proves every step above from the graph, then writes::

    o, present = MambaChunkScan(x, d, -0.0s, A, Reshape(B, [0, 0, G, N]), Reshape(C, [0, 0, G, N]), zeros, past;
                                dt_softplus = 0, state_layout = 1)
    o = Reshape(o, [0, 0, H P])

so genai's inputs and outputs keep their names, types and layout. A float16 or bfloat16 build widens x, B, C and
the state from the 16-bit type (``Cast(to=float)`` after each part's Split, before the Reshapes) while computing d in
float32: where x, B and C all widen from one 16-bit type, the node reads those 16-bit values (and the state's, where it
widens from that type) with the float32 d, which the op computes exactly as on the widened values (a 16-bit value is
exact in float32), and its CUDA kernel then takes the 16-bit path. ``state_layout = 1`` has the node read and write
the state in LinearAttention's (B, H, N, P) layout, so a decode step moves no more state than LinearAttention does
(the Transposes around the node of earlier releases copied the 4 MB state of a Nemotron-H-8B layer twice a call,
most of a CPU decode step).

ONNX's own ``LinearAttention`` (the default domain, added at opset 27) has ORT's inputs, packed (B, T, H D) layout,
(B, H_kv, d_k, d_v) = (B, H, N, P) state, recurrences and attribute defaults (``update_rule`` gated_delta, ``scale``
0 meaning 1/sqrt(d_k), both heads required); it lacks ORT's ``state_window`` and says of ``chunk_size`` that it is
a tuning hint that does not change the outputs (as ORT's own schema says of its op's). Its function body, which ONNX
Runtime 1.32 runs on the CPU, is the gated recurrence above token by token in float32 (a Scan: exp(decay) times the
state plus k v^T, then scale q^T S, cast back to q's and the state's types). The rule proves the same graph around
it where the model's opset defines the op's version 27 (a model at an opset the installed onnx does not know is
refused). Either spelling may carry ``chunk_size``.

What the graph cannot show, the node checks at run time: x, d, B and C with the same batch and length (the graph's
Mul would broadcast a length-1 x against a longer d; the kernel refuses that with an error naming the shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.reference.mamba_chunk_scan import DOMAIN
from fusion.rules._decode import (
    PlannedRule,
    Refusal,
    apply_with_log,
    dtype_name,
    emulate,
    leaf_indices,
    negative_zeros,
    prove_standard_version,
    type_untyped_values,
)
from fusion.rules._log import FusionLog
from fusion.rules._prefill import (
    SIXTEEN_BIT_DTYPES,
    axis_of,
    const_ints,
    constant_limit,
    mul_operands,
    producer_of,
    same,
    strip,
)
from fusion.shapes.dims import ForwardShapes, constant_array

FORM = "LinearAttention"
BUILDER_DOMAIN = "com.microsoft"
#: ONNX's own op (the default domain), and the opset that added it
STANDARD_DOMAIN = ""
STANDARD_SINCE = 27
#: LinearAttention's attributes whose values the proof reads, and ``chunk_size``, which both specifications (ONNX's
#: and ONNX Runtime's) call a tuning hint that does not change the outputs: the scan computes the same recurrence
#: whatever its value. Any other attribute (ORT's state window, another rule's parameters) is refused rather than
#: guessed at.
_KNOWN_ATTRIBUTES = frozenset({"update_rule", "scale", "q_num_heads", "kv_num_heads", "chunk_size"})
_KNOWN_ATTRIBUTES_BY_DOMAIN = {BUILDER_DOMAIN: _KNOWN_ATTRIBUTES, STANDARD_DOMAIN: _KNOWN_ATTRIBUTES}


@dataclasses.dataclass
class _Narrow:
    """A float32 value that is the exact widening of 16-bit ``source``: ``Cast(source, to=float)``, or ``Reshape`` of
    that by ``shape`` (``allowzero`` as the graph's), whose 16-bit form is ``Reshape(source, shape)``."""

    source: ir.Value
    shape: ir.Value | None = None
    allowzero: int = 0


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    x: ir.Value
    d: ir.Value
    A: ir.Value
    B: ir.Value
    C: ir.Value
    past: ir.Value
    groups: int
    heads: int
    head_dim: int
    state_size: int
    leftovers: list[ir.Value]
    attributes: dict[str, Any]
    #: x, B and C (and the state, where it is too) as the 16-bit values the graph widened: the scan reads those
    narrow: dict[str, _Narrow] = dataclasses.field(default_factory=dict)


def _int_dims(shapes: ForwardShapes, value: ir.Value) -> list[Any]:
    dims = shapes(value)
    return [] if dims is None else list(dims)


class LinearAttentionScanFusion(PlannedRule):
    """Rewrites one ``LinearAttention(update_rule="gated")`` of ``domain`` (ORT's, as mobius writes it, or ONNX's)
    into a MambaChunkScan node on the state as it is (``state_layout`` 1)."""

    FORM = FORM

    def __init__(self, name: str, *, domain: str) -> None:
        super().__init__(name)
        self._domain = domain

    def pattern(self, op, q, k, v, past, decay):
        return op.LinearAttention(
            q,
            k,
            v,
            past,
            decay,
            _domain=self._domain,
            _allow_other_attributes=True,
            _allow_other_inputs=True,
            _outputs=["o", "present"],
        )

    def check(self, context, q, k, v, past, decay, o, present, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        anchor = o.producer()
        if anchor is None or anchor.attributes.get_string("update_rule", "") != "gated":
            return result.fail("not a gated LinearAttention")
        try:
            if self._shapes is None:
                type_untyped_values(o.graph)
                self._shapes = ForwardShapes(o.graph)
            self._plan = _prove(anchor, q, k, v, past, decay, self._shapes)
        except Refusal as refusal:
            return self.refused(result, anchor, refusal)
        return result

    def rewrite(self, op, **_: Any):
        plan: _Plan = self.take_plan()
        self._shapes = None  # the graph changes here: the next check proves on fresh shapes
        heads, groups, n, p = plan.heads, plan.groups, plan.state_size, plan.head_dim
        by_group = op.Constant(value_ints=[0, 0, groups, n])
        base = plan.anchor.name or "linear_attention_scan"
        # The model-local function takes every input: -0.0 as the bias (adding it is the identity, no rounding) and
        # zeros as D (the graph keeps its own skip after the node).
        no_bias = negative_zeros(f"{base}_dt_bias", heads, ir.DataType.FLOAT)
        no_skip = ir.tensor(np.zeros(heads, np.float32), name=f"{base}_D")

        def read(name: str, value: ir.Value):
            narrow = plan.narrow.get(name)
            if narrow is None:
                return value
            if narrow.shape is None:
                return narrow.source
            return op.Reshape(narrow.source, narrow.shape, allowzero=narrow.allowzero)

        out, present = op.MambaChunkScan(
            read("x", plan.x),
            plan.d,
            op.initializer(no_bias.const_value, name=no_bias.name),
            plan.A,
            op.Reshape(read("B", plan.B), by_group),
            op.Reshape(read("C", plan.C), by_group),
            op.initializer(no_skip, name=no_skip.name),
            read("past", plan.past),
            _domain=DOMAIN,
            _version=1,
            _outputs=2,
            dt_softplus=0,
            state_layout=1,  # genai's (B, H, N, P) state as it is
        )
        o = op.Reshape(out, op.Constant(value_ints=[0, 0, heads * p]))
        return o, present


def _prove(anchor: ir.Node, q, k, v, past, decay, shapes: ForwardShapes) -> _Plan:
    if anchor.domain == STANDARD_DOMAIN:
        prove_standard_version(anchor, STANDARD_SINCE)
    unknown = sorted(set(anchor.attributes) - _KNOWN_ATTRIBUTES_BY_DOMAIN[anchor.domain])
    if unknown:
        raise Refusal(f"LinearAttention has attributes the proof does not read: {unknown}", anchor)
    if len([i for i in anchor.inputs if i is not None]) != 5 or len(anchor.inputs) > 6:
        raise Refusal("LinearAttention has a beta input or more (the gated rule reads none)", anchor)
    scale = anchor.attributes.get("scale")
    if scale is None or scale.as_float() != 1.0:
        # absent (or 0) means 1/sqrt(d_k); the scan reads C unscaled
        raise Refusal(f"LinearAttention's scale is {None if scale is None else scale.as_float()}, not 1", anchor)
    heads = anchor.attributes.get_int("q_num_heads", 0)
    if heads < 1 or anchor.attributes.get_int("kv_num_heads", 0) != heads:
        raise Refusal("LinearAttention's q_num_heads and kv_num_heads differ (grouped query heads)", anchor)
    for name, value in (("q", q), ("k", k), ("v", v), ("past_state", past), ("decay", decay)):
        if value.dtype != ir.DataType.FLOAT:
            raise Refusal(f"LinearAttention's {name} is {dtype_name(value.dtype)}, not float", value)

    # decay = A * d, d >= 0 and A <= 0, both per head
    d, A = _decay(decay, heads, shapes)
    # v = Reshape(Unsqueeze(d, -1) * x, [0, 0, H P]), with the same d
    x, head_dim = _value(v, d, heads, shapes)
    # N and P from the state: genai's past input, whose declared dims ONNX Runtime enforces
    past_dims = _int_dims(shapes, past)
    if len(past_dims) != 4 or not all(isinstance(dim, int) for dim in past_dims[1:]) or past_dims[1] != heads:
        raise Refusal(f"past_state's dims {past_dims} are not (B, {heads}, N, P) with N and P proven", past)
    state_size = past_dims[2]
    if past_dims[3] != head_dim:
        raise Refusal(f"past_state's dims {past_dims} do not end in v's head width {head_dim}", past)
    # q = C, k = B by head
    c_source, c_groups = _by_head(q, heads, state_size, "q (C)", shapes)
    b_source, b_groups = _by_head(k, heads, state_size, "k (B)", shapes)
    groups = c_groups
    if c_groups != b_groups:  # then read both per head (G = H): the same elements, no repeat to prove
        b_source, c_source, groups = k, q, heads
    return _Plan(
        anchor=anchor,
        x=x,
        d=d,
        A=A,
        B=b_source,
        C=c_source,
        past=past,
        groups=groups,
        heads=heads,
        head_dim=head_dim,
        state_size=state_size,
        leftovers=list(anchor.outputs),  # LinearAttention, then its inputs' chains once unread
        attributes={"heads": heads, "head_dim": head_dim, "groups": groups, "state_size": state_size},
        narrow=_sixteen_bit_reads(x, b_source, c_source, past),
    )


def _sixteen_bit_reads(x: ir.Value, b: ir.Value, c: ir.Value, past: ir.Value) -> dict[str, _Narrow]:
    """x, B and C by name as the 16-bit values the graph widened, where all three widen from one 16-bit type
    (mobius' float16 and bfloat16 builds; the scan then reads them with the float32 time step: the same products, a
    16-bit value being exact in float32), and the state ("past") too where it widens from that type; else none."""
    reads = {name: _widened(value) for name, value in (("x", x), ("B", b), ("C", c))}
    types = {read.source.dtype if read is not None else None for read in reads.values()}
    if len(types) != 1 or None in types:
        return {}
    state = _widened(past)
    if state is not None and state.source.dtype in types:
        reads["past"] = state
    return reads


def _widened(value: ir.Value) -> _Narrow | None:
    """``value`` (float32) as the 16-bit value it widens: ``Cast(s, to=float)`` of a float16 or bfloat16 ``s``, or a
    ``Reshape`` of that (a Reshape moves elements and a Cast maps each alone, so they commute); else None."""
    shape, allowzero = None, 0
    reshape = producer_of(value, "Reshape")
    if reshape is not None and len(reshape.inputs) == 2 and reshape.inputs[1] is not None:
        shape, allowzero = reshape.inputs[1], reshape.attributes.get_int("allowzero", 0)
        value = reshape.inputs[0]
    cast = producer_of(value, "Cast")
    if cast is None or cast.attributes.get_int("to", 0) != ir.DataType.FLOAT or not cast.inputs:
        return None
    source = cast.inputs[0]
    if source is None or source.dtype not in SIXTEEN_BIT_DTYPES:
        return None
    return _Narrow(source, shape, allowzero)


def _decay(decay: ir.Value, heads: int, shapes: ForwardShapes) -> tuple[ir.Value, ir.Value]:
    """Prove decay = A * d with A (H,) <= 0 and d (B, T, H) >= 0; return (d, A)."""
    mul = producer_of(decay, "Mul")
    if mul is None:
        raise Refusal("LinearAttention's decay is not a product A * d", decay)
    reasons = []
    for first, second in mul_operands(mul):
        try:
            _non_positive_per_head(first, heads, shapes)
            _non_negative_time_step(second, heads, shapes)
            return second, first
        except Refusal as refusal:
            reasons.append(refusal.reason)
    raise Refusal(f"LinearAttention's decay is not A * d ({'; '.join(reasons)})", decay)


def _non_positive_per_head(value: ir.Value, heads: int, shapes: ForwardShapes) -> None:
    """Prove ``value`` is (H,) float32 and <= 0: -exp(.) or constants <= 0."""
    if value.dtype != ir.DataType.FLOAT or _int_dims(shapes, value) != [heads]:
        raise Refusal(f"A is not ({heads},) float (dims {_int_dims(shapes, value)})", value)
    data = constant_array(value)
    if data is not None:
        if not (data <= 0).all():
            raise Refusal("A has positive (or NaN) entries", value)
        return
    neg = producer_of(value, "Neg")
    if neg is None or producer_of(neg.inputs[0], "Exp") is None:
        raise Refusal("A is not -exp(.) nor a constant <= 0", value)


def _non_negative_time_step(value: ir.Value, heads: int, shapes: ForwardShapes) -> None:
    """Prove ``value`` is (B, T, H) float32 and >= 0: Softplus(.), or a Clip of it at non-negative limits."""
    dims = _int_dims(shapes, value)
    # Dims the graph does not prove are the kernel's to check at run time (dt must be x's (B, T, H)).
    if value.dtype != ir.DataType.FLOAT or (dims and (len(dims) != 3 or dims[2] not in (heads, None))):
        raise Refusal(f"d is not (B, T, {heads}) float (dims {dims})", value)
    clip = producer_of(value, "Clip")
    source = value
    if clip is not None:
        limits = [i for i in list(clip.inputs)[1:3]]
        if not limits or limits[0] is None:
            raise Refusal("d's Clip has no lower limit", value)
        for limit in limits:
            if limit is None:
                continue
            bound = constant_limit(limit)
            if bound is None or not bound >= 0:
                raise Refusal(f"d's Clip limit {bound} is not a constant >= 0", limit)
        source = clip.inputs[0]
    if producer_of(source, "Softplus") is None:
        raise Refusal("d is not a Softplus (or a Clip of one at limits >= 0)", value)


def _value(v: ir.Value, d: ir.Value, heads: int, shapes: ForwardShapes) -> tuple[ir.Value, int]:
    """Prove v = Reshape(Unsqueeze(d, -1) * x, [0, 0, H P]) with x (B, T, H, P); return (x, P)."""
    reshape = producer_of(v, "Reshape")
    if reshape is None or reshape.attributes.get_int("allowzero", 0):
        raise Refusal("LinearAttention's v is not a Reshape of x * d", v)
    mul = producer_of(reshape.inputs[0], "Mul")
    if mul is None:
        raise Refusal("LinearAttention's v is not a Reshape of x * d", v)
    for first, second in mul_operands(mul):
        unsqueeze = producer_of(first, "Unsqueeze")
        if unsqueeze is None or not same(unsqueeze.inputs[0], d) or len(unsqueeze.inputs) < 2:
            continue
        if axis_of(unsqueeze.inputs[1], 4) != 3:
            raise Refusal("v's time step is not unsqueezed at its last axis", first)
        x = strip(second)
        dims = _int_dims(shapes, x)
        if len(dims) != 4 or dims[2] != heads or not isinstance(dims[3], int) or x.dtype != ir.DataType.FLOAT:
            raise Refusal(f"v's x is not (B, T, {heads}, P) float (dims {dims})", x)
        head_dim = dims[3]
        if const_ints(reshape.inputs[1]) != [0, 0, heads * head_dim]:
            raise Refusal(f"v's Reshape to {const_ints(reshape.inputs[1])} is not [0, 0, H P]", reshape.inputs[1])
        return x, head_dim
    raise Refusal("v is not d (unsqueezed) times x", v)


def _by_head(value: ir.Value, heads: int, state_size: int, what: str, shapes: ForwardShapes) -> tuple[ir.Value, int]:
    """Return (the (B, T, G N) source, G): ``value`` (B, T, H N) read per head, proven to repeat group h // (H / G)
    to head h where the graph repeats groups, else ``value`` itself with G = H. Dims the graph does not prove are
    LinearAttention's to check at run time (its q and k must be (B, T, H N) for the state's N)."""
    dims = _int_dims(shapes, value)
    if dims and (len(dims) != 3 or (isinstance(dims[2], int) and dims[2] != heads * state_size)):
        raise Refusal(f"{what}'s dims {dims} are not (B, T, {heads} x {state_size})", value)
    outer = producer_of(value, "Reshape")
    repeat = producer_of(outer.inputs[0], "Expand") if outer is not None else None
    inner = producer_of(repeat.inputs[0], "Reshape") if repeat is not None else None
    if inner is None:
        return value, heads
    source = inner.inputs[0]
    # The groups' width is the inner Reshape's (its input's last dim must be G N for the graph to run at all).
    inner_target = const_ints(inner.inputs[1])
    if inner_target is None or len(inner_target) < 3 or inner_target[-1] != state_size:
        raise Refusal(f"{what}'s groups are reshaped to {inner_target}, not (.., G, .., {state_size})", inner.inputs[1])
    groups = int(np.prod(inner_target[2:])) // state_size
    if groups < 1 or heads % groups:
        raise Refusal(f"{what} repeats {groups} groups to {heads} heads", source)
    # Every shape on the way keeps the batch and length (0: copy) and is a constant otherwise, so each (b, t) row is
    # moved by the same map: emulated on 2 x 3 rows, it must be group h // (H / G) to head h, element by element.
    for node in (inner, repeat, outer):
        target = const_ints(node.inputs[1])
        keep = [1, 1] if node is repeat else [0, 0]
        if target is None or target[:2] != keep or any(t < 1 for t in target[2:]):
            raise Refusal(f"{what}'s {node.op_type} to {target} does not keep the batch and length", node.inputs[1])
    leaf = leaf_indices([2, 3, groups * state_size])
    got = emulate(value, {source: leaf}, {})
    rows = np.repeat(leaf.reshape(2, 3, groups, 1, state_size), heads // groups, axis=3)
    if got is None or got.shape != (2, 3, heads * state_size) or not np.array_equal(got, rows.reshape(2, 3, -1)):
        raise Refusal(f"{what} is not its groups repeated to the heads (group h // (H / G) to head h)", value)
    return source, groups


linear_attention_scan_rules = pattern.RewriteRuleSet(
    [
        LinearAttentionScanFusion.rule("LinearAttentionScan", domain=BUILDER_DOMAIN),
        LinearAttentionScanFusion.rule("onnx::LinearAttentionScan", domain=STANDARD_DOMAIN),
    ]
)
linear_attention_scan_rules.remove_unused_nodes = False


def fuse_linear_attention_scan(model: ir.Model, log: FusionLog | None = None) -> int:
    """Replace every proven gated LinearAttention of ``model`` in place; return how many were replaced."""
    return apply_with_log(linear_attention_scan_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every gated LinearAttention (ORT's or ONNX's) left in ``graph``."""
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(graph)
        if node.op_type == "LinearAttention"
        and node.domain in _KNOWN_ATTRIBUTES_BY_DOMAIN
        and node.attributes.get_string("update_rule", "") == "gated"
    ]


__all__ = [
    "LinearAttentionScanFusion",
    "find_anchors",
    "fuse_linear_attention_scan",
    "linear_attention_scan_rules",
]
