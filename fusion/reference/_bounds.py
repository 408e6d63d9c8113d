"""Exact rounding and interval helpers shared by the decode-step references' accuracy budgets.

A budget here is an interval per output element: every value a correct kernel may produce for the given
inputs. It is built by following the op's formula with intervals in float64: a correctly rounded float32
operation followed by a rounding to T is monotone, so it maps an interval's endpoints to the result's
endpoints exactly; only operations whose last bits are not fixed by the contract (exp, log1p, sigmoid, a
sum whose order is free) widen the interval, by a bound on the magnitudes of their terms.
"""

from __future__ import annotations

import numpy as np

from fusion.reference._common import MANTISSA_BITS, MIN_EXPONENT, SUPPORTED_TYPES, bfloat16

#: Unit roundoff of float32 (half its ulp at 1).
U32 = 2.0**-24
#: Largest absolute error of one float32 rounding in the subnormal range (half the smallest subnormal).
TINY32 = 2.0**-150
#: Relative error allowed for a float32 exp, log1p or sigmoid (16 unit roundoffs, about 8 ulps).
TRANSCENDENTAL_ERROR = 16 * U32

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

_MAX = {
    np.dtype(np.float32): float(np.finfo(np.float32).max),
    np.dtype(np.float16): 65504.0,
    bfloat16: 3.3895313892515355e38,
}


def check_dtype(name: str, arr: np.ndarray, op_type: str) -> np.dtype:
    """Return ``arr.dtype`` if the decode-step ops accept it, else raise ValueError naming the input."""
    if arr.dtype not in SUPPORTED_TYPES.values():
        raise ValueError(f"{op_type}: {name} must be float, float16 or bfloat16, got {arr.dtype}")
    return arr.dtype


