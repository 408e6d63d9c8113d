"""The CPU kernel of ai.mambafuse::GatedGroupRMSNorm against fusion/reference/gated_group_rms_norm.py (docs/op.md)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import contrib_ops
from fusion.reference import SUPPORTED_TYPES, budget_report, gated_group_rms_norm, reference_for_budget
from fusion.reference.gated_group_rms_norm import gated_values
from tests._ops import (
    BFLOAT16,
    EDGE_GROUP_SIZE,
    EDGE_NONFINITE_GROUPS,
    EXPORTER_TYPE_MIXES,
    FLOAT,
    FLOAT16,
    GATED_TYPE_MIXES,
    GATED_TYPES,
    TIE_TYPE_MIXES,
    TYPE_NAMES,
    assert_one_consistent_evaluation,
    edge_value_inputs,
    feed,
    gated_type_id,
    make_model,
    nonfinite_groups,
    one_node_model,
    random_inputs,
    tie_close_inputs,
)
from tests._ops import check_against_reference as shared_check

TYPES = (FLOAT, FLOAT16, BFLOAT16)


def cpu_session(model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return contrib_ops.session(model, session_options=options, use_library=True)


def run_op(model: onnx.ModelProto, y: np.ndarray, z: np.ndarray, w: np.ndarray, threads: int = 1) -> np.ndarray:
    return cpu_session(model, threads).run(None, {"y": feed(y), "z": feed(z), "w": feed(w)})[0]


def check_against_reference(
    y: np.ndarray,
    z: np.ndarray,
    w: np.ndarray,
    *,
    group_size: int,
    epsilon: float = 1e-5,
    norm_type: int | None = None,
    out_type: int | None = None,
    gated_type: int | None = None,
    threads: int = 1,
) -> np.ndarray:
    """Run the CPU kernel on (y, z, w), assert it is within the accuracy budget of the reference, and return
    its output in the op's output type."""
    return shared_check(
        lambda model: cpu_session(model, threads),
        y,
        z,
        w,
        group_size=group_size,
        epsilon=epsilon,
        norm_type=norm_type,
        out_type=out_type,
        gated_type=gated_type,
    )


@pytest.fixture(scope="module", autouse=True)
def _library() -> str:
    # The Makefile builds the library before the tests; a missing one is a failure, not a skip.
    return contrib_ops.library_path()


@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"),
    list(itertools.product(TYPES, repeat=5)),
    ids=lambda t: TYPE_NAMES[t],  # y-z-w-norm-out
)
def test_every_type_combination(y_type: int, z_type: int, w_type: int, norm_type: int, out_type: int) -> None:
    rng = np.random.default_rng([y_type, z_type, w_type, norm_type, out_type])
    # 14 400 elements: with a half norm_dtype, enough n within the tie window (about 0.2 % for float16) that
    # every case meets some.
    y, z, w = random_inputs(rng, (30, 5, 96), y_type, z_type, w_type)
    check_against_reference(y, z, w, group_size=48, norm_type=norm_type, out_type=out_type)


@pytest.mark.parametrize("gated_type", GATED_TYPES, ids=gated_type_id)
@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"),
    list(GATED_TYPE_MIXES.values()),
    ids=list(GATED_TYPE_MIXES),
)
def test_gated_dtype(
    y_type: int, z_type: int, w_type: int, norm_type: int, out_type: int, gated_type: int | None
) -> None:
    """The third rounding point (h rounded to gated_dtype before the norm), with every type mix it meets."""
    rng = np.random.default_rng([y_type, z_type, w_type, norm_type, out_type, gated_type or 0])
    y, z, w = random_inputs(rng, (30, 5, 96), y_type, z_type, w_type)
    check_against_reference(y, z, w, group_size=48, norm_type=norm_type, out_type=out_type, gated_type=gated_type)


def gated_rounding_probes(gated_type: int) -> np.ndarray:
    """Return float32 values of h that probe the rounding to ``gated_type``: every rounding tie between
    neighbouring values of a binade around 1 and of the subnormal range, one float32 ulp either side of
    those ties, the overflow edge, and random values down to the subnormals."""
    dtype = SUPPORTED_TYPES[gated_type]
    rng = np.random.default_rng(gated_type)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = (
        bits.view(np.float16).astype(np.float32)
        if gated_type == FLOAT16
        else ((bits.astype(np.uint32) << 16).view(np.float32))
    )
    finite = values[np.isfinite(values) & (values > 0)]
    finite = np.sort(finite)
    # ties between neighbours: the subnormal range and the smallest normals, and around 1
    low = finite[:300]
    one = finite[np.searchsorted(finite, 1.0) - 150 : np.searchsorted(finite, 1.0) + 150]
    picked = np.concatenate([low, one])
    ties = ((picked[:-1].astype(np.float64) + picked[1:].astype(np.float64)) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(0))])
    # float16's overflow edge (65504 and the tie to Inf above it); bfloat16's lies where h^2 overflows
    # float32 itself, the kernel's nf is 0 there and the float64 reference no guide.
    top = float(ml_dtypes.finfo(dtype).max) if gated_type == FLOAT16 else 1e19
    edges = np.array([top, top * (1 + 2.0**-12), top * (1 + 2.0**-11), top * (1 + 2.0**-6)], np.float32)
    randoms = (rng.standard_normal(2000) * np.exp2(rng.integers(-30, 5, 2000))).astype(np.float32)
    probes = np.concatenate([ties, near, picked, edges, randoms])
    signs = np.where(rng.random(probes.size) < 0.5, -1.0, 1.0).astype(np.float32)
    return probes * signs


