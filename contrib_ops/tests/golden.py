"""Golden cases for the standalone kernel programs, and how to build and check them.

``kernel_golden_test.cc`` links the CPU math core (and, where built in, the MSL emulation or the real Metal
kernel) without ONNX Runtime, so it runs where the library cannot: cross-compiled for AArch64 under
qemu, under sanitizers, on a Mac's GPU. This module is its other half:

- ``write_cases(directory, cases)`` draws seeded inputs, evaluates the reference in float64 and
  writes ``cases.txt`` plus raw little-endian ``<name>.y/.z/.w/.expected`` files (nothing is committed);
- the program writes ``<name>.out``; ``check_case`` applies the accuracy budget of docs/op.md
  (``budget_report``) and, for edge cases, that NaN/Inf stay inside their own group.

The program checks each case coarsely itself (NaN/Inf placement, a ulp bound given in cases.txt) so that
it is useful without Python; the budget verdict is the one made here.

``cases.txt``, one case per line::

    name y_type z_type w_type norm_type out_type store_type gated_type rows channels group_size epsilon chunks ulp_limit
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import onnx

from fusion.reference import SUPPORTED_TYPES, budget_report, reference_for_budget

FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16
TYPES = (FLOAT, FLOAT16, BFLOAT16)
TYPE_NAMES = {FLOAT: "f32", FLOAT16: "f16", BFLOAT16: "bf16"}
_MANTISSA_BITS = {FLOAT: 23, FLOAT16: 10, BFLOAT16: 7}

REPO = Path(__file__).resolve().parents[2]
CONTRIB = REPO / "contrib_ops"
CPU_DIR = CONTRIB / "cpu"
METAL_DIR = CONTRIB / "metal"
TESTS_DIR = CONTRIB / "tests"

#: What a developer on Debian/Ubuntu x86-64 installs to run the AArch64 tests.
CROSS_PACKAGES = ("g++-aarch64-linux-gnu", "qemu-user")
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


@dataclasses.dataclass(frozen=True)
class GoldenCase:
    """One run of the op: shape, attributes, the five types, and how the items are split into calls."""

    name: str
    shape: tuple[int, ...]
    group_size: int
    y_type: int = FLOAT
    z_type: int = FLOAT
    w_type: int = FLOAT
    norm_type: int = FLOAT
    out_type: int = FLOAT
    store_type: int | None = None  # None: out_type; FLOAT: ORT widened the node's output
    gated_type: int = FLOAT  # rounding point of h (attribute gated_dtype; FLOAT: none)
    epsilon: float = 1e-5
    edge_values: bool = False  # zeros, tiny, huge, NaN/Inf in chosen groups (see _edge_inputs)
    ties: bool = False  # gated products at gated_type rounding ties (see tie_close_inputs)
    chunks: int = 1  # the item range is split into this many calls, on as many threads
    seed: int = 0

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def channels(self) -> int:
        return self.shape[-1]

    @property
    def storage(self) -> int:
        return self.out_type if self.store_type is None else self.store_type


def _types_id(types: Sequence[int]) -> str:
    return "-".join(TYPE_NAMES[t] for t in types)


def type_combination_cases() -> list[GoldenCase]:
    """Every (y, z, w, norm, out) type combination, [3, 4560] with group size 456 (3^5 = 243 cases).

    456 is a multiple of neither a vector width nor the SIMD width (remainders everywhere), and 30 groups
    keep the MSL emulation (one simd_sum per group) quick. 13680 elements each: with a half norm_dtype,
    enough n within the tie window (about 0.2 % for float16, where a kernel and the float64 reference may
    round n apart; the budget's intervals admit both) that every case meets some.
    """
    return [
        GoldenCase(f"types_{_types_id(t)}", (3, 4560), 456, *t, seed=i)
        for i, t in enumerate(itertools.product(TYPES, repeat=5))
    ]


#: (shape, group_size, chunks): decode width, the odd group sizes, one group, group of one, a split range.
SHAPES: tuple[tuple[tuple[int, ...], int, int], ...] = (
    ((1, 7680), 960, 1),  # Nemotron-H decode row, 8 groups
    ((4, 120), 40, 1),
    ((3, 5, 96), 48, 2),
    ((2, 3, 64), 64, 1),  # one group per row
    ((5, 24), 1, 1),  # group of one
    ((2, 1, 100), 25, 1),  # group size not a multiple of any vector or SIMD width
    ((16, 4096), 512, 3),  # several calls over a split item range, on three threads
)


def shape_cases(shapes: Iterable[tuple[tuple[int, ...], int, int]] = SHAPES) -> list[GoldenCase]:
    """Each shape of ``shapes`` for each single type (all five types equal)."""
    cases = []
    for (shape, group_size, chunks), t in itertools.product(shapes, TYPES):
        dims = "x".join(map(str, shape))
        cases.append(
            GoldenCase(f"shape_{dims}_gs{group_size}_{TYPE_NAMES[t]}", shape, group_size, *(t,) * 5, chunks=chunks)
        )
    return cases


def special_cases() -> list[GoldenCase]:
    """Edge values per type, epsilon 0, the widened-output storage, an empty tensor."""
    cases = [GoldenCase(f"edge_{TYPE_NAMES[t]}", (3, 256), 32, *(t,) * 5, edge_values=True, seed=11) for t in TYPES]
    cases += [
        GoldenCase("epsilon0_f32", (4, 120), 40, epsilon=0.0, seed=3),
        GoldenCase("epsilon1e-2_f16", (4, 120), 40, *(FLOAT16,) * 5, epsilon=1e-2, seed=4),
        # ORT may hand the kernel a float output buffer for an fp16/bf16 output_dtype (docs/op.md, type rules).
        GoldenCase("widened_out_f16", (2, 96), 48, *(FLOAT16,) * 5, store_type=FLOAT, seed=5),
        GoldenCase("widened_out_bf16", (2, 96), 48, FLOAT, BFLOAT16, FLOAT, FLOAT, BFLOAT16, FLOAT, seed=6),
        GoldenCase("empty_rows", (0, 96), 48, seed=7),
    ]
    return cases


def gated_cases() -> list[GoldenCase]:
    """h rounded to each gated_dtype, with the type mixes builders write: all half (mobius), float32 with a
    float32 output (where a flipped h shows most), an exporter's B form, and the edge values."""
    mixes = {
        "f32": (FLOAT,) * 5,
        "f16": (FLOAT16,) * 5,
        "bf16": (BFLOAT16,) * 5,
        "B-f16": (FLOAT, FLOAT16, FLOAT, FLOAT, FLOAT16),
    }
    cases = [
        GoldenCase(f"gated_{TYPE_NAMES[g]}_{mix}", (3, 4560), 456, *types, gated_type=g, seed=40 + i)
        for i, (g, (mix, types)) in enumerate(itertools.product(TYPES, mixes.items()))
    ]
    cases += [
        GoldenCase(f"gated_{TYPE_NAMES[g]}_shape_1x7680", (1, 7680), 960, *(g,) * 5, gated_type=g, seed=60)
        for g in (FLOAT16, BFLOAT16)
    ]
    cases += [
        GoldenCase(f"gated_edge_{TYPE_NAMES[t]}", (3, 256), 32, *(t,) * 5, gated_type=t, edge_values=True, seed=11)
        for t in (FLOAT16, BFLOAT16)
    ]
    return cases


#: (y, z, w, norm, output) types of the tie cases: float32 outputs (where a tipped h shows most, also from
#: half inputs, and with a bfloat16 norm_dtype), float32 inputs with a half output, and the exporters' forms.
TIE_TYPE_MIXES: dict[str, tuple[int, int, int, int, int]] = {
    "f32": (FLOAT,) * 5,
    "f16-out-f32": (FLOAT16, FLOAT16, FLOAT16, FLOAT, FLOAT),
    "f32-norm-bf16": (FLOAT, FLOAT, FLOAT, BFLOAT16, FLOAT),
    "f32-out-f16": (FLOAT, FLOAT, FLOAT, FLOAT16, FLOAT16),
    "B-f16": (FLOAT, FLOAT16, FLOAT, FLOAT, FLOAT16),
    "B-bf16": (FLOAT, BFLOAT16, FLOAT, FLOAT, BFLOAT16),
    "C-f16": (FLOAT16,) * 5,
    "C-bf16": (BFLOAT16,) * 5,
}


def tie_cases() -> list[GoldenCase]:
    """Gated products built to sit at rounding ties (tie_close_inputs), for both half gated_dtypes and every
    mix of TIE_TYPE_MIXES: 8 rows of 8 groups of 96, and rows of 960-wide groups split over two calls."""
    cases = [
        GoldenCase(f"ties_{TYPE_NAMES[g]}_{mix}", (8, 768), 96, *types, gated_type=g, ties=True, seed=70 + i)
        for i, (g, (mix, types)) in enumerate(itertools.product((FLOAT16, BFLOAT16), TIE_TYPE_MIXES.items()))
    ]
    cases += [
        GoldenCase(f"ties_{TYPE_NAMES[g]}_f32_4x7680", (4, 7680), 960, gated_type=g, ties=True, chunks=2, seed=90)
        for g in (FLOAT16, BFLOAT16)
    ]
    return cases


def all_cases() -> list[GoldenCase]:
    return type_combination_cases() + shape_cases() + special_cases() + gated_cases() + tie_cases()


# --- data -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GoldenData:
    """A case's inputs and its float64-evaluated reference (``bounds``: the intervals of the consistent
    evaluations, see reference_for_budget)."""

    case: GoldenCase
    y: np.ndarray
    z: np.ndarray
    w: np.ndarray
    expected: np.ndarray
    bounds: tuple[np.ndarray, np.ndarray]

    @property
    def ulp_limit(self) -> int:
        """A coarse bound (in ulps of the output type) for the program's own check; budget_report decides."""
        out, norm = self.case.out_type, self.case.norm_type
        limit = 2 if out != FLOAT else 40  # rel 2e-6 is at most 34 float32 ulps
        for rounding in (norm, self.case.gated_type):
            if _MANTISSA_BITS[rounding] <= _MANTISSA_BITS[out]:
                # a tie-close n (or h) may round the other way: about |w| * ulp(norm, n), in output ulps
                limit += 4 * 2 ** (_MANTISSA_BITS[out] - _MANTISSA_BITS[rounding])
        return limit


def _edge_inputs(case: GoldenCase, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Zero groups, values near sqrt(eps), large values, half-subnormal results, NaN/Inf in chosen groups."""
    gs = case.group_size
    y = rng.standard_normal(case.shape).astype(np.float32)
    z = (2.0 * rng.standard_normal(case.shape)).astype(np.float32)

    def g(i: int) -> slice:
        return slice(i * gs, (i + 1) * gs)

    y[0, g(0)] = 0.0  # a zero group gives zeros
    z[0, g(1)] = 0.0  # zero gate: silu(0) = 0
    y[0, g(2)] *= 3e-3  # |h| ~ sqrt(eps): eps dominates the mean square
    z[0, g(3)] = np.linspace(-30.0, 30.0, gs)  # saturated sigmoid on both sides
    y[0, g(4)] *= 1e3 if case.y_type != FLOAT16 else 1e2  # large values (fp16 max is 65504)
    y[0, g(5)] *= 1e-5  # one dominant element: the others normalize into the half subnormal range
    y[0, g(5)][0] = 8.0
    z[0, g(5)] = 3.0
    y[1, g(0)][5] = np.nan  # NaN in y
    z[1, g(3)][7] = np.inf  # +Inf gate: silu = +Inf, the group becomes NaN/Inf
    z[1, g(5)][2] = -np.inf  # -Inf gate: silu = -Inf * 0 = NaN
    y[2, g(7)][0] = np.inf
    z[2, g(6)] = np.linspace(-120.0, -80.0, gs)  # exp underflow range of the sigmoid
    return y, z


#: Gates whose sigmoid is 1 to float32 (e^-z < 2^-25) but not to float64: there a float32 kernel computes
#: y silu(z) as the exact product y z, while the exact h lies e^-z (< 2.1e-9) below it. Integers, so that
#: every input type holds them; their odd parts (1 to 15) are what y = tie / z has to divide.
TIE_GATES = np.arange(20.0, 31.0)


def tie_close_inputs(
    rng: np.random.Generator,
    shape: Sequence[int],
    group_size: int,
    y_type: int,
    z_type: int,
    w_type: int,
    gated_type: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (y, z, w), rounded to their types, whose gated products sit at ``gated_type`` rounding ties.

    In every group a quarter of the elements (at least two), of both signs, get an exact product y silu(z)
    within the tie window (GATED_TIE_WINDOW) of a tie; in the first group of each row every element does,
    and in the second one such element (|h| ~ 16 to 64) dominates the group's sum of squares. The rest are
    drawn as for the other cases (y ~ N(0, 1), z ~ N(0, 2)).

    Two kinds of tie: with a gate in TIE_GATES and y = tie / z exactly, a float32 kernel's h is the tie itself
    and rounds to the even neighbour, where the exact h (just below the tie) rounds toward zero: about half of
    them tip, deterministically. Where y is float32, half of the ties instead get a gate of 0.5 to 4 in
    magnitude and y = tie / silu(z) rounded to float32 (within 2^-24 of the tie), which the kernel's own
    rounding error tips either way. The weight is 1 + N(0, 0.5).
    """
    ydt, zdt, wdt, gdt = (SUPPORTED_TYPES[t] for t in (y_type, z_type, w_type, gated_type))
    y = rng.standard_normal(shape)
    z = 2.0 * rng.standard_normal(shape)
    w = (1.0 + 0.5 * rng.standard_normal(shape[-1])).astype(wdt)
    groups = int(np.prod(shape, dtype=np.int64)) // group_size
    per_row = shape[-1] // group_size
    order = rng.random((groups, group_size)).argsort(axis=-1)
    pick = order < max(2, group_size // 4)
    scale = np.ones((groups, group_size))
    rows_first = np.arange(0, groups, per_row)
    pick[rows_first] = True
    if per_row > 1:
        pick[rows_first + 1, 0] = True
        scale[rows_first + 1, 0] = 16.0
    count = int(pick.sum())
    # A tie above each of `tries` random gated_dtype values per target; the first one whose y = tie / z is a
    # value of y's type for one of the gates.
    tries = 64
    magnitude = (np.exp2(rng.uniform(-2.0, 2.0, (count, tries))) * scale[pick][:, None]).astype(gdt)
    upper = np.nextafter(magnitude, np.array(np.inf, gdt))
    tie = (magnitude.astype(np.float64) + upper.astype(np.float64)) / 2
    gates = TIE_GATES.astype(zdt).astype(np.float64)
    quotient = tie[:, :, None] / gates
    exact = (quotient.astype(ydt).astype(np.float64) == quotient) & (quotient * gates == tie[:, :, None])
    flat = exact.reshape(count, -1)
    assert flat.any(axis=1).all(), "no tie / gate quotient is a value of y's type"
    first = flat.argmax(axis=1)
    tie_y = quotient.reshape(count, -1)[np.arange(count), first]
    tie_z = np.broadcast_to(gates, quotient.shape).reshape(count, -1)[np.arange(count), first]
    if y_type == FLOAT:
        # Near-ties that the kernel's rounding error decides, at ordinary gates.
        near = rng.random(count) < 0.5
        gate = (rng.uniform(0.5, 4.0, count) * np.where(rng.random(count) < 0.5, -1.0, 1.0)).astype(zdt)
        gate64 = gate.astype(np.float64)
        silu = gate64 / (1.0 + np.exp(-gate64))
        tie_y = np.where(near, (tie[:, 0] / silu).astype(np.float32).astype(np.float64), tie_y)
        tie_z = np.where(near, gate64, tie_z)
    sign = np.where(rng.random(count) < 0.5, -1.0, 1.0)
    y.reshape(groups, group_size)[pick] = sign * tie_y
    z.reshape(groups, group_size)[pick] = tie_z
    return y.astype(ydt), z.astype(zdt), w


def make_data(case: GoldenCase) -> GoldenData:
    """Return the case's seeded inputs (rounded to their types) and the float64 reference."""
    rng = np.random.default_rng([case.seed, case.group_size, *case.shape])
    if case.ties:
        types = (case.y_type, case.z_type, case.w_type, case.gated_type)
        y, z, w = tie_close_inputs(rng, case.shape, case.group_size, *types)
    else:
        if case.edge_values:
            y, z = _edge_inputs(case, rng)
        else:
            y = rng.standard_normal(case.shape).astype(np.float32)
            z = (2.0 * rng.standard_normal(case.shape)).astype(np.float32)
        w = (1.0 + 0.5 * rng.standard_normal(case.channels)).astype(np.float32)
        y = y.astype(SUPPORTED_TYPES[case.y_type])
        z = z.astype(SUPPORTED_TYPES[case.z_type])
        w = w.astype(SUPPORTED_TYPES[case.w_type])
    reference = reference_for_budget(
        y,
        z,
        w,
        epsilon=case.epsilon,
        group_size=case.group_size,
        norm_dtype=SUPPORTED_TYPES[case.norm_type],
        output_dtype=SUPPORTED_TYPES[case.out_type],
        gated_dtype=SUPPORTED_TYPES[case.gated_type],
    )
    return GoldenData(case, y, z, w, reference["expected"], reference["bounds"])


def write_cases(directory: Path, cases: Iterable[GoldenCase]) -> dict[str, GoldenData]:
    """Write ``cases.txt`` and the input/expected files of ``cases`` into ``directory``; return the data."""
    directory.mkdir(parents=True, exist_ok=True)
    data: dict[str, GoldenData] = {}
    lines = []
    for case in cases:
        d = make_data(case)
        data[case.name] = d
        for suffix, array in (("y", d.y), ("z", d.z), ("w", d.w), ("expected", d.expected)):
            np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tofile(
                directory / f"{case.name}.{suffix}"
            )
        fields = [
            case.name,
            case.y_type,
            case.z_type,
            case.w_type,
            case.norm_type,
            case.out_type,
            case.storage,
            case.gated_type,
            case.rows,
            case.channels,
            case.group_size,
            repr(float(case.epsilon)),
            case.chunks,
            d.ulp_limit,
        ]
        lines.append(" ".join(map(str, fields)))
    (directory / "cases.txt").write_text("\n".join(lines) + "\n")
    return data


def read_output(output_directory: Path, data: GoldenData) -> np.ndarray:
    """Return the program's output of a case, converted to the op's output type (exact)."""
    case = data.case
    path = output_directory / f"{case.name}.out"
    stored = np.fromfile(path, dtype=SUPPORTED_TYPES[case.storage].newbyteorder("<"))
    if stored.size != data.expected.size:
        raise AssertionError(f"{path}: {stored.size} values, expected {data.expected.size}")
    return stored.astype(SUPPORTED_TYPES[case.storage]).astype(SUPPORTED_TYPES[case.out_type]).reshape(case.shape)


def check_case(output_directory: Path, data: GoldenData, program_log: str = "") -> tuple[bool, str]:
    """Return (ok, message): the program's output of a case against the budget of docs/op.md.

    A case the program wrote no output for fails with the end of ``program_log`` (its stdout).
    """
    if not (output_directory / f"{data.case.name}.out").is_file():
        return False, f"the program wrote no output for {data.case.name}:\n{program_log[-2000:]}"
    actual = read_output(output_directory, data)
    if data.case.store_type == FLOAT and data.case.out_type != FLOAT:
        # A widened output must still hold values rounded to output_dtype.
        stored = np.fromfile(output_directory / f"{data.case.name}.out", dtype="<f4").reshape(data.case.shape)
        if not np.array_equal(stored, actual.astype(np.float32), equal_nan=True):
            return False, "the widened float output holds values that are not rounded to output_dtype"
    ok, message = budget_report(actual, data.expected, bounds=data.bounds)
    if ok and data.case.edge_values:
        finite_actual = np.isfinite(actual.astype(np.float32))
        finite_expected = np.isfinite(data.expected.astype(np.float32))
        if not np.array_equal(finite_actual, finite_expected):
            bad = int((finite_actual != finite_expected).sum())
            return False, f"NaN/Inf placement differs from the reference in {bad} elements"
        zero_group = actual[0, : data.case.group_size].astype(np.float32)
        if not np.all(zero_group == 0.0):
            return False, f"a zero group gave {zero_group[:4]}"
    return ok, message


# --- building and running the program ----------------------------------------------------------------


def cmake_flags(variable: str) -> list[str]:
    """Return the flags of ``set(<variable> ...)`` in contrib_ops/CMakeLists.txt (one source of truth)."""
    text = (CONTRIB / "CMakeLists.txt").read_text()
    match = re.search(rf"set\({re.escape(variable)}\s+([^)]*)\)", text)
    if match is None:
        raise RuntimeError(f"contrib_ops/CMakeLists.txt no longer sets {variable}; update contrib_ops/tests/golden.py")
    return shlex.split(match.group(1))


def isa_variant_flags() -> list[tuple[str, list[str]]]:
    """Return the x86-64 variants of the math core and their flags, as contrib_ops/CMakeLists.txt lists
    them ("isa_avx2|-march=x86-64-v3 ...")."""
    text = (CONTRIB / "CMakeLists.txt").read_text()
    variants = [(ns, shlex.split(flags)) for ns, flags in re.findall(r'"(isa_avx\w+)\|([^"]*)"', text)]
    if not variants:
        raise RuntimeError("contrib_ops/CMakeLists.txt lists no isa_avx* variants; update contrib_ops/tests/golden.py")
    return variants


def cross_tools_problem() -> str | None:
    """Return why the AArch64 cross toolchain cannot be used here, or None when it can."""
    missing = [tool for tool in (CROSS_CXX, QEMU) if shutil.which(tool) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not found: the AArch64 kernel test cross-compiles the math core and runs it "
        f"under qemu. Install them with `make deps` (it runs contrib_ops/tests/install_cross_tools.sh), or "
        f"`sudo apt-get install {' '.join(CROSS_PACKAGES)}`."
    )


def compile_program(
    output: Path,
    *,
    cxx: str,
    extra_flags: Sequence[str] = (),
    link_flags: Sequence[str] = (),
    x86_dispatch: bool = False,
    msl_emulation: bool = False,
    metal: bool = False,
    cmake: str = "cmake",
    driver: Path | None = None,
) -> None:
    """Compile kernel_golden_test (math core + dispatcher + driver) with the library's flags.

    The math core gets CMake's ``_math_flags`` (and, with ``x86_dispatch``, the AVX2/AVX-512 variants);
    every file gets the library's warnings plus -Werror. ``msl_emulation`` adds the Metal kernel compiled as
    C++ (any platform); ``metal`` the real Metal host (macOS only; ``cmake`` embeds the MSL source as
    CMake's build does). ``driver`` replaces kernel_golden_test.cc (e.g. kernel_bench.cc). Raises RuntimeError
    with the compiler output.
    """
    warnings = [*cmake_flags("_warnings"), "-Werror"]
    math_flags = cmake_flags("_math_flags")
    build = output.parent / f"{output.name}.objects"
    build.mkdir(parents=True, exist_ok=True)
    base = [cxx, "-std=c++17", *warnings, *extra_flags]
    variants = [("isa_generic", [])]
    if x86_dispatch:
        variants += isa_variant_flags()
    objects = []
    jobs = []
    for ns, flags in variants:
        obj = build / f"math_{ns}.o"
        jobs.append(
            [
                *base,
                *math_flags,
                *flags,
                f"-DMAMBAFUSE_ISA_NS={ns}",
                f"-I{CPU_DIR}",
                "-c",
                str(CPU_DIR / "gated_group_rms_norm_math.cc"),
                "-o",
                str(obj),
            ]
        )
        objects.append(obj)
    dispatch = ["-DMAMBAFUSE_X86_DISPATCH=1"] if x86_dispatch else []
    obj = build / "impl.o"
    jobs.append(
        [*base, "-O2", *dispatch, f"-I{CPU_DIR}", "-c", str(CPU_DIR / "gated_group_rms_norm_impl.cc"), "-o", str(obj)]
    )
    objects.append(obj)
    driver_defs = ["-DMAMBAFUSE_MSL_EMULATION=1"] if msl_emulation else []
    driver_defs += ["-DMAMBAFUSE_WITH_METAL=1"] if metal else []
    obj = build / "driver.o"
    jobs.append(
        [
            *base,
            "-O2",
            *driver_defs,
            f"-I{CPU_DIR}",
            f"-I{TESTS_DIR}",
            f"-I{CONTRIB}",
            "-c",
            str(driver or TESTS_DIR / "kernel_golden_test.cc"),
            "-o",
            str(obj),
        ]
    )
    objects.append(obj)
    frameworks: list[str] = []
    if metal:
        generated = build / "generated"
        generated.mkdir(exist_ok=True)
        _run(
            [
                cmake,
                f"-DINPUT={METAL_DIR / 'gated_group_rms_norm.metal'}",
                f"-DOUTPUT={generated / 'gated_group_rms_norm_metal_source.h'}",
                "-P",
                str(METAL_DIR / "embed_msl.cmake"),
            ]
        )
        obj = build / "metal_host.o"
        jobs.append(
            [
                *base,
                "-O2",
                "-x",
                "objective-c++",
                "-fobjc-arc",
                f"-I{CPU_DIR}",
                f"-I{METAL_DIR}",
                f"-I{generated}",
                "-c",
                str(METAL_DIR / "gated_group_rms_norm_metal.mm"),
                "-o",
                str(obj),
            ]
        )
        objects.append(obj)
        frameworks = ["-framework", "Metal", "-framework", "Foundation"]
    if msl_emulation:
        obj = build / "msl_emulation.o"
        # -fno-strict-aliasing: the emulated kernel reads half/bfloat structs through byte pointers, as MSL does.
        jobs.append(
            [
                *base,
                "-O2",
                "-fno-strict-aliasing",
                f"-I{CPU_DIR}",
                f"-I{TESTS_DIR}",
                f"-I{METAL_DIR}",
                f"-I{METAL_DIR / 'emulation'}",
                "-c",
                str(TESTS_DIR / "msl_emulation.cc"),
                "-o",
                str(obj),
            ]
        )
        objects.append(obj)
    _run_parallel(jobs)
    _run([cxx, *extra_flags, *map(str, objects), "-o", str(output), "-pthread", *frameworks, *link_flags])


def _run(command: Sequence[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"command failed ({result.returncode}): {shlex.join(command)}\n{result.stdout}{result.stderr}"
        )


def _run_parallel(commands: Sequence[Sequence[str]]) -> None:
    """Run compiler commands two at a time (the CI machine has two cores); fail with the first error."""
    limit = max(1, min(len(commands), os.cpu_count() or 1, 4))
    pending = list(commands)
    running: list[tuple[Sequence[str], subprocess.Popen[str]]] = []
    errors = []
    while pending or running:
        while pending and len(running) < limit:
            command = pending.pop(0)
            running.append(
                (command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            )
        command, process = running.pop(0)
        output, _ = process.communicate()
        if process.returncode != 0:
            errors.append(f"command failed ({process.returncode}): {shlex.join(command)}\n{output}")
    if errors:
        raise RuntimeError("\n".join(errors))


def run_program(
    command: Sequence[str],
    directory: Path,
    *,
    output_directory: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run the golden program on the cases in ``directory`` (outputs into ``output_directory``, default the
    same); return the completed process (the caller checks rc)."""
    full_env = {**os.environ, **(env or {})}
    out = [f"--out={output_directory}"] if output_directory is not None else []
    if output_directory is not None:
        output_directory.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [*command, *out, str(directory)], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def failures(output_directory: Path, data: dict[str, GoldenData]) -> list[str]:
    """Return one line per case whose output in ``output_directory`` misses the budget (empty: all pass)."""
    lines = []
    for name, d in data.items():
        ok, message = check_case(output_directory, d)
        if not ok:
            lines.append(f"{name}: {message}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m contrib_ops.tests.golden write DIR`` / ``check DIR [OUTDIR]``: for running the program by
    hand (a CMake build with MAMBAFUSE_BUILD_TESTS=ON, a Mac). The cases are seeded, so ``check`` re-derives
    the reference instead of storing it."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m contrib_ops.tests.golden", description=main.__doc__)
    parser.add_argument("action", choices=["write", "check"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("output_directory", type=Path, nargs="?", help="where the program wrote .out files")
    args = parser.parse_args(argv)
    if args.action == "write":
        write_cases(args.directory, all_cases())
        print(f"{len(all_cases())} cases in {args.directory}")
        return 0
    data = {case.name: make_data(case) for case in all_cases()}
    lines = failures(args.output_directory or args.directory, data)
    print("\n".join(lines) if lines else f"all {len(data)} cases within the budget of docs/op.md")
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
