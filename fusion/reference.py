"""Numpy reference of ``ai.mambafuse::GatedGroupRMSNorm`` — the executable form of DESIGN.md §1.

For every row (leading axes flattened) and every contiguous group ``g`` of ``group_size`` columns::

    h[j]  = f32(Y[j]) * (f32(Z[j]) * sigmoid(f32(Z[j])))      # y * silu(gate), this order
    m2    = sum_j h[j]^2                                       # over the group
    nf    = 1 / sqrt(m2 / group_size + epsilon)
    n[j]  = round(norm_dtype,   h[j] * nf)
    O[j]  = round(output_dtype, f32(W[col]) * f32(n[j]))

The two rounding points (to ``norm_dtype`` before the weight multiply, to ``output_dtype`` after it)
are what HF ``NemotronHRMSNormGated`` / ``Zamba2RMSNormGated`` do; they decide whether a fused result
matches the graph it replaced, so they are kept exactly.

``compute_dtype=np.float32`` mirrors the kernels; ``np.float64`` gives the "exact" evaluation that the
accuracy budget is measured against. bfloat16 comes from ``ml_dtypes`` (round-to-nearest-even).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx.reference.op_run import OpRun

DOMAIN = "ai.mambafuse"
OP_TYPE = "GatedGroupRMSNorm"

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: ONNX TensorProto element types the op accepts, and their numpy dtypes.
SUPPORTED_TYPES: dict[int, np.dtype] = {
    onnx.TensorProto.FLOAT: np.dtype(np.float32),
    onnx.TensorProto.FLOAT16: np.dtype(np.float16),
    onnx.TensorProto.BFLOAT16: bfloat16,
}


def onnx_type_to_dtype(elem_type: int) -> np.dtype:
    """Return the numpy dtype of a supported TensorProto element type, or raise ValueError."""
    try:
        return SUPPORTED_TYPES[elem_type]
    except KeyError:
        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else elem_type
        raise ValueError(
            f"GatedGroupRMSNorm supports float, float16 and bfloat16; got element type {name}"
        ) from None


def dtype_to_onnx_type(dtype: np.dtype | type) -> int:
    """Return the TensorProto element type of a supported numpy dtype, or raise ValueError."""
    dtype = np.dtype(dtype)
    for elem_type, candidate in SUPPORTED_TYPES.items():
        if candidate == dtype:
            return elem_type
    raise ValueError(f"GatedGroupRMSNorm supports float32, float16 and bfloat16; got {dtype}")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument never overflows; both branches are exact formulations.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype)


def gated_group_rms_norm(
    y: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    *,
    epsilon: float,
    group_size: int,
    norm_dtype: np.dtype | type | None = None,
    output_dtype: np.dtype | type | None = None,
    compute_dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """Return ``GatedGroupRMSNorm(y, z, w)`` as DESIGN.md §1 defines it.

    ``norm_dtype`` / ``output_dtype`` default to ``y.dtype``. Raises ValueError for any input the op
    rejects, with the same conditions as the kernels.
    """
    y, z, w = np.asarray(y), np.asarray(z), np.asarray(w)
    for name, arr in (("Y", y), ("Z", z), ("W", w)):
        dtype_to_onnx_type(arr.dtype)  # raises for unsupported types
        if arr.ndim == 0:
            raise ValueError(f"{name} must have at least one axis, got a scalar")
    norm_dtype = np.dtype(y.dtype if norm_dtype is None else norm_dtype)
    output_dtype = np.dtype(y.dtype if output_dtype is None else output_dtype)
    dtype_to_onnx_type(norm_dtype)
    dtype_to_onnx_type(output_dtype)
    if y.shape != z.shape:
        raise ValueError(f"Y and Z must have the same shape, got {y.shape} and {z.shape}")
    channels = y.shape[-1]
    if w.shape != (channels,):
        raise ValueError(f"W must have shape [C] = [{channels}], got {list(w.shape)}")
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    if channels % group_size != 0:
        raise ValueError(f"C = {channels} is not divisible by group_size = {group_size}")

    cd = np.dtype(compute_dtype)
    groups = y.reshape(-1, channels // group_size, group_size) if channels else y.reshape(-1, 0, group_size)
    gate = z.reshape(groups.shape).astype(cd)
    h = groups.astype(cd) * (gate * _sigmoid(gate))
    with np.errstate(over="ignore", invalid="ignore"):
        m2 = np.sum(h * h, axis=-1, keepdims=True, dtype=cd)
        inv_rms = (cd.type(1.0) / np.sqrt(m2 / cd.type(group_size) + cd.type(epsilon))).astype(cd)
        normed = (h * inv_rms).astype(norm_dtype)
        out = (w.astype(cd).reshape(-1, group_size) * normed.astype(cd)).astype(output_dtype)
    return out.reshape(y.shape)


class GatedGroupRMSNorm(OpRun):
    """``onnx.reference`` implementation, so ``ReferenceEvaluator`` runs fused models."""

    op_domain = DOMAIN

    def _run(  # type: ignore[override]
        self,
        y: np.ndarray,
        z: np.ndarray,
        w: np.ndarray,
        epsilon: float | None = None,
        group_size: int | None = None,
        norm_dtype: int | None = None,
        output_dtype: int | None = None,
    ) -> tuple[Any]:
        if epsilon is None or group_size is None:
            raise ValueError("GatedGroupRMSNorm needs the attributes epsilon and group_size")
        out = gated_group_rms_norm(
            y,
            z,
            w,
            epsilon=float(epsilon),
            group_size=int(group_size),
            norm_dtype=None if norm_dtype is None else onnx_type_to_dtype(norm_dtype),
            output_dtype=None if output_dtype is None else onnx_type_to_dtype(output_dtype),
        )
        return (out,)


def reference_evaluator(model: onnx.ModelProto, **kwargs: Any):
    """Return an ``onnx.reference.ReferenceEvaluator`` that knows the fused op."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=[GatedGroupRMSNorm], **kwargs)