def gated_rounding_case(gated_type: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (y, z, w, h): groups of two, [probe, anchor], whose exact gated products are the probes h.

    z = 64 makes silu(z) = 64 exactly in float32 and float64 (e^-64 vanishes against 1), so h = 64 * y is
    exact. The anchor, a power of two >= 4 |h| (exact in every type), holds nf nearly constant: the probe's
    output h_r * nf then moves with its rounded value h_r at >= 16/17 of its relative change, which is
    >= 2^-12 for a neighbouring float16/bfloat16 value, far over the float32 budget (2e-6). Below 2^-62
    the anchor is 0 (its square would leave float32's normal range) and epsilon sets nf.
    """
    probes = gated_rounding_probes(gated_type)
    # Keep the probes that are exact multiples of 64 (in the float32 subnormal range, where bfloat16's
    # subnormals are, h / 64 can lose bits; the bfloat16 ties there are still exact).
    exact = (probes / np.float32(64.0)) * np.float32(64.0) == probes
    h = probes[exact]
    assert h.size > 0.8 * probes.size, f"only {h.size} of {probes.size} probes are exact multiples of 64"
    magnitude = np.abs(h.astype(np.float64))
    anchor = 4.0 * np.exp2(np.ceil(np.log2(np.maximum(magnitude, 1e-300))))
    # No anchor where its square leaves float32's normal range or it is not a finite gated_dtype value
    # (float16's top binade: there the probe's finiteness shows the rounding to Inf).
    top = float(ml_dtypes.finfo(SUPPORTED_TYPES[gated_type]).max)
    anchor = np.where((magnitude < 2.0**-62) | (anchor > top) | (anchor > 2.0**62), 0.0, anchor)
    pairs = np.stack([h, anchor.astype(np.float32)], axis=-1).reshape(1, -1)
    y = pairs / np.float32(64.0)
    z = np.full_like(y, 64.0)
    w = np.ones(y.shape[-1], np.float32)
    return y, z, w, h


GATED_ROUNDING_EPSILON = 1e-30


@pytest.mark.parametrize("gated_type", [FLOAT16, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
def test_gated_rounding_is_exact(gated_type: int) -> None:
    """h rounded to gated_dtype bit for bit as numpy/ml_dtypes round (nearest even): ties, one float32 ulp
    either side of them, half-subnormal products, float16's overflow to Inf (see gated_rounding_case)."""
    y, z, w, h = gated_rounding_case(gated_type)
    actual = check_against_reference(
        y, z, w, group_size=2, epsilon=GATED_ROUNDING_EPSILON, gated_type=gated_type
    ).reshape(-1, 2)[:, 0]
    assert_probes_rounded_exactly(actual, h, y.reshape(-1, 2)[:, 1], group_size=2, gated_type=gated_type)


def assert_probes_rounded_exactly(
    actual: np.ndarray, h: np.ndarray, anchors: np.ndarray, *, group_size: int, gated_type: int
) -> None:
    """Check each probe's normalized output against h rounded by numpy / ml_dtypes, in float64.

    Independently of the reference: every group holds the probe (gate 64, so silu = 64 * y), its anchor
    and zeros; ``actual`` is the probe's output per group.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = h.astype(SUPPORTED_TYPES[gated_type]).astype(np.float64)
        anchor = anchors.astype(np.float64) * 64.0
        want = rounded / np.sqrt((rounded * rounded + anchor * anchor) / group_size + GATED_ROUNDING_EPSILON)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(actual), finite), "overflow of h to Inf is not where numpy puts it"
    error = np.abs(actual[finite] - want[finite])
    bad = np.flatnonzero(error > 2e-6 * np.abs(want[finite]))
    assert bad.size == 0, (
        f"{bad.size} of {finite.sum()} h rounded differently (max error {error.max():.3g}), "
        f"e.g. h = {h[finite][bad[:5]]}"
    )


#: (shape, group_size) of the tie cases: rows of eight 96-wide groups, and decode-width rows of 960-wide ones.
TIE_SHAPES = [((8, 768), 96), ((4, 7680), 960)]


@pytest.mark.parametrize(("shape", "group_size"), TIE_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("gated_type", [FLOAT16, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"), list(TIE_TYPE_MIXES.values()), ids=list(TIE_TYPE_MIXES)
)
def test_gated_products_at_ties(
    y_type: int,
    z_type: int,
    w_type: int,
    norm_type: int,
    out_type: int,
    gated_type: int,
    shape: tuple[int, ...],
    group_size: int,
) -> None:
    """Many h of each group at gated_dtype rounding ties, of both signs (tie_close_inputs): a float32 kernel
    tips some of them and not others, and each group's nf follows the values it took. Within the budget
    (docs/op.md: every element within the tolerance of a consistent evaluation) for half and float32
    outputs; where norm_dtype and the output are float32, also exactly one consistent evaluation."""
    rng = np.random.default_rng([y_type, z_type, w_type, norm_type, out_type, gated_type, group_size])
    y, z, w = tie_close_inputs(rng, shape, group_size, y_type, z_type, w_type, gated_type)
    actual = check_against_reference(
        y, z, w, group_size=group_size, norm_type=norm_type, out_type=out_type, gated_type=gated_type, threads=2
    )
    if norm_type == FLOAT and out_type == FLOAT:
        assert_one_consistent_evaluation(actual, y, z, w, group_size=group_size, gated_type=gated_type)


#: Random float32 rows of issue 25 whose outputs the earlier budget rejected (it knew two references: the
#: exact one and the one with every tie-close h flipped): (shape, group_size, weight scale, gated_dtype).
ISSUE_25_ROWS = [((512, 7680), 960, 1.0, FLOAT16), ((7, 8192), 1024, 8.0, FLOAT16)]


@pytest.mark.parametrize(("shape", "group_size", "w_scale", "gated_type"), ISSUE_25_ROWS, ids=lambda v: str(v))
def test_random_rows_with_a_few_tie_close_products(
    shape: tuple[int, ...], group_size: int, w_scale: float, gated_type: int
) -> None:
    """Ordinary inputs (about 0.3 % of the h within the tie window of a float16 rounding tie, a few a group):
    float32 outputs within the budget, and one consistent evaluation."""
    rng = np.random.default_rng(0)
    y, z, w = random_inputs(rng, shape, FLOAT, FLOAT, FLOAT)
    w = (w * np.float32(w_scale)).astype(np.float32)
    actual = check_against_reference(y, z, w, group_size=group_size, gated_type=gated_type, threads=2)
    assert_one_consistent_evaluation(actual, y, z, w, group_size=group_size, gated_type=gated_type)


def test_budget_rejects_outputs_off_the_consistent_evaluations() -> None:
    """The budget allows what tie-close h may do and no more: the kernel's float32 output of an issue-25 row
    passes, and each of these changes to it is rejected: one element off by 4e-6 (twice the tolerance) where
    its interval is narrow, a group's outputs scaled by 1 + 1e-5 (a wrong nf), the group of a NOT tie-close h
    rounded the other way, a tie-close element between its two roundings (h not rounded), and a float16
    output three ulps off."""
    rng = np.random.default_rng(0)
    y, z, w = random_inputs(rng, (7, 8192), FLOAT, FLOAT, FLOAT)
    attrs = dict(epsilon=1e-5, group_size=1024, gated_dtype=np.float16)
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[7, 8192], group_size=1024, gated_dtype=FLOAT16)
    actual = run_op(model, y, z, w)
    reference = reference_for_budget(y, z, w, **attrs)
    ok, message = budget_report(actual, **reference)
    assert ok, message
    low, high = reference["bounds"]
    expected = reference["expected"].astype(np.float64)
    rounded, other, close = gated_values(y, z, np.float16)
    # A group whose elements' intervals are narrow (few tie-close h, none of them large).
    narrow = close | (np.max(high - low, axis=0) <= 5e-7 * np.abs(expected))
    groups = narrow.reshape(7, 8, 1024).all(axis=-1)
    assert groups.any(), "no group with narrow intervals"
    row, group = np.argwhere(groups)[0]
    columns = slice(group * 1024, (group + 1) * 1024)

    def rejected(changed: np.ndarray, what: str) -> None:
        ok, message = budget_report(changed.astype(np.float32), **reference)
        assert not ok, f"{what} passed: {message}"

    element = actual.copy()
    element[row, group * 1024 + int(np.argmin(close[row, columns]))] *= np.float32(1 + 4e-6)  # not tie-close
    rejected(element, "one element off by 4e-6")
    scaled = actual.copy()
    scaled[row, columns] *= np.float32(1 + 1e-5)
    rejected(scaled, "a group normalized with nf * (1 + 1e-5)")
    # The largest h of a group that is not tie-close, rounded to its other float16 neighbour.
    largest = group * 1024 + int(np.argmax(np.where(close[row, columns], 0.0, np.abs(rounded[row, columns]))))
    flip = np.zeros(y.shape, bool)
    flip[row, largest] = True
    wrong = actual.copy()
    wrong[row, columns] = gated_group_rms_norm(y, z, w, **attrs, compute_dtype=np.float64, flip_gated=flip)[
        row, columns
    ]
    rejected(wrong, "a group whose h that is not tie-close was rounded the other way")
    wrong[row, largest] = actual[row, largest]
    rejected(wrong, "the group of that h, without the h itself")
    # A tie-close element between its two roundings.
    tie_row, tie_column = np.argwhere(close)[0]
    between = actual.copy()
    between[tie_row, tie_column] *= np.float32(
        (rounded + other)[tie_row, tie_column] / 2 / rounded[tie_row, tie_column]
    )
    rejected(between, "a tie-close element between its two roundings")
    # A float16 output: one element three ulps away (the hard limit is two).
    half = one_node_model(
        FLOAT, FLOAT, FLOAT, shape=[7, 8192], group_size=1024, gated_dtype=FLOAT16, output_dtype=FLOAT16
    )
    actual = run_op(half, y, z, w).astype(np.float16)
    reference = reference_for_budget(y, z, w, **attrs, output_dtype=np.float16)
    ok, message = budget_report(actual, **reference)
    assert ok, message
    column = group * 1024 + int(np.argmin(close[row, columns]))
    bits = actual.view(np.uint16)
    bits[row, column] += 3  # three float16 values further from zero
    ok, message = budget_report(actual, **reference)
    assert not ok, f"a float16 output three ulps off passed: {message}"


def test_budget_accepts_every_consistent_evaluation() -> None:
    """The other side: outputs of the reference with any choice of the tie-close h flipped (none, half of them
    at random, all) pass, in float32 and float16."""
    rng = np.random.default_rng(5)
    y, z, w = tie_close_inputs(rng, (8, 768), 96, FLOAT, FLOAT, FLOAT, FLOAT16)
    _, _, close = gated_values(y, z, np.float16)
    for output_dtype in (np.float32, np.float16):
        attrs = dict(epsilon=1e-5, group_size=96, gated_dtype=np.float16, output_dtype=output_dtype)
        reference = reference_for_budget(y, z, w, **attrs)
        for flip in (np.zeros(close.shape, bool), close & (rng.random(close.shape) < 0.5), close):
            evaluation = gated_group_rms_norm(y, z, w, **attrs, compute_dtype=np.float64, flip_gated=flip)
            ok, message = budget_report(evaluation, **reference)
            assert ok, f"{flip.sum()} of {close.sum()} tie-close h flipped, {np.dtype(output_dtype)}: {message}"


def test_default_norm_and_output_types_follow_y() -> None:
    rng = np.random.default_rng(1)
    y, z, w = random_inputs(rng, (4, 120), FLOAT16, FLOAT, BFLOAT16)
    check_against_reference(y, z, w, group_size=40)


SHAPES = [
    ((1, 7680), 960),  # Nemotron-H decode row, 8 groups
    ((3, 5, 96), 48),
    ((4, 120), 40),
    ((2, 3, 64), 64),  # one group
    ((64, 8192), 1024),  # prefill-sized: several chunks over the thread pool
    ((5, 24), 1),  # group of one
    ((2, 1, 100), 25),  # group size not a multiple of the vector width
]


@pytest.mark.parametrize(("shape", "group_size"), SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("elem_type", TYPES, ids=lambda t: TYPE_NAMES[t])
@pytest.mark.parametrize("threads", [1, 2])
def test_shapes(shape: tuple[int, ...], group_size: int, elem_type: int, threads: int) -> None:
    rng = np.random.default_rng([len(shape), *shape, group_size, elem_type])
    y, z, w = random_inputs(rng, shape, elem_type, elem_type, elem_type)
    check_against_reference(y, z, w, group_size=group_size, threads=threads)


@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"),
    [(FLOAT,) * 5, EXPORTER_TYPE_MIXES["B-f16"], EXPORTER_TYPE_MIXES["C-bf16"]],
    ids=["f32", "B-f16", "C-bf16"],
)
def test_prefill_sized_output_is_streamed_correctly(
    y_type: int, z_type: int, w_type: int, norm_type: int, out_type: int
) -> None:
    """Outputs of 16 MB and more are written with non-temporal stores (x86): 512 x 8192 float32 or
    1024 x 8192 half outputs, over two threads (each thread's range fenced)."""
    rng = np.random.default_rng(17)
    y, z, w = random_inputs(rng, (1024 if out_type != FLOAT else 512, 8192), y_type, z_type, w_type)
    check_against_reference(y, z, w, group_size=1024, norm_type=norm_type, out_type=out_type, threads=2)


@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"),
    list(EXPORTER_TYPE_MIXES.values()),
    ids=list(EXPORTER_TYPE_MIXES),
)
def test_exporter_type_mixes_at_decode_width(
    y_type: int, z_type: int, w_type: int, norm_type: int, out_type: int
) -> None:
    rng = np.random.default_rng(7)
    y, z, w = random_inputs(rng, (1, 7680), y_type, z_type, w_type)
    check_against_reference(y, z, w, group_size=960, norm_type=norm_type, out_type=out_type)


@pytest.mark.parametrize("elem_type", TYPES, ids=lambda t: TYPE_NAMES[t])
def test_edge_values(elem_type: int) -> None:
    """Zero groups, values near sqrt(eps), large values, NaN/Inf confined to their own group."""
    y, z, w = edge_value_inputs(elem_type)
    actual = check_against_reference(y, z, w, group_size=EDGE_GROUP_SIZE)
    # The special values reach their own group only.
    out = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=EDGE_GROUP_SIZE, compute_dtype=np.float64)
    assert nonfinite_groups(out) == EDGE_NONFINITE_GROUPS
    assert np.array_equal(np.isfinite(actual.astype(np.float32)), np.isfinite(out.astype(np.float32)))
    zero_group = actual[0, :EDGE_GROUP_SIZE].astype(np.float32)
    assert np.all(zero_group == 0.0), f"zero group gave {zero_group[:4]}"


#: y scales that put h = y * silu(z) into float32's subnormals (1e-39), below sqrt(FLT_MIN) so that h^2
#: underflows (1e-25), or partly there (a row whose groups alternate normal and subnormal values).
SUBNORMAL_ROWS = {"subnormal": 1e-39, "square_underflows": 1e-25, "mixed": None}


@pytest.mark.parametrize("rows", list(SUBNORMAL_ROWS), ids=list(SUBNORMAL_ROWS))
@pytest.mark.parametrize(
    ("elem_type", "out_type", "epsilon"),
    # (epsilon 0 is left out: a group whose squares all underflow float32 has nf = 1/0 in float32 arithmetic,
    # while the float64 reference still sees their sum.)
    [(FLOAT, FLOAT, 1e-5), (FLOAT, FLOAT, 1e-9), (FLOAT, FLOAT16, 1e-5), (FLOAT, BFLOAT16, 1e-5)],
    ids=["f32", "f32-eps1e-9", "f32-out-f16", "f32-out-bf16"],
)
def test_subnormal_rows(rows: str, elem_type: int, out_type: int, epsilon: float) -> None:
    """Rows whose values decay into float32 subnormals (chains without residual Adds): the kernel's fast
    paths for them (flush-to-zero with underflow detection, y rescaled by a power of two) must give the
    reference's results, tiny groups included (nf = 1/sqrt(eps) makes their outputs normal floats)."""
    rng = np.random.default_rng([7, len(rows), out_type, int(epsilon > 0)])
    y, z, w = random_inputs(rng, (6, 960), elem_type, elem_type, elem_type)
    scale = SUBNORMAL_ROWS[rows]
    if scale is None:
        y.reshape(6, -1, 96)[:, 1::2] *= np.float32(1e-39)  # every other group of each row
        y[3] *= np.float32(1e-39)  # and one row entirely
    else:
        y *= np.float32(scale)
    y[5, :96] = 0.0  # a zero group among them
    z[4, 96:192] = np.linspace(-100.0, -80.0, 96)  # silu in exp's underflow range
    check_against_reference(y, z, w, group_size=96, epsilon=epsilon, out_type=out_type)


def test_decayed_rows_across_the_subnormal_range() -> None:
    """Rows whose y are all float32 subnormals, spread over the whole range (the top mantissa bits set,
    down to a few units of 2^-149), and rows that mix such groups with normal y: the x86 kernel scales a
    group of subnormal y by 2^k from the integer mantissas, a mixed one bit by bit; both must be exact."""
    rng = np.random.default_rng(126)
    y, z, w = random_inputs(rng, (4, 384), FLOAT, FLOAT, FLOAT)
    y = (rng.uniform(-1.0, 1.0, y.shape) * 2.0**-126).astype(np.float32)
    y[0, :8] = np.float32(2.0**-126) * np.float32(0.9999999)  # the largest subnormals
    y[1, :8] = np.float32(3 * 2.0**-149)  # and a few of the smallest
    y[2, 96:192] = rng.standard_normal(96).astype(np.float32) * np.float32(1e-30)  # a normal group between
    y[3, 200] = np.float32(1e-37)  # one normal y in a group of subnormal ones
    assert np.count_nonzero(np.abs(y) >= np.float32(2.0**-127)) > 500
    check_against_reference(y, z, w, group_size=96)


def test_gates_at_the_edge_of_the_table_exp() -> None:
    """The table-based silu serves |z| <= 86 and hands a group with any larger |z| (or NaN/Inf) to the
    full-range silu: gates on both sides of +-86 (one such lane in an otherwise ordinary group, at every
    lane position of a vector and of the unrolled step), and groups of large gates only, match the reference.
    (The instruction-set level is the process's: run under MAMBAFUSE_CPU_ISA=avx2 / baseline for the others.)"""
    rng = np.random.default_rng(86)
    y, z, w = random_inputs(rng, (8, 128), FLOAT, FLOAT, FLOAT)
    edge = np.float32(86.0)
    above = np.nextafter(edge, np.float32(np.inf))
    for row, value in enumerate([edge, above, -edge, -above]):
        z[row, (row * 37) % 64] = value  # one lane of the row's first group (of 64)
        z[row, 64 + (row * 53) % 64] = value  # and of the second
    z[4] = np.linspace(-120.0, 120.0, 128)
    z[5] = np.linspace(-86.0, 86.0, 128)
    z[6, :64] = np.float32(-87.5)
    z[7] = rng.uniform(-88.0, -84.0, 128)
    check_against_reference(y, z, w, group_size=64, epsilon=1e-5, out_type=FLOAT)


@pytest.mark.parametrize("group_size", [96, 128])
@pytest.mark.parametrize("y_type", [FLOAT, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
@pytest.mark.parametrize("subnormal_input", ["y", "z"])
def test_subnormal_inputs_with_normal_outputs(subnormal_input: str, y_type: int, group_size: int) -> None:
    """Groups where every 7th y (or z) is a float32 subnormal whose output is a normal float, and no product
    underflows to give it away: the x86 gate pass reads subnormal inputs as 0 (DAZ) and must notice them from
    their bits (a zero for them fails the budget by far). y: tiny normal y (h^2 ~ 1e-20, so nf ~ 1/sqrt(eps))
    around subnormal ones, outputs ~1e-37. z: y ~ 1e22 with gates of -30 around subnormal gates in
    [2^-127, 2^-126) (silu(z) ~ z/2 keeps 22 bits there; h ~ 1e-17), outputs ~1e-28. Group sizes: 96 ends in
    a partial block of AVX-512's unrolled loop (a tail probed element by element), 128 ends in none at any
    width (the loop's own probe of the products must notice them)."""
    rng = np.random.default_rng([29, len(subnormal_input), y_type])
    y, z, w = random_inputs(rng, (4, 2 * group_size), FLOAT, FLOAT, FLOAT)
    pick = np.zeros(y.shape, bool)
    pick[:, 3::7] = True
    if subnormal_input == "y":
        y = np.where(pick, y * np.float32(1e-39), y * np.float32(1e-10)).astype(np.float32)
    else:
        y = (y * np.float32(1e22)).astype(np.float32)
        tiny = np.sign(z) * rng.uniform(0.5, 1.0, z.shape) * 2.0**-126
        z = np.where(pick, tiny, -30.0).astype(np.float32)
    y = y.astype(SUPPORTED_TYPES[y_type])
    subnormal = np.abs((y if subnormal_input == "y" else z).astype(np.float32)) < np.float32(2.0**-126)
    assert np.count_nonzero(subnormal & pick) > 50 and not np.any(subnormal & ~pick)
    check_against_reference(y, z, w, group_size=group_size)


def test_scaled_group_whose_norm_pass_overflows_keeps_its_subnormal_outputs() -> None:
    """A decayed row (subnormal y, epsilon 0: normalized values ~1) with a huge weight: the x86 kernel's
    norm pass for a rescaled group computes 2^64 times the outputs, which overflows at w = 1e30, and is then
    redone exactly. The redo must not flush: the outputs of the tiny weights (1e-40) are float32 subnormals
    of a few hundred units of 2^-149, and flushed to zero they would still pass the budget (its floor is the
    smallest normal float), so they are checked against the reference one by one."""
    rng = np.random.default_rng(64)
    y, z, w = random_inputs(rng, (2, 96), FLOAT, FLOAT, FLOAT)
    y = (y * np.float32(1e-39)).astype(np.float32)
    w = np.full(96, 1e-40, np.float32)
    w[[5, 50]] = np.float32(1e30)
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 96], group_size=96, epsilon=0.0)
    actual = run_op(model, y, z, w).astype(np.float64)
    expected = gated_group_rms_norm(y, z, w, epsilon=0.0, group_size=96, compute_dtype=np.float64)
    tiny = np.abs(expected) > 2.0**-140
    tiny[:, [5, 50]] = False
    assert np.count_nonzero(tiny) > 100
    assert np.all(actual[tiny] != 0.0), "subnormal outputs flushed to zero"
    assert np.max(np.abs(actual[tiny] - expected[tiny])) <= 2 * 2.0**-149
    big = actual[:, [5, 50]]
    assert np.all(np.abs(big - expected[:, [5, 50]]) <= 2e-6 * np.abs(expected[:, [5, 50]]))


@pytest.mark.parametrize("ordinary_max", [None, 0.25], ids=["as-drawn", "max-0.25"])
def test_result_of_a_row_does_not_depend_on_the_rows_before_it(ordinary_max: float | None) -> None:
    """After a subnormal row the kernel may start the next group on its rescaling path (a guess); an
    ordinary row must still come out bit for bit as it does on its own — also one whose y are all below
    1/2, which the rescaling path would scale (by 2^k, k > 0) and compute another way."""
    rng = np.random.default_rng(23)
    y, z, w = random_inputs(rng, (200, 960), FLOAT, FLOAT, FLOAT)
    if ordinary_max is not None:
        y[1::2] *= np.float32(ordinary_max / np.abs(y[1::2]).max(axis=1, keepdims=True))
    y[0::2] *= np.float32(1e-39)  # subnormal and ordinary rows alternate
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[200, 960], group_size=96)
    together = run_op(model, y, z, w)[1::2]
    alone_model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[100, 960], group_size=96)
    alone = run_op(alone_model, y[1::2], z[1::2], w)  # the ordinary rows only
    differ = int((together != alone).sum())
    assert differ == 0, f"{differ} of {alone.size} outputs of ordinary rows changed after subnormal rows"


