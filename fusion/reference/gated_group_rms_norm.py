"""Numpy reference of ``ai.mambafuse::GatedGroupRMSNorm`` — the executable form of docs/op.md.

For every row (leading axes flattened) and every contiguous group ``g`` of ``group_size`` columns::

    h[j]  = round(gated_dtype, f32(Y[j]) * (f32(Z[j]) * sigmoid(f32(Z[j]))))  # y * silu(gate), this order
    m2    = sum_j h[j]^2                                       # over the group
    nf    = 1 / sqrt(m2 / group_size + epsilon)
    n[j]  = round(norm_dtype,   h[j] * nf)
    O[j]  = round(output_dtype, f32(W[col]) * f32(n[j]))

The two rounding points (to ``norm_dtype`` before the weight multiply, to ``output_dtype`` after it)
are what HF ``NemotronHRMSNormGated`` / ``Zamba2RMSNormGated`` do; they decide whether a fused result
matches the graph it replaced, so they are kept exactly. The optional third one, ``gated_dtype`` (absent
or float: none), is where builders such as Microsoft's mobius round the gated product to the model's half
type before the norm.

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
        name = (
            onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else elem_type
        )
        raise ValueError(f"GatedGroupRMSNorm supports float, float16 and bfloat16; got element type {name}") from None


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
    gated_dtype: np.dtype | type | None = None,
    compute_dtype: np.dtype | type = np.float32,
    return_normed: bool = False,
    flip_gated_ties: float = 0.0,
    flip_norm_ties: float = 0.0,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Return ``GatedGroupRMSNorm(y, z, w)`` as docs/op.md defines it.

    ``norm_dtype`` / ``output_dtype`` default to ``y.dtype``; ``gated_dtype`` defaults to float32 (h is not
    rounded). With ``return_normed`` also returns ``n``, the normalized value at its rounding point
    (``norm_dtype``), for ``budget_report``. Raises ValueError for any input the op rejects, with the same
    conditions as the kernels.

    ``flip_gated_ties`` > 0 gives the *alternative* reference of ``budget_report``: every h whose exact
    value lies within that relative distance of a ``gated_dtype`` rounding tie is rounded to the other
    neighbour (an fp32 kernel computes h a few float32 ulps off, so it may land on either side).
    ``flip_norm_ties`` does the same for ``n`` at the ``norm_dtype`` rounding point.
    """
    y, z, w = np.asarray(y), np.asarray(z), np.asarray(w)
    for name, arr in (("Y", y), ("Z", z), ("W", w)):
        dtype_to_onnx_type(arr.dtype)  # raises for unsupported types
        if arr.ndim == 0:
            raise ValueError(f"{name} must have at least one axis, got a scalar")
    norm_dtype = np.dtype(y.dtype if norm_dtype is None else norm_dtype)
    output_dtype = np.dtype(y.dtype if output_dtype is None else output_dtype)
    gated_dtype = np.dtype(np.float32 if gated_dtype is None else gated_dtype)
    dtype_to_onnx_type(norm_dtype)
    dtype_to_onnx_type(output_dtype)
    dtype_to_onnx_type(gated_dtype)
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
    with np.errstate(over="ignore", invalid="ignore"):  # NaN/Inf inputs propagate, as in the kernels
        h = groups.astype(cd) * (gate * _sigmoid(gate))
        if gated_dtype != np.float32:  # rounding point 0 (float32: none, whatever compute_dtype is)
            h = _round_to(h, gated_dtype, flip_gated_ties).astype(cd)
        m2 = np.sum(h * h, axis=-1, keepdims=True, dtype=cd)
        inv_rms = (cd.type(1.0) / np.sqrt(m2 / cd.type(group_size) + cd.type(epsilon))).astype(cd)
        normed = _round_to(h * inv_rms, norm_dtype, flip_norm_ties)
        out = (w.astype(cd).reshape(-1, group_size) * normed.astype(cd)).astype(output_dtype)
    if return_normed:
        return out.reshape(y.shape), normed.reshape(y.shape)
    return out.reshape(y.shape)


def _round_to(h: np.ndarray, dtype: np.dtype, flip_ties: float) -> np.ndarray:
    """Return ``h`` rounded to ``dtype`` (nearest even); with ``flip_ties`` > 0, values within that relative
    distance of a rounding tie go to the neighbour on the other side of the tie instead."""
    rounded = h.astype(dtype)
    if flip_ties <= 0:
        return rounded
    with np.errstate(invalid="ignore", over="ignore"):
        wide = h.astype(np.float64)
        near = rounded.astype(np.float64)
        step = ulp_of(np.where(np.isfinite(near), near, 0.0), dtype)
        # The neighbour across the nearest tie: one ulp up or down from the rounded value.
        other = np.where(wide >= near, near + step, near - step)
        tie = (near + other) / 2
        close = np.isfinite(wide) & (np.abs(wide - tie) <= flip_ties * np.abs(wide))
        return np.where(close, other.astype(dtype), rounded)


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
        gated_dtype: int | None = None,
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
            gated_dtype=None if not gated_dtype else onnx_type_to_dtype(gated_dtype),
        )
        return (out,)


