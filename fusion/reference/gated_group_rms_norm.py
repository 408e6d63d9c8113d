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

import numpy as np
import onnx

from fusion.reference._common import (
    DOMAIN,
    MANTISSA_BITS,
    MIN_EXPONENT,
    SUPPORTED_TYPES,
    reference_op,
    sigmoid,
)

OP_TYPE = "GatedGroupRMSNorm"


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
    flip_gated: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Return ``GatedGroupRMSNorm(y, z, w)`` as docs/op.md defines it.

    ``norm_dtype`` / ``output_dtype`` default to ``y.dtype``; ``gated_dtype`` defaults to float32 (h is not
    rounded). With ``return_normed`` also returns ``n``, the normalized value at its rounding point
    (``norm_dtype``), for ``budget_report``. Raises ValueError for any input the op rejects, with the same
    conditions as the kernels.

    ``flip_gated`` (a boolean mask of Y's shape, with a half ``gated_dtype``) evaluates one *consistent
    evaluation* of the accuracy budget (``budget_report``): where it is True, h is rounded to the neighbour
    across its nearest ``gated_dtype`` rounding tie instead of to the nearest value, and the group's nf
    follows from the values taken.
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

    if y.size == 0:  # a zero-size leading axis, or C = 0 (no groups to reshape into)
        empty = np.zeros(y.shape, output_dtype)
        return (empty, np.zeros(y.shape, norm_dtype)) if return_normed else empty
    cd = np.dtype(compute_dtype)
    groups = y.reshape(-1, channels // group_size, group_size)
    gate = z.reshape(groups.shape).astype(cd)
    with np.errstate(over="ignore", invalid="ignore"):  # NaN/Inf inputs propagate, as in the kernels
        h = groups.astype(cd) * (gate * sigmoid(gate))
        if gated_dtype != np.float32:  # rounding point 0 (float32: none, whatever compute_dtype is)
            if flip_gated is None:
                h = h.astype(gated_dtype).astype(cd)
            else:
                rounded, other, _ = tie_neighbours(h, gated_dtype)
                h = np.where(np.asarray(flip_gated, bool).reshape(h.shape), other, rounded).astype(cd)
        m2 = np.sum(h * h, axis=-1, keepdims=True, dtype=cd)
        inv_rms = (cd.type(1.0) / np.sqrt(m2 / cd.type(group_size) + cd.type(epsilon))).astype(cd)
        normed = (h * inv_rms).astype(norm_dtype)
        out = (w.astype(cd).reshape(-1, group_size) * normed.astype(cd)).astype(output_dtype)
    if return_normed:
        return out.reshape(y.shape), normed.reshape(y.shape)
    return out.reshape(y.shape)


def tie_neighbours(x: np.ndarray, dtype: np.dtype | type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (rounded, other, distance) for values ``x`` rounded to ``dtype``, all float64: the nearest
    value (even on a tie), its neighbour on the other side of the rounding tie nearest to ``x``, and the
    relative distance ``|x - tie| / |x|`` of ``x`` from that tie (inf for 0 and non-finite values, and at
    the overflow threshold, whose other side is Inf)."""
    dtype = np.dtype(dtype)
    wide = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        rounded = wide.astype(dtype)
        toward = np.where(wide >= rounded.astype(np.float64), np.inf, -np.inf).astype(dtype)
        other = np.nextafter(rounded, toward).astype(np.float64)
        rounded = rounded.astype(np.float64)
        tie = (rounded + other) / 2
        distance = np.abs(wide - tie) / np.abs(wide)
    usable = np.isfinite(wide) & np.isfinite(rounded) & np.isfinite(other) & (wide != 0)
    return rounded, np.where(usable, other, rounded), np.where(usable, distance, np.inf)


def _evaluate_node(
    y: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    epsilon: float | None = None,
    group_size: int | None = None,
    norm_dtype: int | None = None,
    output_dtype: int | None = None,
    gated_dtype: int | None = None,
) -> tuple[np.ndarray]:
    """Return ``(gated_group_rms_norm(...),)`` of a node's inputs and attributes (dtypes as TensorProto types)."""
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


#: ``onnx.reference`` implementation, so ``ReferenceEvaluator`` runs fused models.
GatedGroupRMSNorm = reference_op(DOMAIN, OP_TYPE, _evaluate_node)


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


def ulp_of(x: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """Return the spacing of ``dtype`` at |x| (float64), subnormal range included."""
    dtype = np.dtype(dtype)
    mag = np.abs(np.asarray(x, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    exponent = np.maximum(np.where(mag > 0, exponent, MIN_EXPONENT[dtype]), MIN_EXPONENT[dtype])
    return np.exp2(exponent - MANTISSA_BITS[dtype])


#: Relative distance from a half-precision rounding tie within which a float32 kernel's value may round to
#: either neighbour (at the gated_dtype and norm_dtype rounding points): 16 float32 ulps. A kernel computes
#: h within ~5e-7 of the exact product, and h * nf within ~6e-7 (contrib_ops/cpu: the math core's comment).
GATED_TIE_WINDOW = 2.0**-20


def budget_report(
    actual: np.ndarray,
    expected: np.ndarray,
    *,
    bounds: tuple[np.ndarray, np.ndarray] | None = None,
    normed: np.ndarray | None = None,
    weight: np.ndarray | None = None,
) -> tuple[bool, str]:
    """Return (within budget, message) for ``actual`` against the float64 reference, as docs/op.md states it.

    ``bounds`` = (low, high) from ``reference_for_budget``: for each element, the intervals (a leading axis,
    one per choice of the element's own h at a gated_dtype tie) of the outputs that the *consistent
    evaluations* of its group reach. Without ``bounds`` the one consistent evaluation is ``expected``.
    Each element is measured from the nearest of its intervals (0 inside), relative to the nearest value
    ``v`` of that interval: half-precision outputs, <= 1 ulp(v) for >= 99.9 % of the elements (rounded
    down: below 1000 elements, all), <= 2 ulp(v) for all; float32 outputs, <= 2e-6 |v| + the smallest
    normal float32 for all. NaN must sit exactly where ``expected`` has NaN, and infinities must match.

    ``normed`` and ``weight`` (n from the reference with ``return_normed=True``, and W), for a caller
    without ``bounds``: where ``norm_dtype`` is coarser than the output, up to 0.1 % of the elements
    (float32 outputs too) may then exceed the 1-ulp / 2e-6 limit, and all must stay within the hard limit
    plus ``|w| * ulp(norm_dtype, n)`` (one n rounded across a tie).
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
    if bounds is None:
        low = high = e64[None]
    else:
        low = np.asarray(bounds[0], np.float64).reshape(-1, *e64.shape)
        high = np.asarray(bounds[1], np.float64).reshape(-1, *e64.shape)
        # Groups with NaN/Inf (or h rounded to Inf) have no intervals: their one evaluation is expected.
        usable = np.isfinite(low) & np.isfinite(high)
        low, high = np.where(usable, low, e64), np.where(usable, high, e64)
    with np.errstate(invalid="ignore", over="ignore"):
        nearest = np.clip(np.where(finite, a64, e64), low, high)  # per interval
        err = np.where(finite, np.abs(a64 - nearest), 0.0)
    if actual.dtype == np.float32:
        tight = 2e-6 * np.abs(nearest) + np.finfo(np.float32).tiny
        strict = tight
    else:
        tight = ulp_of(nearest, actual.dtype)
        strict = 2 * tight
    extra = np.zeros_like(e64)
    coarser_norm = normed is not None and MANTISSA_BITS[np.asarray(normed).dtype] < MANTISSA_BITS[actual.dtype]
    if coarser_norm:
        n = np.asarray(normed)
        w = np.broadcast_to(np.abs(np.asarray(weight, np.float64)), e64.shape)
        extra = np.where(finite, w * ulp_of(n.astype(np.float64), n.dtype), 0.0)
    # An element is as far over as its nearest interval lets it be.
    over_tight = int(np.all(err > tight, axis=0).sum())
    over_strict = int(np.all(err > strict + extra, axis=0).sum())
    allowed = int(0.001 * actual.size) if (actual.dtype != np.float32 or coarser_norm) else 0
    ok = mismatched_special == 0 and over_strict == 0 and over_tight <= allowed
    unit_name = "rel 2e-6" if actual.dtype == np.float32 else "1 ulp"
    worst = float(np.max(np.min(err / tight, axis=0)))
    msg = (
        f"{over_tight} of {actual.size} elements > {unit_name} (allowed {allowed}), "
        f"{over_strict} over the hard limit, {mismatched_special} NaN/Inf mismatches; "
        f"worst error {worst:.3g} x ({unit_name})"
    )
    return ok, msg


def gated_values(
    y: np.ndarray, z: np.ndarray, gated_dtype: np.dtype | type | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (h, other, tie_close), float64 and of Y's shape: h as the float64 reference computes it (rounded
    to a half ``gated_dtype``), the neighbour across h's nearest ``gated_dtype`` rounding tie, and where the
    exact product lies within ``GATED_TIE_WINDOW`` of that tie (other = h and no tie-close value where
    ``gated_dtype`` is float32 or absent)."""
    y, z = np.asarray(y), np.asarray(z)
    gated_dtype = np.dtype(np.float32 if gated_dtype is None else gated_dtype)
    gate = z.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        h = y.astype(np.float64) * (gate * sigmoid(gate))  # as gated_group_rms_norm computes it
    if gated_dtype == np.float32:
        return h, h, np.zeros(h.shape, bool)
    rounded, other, distance = tie_neighbours(h, gated_dtype)
    return rounded, other, distance <= GATED_TIE_WINDOW


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
) -> dict[str, Any]:
    """Return the float64 reference and the intervals of its consistent evaluations, as ``budget_report``'s
    keyword arguments ``expected`` and ``bounds`` (docs/op.md, accuracy budget).

    A consistent evaluation takes, for every h within ``GATED_TIE_WINDOW`` of a half ``gated_dtype``
    rounding tie, either neighbour, and the group's nf from the values taken (float64); for every
    ``h * nf`` within the window of a half ``norm_dtype`` tie, either neighbour of n. ``bounds`` = (low,
    high), each of shape ``(2, *Y.shape)``: for an element whose own h keeps its nearest value (index 0)
    or takes the other neighbour (index 1, the same as 0 where h is not tie-close), the lowest and highest
    output of the consistent evaluations, over the interval of nf that the choices of the group's other
    tie-close h span.
    """
    attrs = dict(epsilon=epsilon, group_size=group_size, norm_dtype=norm_dtype, output_dtype=output_dtype)
    expected = gated_group_rms_norm(y, z, w, **attrs, gated_dtype=gated_dtype, compute_dtype=np.float64)
    y, z, w = np.asarray(y), np.asarray(z), np.asarray(w)
    norm_dtype = np.dtype(y.dtype if norm_dtype is None else norm_dtype)
    output_dtype = np.dtype(y.dtype if output_dtype is None else output_dtype)
    if y.size == 0:
        return {"expected": expected, "bounds": (expected.astype(np.float64), expected.astype(np.float64))}
    shape = (-1, y.shape[-1] // group_size, group_size)
    h, other, close = (a.reshape(shape) for a in gated_values(y, z, gated_dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        # Taking the other neighbour moves the group's sum of squares by d; the group's other tie-close h
        # move it by at most their negative and positive changes together.
        d = np.where(close, other * other - h * h, 0.0)
        m2 = np.sum(h * h, axis=-1, keepdims=True)
        down = np.sum(np.minimum(d, 0.0), axis=-1, keepdims=True)
        up = np.sum(np.maximum(d, 0.0), axis=-1, keepdims=True)
        others_low = m2 + np.minimum(down - np.minimum(d, 0.0), 0.0)
        others_high = m2 + np.maximum(up - np.maximum(d, 0.0), 0.0)
        weight = np.broadcast_to(w.astype(np.float64).reshape(-1, group_size), h.shape)
        ranges = dict(group_size=group_size, epsilon=epsilon, norm_dtype=norm_dtype, output_dtype=output_dtype)
        low, high = _output_range(h, others_low, others_high, weight, **ranges)
        if not close.any():
            return {"expected": expected, "bounds": (low.reshape(y.shape), high.reshape(y.shape))}
        # The tie-close elements that take the other neighbour: their own change moves m2 by d.
        low_taken, high_taken = low.copy(), high.copy()
        others = (np.broadcast_to(m2_end, h.shape)[close] + d[close] for m2_end in (others_low, others_high))
        low_taken[close], high_taken[close] = _output_range(other[close], *others, weight[close], **ranges)
    return {
        "expected": expected,
        "bounds": (np.stack([low, low_taken]).reshape(2, *y.shape), np.stack([high, high_taken]).reshape(2, *y.shape)),
    }


def _output_range(
    h: np.ndarray,
    m2_low: np.ndarray,
    m2_high: np.ndarray,
    weight: np.ndarray,
    *,
    group_size: int,
    epsilon: float,
    norm_dtype: np.dtype,
    output_dtype: np.dtype,
) -> tuple[np.ndarray, np.ndarray]:
    """Return the lowest and highest output (float64) of elements with gated value ``h`` whose group's sum
    of squares lies in [m2_low, m2_high], through both rounding points (a half norm_dtype's tie window
    included)."""
    nf_high = 1.0 / np.sqrt(m2_low / group_size + epsilon)
    nf_low = 1.0 / np.sqrt(m2_high / group_size + epsilon)
    t_low = np.minimum(h * nf_low, h * nf_high)
    t_high = np.maximum(h * nf_low, h * nf_high)
    if norm_dtype != np.float32:  # an h * nf within the window of a norm_dtype tie may round either way
        t_low, t_high = t_low - GATED_TIE_WINDOW * np.abs(t_low), t_high + GATED_TIE_WINDOW * np.abs(t_high)
    # Rounding and the weight multiply are monotonic: the ends of the interval map to the ends.
    ends = [
        (weight * t.astype(norm_dtype).astype(np.float64)).astype(output_dtype).astype(np.float64)
        for t in (t_low, t_high)
    ]
    return np.minimum(*ends), np.maximum(*ends)
