"""Graph reading the prefill rules share (fusion/rules/mamba_chunk_scan.py, fusion/rules/causal_conv1d.py): a
producer of a given op seen through copies (Identity, whole-range Slice), constant ints and scalars seen through
Casts, the operand orders of commutative ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion.reference.causal_conv1d import DOMAIN
from fusion.rules._decode import _BOOL_OPS, _SAME_TYPE_AS, Refusal, negative_zeros, producer_op
from fusion.shapes.dims import constant_array

SUPPORTED_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
#: The supported 16-bit types: exact in float32, so a graph's widening of them to float32 loses nothing
SIXTEEN_BIT_DTYPES = SUPPORTED_DTYPES - {ir.DataType.FLOAT}
ONNX_DOMAINS = ("", "ai.onnx")


def producer_of(value: ir.Value | None, *ops: str) -> ir.Node | None:
    """Return ``value``'s producer when it is one of ``ops`` in the ONNX domain, else None."""
    if value is None:
        return None
    producer = strip(value).producer()
    if producer is None or producer.domain not in ONNX_DOMAINS or producer.op_type not in ops:
        return None
    return producer


def strip(value: ir.Value) -> ir.Value:
    """Return what ``value`` copies through Identity nodes (torch's ``clone`` / ``contiguous``) and Casts to the
    type their input already has (TorchScript's ``.to(dtype)``), else itself."""
    while (node := value.producer()) is not None and node.domain in ONNX_DOMAINS and node.inputs:
        source = node.inputs[0]
        if source is None:
            break
        if node.op_type == "Identity" or (
            node.op_type == "Cast" and source.dtype is not None and source.dtype == value.dtype
        ):
            value = source
            continue
        break
    return value


def whole(value: ir.Value) -> ir.Value:
    """Return what ``value`` is a whole-range Slice of (``t[:, :, :]``: starts 0, ends past any size, steps 1)."""
    node = producer_of(value, "Slice")
    if node is None:
        return value
    # a whole-range slice: every listed axis from 0 to past its end (a view, the same elements in the same order)
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends = const_ints(inputs[1]), const_ints(inputs[2])
    steps = const_ints(inputs[4]) if inputs[4] is not None else None
    if starts is None or ends is None or any(starts) or any(e < 2**62 for e in ends):
        return value
    if inputs[4] is not None and (steps is None or any(step != 1 for step in steps)):
        return value
    return strip(inputs[0])


def same(a: ir.Value | None, b: ir.Value | None) -> bool:
    """Whether two values are one tensor, up to Identity copies."""
    return a is not None and b is not None and whole(strip(a)) is whole(strip(b))


def need(value: ir.Value | None, op: str, what: str) -> ir.Node:
    node = producer_of(value, op)
    if node is None:
        found = producer_op(strip(value)) if value is not None else None
        raise Refusal(f"{what} is not a {op} (found {found or 'a graph input or constant'})", value)
    return node


def const_ints(value: ir.Value | None) -> list[int] | None:
    array = constant_array(value)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.reshape(-1)]