# --- accuracy budget (DESIGN.md §1) -----------------------------------------------------------------


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return |a - b| in units in the last place of their (shared, half-precision or float32) dtype.

    Uses the ordered-integer trick: the bit patterns of finite floats, mapped so that integer order is
    float order, differ by the number of representable values between them. Equal NaNs count as 0,
    a NaN against a number as a huge distance.
    """
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype:
        raise ValueError(f"ulp_distance needs one dtype, got {a.dtype} and {b.dtype}")
    bits = {2: np.int16, 4: np.int32}[a.dtype.itemsize]

    def ordered(x: np.ndarray) -> np.ndarray:
        i = x.view(bits).astype(np.int64)
        sign_bit = np.int64(1) << (8 * a.dtype.itemsize - 1)
        return np.where(i < 0, -(i + sign_bit), i)  # -0.0 and +0.0 both map to 0

    dist = np.abs(ordered(a) - ordered(b))
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    dist = np.where(nan_a & nan_b, 0, dist)
    return np.where(nan_a ^ nan_b, np.iinfo(np.int64).max, dist)


def budget_report(actual: np.ndarray, expected: np.ndarray) -> tuple[bool, str]:
    """Return (within budget, message) for ``actual`` against a float64-evaluated ``expected``.

    Half precision: <= 1 ulp for >= 99.9 % of elements and <= 2 ulp for all. float32: relative error
    <= 2e-6 (with an absolute floor at the smallest normal float32 for values near zero). NaN must sit
    where the expected NaN sits.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False, f"shape/dtype {actual.shape} {actual.dtype} != expected {expected.shape} {expected.dtype}"
    if actual.size == 0:
        return True, "empty"
    if actual.dtype == np.float32:
        a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
        nan_a, nan_e = np.isnan(a64), np.isnan(e64)
        with np.errstate(invalid="ignore"):
            err = np.abs(a64 - e64)
            bad = (err > 2e-6 * np.abs(e64) + np.finfo(np.float32).tiny) & ~(nan_a & nan_e)
            same_inf = np.isinf(e64) & (a64 == e64)
            bad &= ~same_inf
        bad |= nan_a ^ nan_e
        rel = np.where(np.isfinite(err) & (e64 != 0), err / np.maximum(np.abs(e64), 1e-300), 0.0)
        msg = f"{int(bad.sum())} of {actual.size} elements exceed rel 2e-6; max rel error {float(rel.max()):.3g}"
        return not bad.any(), msg
    dist = ulp_distance(actual, expected)
    over1 = int((dist > 1).sum())
    over2 = int((dist > 2).sum())
    ok = over2 == 0 and over1 <= 0.001 * actual.size
    msg = (
        f"{over1} of {actual.size} elements > 1 ulp (allowed {int(0.001 * actual.size)}), "
        f"{over2} > 2 ulp; max {int(dist.max())} ulp"
    )
    return ok, msg
