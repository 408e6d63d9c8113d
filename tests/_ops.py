"""Helpers shared by the kernel tests: one-node models of the op and random inputs for them."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.helper as oh

from contrib_ops.tests.golden import TIE_TYPE_MIXES, tie_close_inputs
from fusion.reference import (
    DOMAIN,
    OP_TYPE,
    SUPPORTED_TYPES,
    bfloat16,
    budget_report,
    dtype_to_onnx_type,
    gated_group_rms_norm,
    reference_for_budget,
)
from fusion.reference.gated_group_rms_norm import gated_values

FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16
TYPE_NAMES = {FLOAT: "f32", FLOAT16: "f16", BFLOAT16: "bf16"}


#: IR version of the test models: 10 loads in every onnxruntime the library supports (1.23 reads <= 11).
IR_VERSION = 10


def make_model(graph: onnx.GraphProto, opset: int = 18) -> onnx.ModelProto:
    """Return a model of ``graph`` importing the default domain at ``opset`` and ai.mambafuse 1."""
    return oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", opset), oh.make_opsetid(DOMAIN, 1)], ir_version=IR_VERSION
    )


#: (Y, Z, W, norm, output) types of the chains real exporters write (docs/forms.md, forms B and C).
EXPORTER_TYPE_MIXES: dict[str, tuple[int, int, int, int, int]] = {
    "C-f16": (FLOAT16, FLOAT16, FLOAT16, FLOAT16, FLOAT16),  # fp16 decode
    "B-f16": (FLOAT, FLOAT16, FLOAT, FLOAT, FLOAT16),  # fp16 prefill: y already f32, f32 weight
    "B-bf16": (FLOAT, BFLOAT16, FLOAT, FLOAT, BFLOAT16),
    "C-bf16": (BFLOAT16, BFLOAT16, BFLOAT16, BFLOAT16, BFLOAT16),
}

#: gated_dtype: absent (None), or set to each type the op accepts; and the type mixes (Y, Z, W, norm,
#: output) the gated rounding point is tested with: float32, float32 with a half output, the exporters'.
GATED_TYPES = (None, FLOAT, FLOAT16, BFLOAT16)
GATED_TYPE_MIXES: dict[str, tuple[int, int, int, int, int]] = {
    "f32": (FLOAT,) * 5,
    "f32-out-f16": (FLOAT, FLOAT, FLOAT, FLOAT16, FLOAT16),
    **EXPORTER_TYPE_MIXES,
}


def gated_type_id(gated_type: int | None) -> str:
    """The test id of a gated_dtype parameter."""
    return "absent" if gated_type is None else TYPE_NAMES[gated_type]


def stored_output_type(y_type: int, z_type: int, w_type: int, output_dtype: int) -> int:
    """Return the element type of the op's output tensor: output_dtype, except float32 when Y, Z and W
    are all float32 (the values are still rounded to output_dtype; see InferGatedGroupRMSNorm)."""
    return FLOAT if (y_type, z_type, w_type) == (FLOAT, FLOAT, FLOAT) else output_dtype


def io_type(elem_type: int) -> int:
    """Return the element type a test feeds/reads for ``elem_type``: numpy has no bfloat16 that ORT takes."""
    return FLOAT if elem_type == BFLOAT16 else elem_type


def one_node_model(
    y_type: int,
    z_type: int,
    w_type: int,
    *,
    shape: Sequence[int | str],
    group_size: int,
    epsilon: float = 1e-5,
    norm_dtype: int | None = None,
    output_dtype: int | None = None,
    gated_dtype: int | None = None,
    out_type: int | None = None,
    w_shape: Sequence[int] | None = None,
    z_shape: Sequence[int | str] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    """Return a model running one GatedGroupRMSNorm; bfloat16 values enter and leave through exact Casts.

    Inputs y, z, w are float32 where the op's type is bfloat16 (a Cast to bf16 of a value that is already
    bf16-representable is exact), and the output is cast to float32 when it is bfloat16.
    """
    attrs: dict[str, object] = {"epsilon": epsilon, "group_size": group_size}
    if norm_dtype is not None:
        attrs["norm_dtype"] = norm_dtype
    if output_dtype is not None:
        attrs["output_dtype"] = output_dtype
    if gated_dtype is not None:
        attrs["gated_dtype"] = gated_dtype
    result_type = out_type if out_type is not None else (output_dtype if output_dtype is not None else y_type)
    if out_type is None:
        result_type = stored_output_type(y_type, z_type, w_type, result_type)
    nodes: list[onnx.NodeProto] = []
    inputs = []
    op_inputs = []
    channels = shape[-1]
    shapes = {"y": list(shape), "z": list(z_shape or shape), "w": list(w_shape or [channels])}
    for name, elem_type in (("y", y_type), ("z", z_type), ("w", w_type)):
        inputs.append(oh.make_tensor_value_info(name, io_type(elem_type), shapes[name]))
        if elem_type == BFLOAT16:
            nodes.append(oh.make_node("Cast", [name], [f"{name}_bf16"], to=BFLOAT16))
            op_inputs.append(f"{name}_bf16")
        else:
            op_inputs.append(name)
    op_out = "out_bf16" if result_type == BFLOAT16 else "out"
    nodes.append(oh.make_node(OP_TYPE, op_inputs, [op_out], domain=DOMAIN, **attrs))
    if result_type == BFLOAT16:
        nodes.append(oh.make_node("Cast", [op_out], ["out"], to=FLOAT))
    graph = oh.make_graph(
        nodes, "gated_group_rms_norm", inputs, [oh.make_tensor_value_info("out", io_type(result_type), None)]
    )
    return make_model(graph, opset)


def random_inputs(
    rng: np.random.Generator, shape: Sequence[int], y_type: int, z_type: int, w_type: int, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (y, z, w) drawn from N(0, scale) and rounded to the op's input types."""
    y = (rng.standard_normal(shape) * scale).astype(SUPPORTED_TYPES[y_type])
    z = (rng.standard_normal(shape) * 2.0).astype(SUPPORTED_TYPES[z_type])
    w = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(SUPPORTED_TYPES[w_type])
    return y, z, w