def _decayed_targets(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Groups of 96 (y, z) that a decayed group before them sends first to the kernel's scaled pass for y all
    subnormal or zero (k = 126): where that pass stands, where its products underflow, and where its y are not
    such y after all."""
    subnormal = (rng.uniform(-1.0, 1.0, 96) * 2.0**-126).astype(np.float32)
    ordinary_z = rng.standard_normal(96).astype(np.float32) * np.float32(3)
    few_units = (rng.integers(-3, 4, 96) * 2.0**-149).astype(np.float32)  # largest |y| 3 * 2^-149: k = 127 alone
    one_normal = subnormal.copy()
    one_normal[37] = np.float32(1e-30)
    one_subnormal_z = ordinary_z.copy()
    one_subnormal_z[5] = np.float32(2.0**-140)
    return {
        "subnormal": (subnormal, ordinary_z),
        "few-units": (few_units, ordinary_z),
        "products-underflow": (few_units, np.full(96, -40.0, np.float32)),  # |h| 2^126 ~ 1e-22: h^2 underflows
        "one-normal-y": (one_normal, ordinary_z),
        "zeros": (np.zeros(96, np.float32), ordinary_z),
        "signed-zeros-and-subnormals": (np.where(np.arange(96) % 2 == 0, np.float32(-0.0), few_units), ordinary_z),
        "one-subnormal-z": (subnormal, one_subnormal_z),
    }


def test_result_of_a_group_does_not_depend_on_a_decayed_group_before_it() -> None:
    """After a group of subnormal y the kernel tries the next one's scaled pass first (it reads y once,
    checking that they are subnormal or zero as it goes); each group must come out bit for bit as it does
    after an ordinary group, which takes the usual way (the fast pass, then the scaled pass with its own
    k, or the exact one) — whether the first try stands or not."""
    rng = np.random.default_rng(1260)
    targets = _decayed_targets(rng)
    decayed = (rng.standard_normal(96) * 1e-39).astype(np.float32)
    ordinary = rng.standard_normal(96).astype(np.float32)
    lead_z = rng.standard_normal(96).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 2 * 96).astype(np.float32)
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[1, 2 * 96], group_size=96)
    for name, (y_target, z_target) in targets.items():
        z = np.concatenate([lead_z, z_target])[None]
        after_decayed = run_op(model, np.concatenate([decayed, y_target])[None], z, w)[0, 96:]
        after_ordinary = run_op(model, np.concatenate([ordinary, y_target])[None], z, w)[0, 96:]
        np.testing.assert_array_equal(after_decayed.view(np.uint32), after_ordinary.view(np.uint32), err_msg=name)
        check_against_reference(np.concatenate([decayed, y_target])[None], z, w, group_size=96)


#: The type combinations whose norm pass the kernel runs in one loop with the next group's gate pass
#: (FusedPass): (y/z/w type, gated_dtype, norm_dtype = output_dtype).
INTERLEAVED_TYPES = {
    "f32": (FLOAT, None, None),
    "f32-norm-f16": (FLOAT, None, FLOAT16),
    "f32-gated-f16-norm-f16": (FLOAT, FLOAT16, FLOAT16),
    "f32-norm-bf16": (FLOAT, None, BFLOAT16),
    "f32-gated-bf16-norm-bf16": (FLOAT, BFLOAT16, BFLOAT16),
    "f16-gated-f16": (FLOAT16, FLOAT16, None),
    "f16": (FLOAT16, None, None),
    "bf16-gated-bf16": (BFLOAT16, BFLOAT16, None),
    "bf16": (BFLOAT16, None, None),
}


@pytest.mark.parametrize("group_size", [960, 128, 200, 40])
@pytest.mark.parametrize(
    ("elem_type", "gated_type", "norm_type"), INTERLEAVED_TYPES.values(), ids=list(INTERLEAVED_TYPES)
)
def test_interleaved_passes(elem_type: int, gated_type: int | None, norm_type: int | None, group_size: int) -> None:
    """Rows of several groups in the type combinations whose norm pass runs together with the next
    group's gate pass: whole blocks of 64 elements and a rest (200, 40), within a row and across rows."""
    rng = np.random.default_rng([group_size, elem_type, gated_type or 0, norm_type or 0])
    y, z, w = random_inputs(rng, (3, 4 * group_size), elem_type, elem_type, elem_type)
    check_against_reference(
        y, z, w, group_size=group_size, gated_type=gated_type, norm_type=norm_type, out_type=norm_type
    )


