"""The Metal kernel's logic, emulated on the CPU, against fusion/reference/gated_group_rms_norm.py (docs/op.md).

contrib_ops/metal/gated_group_rms_norm.metal is compiled as C++ with the host compiler through
contrib_ops/metal/msl_shim.h: address spaces and attributes vanish, half/bfloat are exact RNE storage
types, and simd_sum runs over 32 lanes that are 32 std::threads meeting at a barrier. The golden program
(contrib_ops/tests/kernel_golden_test.cc, built with MAMBAFUSE_MSL_EMULATION) then runs the same golden
cases as the AArch64 test: every type combination, group sizes 1, 25, 40, 48, 64, 456, 512 and 960 (most
not multiples of the SIMD width), one group per row, edge values with NaN/Inf confined to their group.

What emulation cannot show (contrib_ops/APPLE.md): that Apple's compiler accepts the MSL, the hardware's
simd_sum order (the kernel is checked under two orders and two widths instead), its half/bfloat
conversions and denormal handling, and speed. On a Mac, test_metal_kernel_on_the_gpu runs the real kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from contrib_ops.tests import golden

CASES = golden.all_cases()
CXX = os.environ.get("CXX", "c++")


@pytest.fixture(scope="module")
def golden_cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, golden.GoldenData]]:
    directory = tmp_path_factory.mktemp("golden_msl")
    return directory, golden.write_cases(directory, CASES)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    binary = tmp_path_factory.mktemp("msl_build") / "kernel_golden_test_msl"
    golden.compile_program(binary, cxx=CXX, msl_emulation=True)
    return binary


@pytest.fixture(scope="module")
def apple_like_run(
    emulator: Path, golden_cases: tuple[Path, dict[str, golden.GoldenData]]
) -> subprocess.CompletedProcess[str]:
    """32-wide SIMD groups, 4 per threadgroup, a butterfly simd_sum: how the host dispatches on a Mac."""
    directory, _ = golden_cases
    return golden.run_program(
        [str(emulator), "--backend=msl-emulation", "--simd-width=32", "--simdgroups=4", "--sum-order=tree"],
        directory,
        output_directory=directory / "simd32",
    )


def test_emulated_kernel_passes_its_own_checks(apple_like_run: subprocess.CompletedProcess[str]) -> None:
    failed = [line for line in apple_like_run.stdout.splitlines() if "FAILED" in line or "ERROR" in line]
    assert apple_like_run.returncode == 0, (
        f"rc {apple_like_run.returncode}: {failed[:10]}\n{apple_like_run.stderr[-2000:]}"
    )
    assert f"{len(CASES)} cases, 0 failures" in apple_like_run.stdout


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_case_within_budget(
    name: str,
    apple_like_run: subprocess.CompletedProcess[str],
    golden_cases: tuple[Path, dict[str, golden.GoldenData]],
) -> None:
    directory, data = golden_cases
    ok, message = golden.check_case(directory / "simd32", data[name], apple_like_run.stdout)
    assert ok, message


@pytest.mark.parametrize(
    ("width", "simdgroups", "order"),
    [(32, 3, "sequential"), (16, 5, "tree")],
    ids=["simd32-lane-order", "simd16"],
)
def test_independent_of_simd_width_and_sum_order(
    width: int,
    simdgroups: int,
    order: str,
    emulator: Path,
    golden_cases: tuple[Path, dict[str, golden.GoldenData]],
    tmp_path: Path,
) -> None:
    """The kernel reads its width from threads_per_simdgroup and must meet the budget for any reduction
    order (Apple documents neither as fixed); odd SIMD-group counts leave the last threadgroup part idle."""
    directory, data = golden_cases
    result = golden.run_program(
        [
            str(emulator),
            "--backend=msl-emulation",
            f"--simd-width={width}",
            f"--simdgroups={simdgroups}",
            f"--sum-order={order}",
        ],
        directory,
        output_directory=tmp_path,
    )
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    failures = golden.failures(tmp_path, data)
    assert not failures, f"{len(failures)} cases over budget:\n" + "\n".join(failures[:20])


def test_shim_half_and_bfloat_conversions_round_to_nearest_even(tmp_path: Path) -> None:
    """The shim's half/bfloat (the emulation's stand-ins for MSL's) against ml_dtypes, on every float16 and
    bfloat16 value, their midpoints, and the overflow/underflow boundaries."""
    source = tmp_path / "conversions.cc"
    source.write_text(
        '#include <cstdio>\n#include <cstdint>\n#include <cstring>\n#include "msl_shim.h"\n'
        "int main() {\n"
        "  float f;\n"
        "  while (std::fread(&f, sizeof f, 1, stdin) == 1) {\n"
        "    const metal::half h(f);\n    const metal::bfloat b(f);\n"
        "    const float back[2] = {static_cast<float>(h), static_cast<float>(b)};\n"
        "    std::fwrite(&h.bits, 2, 1, stdout);\n    std::fwrite(&b.bits, 2, 1, stdout);\n"
        "    std::fwrite(back, sizeof back, 1, stdout);\n  }\n}\n"
    )
    binary = tmp_path / "conversions"
    subprocess.run(
        [
            CXX,
            "-std=c++17",
            *golden.cmake_flags("_warnings"),
            "-Werror",
            "-O1",
            f"-I{golden.METAL_DIR}",
            str(source),
            "-o",
            str(binary),
            "-pthread",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    values = _conversion_probes()
    output = subprocess.run([str(binary)], input=values.tobytes(), capture_output=True, check=True).stdout
    record = np.dtype([("h", "<u2"), ("b", "<u2"), ("h_back", "<f4"), ("b_back", "<f4")])
    got = np.frombuffer(output, dtype=record)
    assert got.size == values.size
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to Inf and NaN are among the probes
        want_h = values.astype(np.float16)
        want_b = values.astype(ml_dtypes.bfloat16)
    nan = np.isnan(values)
    bad_h = np.flatnonzero((got["h"] != want_h.view(np.uint16)) & ~nan)
    bad_b = np.flatnonzero((got["b"] != want_b.view(np.uint16)) & ~nan)
    assert bad_h.size == 0, f"{bad_h.size} half conversions differ, e.g. {values[bad_h[:5]]}"
    assert bad_b.size == 0, f"{bad_b.size} bfloat conversions differ, e.g. {values[bad_b[:5]]}"
    assert np.array_equal(got["h_back"][~nan], want_h.astype(np.float32)[~nan])
    assert np.array_equal(got["b_back"][~nan], want_b.astype(np.float32)[~nan])
    assert np.isnan(got["h_back"][nan]).all() and np.isnan(got["b_back"][nan]).all()


def _conversion_probes() -> np.ndarray:
    """Every float16 and bfloat16 value, the midpoints between neighbours (where ties-to-even decides),
    random values over a wide range, and the overflow/underflow edges, as float32."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN bit patterns and Inf are probes too
        all16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
        halves = all16.view(np.float16).astype(np.float32)
        bfloats = (all16.astype(np.uint32) << 16).view(np.float32)
        mid_h = ((halves[:-1].astype(np.float64) + halves[1:].astype(np.float64)) / 2).astype(np.float32)
        mid_b = ((bfloats[:-1].astype(np.float64) + bfloats[1:].astype(np.float64)) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    scale = np.exp2(rng.integers(-30, 30, 100_000)).astype(np.float32)
    randoms = rng.standard_normal(100_000).astype(np.float32) * scale
    edges = np.array(
        [65504, 65519.99, 65520, 65536, 3.4e38, 2**-24, 2**-25, 2**-25 * 1.0001, 1e-45, 0.0, -0.0], np.float32
    )
    return np.concatenate([halves, bfloats, mid_h, mid_b, randoms, edges, -edges])


@pytest.mark.skipif(sys.platform != "darwin", reason="the real Metal kernel needs macOS and an Apple GPU")
def test_metal_kernel_on_the_gpu(
    tmp_path_factory: pytest.TempPathFactory, golden_cases: tuple[Path, dict[str, golden.GoldenData]]
) -> None:
    """On a Mac: the same golden cases through the real Metal kernel (compiled by Apple's compiler at run time)."""
    build = tmp_path_factory.mktemp("metal_build")
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")
    assert cmake, "cmake is needed to embed the MSL source (pip install cmake)"
    golden.compile_program(build / "kernel_golden_test_metal", cxx=CXX, metal=True, cmake=cmake)
    directory, data = golden_cases
    result = golden.run_program(
        [str(build / "kernel_golden_test_metal"), "--backend=metal"], directory, output_directory=directory / "metal"
    )
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}"
    failures = golden.failures(directory / "metal", data)
    assert not failures, f"{len(failures)} cases over budget:\n" + "\n".join(failures[:20])