def feed(arr: np.ndarray) -> np.ndarray:
    """Return the array a session is fed for ``arr`` (bfloat16 goes in as its exact float32 value)."""
    return arr.astype(np.float32) if arr.dtype == bfloat16 else arr


def as_type(arr: np.ndarray, elem_type: int) -> np.ndarray:
    """Return a session output converted back to the op's output type (exact for bf16 read as f32)."""
    return arr.astype(SUPPORTED_TYPES[elem_type])


EDGE_GROUP_SIZE, EDGE_GROUPS = 32, 8
#: (row, group) of the edge-value inputs whose output is NaN/Inf; every other group must stay finite.
EDGE_NONFINITE_GROUPS = {(1, 0), (1, 3), (1, 5), (2, 7)}


def edge_value_inputs(elem_type: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (y, z, w) of 3 rows x 8 groups of 32 in ``elem_type`` with one edge case per group: zeros,
    a zero gate, |h| ~ sqrt(eps), a saturated sigmoid, large values, NaN/+-Inf (EDGE_NONFINITE_GROUPS),
    gates in exp's underflow range."""
    dtype = SUPPORTED_TYPES[elem_type]
    rng = np.random.default_rng(11)
    group_size = EDGE_GROUP_SIZE
    y, z, w = random_inputs(rng, (3, group_size * EDGE_GROUPS), elem_type, elem_type, elem_type)
    y, z = y.astype(np.float32), z.astype(np.float32)

    def g(i: int) -> slice:
        return slice(i * group_size, (i + 1) * group_size)

    y[0, g(0)] = 0.0  # a zero group gives zeros
    z[0, g(1)] = 0.0  # zero gate: silu(0) = 0
    y[0, g(2)] *= 3e-3  # |h| ~ sqrt(eps): eps dominates the mean square
    z[0, g(3)] = np.linspace(-30.0, 30.0, group_size)  # saturated sigmoid on both sides
    y[0, g(4)] *= 1e3 if elem_type != FLOAT16 else 1e2  # large values (fp16 max is 65504)
    y[1, g(0)][5] = np.nan  # NaN in y
    z[1, g(3)][7] = np.inf  # +Inf gate: silu = +Inf, the group becomes NaN/Inf
    z[1, g(5)][2] = -np.inf  # -Inf gate: silu = -Inf * 0 = NaN
    y[2, g(7)][0] = np.inf
    z[2, g(6)] = np.linspace(-120.0, -80.0, group_size)  # exp underflow range of the sigmoid
    return y.astype(dtype), z.astype(dtype), w


def nonfinite_groups(out: np.ndarray) -> set[tuple[int, int]]:
    """Return the (row, group) pairs of an edge-value output that hold a NaN or an Inf."""
    finite = np.isfinite(out.astype(np.float32)).reshape(out.shape[0], -1, EDGE_GROUP_SIZE).all(axis=-1)
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(~finite), strict=True)}