@pytest.mark.parametrize(
    ("elem_type", "gated_type", "norm_type"), INTERLEAVED_TYPES.values(), ids=list(INTERLEAVED_TYPES)
)
def test_interleaved_and_lone_passes_agree_bit_for_bit(
    elem_type: int, gated_type: int | None, norm_type: int | None
) -> None:
    """A row's first group is computed alone when the row is, and interleaved with the previous row's last
    group when it follows one: the outputs must be the same bits either way."""
    rng = np.random.default_rng([elem_type, gated_type or 0, norm_type or 0, 6])
    y, z, w = random_inputs(rng, (6, 384), elem_type, elem_type, elem_type)
    attrs = dict(group_size=96, norm_dtype=norm_type, output_dtype=norm_type, gated_dtype=gated_type)
    together = run_op(one_node_model(elem_type, elem_type, elem_type, shape=[6, 384], **attrs), y, z, w)
    single = one_node_model(elem_type, elem_type, elem_type, shape=[1, 384], **attrs)
    for row in range(6):
        alone = run_op(single, y[row : row + 1], z[row : row + 1], w)
        np.testing.assert_array_equal(together[row : row + 1], alone, err_msg=f"row {row}")


#: The CPU kernel's relative error before an output's last rounding: h within ~5e-7 of the exact product (the
#: math core's file comment), then nf and the norm_dtype rounding point (6e-8).
KERNEL_RELATIVE_ERROR = 6e-7


