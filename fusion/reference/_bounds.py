"""Exact rounding and interval helpers shared by the decode-step references' accuracy budgets.

A budget here is an interval per output element: every value a correct kernel may produce for the given
inputs. It is built by following the op's formula with intervals in float64: a correctly rounded float32
operation followed by a rounding to T is monotone, so it maps an interval's endpoints to the result's
endpoints exactly; only operations whose last bits are not fixed by the contract (exp, log1p, sigmoid, a
sum whose order is free) widen the interval, by a bound on the magnitudes of their terms.

Where an op's special values follow float32's (a float32 intermediate may overflow to Inf where float64 does not),
its budget is an ``Outcomes`` per element instead: the interval, plus +Inf, -Inf and NaN where some admissible
float32 evaluation gives them, followed through every float32 operation (``check_outcomes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from fusion.reference._common import MANTISSA_BITS, MIN_EXPONENT, SUPPORTED_TYPES, bfloat16

#: Unit roundoff of float32 (half its ulp at 1).
U32 = 2.0**-24
#: Largest absolute error of one float32 rounding in the subnormal range (half the smallest subnormal).
TINY32 = 2.0**-150
#: Relative error allowed for a float32 exp, log1p or sigmoid (16 unit roundoffs, about 8 ulps).
TRANSCENDENTAL_ERROR = 16 * U32
#: The smallest magnitude that a float32 rounding takes to infinity: float32's largest value plus half its last
#: step (the tie rounds to the even neighbour, 2^128, which is Inf).
OVERFLOW32 = 2.0**128 - 2.0**103

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


def float32_range(v: np.ndarray) -> np.ndarray:
    """Return float64 ``v`` in float32's range: +-Inf where a float32 rounding of it overflows (|v| >= OVERFLOW32),
    a zero of its sign where that rounding gives zero (|v| <= 2^-150, the tie going to the even 0), else ``v``.

    A float64 evaluation that applies it after each of the formula's float32 operations has the float32
    evaluation's special values (Inf where float32 overflows, 0 * Inf = NaN where it underflows) but float64's
    precision."""
    v = np.asarray(v, np.float64)
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(v)
        v = np.where(magnitude >= OVERFLOW32, np.copysign(np.inf, v), v)
        return np.where(magnitude <= TINY32, np.copysign(0.0, v), v)


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


@dataclasses.dataclass(frozen=True)
class Outcomes:
    """The values each element of a float32 evaluation may take: every value of [lo, hi], +Inf where ``pos_inf``,
    -Inf where ``neg_inf`` and NaN where ``nan``; no interval where lo and hi are NaN.

    Followed through a formula with the methods below, one per kind of float32 operation, it holds every result of
    every admissible evaluation, the special values included: 0 * Inf and Inf - Inf give NaN, an interval that a
    rounding takes past float32's largest value reaches Inf. Every method returns it canonical: a non-empty
    interval holds a finite value (a lone infinity is its flag) and an infinite end sets its flag.
    """

    lo: np.ndarray
    hi: np.ndarray
    pos_inf: np.ndarray
    neg_inf: np.ndarray
    nan: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray) -> Outcomes:
        """Return the outcomes of exact values (an input): each element its value."""
        v = np.asarray(values).astype(np.float64)
        no = np.zeros(v.shape, bool)
        return cls.canonical(v, v, no, no, np.isnan(v))

    @classmethod
    def canonical(
        cls, lo: np.ndarray, hi: np.ndarray, pos_inf: np.ndarray, neg_inf: np.ndarray, nan: np.ndarray
    ) -> Outcomes:
        """Return these outcomes in canonical form (see the class)."""
        lo, hi, pos_inf, neg_inf, nan = np.broadcast_arrays(lo, hi, pos_inf, neg_inf, nan)
        with np.errstate(invalid="ignore"):
            only_inf = (lo == np.inf) | (hi == -np.inf)
            pos_inf = pos_inf | (hi == np.inf)
            neg_inf = neg_inf | (lo == -np.inf)
        return cls(np.where(only_inf, np.nan, lo), np.where(only_inf, np.nan, hi), pos_inf, neg_inf, nan.copy())

    def __getitem__(self, key: object) -> Outcomes:
        return Outcomes(*(np.asarray(a)[key] for a in (self.lo, self.hi, self.pos_inf, self.neg_inf, self.nan)))

    @property
    def interval(self) -> np.ndarray:
        """Where the outcomes include finite values (an interval)."""
        return ~np.isnan(self.lo)

    @property
    def nan_only(self) -> np.ndarray:
        """Where NaN is the only outcome."""
        return ~self.interval & ~self.pos_inf & ~self.neg_inf

    def _has_positive(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return self.pos_inf | (self.interval & (self.hi > 0))

    def _has_negative(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return self.neg_inf | (self.interval & (self.lo < 0))

    def _has_zero(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return self.interval & (self.lo <= 0) & (self.hi >= 0)

    def rounded(self, *dtypes: np.dtype | type) -> Outcomes:
        """Return the outcomes after rounding to each of ``dtypes`` in turn (monotone: end to end; overflow to Inf)."""
        lo, hi = round_interval(self.lo, self.hi, *dtypes)
        return Outcomes.canonical(lo, hi, self.pos_inf, self.neg_inf, self.nan)

    def union(self, other: Outcomes) -> Outcomes:
        """Return the outcomes of either (the interval's hull)."""
        return Outcomes.canonical(
            np.fmin(self.lo, other.lo),
            np.fmax(self.hi, other.hi),
            self.pos_inf | other.pos_inf,
            self.neg_inf | other.neg_inf,
            self.nan | other.nan,
        )

    def add(self, other: Outcomes) -> Outcomes:
        """Return the outcomes of the exact sums (round them with ``rounded``); Inf - Inf is NaN."""
        a, b = self, other
        # Canonical ends never give Inf - Inf: a low end is below +Inf and a high end above -Inf.
        pos = (a.pos_inf & (b.interval | b.pos_inf)) | (b.pos_inf & (a.interval | a.pos_inf))
        neg = (a.neg_inf & (b.interval | b.neg_inf)) | (b.neg_inf & (a.interval | a.neg_inf))
        nan = a.nan | b.nan | (a.pos_inf & b.neg_inf) | (a.neg_inf & b.pos_inf)
        return Outcomes.canonical(a.lo + b.lo, a.hi + b.hi, pos, neg, nan)

    def mul(self, other: Outcomes) -> Outcomes:
        """Return the outcomes of the exact products (round them with ``rounded``); 0 * Inf is NaN."""
        a, b = self, other
        both = a.interval & b.interval
        with np.errstate(invalid="ignore", over="ignore"):
            # A corner 0 * Inf: an interval with an infinite end also holds finite values, whose product with 0 is
            # 0 (its other products are the infinite corners).
            corners = [
                np.where(both & np.isnan(c), 0.0, c) for c in (a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi)
            ]
        lo = np.minimum(np.minimum(corners[0], corners[1]), np.minimum(corners[2], corners[3]))
        hi = np.maximum(np.maximum(corners[0], corners[1]), np.maximum(corners[2], corners[3]))
        a_pos, a_neg, b_pos, b_neg = a._has_positive(), a._has_negative(), b._has_positive(), b._has_negative()
        pos = (a.pos_inf & b_pos) | (a.neg_inf & b_neg) | (b.pos_inf & a_pos) | (b.neg_inf & a_neg)
        neg = (a.pos_inf & b_neg) | (a.neg_inf & b_pos) | (b.pos_inf & a_neg) | (b.neg_inf & a_pos)
        a_inf, b_inf = a.pos_inf | a.neg_inf, b.pos_inf | b.neg_inf
        nan = a.nan | b.nan | (a_inf & b._has_zero()) | (b_inf & a._has_zero())
        return Outcomes.canonical(lo, hi, pos, neg, nan)

    def increasing(
        self, lower: Callable[[np.ndarray], np.ndarray], upper: Callable[[np.ndarray], np.ndarray]
    ) -> Outcomes:
        """Return the outcomes of an increasing function (an exp, a softplus) known up to ``lower`` <= f <= ``upper``
        (both increasing, NaN to NaN, defined at +-Inf)."""
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            result = Outcomes.canonical(lower(self.lo), upper(self.hi), False, False, self.nan)
            for flag, value in ((self.pos_inf, np.inf), (self.neg_inf, -np.inf)):
                v = np.where(flag, value, np.nan)
                result = result.union(Outcomes.canonical(lower(v), upper(v), False, False, False))
        return result

    def float32_sum(self, axis: int = -1) -> Outcomes:
        """Return the outcomes of a float32 sum over ``axis`` in any order (any tree of additions, a product fused
        into one or not), each term any of its outcomes: N + 1 unit roundoffs of the terms' magnitudes (2^-150 each
        absolute) around the exact sums, and +Inf (-Inf) where the terms' positive (negative) parts can make a
        partial sum overflow; NaN where both can.
        """
        n = self.lo.shape[axis]
        interval = self.interval
        with np.errstate(invalid="ignore", over="ignore"):
            # a finite partial sum's terms are finite float32 values, so at most 2^128 each
            magnitude = np.where(interval, np.minimum(np.maximum(np.abs(self.lo), np.abs(self.hi)), 2.0**128), 0.0)
            slack = (n + 1) * (U32 * magnitude.sum(axis) + 2 * TINY32)
            positive = np.where(interval, np.maximum(self.hi, 0.0), 0.0).sum(axis)
            negative = np.where(interval, np.minimum(self.lo, 0.0), 0.0).sum(axis)
            reach_pos = self.pos_inf.any(axis) | (positive + slack >= OVERFLOW32)
            reach_neg = self.neg_inf.any(axis) | (negative - slack <= -OVERFLOW32)
            lo, hi = self.lo.sum(axis) - slack, self.hi.sum(axis) + slack  # NaN (none) where a term has no interval
        # A term that is only NaN makes the sum NaN; one that is only +Inf (-Inf) rules -Inf (+Inf) out.
        only_nan = self.nan_only.any(axis)
        only_pos = (~interval & self.pos_inf & ~self.neg_inf).any(axis)
        only_neg = (~interval & self.neg_inf & ~self.pos_inf).any(axis)
        pos = reach_pos & ~only_neg & ~only_nan
        neg = reach_neg & ~only_pos & ~only_nan
        return Outcomes.canonical(lo, hi, pos, neg, self.nan.any(axis) | (reach_pos & reach_neg))

    def allows(self, actual: np.ndarray) -> np.ndarray:
        """Return where ``actual`` (float64) is one of the outcomes."""
        with np.errstate(invalid="ignore"):
            inside = (actual >= self.lo) & (actual <= self.hi)
        special = np.where(actual == np.inf, self.pos_inf, np.where(actual == -np.inf, self.neg_inf, inside))
        return np.where(np.isnan(actual), self.nan, special)


def check_outcomes(name: str, actual: np.ndarray, point: np.ndarray, allowed: Outcomes) -> tuple[int, str]:
    """Return (number of elements not among their outcomes, one line) for ``actual`` against ``allowed``.

    NaN is accepted where ``allowed.nan``, +-Inf where its flag is set, a finite value inside the interval.
    ``point`` (the float64 reference) only labels the worst element.
    """
    a = np.asarray(actual).astype(np.float64)
    bad = ~allowed.allows(a)
    with np.errstate(invalid="ignore"):
        nan_mismatch = bad & (np.isnan(a) | allowed.nan_only)
        inf_mismatch = bad & ~nan_mismatch & (np.isinf(a) | ~allowed.interval)
        ordinary = allowed.interval & np.isfinite(allowed.lo) & np.isfinite(allowed.hi)
        width = np.where(ordinary, allowed.hi - allowed.lo, 0.0)
        dev = np.where(np.isfinite(a) & allowed.interval, np.maximum(allowed.lo - a, a - allowed.hi), np.inf)
    count = int(bad.sum())
    worst = ""
    if count:
        i = np.unravel_index(int(np.argmax(np.where(bad, dev, -np.inf))), a.shape)
        specials = [
            s for s, on in (("+Inf", allowed.pos_inf[i]), ("-Inf", allowed.neg_inf[i]), ("NaN", allowed.nan[i])) if on
        ]
        interval = f"[{allowed.lo[i]!r}, {allowed.hi[i]!r}]" if allowed.interval[i] else "no finite value"
        worst = (
            f"; worst at {tuple(int(j) for j in i)}: {a[i]!r} not in {interval}"
            f"{' or ' + ', '.join(specials) if specials else ''} (reference {np.asarray(point)[i]!r})"
        )
    msg = (
        f"{name}: {count} of {a.size} elements outside the budget "
        f"({int(nan_mismatch.sum())} NaN, {int(inf_mismatch.sum())} Inf mismatches; "
        f"widest interval {float(width.max()) if width.size else 0.0:.3g}){worst}"
    )
    return count, msg


def report_within(
    bounds: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray] | tuple[np.ndarray, Outcomes]],
    actuals: dict[str, tuple[np.ndarray, np.dtype]],
) -> tuple[bool, str]:
    """Return (within budget, message) for outputs ``{name: (actual, expected dtype)}`` against their
    ``bounds[name]``, a ``budget_bounds`` result: (reference, lo, hi), or (reference, Outcomes).

    An output whose shape or dtype is not the expected one fails at once, with one line naming it;
    otherwise every element must pass ``check_within`` (``check_outcomes``), and the message joins its lines,
    one an output.
    """
    lines, total = [], 0
    for name, (actual, dtype) in actuals.items():
        actual = np.asarray(actual)
        point, *allowed = bounds[name]
        if actual.shape != point.shape or actual.dtype != dtype:
            return False, f"{name}: shape/dtype {actual.shape} {actual.dtype} != expected {point.shape} {dtype}"
        if isinstance(allowed[0], Outcomes):
            count, line = check_outcomes(name, actual, point, allowed[0])
        else:
            count, line = check_within(name, actual, point, *allowed)
        total += count
        lines.append(line)
    return total == 0, "; ".join(lines)
