"""Integer shape arithmetic over one symbolic dimension, proven exactly for every size >= 1.

Exporters compute Reshape targets with int64 arithmetic on a sequence length: torch.export's chunked scan
pads ``seq`` to a multiple of the chunk size and slices it back, and writes widths such as
``(64 * Min(seq, 16 * ((seq + Mod(16 - Mod(seq, 16), 16)) // 16))) // seq`` — which is 64 for every
``seq >= 1``. A rule may rely on such a value only if it is *proven* from the graph, not read from a
declared shape.

Every expression built from one symbol ``s`` with ``+``, ``-``, multiplication by a constant, floor
division and ``Mod`` by positive constants is *quasi-affine*: for some period ``P`` and each residue
``r = s mod P`` it is exactly ``a_r * k + b_r`` where ``s = P * k + r``. ``QuasiAffine`` holds those
pieces, so two expressions are compared exactly, residue by residue, over every ``k`` the domain allows
(``s >= 1``). ``Min``/``Max`` stay quasi-affine when one side is below the other on every piece, and
``f // g`` for symbolic ``g`` is kept only when ``f`` is an exact multiple ``c * g``. Anything else is
"not proven" (None): the caller then refuses the fusion.

A symbolic dim of size 0 is outside the domain: a zero-length sequence has no rows to normalize (and
the exporters' own ``// seq`` would divide by zero there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

#: Periods above this are not followed (no exporter needs more than a few chunk sizes' lcm).
MAX_PERIOD = 1 << 14


@dataclasses.dataclass(frozen=True)
class QuasiAffine:
    """An int expression of one symbol ``symbol`` (or a constant when None), exactly, for symbol >= 1.

    ``pieces[r] = (a, b)`` means: for ``s = period * k + r`` the value is ``a * k + b``, for every
    ``k >= k_min(r)`` (``k >= 1`` for ``r == 0``, else ``k >= 0``, i.e. ``s >= 1``).
    """

    symbol: Any
    period: int
    pieces: tuple[tuple[int, int], ...]

    @staticmethod
    def constant(value: int) -> QuasiAffine:
        return QuasiAffine(None, 1, ((0, int(value)),))

    @staticmethod
    def of_symbol(symbol: Any) -> QuasiAffine:
        return QuasiAffine(symbol, 1, ((1, 0),))

    def as_constant(self) -> int | None:
        """Return the value when it is the same for every size, else None."""
        values = set(self.pieces)
        if len(values) == 1:
            a, b = values.pop()
            if a == 0:
                return b
        return None

    def is_symbol(self) -> bool:
        """Return whether the expression equals its symbol for every size."""
        return self.symbol is not None and all((a, b) == (self.period, r) for r, (a, b) in enumerate(self.pieces))

    def lifted(self, period: int) -> QuasiAffine:
        """Return the same expression written with a multiple of its period."""
        if period == self.period:
            return self
        factor = period // self.period
        pieces = []
        for r_new in range(period):
            r = r_new % self.period
            a, b = self.pieces[r]
            pieces.append((a * factor, a * ((r_new - r) // self.period) + b))
        return QuasiAffine(self.symbol, period, tuple(pieces))

    def at(self, size: int) -> int:
        """Return the value for the symbol equal to ``size`` (>= 1)."""
        if size < 1 and self.symbol is not None:
            raise ValueError(f"a symbolic size is >= 1, not {size}")
        a, b = self.pieces[size % self.period]
        return a * (size // self.period) + b

    def lower_bound(self) -> int | None:
        """Return the minimum over the domain, or None when it decreases without bound."""
        lowest = None
        for r, (a, b) in enumerate(self.pieces):
            if a < 0:
                return None
            value = a * _k_min(r) + b
            lowest = value if lowest is None else min(lowest, value)
        return lowest


def _k_min(residue: int) -> int:
    return 1 if residue == 0 else 0


def _unify(left: QuasiAffine, right: QuasiAffine) -> tuple[QuasiAffine, QuasiAffine] | None:
    """Return both on a common symbol and period, or None for two different symbols."""
    if left.symbol is not None and right.symbol is not None and left.symbol != right.symbol:
        return None
    symbol = left.symbol if left.symbol is not None else right.symbol
    period = math.lcm(left.period, right.period)
    if period > MAX_PERIOD:
        return None
    left, right = left.lifted(period), right.lifted(period)
    return (
        QuasiAffine(symbol, period, left.pieces),
        QuasiAffine(symbol, period, right.pieces),
    )


def add(left: QuasiAffine, right: QuasiAffine, sign: int = 1) -> QuasiAffine | None:
    pair = _unify(left, right)
    if pair is None:
        return None
    left, right = pair
    pieces = tuple(
        (a1 + sign * a2, b1 + sign * b2) for (a1, b1), (a2, b2) in zip(left.pieces, right.pieces, strict=True)
    )
    return QuasiAffine(left.symbol, left.period, pieces)


def multiply(left: QuasiAffine, right: QuasiAffine) -> QuasiAffine | None:
    pair = _unify(left, right)
    if pair is None:
        return None
    left, right = pair
    pieces = []
    for (a1, b1), (a2, b2) in zip(left.pieces, right.pieces, strict=True):
        if a1 and a2:
            return None  # s * s is not quasi-affine
        pieces.append((a1 * b2 + a2 * b1, b1 * b2))
    return QuasiAffine(left.symbol, left.period, tuple(pieces))


def floor_divide(left: QuasiAffine, right: QuasiAffine) -> QuasiAffine | None:
    """Return floor(left / right), exactly, or None when that is not quasi-affine or right may be <= 0."""
    pair = _unify(left, right)
    if pair is None:
        return None
    left, right = pair
    if any(a for a, _ in right.pieces):
        # A symbolic divisor: only an exact multiple c * right divides to the constant c.
        ratios = set()
        for (a1, b1), (a2, b2) in zip(left.pieces, right.pieces, strict=True):
            if a2 == 0 or a1 % a2:
                return None
            c = a1 // a2
            if b1 != c * b2:
                return None
            ratios.add(c)
        lowest = right.lower_bound()
        if len(ratios) != 1 or lowest is None or lowest < 1:
            return None
        return QuasiAffine.constant(ratios.pop())
    divisors = [b for _, b in right.pieces]
    if any(d <= 0 for d in divisors):
        return None
    # Written with a period whose step a is a multiple of every divisor, each piece divides exactly: lift
    # by the least factor that makes every a * factor a multiple of its piece's divisor.
    factor = math.lcm(*(d // math.gcd(d, a) for (a, _), d in zip(left.pieces, divisors, strict=True)))
    period = left.period * factor
    if period > MAX_PERIOD:
        return None
    left, right = left.lifted(period), right.lifted(period)
    pieces = tuple((a // d, b // d) for (a, b), (_, d) in zip(left.pieces, right.pieces, strict=True))
    return QuasiAffine(left.symbol, period, pieces)


def modulo(left: QuasiAffine, right: QuasiAffine) -> QuasiAffine | None:
    """Return left mod right with the divisor's sign (ONNX Mod with fmod=0), for a positive divisor."""
    quotient = floor_divide(left, right)
    if quotient is None or any(a for a, _ in right.pieces):
        return None
    product = multiply(quotient, right)
    return None if product is None else add(left, product, sign=-1)


def minimum(left: QuasiAffine, right: QuasiAffine, pick_max: bool = False) -> QuasiAffine | None:
    """Return Min (or Max) of two expressions when one is below the other on every piece."""
    pair = _unify(left, right)
    if pair is None:
        return None
    left, right = pair
    pieces = []
    for r, ((a1, b1), (a2, b2)) in enumerate(zip(left.pieces, right.pieces, strict=True)):
        k0 = _k_min(r)
        first_below = a1 <= a2 and a1 * k0 + b1 <= a2 * k0 + b2
        second_below = a2 <= a1 and a2 * k0 + b2 <= a1 * k0 + b1
        if not (first_below or second_below):
            return None  # they cross: piecewise in k, not one affine piece
        take_first = first_below != pick_max if first_below != second_below else True
        pieces.append((a1, b1) if take_first else (a2, b2))
    return QuasiAffine(left.symbol, left.period, tuple(pieces))