def _assert_tiny_outputs_exact(actual: np.ndarray, expected: np.ndarray, tiny: np.ndarray) -> None:
    """Outputs that are float32 subnormals, one by one (the budget's floor is the smallest normal float,
    so a flushed zero would pass it): none flushed, each within one subnormal step (2^-149: the last
    rounding, twice where a scaled group's outputs are scaled back) of the value the kernel's relative error
    allows. Near 2^-126 that relative error is a few subnormal steps."""
    assert np.count_nonzero(tiny) > 50
    assert np.all(actual[tiny] != 0.0), f"{np.count_nonzero(actual[tiny] == 0.0)} subnormal outputs flushed to zero"
    error = np.abs(actual[tiny] - expected[tiny])
    allowed = 2.0**-149 + KERNEL_RELATIVE_ERROR * np.abs(expected[tiny])
    assert np.all(error <= allowed), f"{np.max(error / 2.0**-149):.1f} subnormal steps off"


def _run_with_w(model: onnx.ModelProto, y: np.ndarray, z: np.ndarray, w: np.ndarray, w_source: str) -> np.ndarray:
    """Run the one-node model with w fed, or made a constant initializer (which the kernel reads once)."""
    if w_source == "constant":
        return contrib_ops.session(_with_constant_w(model, w), use_library=True).run(None, {"y": y, "z": z})[0]
    return run_op(model, y, z, w)


@pytest.mark.parametrize("w_source", ["fed", "constant"])
def test_group_with_subnormal_outputs_before_an_ordinary_one(w_source: str) -> None:
    """Groups whose outputs are mostly float32 subnormals (ordinary y and z, normal weights of 2e-38 on the
    first group of each row), each followed by an ordinary group: the kernel runs a group's norm pass
    together with the next group's gate pass under flush-to-zero, and must redo the first exactly when an
    output underflows, while the next group comes out as it does on its own."""
    rng = np.random.default_rng(39)
    y, z, w = random_inputs(rng, (4, 384), FLOAT, FLOAT, FLOAT)
    w[:96] = np.float32(2e-38) * np.sign(w[:96])
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[4, 384], group_size=96)
    actual = _run_with_w(model, y, z, w, w_source)
    expected = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=96, compute_dtype=np.float64)
    _assert_tiny_outputs_exact(actual.astype(np.float64), expected, np.abs(expected) < 2.0**-126)
    assert budget_report(actual, expected)[0]
    # The ordinary groups (second to fourth of each row) exactly as computed without the tiny group.
    alone = run_op(one_node_model(FLOAT, FLOAT, FLOAT, shape=[4, 288], group_size=96), y[:, 96:], z[:, 96:], w[96:])
    np.testing.assert_array_equal(actual[:, 96:], alone)