def perm_of(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return None if attr is None else [int(v) for v in attr.as_ints()]


def axis_of(value: ir.Value | None, rank: int) -> int | None:
    """The constant axis ``value`` holds (one element), normalized to [0, rank); None if not constant."""
    axes = const_ints(value)
    if axes is None or len(axes) != 1 or not -rank <= axes[0] < rank:
        return None
    return axes[0] % rank


def mul_operands(node: ir.Node) -> list[tuple[ir.Value, ir.Value]]:
    a, b = node.inputs[0], node.inputs[1]
    return [(a, b), (b, a)]


def unit_scaled(value: ir.Value) -> ir.Value:
    """Return x for Div(x, 1) or Mul(x, 1) (torch's softplus with beta = 1, as dynamo writes it in bfloat16)."""
    node = producer_of(value, "Div", "Mul")
    if node is None:
        return value
    one = node.inputs[1]
    if node.op_type == "Mul" and constant_limit(node.inputs[0]) == 1.0:
        return node.inputs[1]
    return node.inputs[0] if constant_limit(one) == 1.0 else value


def constant_limit(value: ir.Value) -> float | None:
    """A constant scalar, seen through a Cast / CastLike (rounded to the type cast to), else None."""
    cast = producer_of(value, "Cast", "CastLike")
    source = cast.inputs[0] if cast is not None else value
    array = constant_array(source)
    if array is None or array.size != 1:
        return None
    if cast is not None and value.dtype is not None and value.dtype in SUPPORTED_DTYPES:
        return float(np.asarray(array.reshape(-1)[0:1]).astype(value.dtype.numpy())[0])
    return float(array.reshape(-1)[0])


def scalar_is(value: ir.Value | None, expected: float) -> bool:
    array = constant_array(value)
    if array is None or array.size != 1:
        return False
    got = float(array.reshape(-1)[0])
    return got == expected or (np.isnan(expected) and np.isnan(got))


#: Ops whose every output has the type of one input (ONNX's schemas), beyond those ``type_untyped_values`` types
#: (``_SAME_TYPE_AS``, whose tables this module reads):
#: TorchScript exports leave a prefill chain's Conv, Clip, Pad, Tile, CumSum and OneHot outputs untyped.
_OUTPUTS_TYPED_AS = {
    **dict.fromkeys(
        (
            "Clip",
            "Pad",
            "Tile",
            "CumSum",
            "Trilu",
            "Einsum",
            "Max",
            "Min",
            "Split",
            "Softplus",
            "Relu",
            "Abs",
            "Log",
            "Conv",
        ),
        0,
    ),
    "OneHot": 2,
}


def type_prefill_values(graph: ir.Graph) -> None:
    """Type the values of ``graph`` that ONNX inference left untyped, by their producers' schemas: what
    ``type_untyped_values`` types, and every output of the prefill chains' ops (``_OUTPUTS_TYPED_AS``), in one pass
    in graph order (a value's producer comes before its readers)."""
    for node in graph:
        if node.domain not in ONNX_DOMAINS:
            continue
        for position, output in enumerate(node.outputs):
            if output.dtype is None:
                dtype = _schema_type(node, position)
                if dtype is not None:
                    output.type = ir.TensorType(dtype)


def _schema_type(node: ir.Node, position: int) -> ir.DataType | None:
    """The type ``node``'s schema gives its output ``position`` from its typed inputs and attributes, else None."""
    op = node.op_type
    if op in _OUTPUTS_TYPED_AS or position == 0 and op in _SAME_TYPE_AS:
        index = _OUTPUTS_TYPED_AS.get(op, _SAME_TYPE_AS.get(op))
        source = node.inputs[index] if index is not None and len(node.inputs) > index else None
        return None if source is None else source.dtype
    if position != 0:
        return None
    if op == "Cast":
        to = node.attributes.get("to")  # a reference in a function body (to=@output_dtype): not known here
        return None if to is None or to.is_ref() else ir.DataType(to.as_int())
    if op in _BOOL_OPS:
        return ir.DataType.BOOL
    return ir.DataType.INT64 if op == "Shape" else None


def causal_conv1d_node(
    op,
    x: ir.Value,
    weight: ir.Value,
    bias: ir.Value | None,
    state: ir.Value | None,
    *,
    channels: int,
    width: int,
    activation: str,
    channels_last: int,
    dtype: ir.DataType,
    name: str,
    round_once: int = 0,
):
    """Write a CausalConv1d node (state_width = K - 1) with every input its model-local function takes: -0.0s for
    an absent bias (adding them is the identity) and a zero (B, C, K - 1) state for an absent one; return its
    (y, final_state). ``round_once`` = 1 is written as the attribute (the output rounded once to T), 0 left to its
    default."""
    if bias is None:
        zeros = negative_zeros(f"{name}_bias", channels, dtype)
        bias = op.initializer(zeros.const_value, name=zeros.name)
    if state is None:
        batch = op.Shape(x, start=0, end=1)
        rest = op.Constant(value_ints=[channels, width - 1])
        state = op.ConstantOfShape(op.Concat(batch, rest, axis=0), value=ir.tensor(np.zeros(1, dtype=dtype.numpy())))
    return op.CausalConv1d(
        x,
        weight,
        bias,
        state,
        _domain=DOMAIN,
        _version=1,
        _outputs=2,
        state_width=width - 1,
        activation=activation,
        channels_last=channels_last,
        **({"round_once": 1} if round_once else {}),
    )