def round_to(v: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """Return float64 ``v`` rounded to nearest-even in ``dtype`` (overflow to +-inf), as float64.

    Direct (one rounding from float64), also for bfloat16, whose library conversion may go through float32.
    """
    dtype = np.dtype(dtype)
    v = np.asarray(v, np.float64)
    if dtype == np.float64:
        return v
    if dtype == np.float32:
        with np.errstate(over="ignore"):
            return v.astype(np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(v)
        safe = np.where(finite, v, 0.0)
        step = _ulp(safe, dtype)
        r = np.rint(safe / step) * step  # rint: half to even, and an even multiple is an even mantissa
        biggest = _MAX[dtype]
        overflow = np.abs(safe) >= biggest + _ulp(np.float64(biggest), dtype) / 2
        r = np.where(overflow, np.copysign(np.inf, safe), r)
        return np.where(finite, r, v)


def compute_dtype_of(compute_dtype: np.dtype | type) -> np.dtype:
    """Return ``compute_dtype`` as a dtype if a reference evaluates in it (float32 or float64), else raise."""
    cd = np.dtype(compute_dtype)
    if cd not in (F32, F64):
        raise ValueError(f"compute_dtype must be float32 or float64, got {cd}")
    return cd


def round_in(v: np.ndarray, dtype: np.dtype, compute_dtype: np.dtype) -> np.ndarray:
    """Return ``v`` (an evaluation's value in ``compute_dtype``) rounded to ``dtype``, back in ``compute_dtype``:
    the float64 evaluation rounds once, directly (``round_to``); the float32 one through numpy's conversion,
    as the kernels do."""
    return round_to(v, dtype) if compute_dtype == F64 else v.astype(dtype).astype(compute_dtype)


def _ulp(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Return the spacing of ``dtype`` in the binade of |v| (subnormal range included)."""
    mag = np.abs(np.asarray(v, np.float64))
    _, exp2 = np.frexp(np.where(mag > 0, mag, 1.0))
    exponent = np.maximum(np.where(mag > 0, exp2 - 1, MIN_EXPONENT[dtype]), MIN_EXPONENT[dtype])
    return np.ldexp(1.0, (exponent - MANTISSA_BITS[dtype]).astype(np.int64))


def round_interval(lo: np.ndarray, hi: np.ndarray, *dtypes: np.dtype | type) -> tuple[np.ndarray, np.ndarray]:
    """Return [lo, hi] after rounding to each of ``dtypes`` in turn (monotone, so endpoint to endpoint)."""
    for dtype in dtypes:
        lo, hi = round_to(lo, dtype), round_to(hi, dtype)
    return lo, hi


def mul_interval(
    a_lo: np.ndarray, a_hi: np.ndarray, b_lo: np.ndarray, b_hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Return the interval of a * b for a in [a_lo, a_hi], b in [b_lo, b_hi] (exact in float64 for the
    products of two float32 values)."""
    with np.errstate(invalid="ignore", over="ignore"):
        corners = np.stack(np.broadcast_arrays(a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi))
    return corners.min(axis=0), corners.max(axis=0)


def widen(lo: np.ndarray, hi: np.ndarray, slack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return [lo - slack, hi + slack]."""
    return lo - slack, hi + slack


def check_within(
    name: str,
    actual: np.ndarray,
    point: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
) -> tuple[int, str]:
    """Return (number of elements out of bounds, one line) for ``actual`` against the interval [lo, hi].

    ``point`` is the float64 reference: where it is NaN, ``actual`` must be NaN; where it is infinite,
    ``actual`` must be the same infinity; elsewhere lo <= actual <= hi (infinite bounds allow an overflow
    that the interval reaches).
    """
    a = np.asarray(actual).astype(np.float64)
    p = np.asarray(point).astype(np.float64)
    with np.errstate(invalid="ignore"):
        nan_p = np.isnan(p)
        nan_mismatch = nan_p ^ np.isnan(a)
        inf_mismatch = np.isinf(p) & (a != p)
        ordinary = ~nan_p & ~np.isinf(p)
        outside = ordinary & ~((a >= lo) & (a <= hi))
        bad = nan_mismatch | inf_mismatch | outside
        width = np.where(ordinary & np.isfinite(lo) & np.isfinite(hi), hi - lo, 0.0)
        dev = np.where(ordinary & np.isfinite(a), np.maximum(lo - a, a - hi), -np.inf)
    count = int(bad.sum())
    worst = ""
    if count:
        i = np.unravel_index(int(np.argmax(np.where(bad, np.where(np.isfinite(dev), dev, np.inf), -np.inf))), a.shape)
        worst = f"; worst at {tuple(int(j) for j in i)}: {a[i]!r} not in [{lo[i]!r}, {hi[i]!r}] (reference {p[i]!r})"
    msg = (
        f"{name}: {count} of {a.size} elements outside the budget "
        f"({int(nan_mismatch.sum())} NaN, {int(inf_mismatch.sum())} Inf mismatches; "
        f"widest interval {float(width.max()) if width.size else 0.0:.3g}){worst}"
    )
    return count, msg


def report_within(
    bounds: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    actuals: dict[str, tuple[np.ndarray, np.dtype]],
) -> tuple[bool, str]:
    """Return (within budget, message) for outputs ``{name: (actual, expected dtype)}`` against their
    ``bounds[name]`` = (reference, lo, hi), a ``budget_bounds`` result.

    An output whose shape or dtype is not the expected one fails at once, with one line naming it;
    otherwise every element must pass ``check_within``, and the message joins its lines, one an output.
    """
    lines, total = [], 0
    for name, (actual, dtype) in actuals.items():
        actual = np.asarray(actual)
        point, lo, hi = bounds[name]
        if actual.shape != point.shape or actual.dtype != dtype:
            return False, f"{name}: shape/dtype {actual.shape} {actual.dtype} != expected {point.shape} {dtype}"
        count, line = check_within(name, actual, point, lo, hi)
        total += count
        lines.append(line)
    return total == 0, "; ".join(lines)