@pytest.mark.parametrize("w_source", ["fed", "constant"])
@pytest.mark.parametrize("w_type", [FLOAT, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
def test_subnormal_weights(w_source: str, w_type: int) -> None:
    """Weights that are float32 subnormals among ordinary ones, in rows of several groups: the outputs are
    w times normalized values of ~1, float32 subnormals, which a weight read as zero (x86's
    denormals-are-zero, under which the kernel may run a norm pass) would flush."""
    rng = np.random.default_rng([40, w_type, len(w_source)])
    y, z, w = random_inputs(rng, (3, 384), FLOAT, FLOAT, FLOAT)
    w[5::7] = (np.sign(w[5::7]) * rng.uniform(0.1, 1.0, w[5::7].size) * 2.0**-126).astype(np.float32)
    if w_type == BFLOAT16:
        w = w.astype(ml_dtypes.bfloat16).astype(np.float32)  # representable: the model's Cast is exact
    model = one_node_model(FLOAT, FLOAT, w_type, shape=[3, 384], group_size=96)
    actual = _run_with_w(model, y, z, w, w_source)
    expected = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=96, compute_dtype=np.float64)
    tiny = np.zeros(expected.shape, bool)
    tiny[:, 5::7] = np.abs(expected[:, 5::7]) < 2.0**-126
    _assert_tiny_outputs_exact(actual.astype(np.float64), expected, tiny)
    assert budget_report(actual, expected)[0]


@pytest.mark.parametrize("case", ["infinite-y-subnormal-z", "subnormal-y-infinite-z"])
def test_subnormal_input_beside_an_infinite_one(case: str) -> None:
    """A subnormal input whose partner is infinite: read as zero (x86's denormals-are-zero in the gate pass)
    the product is 0 * Inf = NaN instead of Inf, which no zero shows; the group's sum is then not finite, and
    the kernel must look at its inputs. Exactly: h = Inf there, nf = 0, NaN in that lane and zeros elsewhere
    in the group."""
    rng = np.random.default_rng(41)
    y, z, w = random_inputs(rng, (2, 192), FLOAT, FLOAT, FLOAT)
    tiny, huge = (y, z) if case == "subnormal-y-infinite-z" else (z, y)
    tiny[0, 10], huge[0, 10] = np.float32(3e-39), np.float32(np.inf)
    tiny[1, 100], huge[1, 100] = np.float32(2e-39), np.float32(np.inf)
    actual = run_op(one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 192], group_size=96), y, z, w)
    expected = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=96, compute_dtype=np.float64)
    assert np.array_equal(np.isnan(actual), np.isnan(expected)) and np.count_nonzero(np.isnan(actual)) == 2
    finite = ~np.isnan(expected)
    assert budget_report(actual[finite], expected[finite])[0]
    assert np.all(actual[0, :96][finite[0, :96]] == 0.0) and np.all(actual[1, 96:][finite[1, 96:]] == 0.0)


@pytest.mark.parametrize("types", [(FLOAT, FLOAT, FLOAT), (BFLOAT16, BFLOAT16, BFLOAT16), (BFLOAT16, FLOAT, FLOAT)])
def test_gate_whose_y_z_overflows_but_not_its_product(types: tuple[int, int, int]) -> None:
    """y = 1e37, z = -80: y z overflows float32, y silu(z) = -1.4e4 does not. The table path computes
    (y z) / (1 + e^-z); such a group must come out as y silu(z), in the first group of a row (the lone gate
    pass) and in a later one (interleaved with the previous group's norm pass)."""
    rng = np.random.default_rng(43)
    y, z, w = random_inputs(rng, (2, 384), *types)
    for row, col in [(0, 5), (0, 200), (1, 300)]:
        y[row, col], z[row, col] = 1e37, -80.0
    actual = check_against_reference(y, z, w, group_size=96)
    assert np.all(np.isfinite(actual.astype(np.float32)))


@pytest.mark.parametrize("epsilon", [0.0, 1e-6, 1e-2])
def test_epsilon(epsilon: float) -> None:
    rng = np.random.default_rng(3)
    y, z, w = random_inputs(rng, (4, 120), FLOAT, FLOAT, FLOAT, scale=0.05)
    check_against_reference(y, z, w, group_size=40, epsilon=epsilon)


def test_empty_leading_axis_gives_empty_output() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", 96], group_size=48)
    y = np.zeros((0, 96), np.float32)
    out = run_op(model, y, y, np.ones(96, np.float32))
    assert out.shape == (0, 96)
    assert out.dtype == np.float32


def test_output_shape_and_type_are_inferred() -> None:
    model = one_node_model(FLOAT16, FLOAT16, FLOAT, shape=["batch", "seq", 96], group_size=48, output_dtype=FLOAT)
    session = contrib_ops.session(model, use_library=True)
    out = session.get_outputs()[0]
    assert out.type == "tensor(float)"
    assert out.shape == ["batch", "seq", 96]


def test_fp16_node_feeding_matmul_on_cpu() -> None:
    """ORT's CPU fp16 handling wraps MatMul (no fp16 CPU kernel) in Casts; the fused node must still load
    and give the values rounded to fp16 (docs/op.md, type rules)."""
    rng = np.random.default_rng(5)
    y, z, w = random_inputs(rng, (1, 96), FLOAT16, FLOAT16, FLOAT16)
    proj = (rng.standard_normal((96, 16)) * 0.1).astype(np.float16)
    nodes = [
        oh.make_node(
            "GatedGroupRMSNorm",
            ["y", "z", "w"],
            ["normed"],
            domain="ai.mambafuse",
            epsilon=1e-5,
            group_size=48,
        ),
        oh.make_node("MatMul", ["normed", "proj"], ["out"]),
    ]
    graph = oh.make_graph(
        nodes,
        "fused_then_matmul",
        [oh.make_tensor_value_info(n, FLOAT16, [1, 96]) for n in "yz"]
        + [oh.make_tensor_value_info("w", FLOAT16, [96])],
        [oh.make_tensor_value_info("out", FLOAT16, [1, 16])],
        initializer=[onnx.numpy_helper.from_array(proj, "proj")],
    )
    model = make_model(graph)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = contrib_ops.session(model, session_options=options, use_library=True)
        out = session.run(None, {"y": y, "z": z, "w": w})[0]
        normed = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=48)
        expected = (normed.astype(np.float32) @ proj.astype(np.float32)).astype(np.float16)
        np.testing.assert_allclose(out.astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=2e-3)


# --- bad input: clear errors that name the problem ----------------------------------------------------


def _expect_error(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None, pattern: str) -> None:
    with pytest.raises(Exception, match=pattern) as info:  # noqa: PT011 - ORT raises several exception types
        session = contrib_ops.session(model, use_library=True)
        if feeds is not None:
            session.run(None, feeds)
    assert "GatedGroupRMSNorm" in str(info.value)


def test_rejects_w_of_wrong_length_at_run_time() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", "c"], w_shape=["wc"], group_size=8)
    y = np.ones((2, 16), np.float32)
    _expect_error(
        model, {"y": y, "z": y, "w": np.ones(15, np.float32)}, r"W must have shape \[C\] = \[16\], got \[15\]"
    )