def check_against_reference(
    make_session: Callable[[onnx.ModelProto], Any],
    y: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    *,
    group_size: int,
    epsilon: float = 1e-5,
    norm_type: int | None = None,
    out_type: int | None = None,
    gated_type: int | None = None,
) -> np.ndarray:
    """Run the op on (y, z, w) in a session from ``make_session``; assert it is within the accuracy budget
    of the float64 reference (docs/op.md) and return its output in the op's output type.

    ``gated_type`` None leaves the attribute gated_dtype out of the node (its default: float, no rounding).
    """
    types = [next(k for k, v in SUPPORTED_TYPES.items() if v == a.dtype) for a in (y, z, w)]
    model = one_node_model(
        *types,
        shape=list(y.shape),
        group_size=group_size,
        epsilon=epsilon,
        norm_dtype=norm_type,
        output_dtype=out_type,
        gated_dtype=gated_type,
    )
    result_type = out_type if out_type is not None else types[0]
    session = make_session(model)
    actual = as_type(session.run(None, {"y": feed(y), "z": feed(z), "w": feed(w)})[0], result_type)
    reference = reference_for_budget(
        y,
        z,
        w,
        epsilon=epsilon,
        group_size=group_size,
        norm_dtype=None if norm_type is None else SUPPORTED_TYPES[norm_type],
        output_dtype=None if out_type is None else SUPPORTED_TYPES[out_type],
        gated_dtype=None if not gated_type else SUPPORTED_TYPES[gated_type],
    )
    ok, message = budget_report(actual, **reference)
    assert ok, message
    return actual


def assert_one_consistent_evaluation(
    actual: np.ndarray,
    y: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    *,
    group_size: int,
    gated_type: int,
    epsilon: float = 1e-5,
) -> int:
    """Assert that a float32 output (float32 norm_dtype) is, element for element within 2e-6, ONE consistent
    evaluation of docs/op.md's budget: the reference with the tie-close h that the kernel rounded the other
    way flipped (``flip_gated``), every group's nf following from them. Return how many h were flipped.

    A check of the kernel independent of the budget's intervals: which h tipped is read off the output (the
    two neighbours differ by a half ulp, >= 2^-11, relative), then the reference is evaluated with those
    choices; a group whose nf followed other choices than its elements show fails.
    """
    dtype = SUPPORTED_TYPES[gated_type]
    rounded, other, close = gated_values(y, z, dtype)
    attrs = dict(epsilon=epsilon, group_size=group_size, norm_dtype=np.float32, output_dtype=np.float32)
    exact = gated_group_rms_norm(y, z, w, **attrs, gated_dtype=dtype, compute_dtype=np.float64)
    grouped = (-1, group_size)
    with np.errstate(invalid="ignore", divide="ignore"):
        # Per element, actual / exact = (the h taken / the nearest h) * (the group's nf / the exact nf).
        ratio = (actual.astype(np.float64) / exact).reshape(grouped)
        step = np.where(close, other / rounded, 1.0).reshape(grouped)
    tie_close = close.reshape(grouped)
    # The group's nf ratio: the median over its elements that are not tie-close; in a group of tie-close
    # elements only, the value that explains the most elements with one of their two choices.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the groups of tie-close elements only: NaN here
        scale = np.nanmedian(np.where(tie_close, np.nan, ratio), axis=-1, keepdims=True)
    for group in np.flatnonzero(tie_close.all(axis=-1)):
        candidates = np.concatenate([ratio[group], ratio[group] / step[group]])[:, None]
        near = np.minimum(np.abs(ratio[group] - candidates), np.abs(ratio[group] - candidates * step[group]))
        scale[group] = candidates[np.argmax((near <= 1e-6 * np.abs(candidates)).sum(axis=-1))]
    flip = (tie_close & (np.abs(ratio - scale * step) < np.abs(ratio - scale))).reshape(y.shape)
    taken = gated_group_rms_norm(y, z, w, **attrs, gated_dtype=dtype, compute_dtype=np.float64, flip_gated=flip)
    error = np.abs(actual.astype(np.float64) - taken)
    bad = error > 2e-6 * np.abs(taken) + np.finfo(np.float32).tiny
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} elements match no consistent evaluation (max error "
        f"{np.max(error / np.abs(taken)):.3g} relative; {flip.sum()} of {close.sum()} tie-close h flipped)"
    )
    return int(flip.sum())


__all__ = [
    "TIE_TYPE_MIXES",
    "assert_one_consistent_evaluation",
    "tie_close_inputs",
    "EDGE_GROUP_SIZE",
    "EDGE_NONFINITE_GROUPS",
    "edge_value_inputs",
    "nonfinite_groups",
    "EXPORTER_TYPE_MIXES",
    "GATED_TYPES",
    "GATED_TYPE_MIXES",
    "gated_type_id",
    "check_against_reference",
    "BFLOAT16",
    "FLOAT",
    "FLOAT16",
    "TYPE_NAMES",
    "as_type",
    "dtype_to_onnx_type",
    "feed",
    "make_model",
    "stored_output_type",
    "one_node_model",
    "random_inputs",
]