def reference_evaluator(model: onnx.ModelProto, **kwargs: Any):
    """Return an ``onnx.reference.ReferenceEvaluator`` that knows the fused op."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=[GatedGroupRMSNorm], **kwargs)


# --- accuracy budget (docs/op.md) -----------------------------------------------------------------


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


_MANTISSA_BITS = {np.dtype(np.float32): 23, np.dtype(np.float16): 10, bfloat16: 7}
_MIN_EXPONENT = {np.dtype(np.float32): -126, np.dtype(np.float16): -14, bfloat16: -126}


def ulp_of(x: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """Return the spacing of ``dtype`` at |x| (float64), subnormal range included."""
    dtype = np.dtype(dtype)
    mag = np.abs(np.asarray(x, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    exponent = np.maximum(np.where(mag > 0, exponent, _MIN_EXPONENT[dtype]), _MIN_EXPONENT[dtype])
    return np.exp2(exponent - _MANTISSA_BITS[dtype])


def budget_report(
    actual: np.ndarray,
    expected: np.ndarray,
    *,
    normed: np.ndarray | None = None,
    weight: np.ndarray | None = None,
    alternative: np.ndarray | None = None,
) -> tuple[bool, str]:
    """Return (within budget, message) for ``actual`` against a float64-evaluated ``expected``.

    The budget of docs/op.md. Half-precision outputs: <= 1 ulp for >= 99.9 % of elements, <= 2 ulp
    for all. float32 outputs: relative error <= 2e-6 (absolute floor: the smallest normal float32).
    NaN must sit exactly where the expected NaN sits, and infinities must match.

    When the value is rounded to a ``norm_dtype`` coarser than the output (``normed``, from the reference
    with ``return_normed=True``, and the ``weight``), an fp32 kernel and the float64 reference can round
    ``n`` to neighbouring values in a tie-close case. Such elements (at most 0.1 %) may then differ by
    ``|w| * ulp(norm_dtype, n)`` on top of the output budget.

    The same holds at the gated rounding point (``gated_dtype``), where one tie-close h that rounds the
    other way also moves its group's nf: ``alternative`` is the reference with every tie-close h flipped
    (``gated_group_rms_norm(..., flip_gated_ties=...)``), and each element is measured against the nearer
    of the two references.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return (
            False,
            f"shape/dtype {actual.shape} {actual.dtype} != expected {expected.shape} {expected.dtype}",
        )
    if actual.size == 0:
        return True, "empty"
    a64, e64 = actual.astype(np.float64), expected.astype(np.float64)
    nan_a, nan_e = np.isnan(a64), np.isnan(e64)
    special = nan_e | np.isinf(e64)
    mismatched_special = int(((nan_a ^ nan_e) | (np.isinf(e64) & (a64 != e64)) | (np.isinf(a64) & ~special)).sum())
    finite = ~special & np.isfinite(a64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.where(finite, np.abs(a64 - e64), 0.0)
        if alternative is not None:
            alt64 = np.asarray(alternative).astype(np.float64)
            err = np.where(np.isfinite(alt64), np.minimum(err, np.abs(a64 - alt64)), err)
    if actual.dtype == np.float32:
        tight = 2e-6 * np.abs(e64) + np.finfo(np.float32).tiny
        strict = tight
    else:
        unit = ulp_of(e64, actual.dtype)
        tight, strict = unit, 2 * unit
    extra = np.zeros_like(e64)
    coarser_norm = normed is not None and _MANTISSA_BITS[np.asarray(normed).dtype] < _MANTISSA_BITS[actual.dtype]
    if coarser_norm:
        n = np.asarray(normed)
        w = np.broadcast_to(np.abs(np.asarray(weight, np.float64)), e64.shape)
        extra = np.where(finite, w * ulp_of(n.astype(np.float64), n.dtype), 0.0)
    over_tight = int((err > tight).sum())
    over_strict = int((err > strict + extra).sum())
    allowed = int(0.001 * actual.size) if (actual.dtype != np.float32 or coarser_norm) else 0
    ok = mismatched_special == 0 and over_strict == 0 and over_tight <= allowed
    unit_name = "rel 2e-6" if actual.dtype == np.float32 else "1 ulp"
    worst = float(np.max(err / tight)) if err.size else 0.0
    msg = (
        f"{over_tight} of {actual.size} elements > {unit_name} (allowed {allowed}), "
        f"{over_strict} over the hard limit, {mismatched_special} NaN/Inf mismatches; "
        f"worst error {worst:.3g} x ({unit_name})"
    )
    return ok, msg


#: Relative distance from a gated_dtype rounding tie within which an fp32 kernel's h (a few float32 ulps
#: off the exact value) may round either way: 16 float32 ulps.
GATED_TIE_WINDOW = 2.0**-20


def reference_for_budget(
    y: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    *,
    epsilon: float,
    group_size: int,
    norm_dtype: np.dtype | type | None = None,
    output_dtype: np.dtype | type | None = None,
    gated_dtype: np.dtype | type | None = None,
) -> dict[str, np.ndarray | None]:
    """Return the float64 reference and what ``budget_report`` needs with it, as its keyword arguments:
    ``expected``, ``normed``, ``weight`` and ``alternative`` (None unless h is rounded to a half type)."""
    attrs = dict(epsilon=epsilon, group_size=group_size, norm_dtype=norm_dtype, output_dtype=output_dtype)
    expected, normed = gated_group_rms_norm(
        y, z, w, **attrs, gated_dtype=gated_dtype, compute_dtype=np.float64, return_normed=True
    )
    alternative = None
    rounds_h = gated_dtype is not None and np.dtype(gated_dtype) != np.float32
    # n is rounded to norm_dtype before a weight multiply: a tie-close n may round the other way too.
    rounds_n = np.dtype(y.dtype if norm_dtype is None else norm_dtype) != np.float32
    if rounds_h or rounds_n:
        alternative = gated_group_rms_norm(
            y,
            z,
            w,
            **attrs,
            gated_dtype=gated_dtype,
            compute_dtype=np.float64,
            flip_gated_ties=GATED_TIE_WINDOW if rounds_h else 0.0,
            flip_norm_ties=GATED_TIE_WINDOW if rounds_n else 0.0,
        )
    return {"expected": expected, "normed": normed, "weight": w, "alternative": alternative}