def _with_constant_w(model: onnx.ModelProto, w: np.ndarray) -> onnx.ModelProto:
    """The model with its input w made a constant initializer (the kernel reads its shape once)."""
    graph = model.graph
    kept = [i for i in graph.input if i.name != "w"]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.append(onnx.numpy_helper.from_array(w, "w"))
    return model


def test_constant_w_gives_the_same_result_as_w_fed() -> None:
    rng = np.random.default_rng(7)
    y, z, w = random_inputs(rng, (3, 32), FLOAT, FLOAT, FLOAT)
    fed = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", 32], group_size=8)
    constant = _with_constant_w(one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", 32], group_size=8), w)
    expected = contrib_ops.session(fed, use_library=True).run(None, {"y": y, "z": z, "w": w})[0]
    session = contrib_ops.session(constant, use_library=True)
    for rows in (3, 1, 3):  # Runs of other shapes after the first: W's shape was read once
        got = session.run(None, {"y": y[:rows], "z": z[:rows]})[0]
        np.testing.assert_array_equal(got, expected[:rows])


def test_rejects_constant_w_of_wrong_length_at_run_time() -> None:
    model = _with_constant_w(
        one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", "c"], w_shape=["wc"], group_size=8), np.ones(15, np.float32)
    )
    y = np.ones((2, 16), np.float32)
    _expect_error(model, {"y": y, "z": y}, r"W must have shape \[C\] = \[16\], got \[15\]")


def test_rejects_w_of_wrong_length_at_load_time() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 16], w_shape=[15], group_size=8)
    _expect_error(model, None, r"W must have shape \[C\] = \[16\], got \[15\]")


def test_rejects_w_of_wrong_rank() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", "c"], w_shape=["a", "b"], group_size=8)
    y = np.ones((2, 16), np.float32)
    _expect_error(model, {"y": y, "z": y, "w": np.ones((2, 8), np.float32)}, r"W must (have shape \[C\]|be 1-D)")


def test_rejects_channels_not_divisible_by_group_size_at_load_time() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 30], group_size=8)
    _expect_error(model, None, r"C = 30 \(last axis of Y\) is not divisible by group_size = 8")


def test_rejects_channels_not_divisible_by_group_size_at_run_time() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", "c"], w_shape=["c"], group_size=8)
    y = np.ones((2, 30), np.float32)
    _expect_error(model, {"y": y, "z": y, "w": np.ones(30, np.float32)}, r"C = 30 .* not divisible by group_size = 8")


def test_rejects_y_z_shape_mismatch() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", 16], z_shape=["m", 16], group_size=8)
    y = np.ones((2, 16), np.float32)
    _expect_error(
        model,
        {"y": y, "z": np.ones((3, 16), np.float32), "w": np.ones(16, np.float32)},
        r"Z must have Y's shape \[2, 16\], got \[3, 16\]",
    )


def test_rejects_y_z_shape_mismatch_at_load_time() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 16], z_shape=[3, 16], group_size=8)
    _expect_error(model, None, r"Z must have Y's shape")


@pytest.mark.parametrize("group_size", [0, -4])
def test_rejects_non_positive_group_size(group_size: int) -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 16], group_size=group_size)
    _expect_error(model, None, rf"group_size must be > 0, got {group_size}")


def test_rejects_unsupported_input_type() -> None:
    node = oh.make_node(
        "GatedGroupRMSNorm", ["y", "z", "w"], ["out"], domain="ai.mambafuse", epsilon=1e-5, group_size=8
    )
    graph = oh.make_graph(
        [node],
        "double",
        [oh.make_tensor_value_info(n, onnx.TensorProto.DOUBLE, [2, 16]) for n in "yz"]
        + [oh.make_tensor_value_info("w", FLOAT, [16])],
        [oh.make_tensor_value_info("out", FLOAT, None)],
    )
    model = make_model(graph)
    _expect_error(model, None, r"input Y has element type double; supported: float, float16, bfloat16")


@pytest.mark.parametrize(
    ("attr", "value", "name"),
    [
        ("norm_dtype", 11, "double"),
        ("output_dtype", 7, "int64"),
        ("norm_dtype", 99, "an unsupported element type"),
        ("gated_dtype", 11, "double"),
        ("gated_dtype", 6, "int32"),
    ],
)
def test_rejects_bad_dtype_attribute(attr: str, value: int, name: str) -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 16], group_size=8, **{attr: value}, out_type=FLOAT)
    _expect_error(model, None, rf"{attr} = {value} \({name}.*\) is not a supported type")


def test_rejects_missing_epsilon() -> None:
    node = oh.make_node("GatedGroupRMSNorm", ["y", "z", "w"], ["out"], domain="ai.mambafuse", group_size=8)
    graph = oh.make_graph(
        [node],
        "no_eps",
        [oh.make_tensor_value_info(n, FLOAT, [2, 16]) for n in "yz"] + [oh.make_tensor_value_info("w", FLOAT, [16])],
        [oh.make_tensor_value_info("out", FLOAT, None)],
    )
    model = make_model(graph)
    _expect_error(model, None, r"required attribute 'epsilon' \(float\) is missing")


# --- resources --------------------------------------------------------------------------------------

