"""The CPU math core on AArch64 (NEON, as on Apple silicon) against the reference (docs/op.md).

The standalone program contrib_ops/tests/kernel_golden_test.cc links the math core without ONNX Runtime.
On Linux x86-64 it is cross-compiled (static) with aarch64-linux-gnu-g++ and run under qemu-aarch64; on an
arm64 host (a Mac, Linux aarch64) it is built natively. Golden inputs and float64 expected outputs come
from contrib_ops/tests/golden.py at test time. A missing cross toolchain on Linux x86-64 is a failure,
not a skip: `make deps` installs it (contrib_ops/tests/install_cross_tools.sh).

qemu runs the real AArch64 instructions (NEON included) with IEEE semantics, so the numbers are those of
an Arm CPU; what it cannot say is how fast they are.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contrib_ops.tests import golden

HOST = platform.machine().lower()
NATIVE_ARM64 = HOST in ("arm64", "aarch64")
LINUX_X86_64 = sys.platform.startswith("linux") and HOST in ("x86_64", "amd64")
CASES = golden.all_cases()


def _require_cross_tools() -> None:
    problem = golden.cross_tools_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="module")
def golden_cases(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, golden.GoldenData]]:
    directory = tmp_path_factory.mktemp("golden_arm64")
    return directory, golden.write_cases(directory, CASES)


@pytest.fixture(scope="module")
def arm64_command(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Return the command that runs the AArch64 build of the golden program."""
    build = tmp_path_factory.mktemp("arm64_build")
    if NATIVE_ARM64:
        binary = build / "kernel_golden_test"
        golden.compile_program(binary, cxx=os.environ.get("CXX", "c++"))
        return [str(binary)]
    if not LINUX_X86_64:
        pytest.skip(f"no AArch64 build path on {sys.platform}/{HOST} (needs Linux x86-64 + qemu, or an arm64 host)")
    _require_cross_tools()
    binary = build / "kernel_golden_test.aarch64"
    golden.compile_program(binary, cxx=golden.CROSS_CXX, link_flags=["-static"])
    return [golden.QEMU, str(binary)]


@pytest.fixture(scope="module")
def arm64_run(
    arm64_command: list[str], golden_cases: tuple[Path, dict[str, golden.GoldenData]]
) -> subprocess.CompletedProcess[str]:
    directory, _ = golden_cases
    return golden.run_program(arm64_command, directory, output_directory=directory / "arm64")


def test_program_passes_its_own_checks(arm64_run: subprocess.CompletedProcess[str]) -> None:
    failed = [line for line in arm64_run.stdout.splitlines() if "FAILED" in line or "ERROR" in line]
    assert arm64_run.returncode == 0, f"rc {arm64_run.returncode}: {failed[:10]}\n{arm64_run.stderr[-2000:]}"
    assert "validate_args: ok" in arm64_run.stdout
    assert f"{len(CASES)} cases, 0 failures" in arm64_run.stdout


def test_dispatches_to_the_neon_build(arm64_run: subprocess.CompletedProcess[str]) -> None:
    # On AArch64 NEON is baseline: the dispatcher has one variant and reports it as "neon".
    assert "isa: neon" in arm64_run.stdout.splitlines()


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_case_within_budget(
    name: str,
    arm64_run: subprocess.CompletedProcess[str],
    golden_cases: tuple[Path, dict[str, golden.GoldenData]],
) -> None:
    directory, data = golden_cases
    ok, message = golden.check_case(directory / "arm64", data[name], arm64_run.stdout)
    assert ok, message


#: NEON instructions the math core must contain on AArch64 (it is written in 4-lane vector extensions):
#: the silu arithmetic, its division, and the float16 conversions fused into loads and stores.
NEON_INSTRUCTIONS = {
    "vector multiply": re.compile(r"\bfmul\s+v\d+\.4s"),
    "vector division": re.compile(r"\bfdiv\s+v\d+\.4s"),
    "float16 -> float32": re.compile(r"\bfcvtl\s+v\d+\.4s"),
    "float32 -> float16": re.compile(r"\bfcvtn\s+v\d+\.4h"),
}


def test_math_core_is_neon_code_on_aarch64(tmp_path: Path) -> None:
    """The math core compiles, with the library's flags, to NEON vector code and calls no libm function
    (exp and the sigmoid are inline polynomials; a scalar libm call per element would cost ~10x)."""
    if NATIVE_ARM64 and sys.platform.startswith("linux"):
        cxx = os.environ.get("CXX", "g++")
    elif LINUX_X86_64:
        _require_cross_tools()
        cxx = golden.CROSS_CXX
    else:
        pytest.skip("reads GCC's AArch64 assembly; Apple clang: see contrib_ops/APPLE.md")
    source = golden.CPU_DIR / "gated_group_rms_norm_math.cc"
    assembly = tmp_path / "math.s"
    result = subprocess.run(
        [
            cxx,
            "-std=c++17",
            *golden.cmake_flags("_math_flags"),
            f"-I{golden.CPU_DIR}",
            "-S",
            str(source),
            "-o",
            str(assembly),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = assembly.read_text()
    missing = [name for name, pattern in NEON_INSTRUCTIONS.items() if not pattern.search(text)]
    assert not missing, f"no NEON {', '.join(missing)} in the AArch64 math core"
    calls = set(re.findall(r"\bbl\s+(\w+)", text))
    libm = sorted(c for c in calls if re.fullmatch(r"_?_?(expf?|exp2f?|sqrtf?|logf?)(_finite)?", c))
    assert not libm, f"the AArch64 math core calls libm: {libm}"


@pytest.mark.skipif(not LINUX_X86_64, reason="the sanitizer build targets Linux x86-64 (AVX2/AVX-512 dispatch)")
@pytest.mark.parametrize("isa", ["baseline", "avx2", "widest"])
def test_native_build_under_sanitizers(
    isa: str,
    tmp_path_factory: pytest.TempPathFactory,
    golden_cases: tuple[Path, dict[str, golden.GoldenData]],
) -> None:
    """The same program on x86-64 with AddressSanitizer + UBSan, for each dispatch level this CPU has."""
    binary = _sanitized_binary(tmp_path_factory)
    directory, data = golden_cases
    env = {
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }
    if isa != "widest":
        env["MAMBAFUSE_CPU_ISA"] = isa
    outputs = tmp_path_factory.mktemp(f"sanitized_{isa}")
    result = golden.run_program([str(binary)], directory, output_directory=outputs, env=env)
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    failures = golden.failures(outputs, data)
    assert not failures, f"{len(failures)} cases over budget:\n" + "\n".join(failures[:20])


_SANITIZED: dict[str, Path] = {}


def _sanitized_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "binary" not in _SANITIZED:
        binary = tmp_path_factory.mktemp("sanitized") / "kernel_golden_test"
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
        golden.compile_program(binary, cxx=os.environ.get("CXX", "g++"), extra_flags=sanitize, x86_dispatch=True)
        _SANITIZED["binary"] = binary
    return _SANITIZED["binary"]
