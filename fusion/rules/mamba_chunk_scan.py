"""Fuse the Mamba-2 prefill scan (the chunked SSD algorithm) into ``ai.mambafuse::MambaChunkScan``.

The chain, as transformers' ``mamba2_chunk_scan`` torch fallback exports it (5.24 and 5.25, every Mamba-2 family;
dynamo optimized and not, transformers' exporter, TorchScript), per layer about 80 nodes. With ``chunk(v)`` =
``Reshape(Pad(v, zeros at the end of axis 1), [b, -1, Q, ...])``, ``segsum(v)`` = transformers' masked cumulative
sum (``Expand(Unsqueeze(v, -1))``, ``Where`` with the strictly-lower mask, ``CumSum`` over the rows, ``Where``
with the lower mask and -inf) and T the activations' type::

    d      = Clip(Where(v > 20, v, Softplus(v)), lo, hi)     v = dt + dt_bias          # T
    xdt    = f32(x) * Unsqueeze(f32(d), 3)  ;  adt = A * f32(d)                        # float32
    Xc, Ac, Bc, Cc = chunk(xdt), chunk(adt), chunk(heads(f32(B))), chunk(heads(f32(C)))
    Ah     = Transpose(Ac, [0, 3, 1, 2]) ;  Acum = CumSum(Ah, -1)
    Y_diag = Einsum("bclsh,bcshp->bclhp", Einsum("bclhn,bcshn->bclsh", Cc, Bc) * Transpose(Exp(segsum(Ah))), Xc)
    states = Einsum("bclhn,bclhp->bchpn", Bc * Unsqueeze(Transpose(Exp(Acum[..., -1:] - Acum))), Xc)
    new    = Einsum("bzch,bzhpn->bchpn", Transpose(Exp(segsum(Pad(Acum[..., -1], (1, 0))))),
                    Concat(zeros like states[:, :1] | Unsqueeze(initial_state, 1), states))
    Y_off  = Einsum("bclhn,bchpn->bclhp", Cc, new[:, :-1]) * Unsqueeze(Transpose(Exp(Acum)))
    y      = Slice(Reshape(Y_diag + Y_off, [b, -1, h, p]) + D * Pad(f32(x)), 0, T, axis 1)   # <- the root
    final_state = new[:, -1]                                                            # where read

Every node is checked (op, constant attributes and operands, which input is which) and every shape is the one the
graph proves (``fusion.shapes``; declared shapes are hints): the chunk padding is zeros at the end of the time axis,
of a length proven non-negative, the same for every operand and making every prompt whole chunks, the chunk reshapes
keep the batch and the trailing dims, the masks are the lower triangles of the size they mask, the zero state is
zeros of one chunk's state, and the output slice ends at the prompt's length. Then the zero-padded tokens change
nothing the slice keeps (their decay is exp(0) = 1 and their input 0), so the node computes the recurrence of
docs/mamba_chunk_scan.md on the unpadded prompt. A graph that computes something else — a chunk-level decay or zero
state fixed to the traced prompt's chunk count (an export specialized to one chunk), another mask, another chunk per
operand — is refused with the step that differs. TorchScript writes the padding's length, ``F.pad``'s lists, the
group-to-head repeat (``Tile`` by a ``OneHot``) and ``expand``'s targets as shape arithmetic that fusion.shapes
follows, and the softplus as ONNX's ``Softplus`` without torch's threshold (the same function up to rounding: see
``time_step``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.reference.mamba_chunk_scan import DOMAIN, SOFTPLUS_THRESHOLD
from fusion.rules._decode import (
    PlannedRule,
    Refusal,
    apply_with_log,
    dtype_name,
    negative_zeros,
    producer_op,
    take_over,
)
from fusion.rules._log import FusionLog, location
from fusion.rules._prefill import (
    ONNX_DOMAINS,
    SUPPORTED_DTYPES,
    axis_of,
    const_ints,
    constant_limit,
    mul_operands,
    need,
    perm_of,
    producer_of,
    same,
    scalar_is,
    strip,
    type_prefill_values,
    unit_scaled,
    whole,
)
from fusion.shapes import arith
from fusion.shapes.dims import (
    Dim,
    ForwardShapes,
    as_expression,
    constant_array,
    dims_equal,
    resolve_shape_tensor,
    simplified,
)

FORM = "prefill"
_F32 = ir.DataType.FLOAT

#: The five Einsums of the chunked algorithm, as transformers writes them (compared up to renaming the letters).
EQ_SCORES = "bclhn,bcshn->bclsh"
EQ_DIAG = "bclsh,bcshp->bclhp"
EQ_STATES = "bclhn,bclhp->bchpn"
EQ_PASS = "bzch,bzhpn->bchpn"
EQ_OFF = "bclhn,bchpn->bclhp"


def normalized_equation(equation: str) -> str:
    """Return an Einsum equation with its letters renamed in order of first appearance (spaces dropped)."""
    names: dict[str, str] = {}
    out = []
    for ch in equation.replace(" ", ""):
        if ch.isalpha():
            names.setdefault(ch, chr(ord("a") + len(names)))
            out.append(names[ch])
        else:
            out.append(ch)
    return "".join(out)


_NORMALIZED = {eq: normalized_equation(eq) for eq in (EQ_SCORES, EQ_DIAG, EQ_STATES, EQ_PASS, EQ_OFF)}


@dataclasses.dataclass
class _Plan:
    anchor: ir.Node
    x: ir.Value
    dt: ir.Value
    dt_bias: np.ndarray | None
    A: np.ndarray | ir.Value
    B: ir.Value
    C: ir.Value
    D: np.ndarray | None
    initial_state: ir.Value | None
    final_state: ir.Value | None
    dims: tuple[Dim, Dim, int, int, int, int]  # batch, length, heads, head_dim, groups, state_size
    dt_softplus: int
    dt_min: float
    dt_max: float
    leftovers: list[ir.Value]
    attributes: dict[str, Any]


def _einsum(value: ir.Value | None, equation: str, what: str) -> ir.Node:
    node = need(value, "Einsum", what)
    got = node.attributes.get_string("equation", "")
    if normalized_equation(got) != _NORMALIZED[equation]:
        raise Refusal(f"{what} is an Einsum '{got}', not the chunked algorithm's '{equation}'", node)
    return node


class MambaChunkScanFusion(PlannedRule):
    """Rewrites one prefill scan (transformers' chunked SSD) into a MambaChunkScan node.

    ``root`` is the node the chain ends in: "Slice" (the output cut back to the prompt: a prompt of any length),
    or "Add" / "Reshape" (no slice: the skip's Add or, without D, the output Reshape; proven only where the
    chunk padding is proven zero).
    """

    FORM = FORM

    def __init__(self, name: str, *, root: str) -> None:
        super().__init__(name)
        self._root = root

    def pattern(self, op, y, starts, ends, axes):
        if self._root == "Slice":
            return op.Slice(y, starts, ends, axes, _allow_other_inputs=True, _outputs=["sliced"])
        if self._root == "Add":
            return op.Add(y, starts, _outputs=["sliced"])
        return op.Reshape(y, starts, _allow_other_attributes=True, _outputs=["sliced"])

    def check(self, context, y, sliced, **_: Any) -> pattern.MatchResult:
        result = pattern.MatchResult()
        # Only a chunked scan's output is a candidate; everything else is not logged.
        if self._root == "Slice":
            anchor, slice_node, output = _diag_of(y), sliced.producer(), y
        else:
            anchor, slice_node, output = _diag_of(sliced), None, sliced
            if anchor is not None and any(_diag_of(user.outputs[0]) is anchor for user, _ in sliced.uses()):
                anchor = None  # a later node ends the chain (the skip's Add, or the Slice): its rule fuses it
            if anchor is not None and any(
                user.op_type == "Slice" and _diag_of(sliced) is anchor for user, _ in sliced.uses()
            ):
                anchor = None
        if anchor is None:
            return result.fail("not the chunked scan's output")
        try:
            self._plan = self._make_plan(anchor, slice_node, output)
        except Refusal as refusal:
            return self.refused(result, anchor, refusal)
        return result

    # the proof ------------------------------------------------------------------------------------------

    def _make_plan(self, anchor: ir.Node, slice_node: ir.Node | None, y: ir.Value) -> _Plan:
        graph = y.graph
        if self._shapes is None:
            type_prefill_values(graph)
            self._shapes = ForwardShapes(graph)
        return _Proof(self._shapes).run(anchor, slice_node, y)

    # rewrite --------------------------------------------------------------------------------------------

    def rewrite(self, op, **_: Any):
        plan: _Plan = self.take_plan()
        t = plan.x.dtype
        heads = plan.dims[2]
        base = plan.anchor.name or "mamba_chunk_scan"

        def initializer(data: np.ndarray, name: str):
            return op.initializer(ir.tensor(data, name=name), name=name)

        if plan.dt_bias is not None:
            dt_bias = initializer(plan.dt_bias.astype(t.numpy()), f"{base}_dt_bias")
        else:
            zeros = negative_zeros(f"{base}_dt_bias", heads, t)
            dt_bias = op.initializer(zeros.const_value, name=zeros.name)
        if isinstance(plan.A, np.ndarray):
            A = initializer(plan.A.astype(np.float32), f"{base}_A")
        else:
            A = op.Reshape(plan.A, op.Constant(value_ints=[heads]))
        D = initializer((plan.D if plan.D is not None else np.zeros(heads)).astype(np.float32), f"{base}_D")
        if plan.initial_state is not None:
            state = plan.initial_state
        else:
            # zeros (B, H, P, N): the batch from x, the rest constants
            batch = op.Shape(plan.x, start=0, end=1)
            rest = op.Constant(value_ints=[heads, plan.dims[3], plan.dims[5]])
            state = op.ConstantOfShape(op.Concat(batch, rest, axis=0), value=ir.tensor(np.zeros(1, dtype=np.float32)))
        out, final_state = op.MambaChunkScan(
            plan.x,
            plan.dt,
            dt_bias,
            A,
            plan.B,
            plan.C,
            D,
            state,
            _domain=DOMAIN,
            _version=1,
            _outputs=2,
            dt_softplus=plan.dt_softplus,
            dt_min=plan.dt_min,
            dt_max=plan.dt_max,
        )
        if plan.final_state is not None:
            take_over(plan.final_state, final_state)
        return out


def _counterexample(length: arith.QuasiAffine | None, pad: arith.QuasiAffine | None, chunk: int) -> str:
    """': at T = t it pads p tokens (t + p is not a multiple of Q)' for the first prompt length that shows it."""
    if length is None or pad is None or not length.is_symbol():
        return ""
    for size in range(1, 2 * math.lcm(pad.period, chunk) + 1):
        tokens = pad.at(size)
        if (size + tokens) % chunk:
            return f": at T = {size} it pads {tokens} tokens ({size + tokens} is not a multiple of {chunk})"
    return ""


def _diag_of(y: ir.Value) -> ir.Node | None:
    """The Y_diag Einsum behind a candidate output ``y`` (Reshape(Add(..)) [+ skip]), else None."""
    candidates = [y]
    add = producer_of(y, "Add")
    if add is not None:
        candidates = list(add.inputs)
    for value in candidates:
        reshape = producer_of(value, "Reshape")
        core = producer_of(reshape.inputs[0], "Add") if reshape is not None else None
        if core is None:
            continue
        for operand in core.inputs:
            node = producer_of(operand, "Einsum")
            if (
                node is not None
                and normalized_equation(node.attributes.get_string("equation", "")) == _NORMALIZED[EQ_DIAG]
            ):
                return node
    return None


class _Proof:
    """One chain's proof, step by step from the output slice back to the op's inputs."""

    def __init__(self, shapes: ForwardShapes) -> None:
        self.shapes = shapes
        self.aliases = shapes.aliases({})
        self.pad: Dim = None  # the chunk padding's length, the same for every chunked operand
        self.chunk: int | None = None
        self.t: ir.DataType | None = None

    # helpers --------------------------------------------------------------------------------------------

    def dims(self, value: ir.Value | None, what: str) -> list[Dim]:
        dims = self.shapes(value)
        if dims is None:
            raise Refusal(f"the shape of {what} is not proven by the graph", value)
        return dims

    def same_dims(self, got: list[Dim], expected: list[Dim], what: str, culprit: ir.Value | None) -> None:
        if len(got) != len(expected) or not all(dims_equal(a, b) for a, b in zip(got, expected, strict=True)):
            raise Refusal(f"{what} has dims {got}, not the proven {expected}", culprit)

    def widened(self, value: ir.Value, what: str) -> ir.Value:
        """The T value that ``value`` (float32) is: itself when T is float, else the source of its Cast."""
        if value.dtype != _F32:
            raise Refusal(f"{what} is {dtype_name(value.dtype)}, not float32", value)
        cast = producer_of(value, "Cast")
        if cast is not None and cast.inputs[0] is not None and cast.inputs[0].dtype in SUPPORTED_DTYPES:
            return cast.inputs[0]
        return value

    def chunked(self, value: ir.Value, what: str) -> ir.Value:
        """Prove ``value`` = Reshape(Pad(source, zeros at the end of axis 1), [b, -1, Q, rest]); return source."""
        reshape = need(value, "Reshape", f"the chunked {what}")
        pad = need(reshape.inputs[0], "Pad", f"the padded {what}")
        source = pad.inputs[0]
        length = self.zero_padded(pad, 1, what)
        source_dims = self.dims(source, what)
        out_dims = self.dims(value, f"the chunked {what}")
        if len(out_dims) != len(source_dims) + 1:
            raise Refusal(f"the chunked {what} has rank {len(out_dims)}, not {len(source_dims) + 1}", value)
        chunk = out_dims[2]
        if not isinstance(chunk, int) or chunk < 1:
            raise Refusal(f"the chunk size of the chunked {what} is not a proven constant ({chunk})", value)
        if self.chunk is None:
            self.chunk = chunk
        elif chunk != self.chunk:
            raise Refusal(f"{what} is chunked by {chunk} tokens, another operand by {self.chunk}", value)
        self.same_dims([out_dims[0], *out_dims[3:]], [source_dims[0], *source_dims[2:]], f"the chunked {what}", value)
        # the padding makes every prompt whole chunks: (T + pad) = chunks * Q for every T (else the graph's Reshape
        # fails for some prompts, and the padding is not the one the chunked algorithm pads by)
        padded = as_expression(source_dims[1]) if len(source_dims) > 1 else None
        pad_length = as_expression(length)
        chunks = as_expression(out_dims[1])
        total = None if padded is None or pad_length is None else arith.add(padded, pad_length)
        whole = None if chunks is None else arith.multiply(chunks, arith.QuasiAffine.constant(chunk))
        if total is None or whole is None or not dims_equal(simplified(total), simplified(whole)):
            raise Refusal(
                f"the chunk padding of {what} is not proven to make every prompt a whole number of {chunk}-token"
                f" chunks{_counterexample(padded, pad_length, chunk)}",
                pad.outputs[0],
            )
        return source

    def zero_padded(self, pad: ir.Node, axis: int, what: str) -> Dim:
        """Prove ``pad`` adds zeros at the end of ``axis`` only, by the chain's one padding length."""
        mode = pad.attributes.get_string("mode", "constant")
        if mode != "constant" or len(pad.inputs) > 3 and pad.inputs[3] is not None:
            raise Refusal(f"the padding of {what} is not a constant pad of the whole tensor", pad.outputs[0])
        if len(pad.inputs) > 2 and pad.inputs[2] is not None and not scalar_is(pad.inputs[2], 0.0):
            raise Refusal(f"the padding of {what} is not zeros", pad.outputs[0])
        amounts = resolve_shape_tensor(pad.inputs[1], self.aliases)
        rank = len(self.dims(pad.inputs[0], what))
        if amounts is None or len(amounts) != 2 * rank:
            raise Refusal(f"the padding amounts of {what} are not proven", pad.outputs[0])
        for index, amount in enumerate(amounts):
            if index != rank + axis and not dims_equal(amount, 0):
                raise Refusal(f"{what} is padded elsewhere than at the end of axis {axis}", pad.outputs[0])
        length = amounts[rank + axis]
        if isinstance(length, int):
            non_negative = length >= 0
        else:
            expression = getattr(length, "lower_bound", None)
            bound = expression() if callable(expression) else None
            non_negative = bound is not None and bound >= 0
        if not non_negative:
            raise Refusal(f"the padding of {what} is not proven non-negative ({length})", pad.outputs[0])
        if self.pad is None:
            self.pad = length
        elif not dims_equal(length, self.pad):
            raise Refusal(f"{what} is padded by {length} tokens, another operand by {self.pad}", pad.outputs[0])
        return length

    def transposed(self, value: ir.Value, perm: list[int], what: str) -> ir.Value:
        node = need(value, "Transpose", what)
        if perm_of(node) != perm:
            raise Refusal(f"{what} is a Transpose by {perm_of(node)}, not {perm}", value)
        return node.inputs[0]

    def unsqueezed(self, value: ir.Value, axis: int, what: str) -> ir.Value:
        node = need(value, "Unsqueeze", what)
        source = node.inputs[0]
        rank = len(self.dims(source, what)) + 1
        axes = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if axes is None and "axes" in node.attributes:
            axes = [int(v) for v in node.attributes["axes"].as_ints()]
        if axes is None or len(axes) != 1 or axes[0] % rank != axis % rank:
            raise Refusal(f"{what} is an Unsqueeze at {axes}, not at {axis}", value)
        return source

    def cumsum(self, value: ir.Value, axis: int, what: str) -> ir.Value:
        node = need(value, "CumSum", what)
        source = node.inputs[0]
        rank = len(self.dims(source, what))
        if node.attributes.get_int("exclusive", 0) or node.attributes.get_int("reverse", 0):
            raise Refusal(f"{what} is an exclusive or reverse CumSum", value)
        if axis_of(node.inputs[1], rank) != axis % rank:
            raise Refusal(f"{what} sums over another axis than {axis}", value)
        return source

    def exp_of(self, value: ir.Value, what: str) -> ir.Value:
        return need(value, "Exp", what).inputs[0]

    def kept_where(self, value: ir.Value, fill: float, diagonal: int, what: str) -> ir.Value:
        """Prove ``value`` = the data where tril(ones, ``diagonal``) over its last two axes, else ``fill``."""
        node = need(value, "Where", what)
        condition, first, second = node.inputs
        if scalar_is(first, fill):
            data, keep_when_true = second, False
        elif scalar_is(second, fill):
            data, keep_when_true = first, True
        else:
            raise Refusal(f"{what} does not fill with {fill}", value)
        size = self.dims(data, what)[-2:]
        self.lower_mask(condition, keep_when_true, diagonal, size, what)
        return data

    def lower_mask(self, condition: ir.Value, keep_when_true: bool, diagonal: int, size: list[Dim], what: str) -> None:
        array = constant_array(condition)
        if array is not None:
            if array.dtype != np.bool_ or array.ndim != 2 or not all(isinstance(d, int) for d in size):
                raise Refusal(f"the mask of {what} is not a constant square boolean", condition)
            expected = np.tril(np.ones(tuple(size), dtype=bool), diagonal)  # type: ignore[arg-type]
            kept = array if keep_when_true else ~array
            if kept.shape != expected.shape or not np.array_equal(kept, expected):
                raise Refusal(f"the mask of {what} is not the lower triangle (diagonal {diagonal})", condition)
            return
        source = condition
        if not keep_when_true:
            not_node = need(condition, "Not", f"the mask of {what}")
            source = not_node.inputs[0]
        trilu = need(source, "Trilu", f"the mask of {what}")
        if trilu.attributes.get_int("upper", 1) != 0:
            raise Refusal(f"the mask of {what} is an upper triangle", source)
        k = const_ints(trilu.inputs[1]) if len(trilu.inputs) > 1 and trilu.inputs[1] is not None else [0]
        if k is None or k != [diagonal]:
            raise Refusal(f"the mask of {what} keeps diagonal {k}, not {diagonal}", source)
        ones = trilu.inputs[0]
        self.same_dims(self.dims(ones, f"the mask of {what}"), list(size), f"the mask of {what}", ones)
        if not self.all_true(ones):
            raise Refusal(f"the mask of {what} is not the triangle of a tensor of ones", ones)

    def all_true(self, value: ir.Value) -> bool:
        array = constant_array(value)
        if array is not None:
            return bool(np.all(array))
        node = producer_of(value, "Expand", "ConstantOfShape")
        if node is None:
            return False
        if node.op_type == "Expand":
            fill = constant_array(node.inputs[0])
            return fill is not None and bool(np.all(fill))
        attr = node.attributes.get("value")
        return attr is not None and bool(np.all(attr.as_tensor().numpy()))

    def all_zero(self, value: ir.Value) -> bool:
        array = constant_array(value)
        if array is not None:
            return not np.any(array)
        node = producer_of(value, "Expand", "ConstantOfShape")
        if node is None:
            return False
        if node.op_type == "Expand":
            fill = constant_array(node.inputs[0])
            return fill is not None and not np.any(fill)
        attr = node.attributes.get("value")
        return attr is None or not np.any(attr.as_tensor().numpy())

    def segsum(self, value: ir.Value, what: str) -> ir.Value:
        """Prove ``value`` = transformers' segment sum of a source (.., L) over its last axis; return the source."""
        summed = self.kept_where(value, float("-inf"), 0, what)
        masked = self.cumsum(summed, -2, what)
        expanded = self.kept_where(masked, 0.0, -1, what)
        expand = need(expanded, "Expand", f"the repeated rows of {what}")
        source = self.unsqueezed(expand.inputs[0], -1, f"the repeated rows of {what}")
        source_dims = self.dims(source, what)
        out = self.dims(expanded, what)
        # Expand broadcasts: the rows keep the source's dims, the new last axis is 1 or the source's length
        # (a Where with the L x L mask broadcasts a 1 to L: the same values)
        if len(out) != len(source_dims) + 1 or not (dims_equal(out[-1], source_dims[-1]) or out[-1] == 1):
            raise Refusal(f"the repeated rows of {what} have dims {out}", expanded)
        self.same_dims(out[:-1], source_dims, f"the repeated rows of {what}", expanded)
        return source

    # the chain ------------------------------------------------------------------------------------------

    def run(self, anchor: ir.Node, slice_node: ir.Node | None, y: ir.Value) -> _Plan:
        chain_outputs: list[ir.Value] = [slice_node.outputs[0] if slice_node is not None else y]
        # y = Reshape(Y_diag + Y_off, [b, -1, h, p]) [+ D * Pad(f32(x))]
        add = producer_of(y, "Add")
        skip = None
        full = y
        if add is not None:
            for first, second in mul_operands(add):
                if producer_of(first, "Reshape") is not None and _diag_of(first) is anchor:
                    full, skip = first, second
                    break
        core = need(need(full, "Reshape", "the scan's output").inputs[0], "Add", "Y_diag + Y_off")
        diag_out, off_out = (
            (core.inputs[0], core.inputs[1])
            if core.inputs[0] is anchor.outputs[0]
            else (core.inputs[1], core.inputs[0])
        )
        # Y_diag = Einsum(Einsum(Cc, Bc) * Transpose(Exp(segsum(Ah))), Xc)
        scores_times_decay, Xc = anchor.inputs
        mul = need(scores_times_decay, "Mul", "the masked scores")
        scores_node, decay_t = None, None
        for first, second in mul_operands(mul):
            if producer_of(first, "Einsum") is not None:
                scores_node, decay_t = _einsum(first, EQ_SCORES, "the scores C·Bᵀ"), second
                break
        if scores_node is None:
            raise Refusal("the masked scores are not Einsum(C, B) * decays", mul.outputs[0])
        Cc, Bc = scores_node.inputs
        # the operands' chunking first: the chunk padding's arithmetic decides every chunk-level shape after it
        xdt = self.chunked(Xc, "x·dt")
        b_heads = self.chunked(Bc, "B")
        c_heads = self.chunked(Cc, "C")
        Ah = self.segsum(
            self.exp_of(self.transposed(decay_t, [0, 2, 3, 4, 1], "the decays"), "the decays"), "the decays"
        )
        Ac = self.transposed(Ah, [0, 3, 1, 2], "the chunked A·dt by head")
        # Y_off = Einsum(Cc, new[:, :-1]) * Unsqueeze(Transpose(Exp(Acum)), 4)
        off_mul = need(off_out, "Mul", "Y_off")
        off_einsum, out_decay = None, None
        for first, second in mul_operands(off_mul):
            if producer_of(first, "Einsum") is not None:
                off_einsum, out_decay = _einsum(first, EQ_OFF, "the state readout"), second
                break
        if off_einsum is None:
            raise Refusal("Y_off is not Einsum(C, states) * decays", off_mul.outputs[0])
        if not same(off_einsum.inputs[0], Cc):
            raise Refusal("the state readout reads another C than the scores", off_einsum.inputs[0])
        acum = self.exp_of(
            self.transposed(
                self.unsqueezed(out_decay, 4, "the readout's decays"), [0, 2, 3, 1], "the readout's decays"
            ),
            "the readout's decays",
        )
        if not same(self.cumsum(acum, -1, "the cumulative A·dt"), Ah):
            raise Refusal("the readout's decays are not the cumulative sums of the chunk's A·dt", acum)
        # the state passing: new = Einsum(decay_chunk, Concat(start, states)); new[:, :-1] to the readout
        previous = off_einsum.inputs[1]
        prev_slice = need(previous, "Slice", "the chunks' start states")
        self.sliced(prev_slice, start=0, end=-1, axis=1, what="the chunks' start states")
        new = prev_slice.inputs[0]
        pass_node = _einsum(new, EQ_PASS, "the state passing")
        decay_chunk, concat_out = pass_node.inputs
        try:
            padded_last = self.segsum(
                self.exp_of(self.transposed(decay_chunk, [0, 3, 2, 1], "the chunk decays"), "the chunk decays"),
                "the chunk decays",
            )
        except Refusal as refusal:
            chunks = (self.shapes(Xc) or [None, None])[1]
            fixed = self.shapes(decay_chunk)
            if fixed is not None and all(isinstance(d, int) for d in fixed) and not isinstance(chunks, int):
                raise Refusal(
                    f"the chunk-level decays have fixed dims {fixed}: the export specialized the number of chunks"
                    " to the traced prompt's, so the graph runs only prompts of that many chunks (longer ones fail"
                    " in its Expand)",
                    decay_chunk,
                ) from None
            raise refusal
        pad = need(padded_last, "Pad", "the chunk totals padded by one")
        # a constant list, or TorchScript's F.pad list reordered in the graph (fusion/shapes: _shape_matrix)
        amounts = resolve_shape_tensor(pad.inputs[1], self.aliases)
        if (
            amounts != [0, 0, 1, 0, 0, 0]
            or pad.attributes.get_string("mode", "constant") != "constant"
            or (len(pad.inputs) > 2 and pad.inputs[2] is not None and not scalar_is(pad.inputs[2], 0.0))
            or (len(pad.inputs) > 3 and pad.inputs[3] is not None)
        ):
            raise Refusal(f"the chunk totals are padded by {amounts}, not one zero in front", padded_last)
        gather = need(pad.inputs[0], "Gather", "the chunk totals")
        if not same(whole(gather.inputs[0]), acum) or not self.last_of(gather, acum):
            raise Refusal("the chunk totals are not the last cumulative sums of each chunk", gather.outputs[0])
        concat = need(concat_out, "Concat", "the states with the start state")
        if concat.attributes.get_int("axis", 0) != 1 or len(concat.inputs) != 2:
            raise Refusal("the start state is not concatenated in front of the chunk states", concat_out)
        start, states = concat.inputs
        states_node = _einsum(states, EQ_STATES, "the chunk states")
        b_decay, Xc_states = states_node.inputs
        if not same(Xc_states, Xc):
            raise Refusal("the chunk states read another x·dt than the diagonal blocks", Xc_states)
        b_mul = need(b_decay, "Mul", "the decayed B")
        decay_states = None
        for first, second in mul_operands(b_mul):
            if same(first, Bc):
                decay_states = second
                break
        if decay_states is None:
            raise Refusal("the chunk states do not read the scores' B", b_decay)
        sub = need(
            self.exp_of(
                self.transposed(self.unsqueezed(decay_states, 4, "the state decays"), [0, 2, 3, 1], "the state decays"),
                "the state decays",
            ),
            "Sub",
            "the state decays",
        )
        total, cumulative = sub.inputs
        if not same(cumulative, acum):
            raise Refusal("the state decays are not taken from the cumulative A·dt", sub.outputs[0])
        self.sliced(need(total, "Slice", "the chunk totals"), start=-1, end=None, axis=-1, what="the chunk totals")
        if not same(need(total, "Slice", "the chunk totals").inputs[0], acum):
            raise Refusal("the chunk totals are not the cumulative A·dt's last", total)
        # the start state: zeros like states[:, :1], or Unsqueeze(initial_state, 1)
        initial_state = self.start_state(start, states)
        # final state: new[:, -1], where read
        final_state = None
        for user, _index in new.uses():
            if user is prev_slice:
                continue
            if (
                user.op_type == "Gather"
                and user.domain in ONNX_DOMAINS
                and user.attributes.get_int("axis", 0) == 1
                and const_ints(user.inputs[1]) == [-1]
                and constant_array(user.inputs[1]).ndim == 0
                and final_state is None
            ):
                final_state = user.outputs[0]
                continue
            raise Refusal(f"the passed states are also read by a {user.op_type} ({location(user)})", new)
        if new.is_graph_output():
            raise Refusal("the passed states are a graph output", new)
        # the operands: x·dt, A·dt, B and C by head, chunked alike
        adt = self.chunked(Ac, "A·dt")
        x32, d_col = self.product_with_dt(xdt, 4, "x·dt")
        x = self.widened(x32, "x")
        self.t = x.dtype
        if self.t not in SUPPORTED_DTYPES:
            raise Refusal(f"x is {dtype_name(self.t)}, not float, float16 or bfloat16", x)
        x_dims = self.dims(x, "x")
        if len(x_dims) != 4 or not all(isinstance(d, int) for d in x_dims[2:]):
            raise Refusal(f"x's dims {x_dims} are not (B, T, H, P) with H and P proven", x)
        batch, length, heads, head_dim = x_dims
        d32 = self.unsqueezed(d_col, 3, "dt by channel") if producer_of(d_col, "Unsqueeze") else None
        if d32 is None:
            cast = need(d_col, "Cast", "dt by channel")
            d32 = cast.outputs[0]
            d_t = self.unsqueezed(cast.inputs[0], 3, "dt by channel")
        else:
            d_t = self.widened(d32, "dt")
        a32, d32_a = self.product_with_dt(adt, 3, "A·dt")
        d_t_a = self.widened(d32_a, "dt")
        if not same(d_t_a, d_t):
            raise Refusal("A·dt and x·dt read different time steps", d32_a)
        A = self.decay_rate(a32, heads)
        if d_t.dtype != self.t:
            raise Refusal(f"the time step is {dtype_name(d_t.dtype)}, not x's {dtype_name(self.t)}", d_t)
        dt, dt_bias, softplus, lo, hi = self.time_step(d_t, heads)
        self.same_dims(self.dims(dt, "dt"), [batch, length, heads], "dt", dt)
        B, groups, state_size = self.heads_of(b_heads, heads, "B")
        C, groups_c, state_size_c = self.heads_of(c_heads, heads, "C")
        if (groups, state_size) != (groups_c, state_size_c):
            raise Refusal("B and C have different groups or state sizes", C)
        for value, name in ((B, "B"), (C, "C")):
            self.same_dims(self.dims(value, name), [batch, length, groups, state_size], name, value)
            if value.dtype != self.t:
                raise Refusal(f"{name} is {dtype_name(value.dtype)}, not x's {dtype_name(self.t)}", value)
        # the skip D * Pad(f32(x)) and the slice back to T tokens
        D = None
        if skip is not None:
            D = self.skip(skip, x32, heads)
        if slice_node is not None:
            self.sliced(slice_node, start=0, end=length, axis=1, what="the output slice")
        elif not dims_equal(self.pad, 0):
            raise Refusal(
                "the output is not cut back to the prompt's length: the export traced a prompt whose length was a"
                f" multiple of the chunk size ({self.chunk}) and dropped the slice, so the graph is right only for"
                " such prompts",
                y,
            )
        if initial_state is not None:
            self.same_dims(
                self.dims(initial_state, "the initial state"),
                [batch, heads, head_dim, state_size],
                "the initial state",
                initial_state,
            )
        return _Plan(
            anchor=anchor,
            x=x,
            dt=dt,
            dt_bias=dt_bias,
            A=A,
            B=B,
            C=C,
            D=D,
            initial_state=initial_state,
            final_state=final_state,
            dims=(batch, length, heads, head_dim, groups, state_size),
            dt_softplus=softplus,
            dt_min=lo,
            dt_max=hi,
            leftovers=[*chain_outputs, *([final_state] if final_state is not None else [])],
            attributes={
                "heads": heads,
                "head_dim": head_dim,
                "groups": groups,
                "state_size": state_size,
                "graph_chunk": self.chunk,
                "dtype": dtype_name(self.t),
                "initial_state": initial_state is not None,
                "final_state": final_state is not None,
            },
        )

    def sliced(self, node: ir.Node, *, start: int, end: int | Dim | None, axis: int, what: str) -> None:
        """Prove ``node`` is Slice(data, [start], [end], [axis], [1]) (end None: to the end)."""
        inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
        rank = len(self.dims(inputs[0], what))
        if const_ints(inputs[1]) != [start] or axis_of(inputs[3], rank) != axis % rank:
            raise Refusal(f"{what} is not a slice from {start} on axis {axis}", node.outputs[0])
        if inputs[4] is not None and const_ints(inputs[4]) != [1]:
            raise Refusal(f"{what} has a step", node.outputs[0])
        if end is None:
            ends = const_ints(inputs[2])
            if ends is None or len(ends) != 1 or ends[0] < 2**62:
                raise Refusal(f"{what} does not run to the end", node.outputs[0])
            return
        if isinstance(end, int) and end < 0:
            if const_ints(inputs[2]) != [end]:
                raise Refusal(f"{what} does not end at {end}", node.outputs[0])
            return
        ends = resolve_shape_tensor(inputs[2], self.aliases)
        if ends is None or len(ends) != 1 or not dims_equal(ends[0], end):
            raise Refusal(f"{what} is not proven to end at the prompt's length ({end})", node.outputs[0])

    def last_of(self, gather: ir.Node, data: ir.Value) -> bool:
        """Whether ``gather`` takes the last element of ``data``'s last axis (a scalar index, so the axis goes)."""
        dims = self.dims(data, "the cumulative A·dt")
        index = constant_array(gather.inputs[1])
        if index is None or index.ndim != 0 or gather.attributes.get_int("axis", 0) % len(dims) != len(dims) - 1:
            return False
        return int(index) == -1 or (isinstance(dims[-1], int) and int(index) == dims[-1] - 1)

    def start_state(self, start: ir.Value, states: ir.Value) -> ir.Value | None:
        states_dims = self.dims(states, "the chunk states")
        if self.all_zero(start):
            self.same_dims(
                self.dims(start, "the zero start state"),
                [states_dims[0], 1, *states_dims[2:]],
                "the zero start state",
                start,
            )
            return None
        source = self.unsqueezed(start, 1, "the initial state")
        cast = producer_of(source, "Cast")
        if cast is not None:
            if source.dtype != _F32:
                raise Refusal("the initial state is not widened to float32", source)
            source = cast.inputs[0]
        if source.dtype not in SUPPORTED_DTYPES:
            raise Refusal(f"the initial state is {dtype_name(source.dtype)}", source)
        return source

    def product_with_dt(self, value: ir.Value, rank: int, what: str) -> tuple[ir.Value, ir.Value]:
        """``value`` = Mul(other, dt-ish): return (other, the dt operand)."""
        mul = need(value, "Mul", what)
        for first, second in mul_operands(mul):
            if self._is_dt(second):
                return first, second
        raise Refusal(f"{what} is not a product with the time step", value)

    def _is_dt(self, value: ir.Value) -> bool:
        probe = value
        for _ in range(3):
            node = producer_of(probe, "Cast", "Unsqueeze")
            if node is None:
                break
            probe = node.inputs[0]
        return producer_of(probe, "Clip", "Where", "Min", "Max") is not None

    def time_step(self, d: ir.Value, heads: int) -> tuple[ir.Value, np.ndarray | None, int, float, float]:
        """Prove d = Clip(Where(v > 20, v, Softplus(v)), lo, hi) or Clip(Softplus(v), lo, hi), v = dt + dt_bias;
        return dt and the rest."""
        lo, hi, value = self.limits(d)
        plain = producer_of(unit_scaled(value), "Softplus")
        if plain is not None:
            # TorchScript writes torch's softplus as ONNX's Softplus, log(1 + exp(v)), without the threshold: above
            # 20 that is v + log1p(exp(-v)), within 2.1e-9 of v, which is far below half an ulp of v (2^-20 in
            # float32) in every supported type: the threshold is a rounding detail of the same function.
            v = unit_scaled(plain.inputs[0])
        else:
            if producer_of(value, "Where") is None:
                found = producer_op(strip(value)) or "a graph input or constant"
                raise Refusal(
                    f"softplus(dt) is neither Softplus(v) nor torch's Where(v > 20, v, Softplus(v)) (found {found})",
                    value,
                )
            where = need(value, "Where", "softplus(dt)")
            condition, above, below = where.inputs
            greater = need(condition, "Greater", "softplus's threshold")
            v = unit_scaled(greater.inputs[0])
            if constant_limit(greater.inputs[1]) != SOFTPLUS_THRESHOLD or not same(above, v):
                raise Refusal("the time step's softplus has another threshold than torch's 20", condition)
            softplus = need(unit_scaled(below), "Softplus", "softplus(dt)")
            if not same(unit_scaled(softplus.inputs[0]), v):
                raise Refusal("softplus(dt) reads another value than its threshold test", below)
        dt, dt_bias = v, None
        add = producer_of(v, "Add")
        if add is not None:
            for first, second in mul_operands(add):
                bias = constant_array(second)
                if bias is not None and bias.size == heads and bias.shape[-1] == heads:
                    dt, dt_bias = first, bias.reshape(-1)
                    if second.dtype != self.t:
                        raise Refusal(f"dt_bias is {dtype_name(second.dtype)}, not x's {dtype_name(self.t)}", second)
                    break
        if dt.dtype != self.t:
            raise Refusal(f"dt is {dtype_name(dt.dtype)}, not x's {dtype_name(self.t)}", dt)
        return dt, dt_bias, 1, lo, hi

    def decay_rate(self, a32: ir.Value, heads: int) -> np.ndarray | ir.Value:
        """A per head: a float32 constant broadcast to (H,), or a float32 value the graph proves (H,) (an export
        without constant folding computes -exp(A_log) at run time)."""
        if a32.dtype != _F32:
            raise Refusal(f"A is {dtype_name(a32.dtype)}, not float32", a32)
        A = constant_array(a32)
        if A is not None:
            if A.size not in (1, heads) or (A.size == heads and A.shape[-1] != heads):
                raise Refusal(f"A has shape {list(A.shape)}, not one value per head", a32)
            return np.broadcast_to(A.reshape(-1), (heads,)).astype(np.float32)
        dims = self.shapes(a32)
        if dims is None or [d for d in dims if d != 1] != [heads] or dims[-1] != heads:
            raise Refusal(f"A is not proven to hold one value per head (dims {dims})", a32)
        return a32

    def limits(self, d: ir.Value) -> tuple[float, float, ir.Value]:
        """Return (lo, hi, the clamped value) of d = Clip(v, lo, hi) or Min(Max(v, lo), hi) (either order), with
        constant limits (rounded to the type they are cast to); (-inf, inf, d) where d is not clamped."""
        lo, hi, value = -float("inf"), float("inf"), d
        clip = producer_of(d, "Clip")
        if clip is not None:
            bounds = []
            for i in (1, 2):
                bound = clip.inputs[i] if i < len(clip.inputs) else None
                bounds.append(None if bound is None else constant_limit(bound))
                if bound is not None and bounds[-1] is None:
                    raise Refusal("the time step's limits are not constants", bound)
            lo = -float("inf") if bounds[0] is None else bounds[0]
            hi = float("inf") if bounds[1] is None else bounds[1]
            return lo, hi, clip.inputs[0]
        for _ in range(2):
            node = producer_of(value, "Min", "Max")
            if node is None or len(node.inputs) != 2:
                break
            for first, second in mul_operands(node):
                bound = constant_limit(second)
                if bound is not None:
                    if node.op_type == "Max":
                        lo = bound
                    else:
                        hi = bound
                    value = first
                    break
            else:
                raise Refusal(f"the time step's {node.op_type} limit is not a constant", node.outputs[0])
        return lo, hi, value

    def heads_of(self, value: ir.Value, heads: int, name: str) -> tuple[ir.Value, int, int]:
        """Prove ``value`` = f32(src) repeated from G groups to H heads (group g serves heads g*H/G..); return src."""
        dims = self.dims(value, f"{name} by head")
        if len(dims) != 4 or not all(isinstance(d, int) for d in dims[2:]) or dims[2] != heads:
            raise Refusal(f"{name} by head has dims {dims}", value)
        state_size = dims[3]
        reshape = producer_of(value, "Reshape")
        if reshape is None:
            return self.widened(value, name), heads, state_size
        repeat = producer_of(reshape.inputs[0], "Expand", "Tile")
        if repeat is None:
            raise Refusal(f"{name}'s repeat to heads is not an Expand or a Tile", reshape.inputs[0])
        source = self.unsqueezed(repeat.inputs[0], 3, f"{name}'s repeat")
        src_dims = self.dims(source, name)
        if len(src_dims) != 4 or not isinstance(src_dims[2], int) or src_dims[3] != state_size:
            raise Refusal(f"{name}'s groups have dims {src_dims}", source)
        groups = src_dims[2]
        if groups < 1 or heads % groups:
            raise Refusal(f"{name} has {groups} groups for {heads} heads", source)
        repeated = self.dims(repeat.outputs[0], f"{name}'s repeat")
        expected = [src_dims[0], src_dims[1], groups, heads // groups, state_size]
        if repeat.op_type == "Tile":
            # constant repeats, or TorchScript's repeat_interleave: Reshape(OneHot([3], 5, [1, H // G]), [-1])
            reps = resolve_shape_tensor(repeat.inputs[1], self.aliases)
            if reps is None or len(reps) != 5 or reps[:3] + reps[4:] != [1, 1, 1, 1]:
                raise Refusal(f"{name}'s repeat tiles {reps}", repeat.outputs[0])
        self.same_dims(repeated, expected, f"{name}'s repeat", repeat.outputs[0])
        self.same_dims(dims, [src_dims[0], src_dims[1], heads, state_size], f"{name} by head", value)
        return self.widened(source, name), groups, state_size

    def skip(self, skip: ir.Value, x32: ir.Value, heads: int) -> np.ndarray:
        mul = need(skip, "Mul", "the skip D·x")
        for first, second in mul_operands(mul):
            pad = producer_of(second, "Pad")
            if pad is None or not same(pad.inputs[0], x32):
                continue
            self.zero_padded(pad, 1, "the skip's x")
            D = constant_array(first)
            dims = self.shapes(first)
            if (
                D is None
                or D.size != heads
                or dims is None
                or dims[-2:] != [heads, 1]
                or any(d != 1 for d in dims[:-2])
            ):
                raise Refusal(f"the skip's D is not a constant per head, (H, 1) (dims {dims})", first)
            return D.reshape(-1).astype(np.float32)
        raise Refusal("the skip is not D * the padded x", skip)


def _rules() -> list[pattern.RewriteRule]:
    return [MambaChunkScanFusion.rule(f"MambaChunkScan[{root}]", root=root) for root in ("Slice", "Add", "Reshape")]


mamba_chunk_scan_rules = pattern.RewriteRuleSet(_rules())
mamba_chunk_scan_rules.remove_unused_nodes = False


def fuse_mamba_chunk_scan(model: ir.Model, log: FusionLog | None = None) -> int:
    """Fuse every prefill scan of ``model`` in place; return how many were fused."""
    return apply_with_log(mamba_chunk_scan_rules, model, log)


def find_anchors(graph: ir.Graph) -> list[ir.Node]:
    """Return every chunked scan left in ``graph``: its diagonal-block Einsum (``EQ_DIAG``)."""
    return [
        node
        for node in ir.traversal.RecursiveGraphIterator(graph)
        if node.op_type == "Einsum"
        and node.domain in ONNX_DOMAINS
        and normalized_equation(node.attributes.get_string("equation", "")) == _NORMALIZED[EQ_DIAG]
    ]


__all__ = [
    "MambaChunkScanFusion",
    "find_anchors",
    "fuse_mamba_chunk_scan",
    "mamba_chunk_scan_rules",
    "normalized_equation",
]