_SCRATCH_PROBE = """
import gc, sys
import numpy as np
sys.path.insert(0, {repo!r})
import contrib_ops
from tests._ops import FLOAT, one_node_model

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

def run(group_size):
    rng = np.random.default_rng(0)
    y = rng.standard_normal((1, group_size), dtype=np.float32)
    z = rng.standard_normal((1, group_size), dtype=np.float32)
    w = np.ones(group_size, np.float32)
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[1, group_size], group_size=group_size)
    session = contrib_ops.session(model, use_library=True)
    out = session.run(None, {{"y": y, "z": z, "w": w}})[0]
    assert np.isfinite(out).all()
    del session, out, y, z, w
    gc.collect()

run(1024)  # ONNX Runtime's own one-time allocations happen here
before = rss_mb()
run({group_size})
print(rss_mb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident set size from /proc")
@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="AddressSanitizer holds freed memory in its quarantine: the resident set cannot show a release",
)
def test_huge_group_size_leaves_no_scratch_behind() -> None:
    """A group of 2^23 floats (32 MB) needs a 32 MB buffer for h while it runs; once the run is over and
    the session gone, the process must not hold it any more (the kernel keeps at most 256 KB per thread).
    Measured in a fresh interpreter: resident memory after, minus before the session."""
    group_size = 1 << 23
    script = _SCRATCH_PROBE.format(repo=str(Path(__file__).resolve().parents[1]), group_size=group_size)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    retained_mb = float(result.stdout.strip().splitlines()[-1])
    assert retained_mb < 16, f"{retained_mb:.0f} MB still resident after a run with group_size {group_size}"


def test_unknown_cpu_isa_is_an_error() -> None:
    """MAMBAFUSE_CPU_ISA set to a value the library does not know fails the session with a message naming
    the variable and the accepted values, instead of quietly running the baseline kernel."""
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "import contrib_ops\n"
        "from tests._ops import FLOAT, one_node_model\n"
        "contrib_ops.session(one_node_model(FLOAT, FLOAT, FLOAT, shape=[1, 8], group_size=4), use_library=True)\n"
    )
    env = dict(os.environ, MAMBAFUSE_CPU_ISA="avx3")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0, "a session was created with MAMBAFUSE_CPU_ISA=avx3"
    assert "MAMBAFUSE_CPU_ISA='avx3'" in result.stderr, result.stderr[-2000:]
    assert "baseline" in result.stderr, result.stderr[-2000:]


# --- the Python handle ------------------------------------------------------------------------------


def test_library_path_env_override_must_exist(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(contrib_ops.LIBRARY_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(contrib_ops.LibraryNotFoundError, match="nope.so"):
        contrib_ops.library_path()


def test_library_not_found_lists_where_it_looked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(contrib_ops.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(contrib_ops, "_candidates", lambda: [contrib_ops.Path("/nonexistent/libmambafuse_ops.so")])
    with pytest.raises(contrib_ops.LibraryNotFoundError, match="/nonexistent/libmambafuse_ops.so"):
        contrib_ops.library_path()


def test_coreml_first_sessions_do_not_want_the_library() -> None:
    assert contrib_ops.wants_library(["CPUExecutionProvider"])
    assert contrib_ops.wants_library(None)
    assert not contrib_ops.wants_library(["CoreMLExecutionProvider", "CPUExecutionProvider"])
    assert not contrib_ops.wants_library([("CoreMLExecutionProvider", {}), "CPUExecutionProvider"])


def test_all_float_inputs_with_half_output_dtype_give_float_tensor_of_rounded_values() -> None:
    """Y, Z, W float32 and output_dtype float16: the output tensor is float32 (as ONNX Runtime's fp16
    fallback expects of a node it widened), its values rounded to float16."""
    rng = np.random.default_rng(8)
    y, z, w = random_inputs(rng, (2, 96), FLOAT, FLOAT, FLOAT)
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=[2, 96], group_size=48, output_dtype=FLOAT16)
    session = contrib_ops.session(model, use_library=True)
    assert session.get_outputs()[0].type == "tensor(float)"
    out = session.run(None, {"y": y, "z": z, "w": w})[0]
    assert out.dtype == np.float32
    assert np.array_equal(out, out.astype(np.float16).astype(np.float32)), "values are not float16-rounded"
    expected = gated_group_rms_norm(
        y, z, w, epsilon=1e-5, group_size=48, output_dtype=np.float16, compute_dtype=np.float64
    )
    ok, message = budget_report(out.astype(np.float16), expected)
    assert ok, message


@pytest.mark.parametrize("level", ["disable", "all"])
def test_fp16_nodes_between_ops_without_fp16_cpu_kernels(level: str) -> None:
    """Fused fp16 nodes between residual Adds (no fp16 CPU kernel): ONNX Runtime widens the isolated
    fused nodes to float32 (docs/op.md, type rules); the model must load and match the unfused graph."""
    from fusion._chains import ChainSpec, build_chain_sequence, half_decode
    from fusion.rewrite import rewrite_model

    spec = ChainSpec(channels=96, group_size=48, leading=(1, 1), **half_decode(FLOAT16))
    model = build_chain_sequence(spec, 3, residual=True)
    fused, result = rewrite_model(model)
    assert result.fused == 3
    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    rng = np.random.default_rng(9)
    feeds = {
        "y": rng.standard_normal((1, 1, 96)).astype(np.float16),
        "z": rng.standard_normal((1, 1, 96)).astype(np.float16),
    }
    got = contrib_ops.session(fused, session_options=options, use_library=True).run(None, feeds)[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(
        got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2 * np.abs(want).max()
    )


def _rankless_model(output_dtype: int, z_shape: list[int | str] | None = None) -> onnx.ModelProto:
    """float16 Y, Z (Y without a shape, Z with ``z_shape``) and W, the op's output through an Identity (or a
    Cast to float for bfloat16) to a graph output whose type is not declared, and its Shape."""
    out = "normed" if output_dtype != BFLOAT16 else "normed_bf16"
    nodes = [
        oh.make_node(
            "GatedGroupRMSNorm",
            ["y", "z", "w"],
            [out],
            domain="ai.mambafuse",
            epsilon=1e-5,
            group_size=8,
            output_dtype=output_dtype,
        ),
        oh.make_node("Identity", [out], ["out"]) if out == "normed" else oh.make_node("Cast", [out], ["out"], to=FLOAT),
        oh.make_node("Shape", [out], ["shape"]),
    ]
    graph = oh.make_graph(
        nodes,
        "rankless",
        [
            oh.make_tensor_value_info("y", FLOAT16, None),
            oh.make_tensor_value_info("z", FLOAT16, z_shape),
            oh.make_tensor_value_info("w", FLOAT16, [16]),
        ],
        [oh.make_empty_tensor_value_info("out"), oh.make_tensor_value_info("shape", onnx.TensorProto.INT64, None)],
    )
    return make_model(graph)


@pytest.mark.parametrize("output_dtype", [FLOAT, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
def test_output_type_without_a_known_rank_is_an_error_at_session_creation(output_dtype: int) -> None:
    """Neither Y nor Z has a known rank: ONNX Runtime takes a custom op's output type only with a shape, so
    the library cannot type the output, and ONNX Runtime types it as W's (float16). The session fails when
    it is created, with a message that names the cause and the remedy (before: it failed at its first run,
    "the output tensor has type float16 but output_dtype is ...")."""
    with pytest.raises(Exception, match=r"neither Y nor Z has a known rank.*declare Y's or Z's shape"):  # noqa: PT011
        contrib_ops.session(_rankless_model(output_dtype), use_library=True)


@pytest.mark.parametrize("output_dtype", [FLOAT16, FLOAT, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
def test_output_type_follows_output_dtype_with_the_gate_rank_alone(output_dtype: int) -> None:
    """Y without a shape, Z with one: the output gets output_dtype (a float output read back as float) and
    Z's shape; with neither (and output_dtype W's type) the output is not declared a scalar (its Shape is
    the tensor's, not []: a shape without dims would be folded as one)."""
    rng = np.random.default_rng(13)
    y, z, w = random_inputs(rng, (2, 3, 16), FLOAT16, FLOAT16, FLOAT16)
    feeds = {"y": y, "z": z, "w": w}
    expected = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=8, output_dtype=SUPPORTED_TYPES[output_dtype])
    for z_shape in (["b", 3, 16], None) if output_dtype == FLOAT16 else (["b", 3, 16],):
        session = contrib_ops.session(_rankless_model(output_dtype, z_shape), use_library=True)
        out, shape = session.run(None, feeds)
        assert list(shape) == [2, 3, 16], f"Z's shape {z_shape}: Shape(output) = {shape}"
        assert out.dtype == (np.float16 if output_dtype == FLOAT16 else np.float32)
        np.testing.assert_array_equal(out.astype(np.float32), expected.astype(np.float32))


def test_inferred_output_shape_takes_known_dims_from_the_gate() -> None:
    """Y's last dim unknown (as in TorchScript exports), Z's known: the output gets Z's dims, so a MatMul
    after the node still type-checks when the session is created."""
    rng = np.random.default_rng(12)
    y, z, w = random_inputs(rng, (2, 3, 96), FLOAT, FLOAT, FLOAT)
    proj = rng.standard_normal((96, 8)).astype(np.float32)
    nodes = [
        oh.make_node(
            "GatedGroupRMSNorm", ["y", "z", "w"], ["normed"], domain="ai.mambafuse", epsilon=1e-5, group_size=48
        ),
        oh.make_node("MatMul", ["normed", "proj"], ["out"]),
    ]
    graph = oh.make_graph(
        nodes,
        "unknown_y_dims",
        [
            oh.make_tensor_value_info("y", FLOAT, [2, 3, None]),
            oh.make_tensor_value_info("z", FLOAT, [2, 3, 96]),
            oh.make_tensor_value_info("w", FLOAT, [96]),
        ],
        [oh.make_tensor_value_info("out", FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(proj, "proj")],
    )
    session = contrib_ops.session(make_model(graph), use_library=True)
    out = session.run(None, {"y": y, "z": z, "w": w})[0]
    expected = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=48) @ proj
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
