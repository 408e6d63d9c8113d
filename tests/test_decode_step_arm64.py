"""The decode-step CPU math cores (SelectiveStateUpdate, CausalConv1dUpdate) on AArch64 (NEON) against the
references at their budgets.

contrib_ops/tests/decode_step_golden_test.cc links the math cores without ONNX Runtime. On Linux x86-64 it is
cross-compiled (static) with aarch64-linux-gnu-g++ and run under qemu-aarch64, as tests/test_kernel_arm64.py
does for the gated norm; on an arm64 host it is built natively. A missing cross toolchain on Linux x86-64 is
a failure, not a skip (`make deps` installs it). tests/test_prefill_arm64.py builds the prefill cores with the same
helpers (``aarch64_program``, ``write_tensor``, ``read_tensor``, ``run_op``).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from contrib_ops.tests import golden
from fusion.reference import causal_conv1d_update as conv_ref
from fusion.reference import selective_state_update as ssu_ref
from fusion.reference._bounds import SUPPORTED_TYPES, bfloat16
from tests.test_causal_conv1d_update_kernel import make_inputs as conv_inputs
from tests.test_selective_state_update_kernel import NAMES as SSU_NAMES
from tests.test_selective_state_update_kernel import make_inputs as ssu_inputs

HOST = platform.machine().lower()
NATIVE_ARM64 = HOST in ("arm64", "aarch64")
LINUX_X86_64 = sys.platform.startswith("linux") and HOST in ("x86_64", "amd64")
ELEM = {dtype: elem for elem, dtype in SUPPORTED_TYPES.items()}
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
SOURCES = [
    "gated_group_rms_norm_math.cc",
    "selective_state_update_math.cc",
    "causal_conv1d_update_math.cc",
]
IMPLS = ["gated_group_rms_norm_impl.cc", "selective_state_update_impl.cc", "causal_conv1d_update_impl.cc"]


def compile_program(
    output: Path,
    cxx: str,
    driver: str,
    sources: Sequence[str],
    impls: Sequence[str],
    link_flags: Sequence[str] = (),
    system_includes: Sequence[Path] = (),
) -> None:
    """Compile the driver contrib_ops/tests/<driver> with the math cores ``sources`` (CMake's math flags, the
    generic level) and their dispatchers ``impls`` (contrib_ops/cpu/), every file with the library's warnings
    and -Werror. Raises RuntimeError with the compiler output."""
    includes = [f"-I{golden.CPU_DIR}", *(f"-isystem{d}" for d in system_includes)]
    base = [cxx, "-std=c++17", *golden.cmake_flags("_warnings"), "-Werror", *includes]
    objects = []
    for name in sources:
        obj = output.parent / f"{name}.o"
        golden._run(
            [
                *base,
                *golden.cmake_flags("_math_flags"),
                "-DMAMBAFUSE_ISA_NS=isa_generic",
                "-c",
                str(golden.CPU_DIR / name),
                "-o",
                str(obj),
            ]
        )
        objects.append(obj)
    for path in [*(golden.CPU_DIR / n for n in impls), golden.TESTS_DIR / driver]:
        obj = output.parent / f"{path.name}.o"
        golden._run([*base, "-O2", "-c", str(path), "-o", str(obj)])
        objects.append(obj)
    golden._run([cxx, *map(str, objects), "-o", str(output), "-pthread", *link_flags])


def aarch64_program(
    build: Path,
    driver: str,
    sources: Sequence[str],
    impls: Sequence[str],
    system_includes: Sequence[Path] = (),
) -> list[str]:
    """Build ``driver`` for AArch64 in ``build`` and return the command that runs it: natively on an arm64 host,
    else (Linux x86-64) cross-compiled, static, under qemu-aarch64. Skips on other hosts; fails where the cross
    toolchain is missing (``make deps`` installs it)."""
    name = Path(driver).stem
    if NATIVE_ARM64:
        compile_program(build / name, os.environ.get("CXX", "c++"), driver, sources, impls, (), system_includes)
        return [str(build / name)]
    if not LINUX_X86_64:
        pytest.skip(f"no AArch64 build path on {sys.platform}/{HOST} (needs Linux x86-64 + qemu, or an arm64 host)")
    problem = golden.cross_tools_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    binary = build / f"{name}.aarch64"
    compile_program(binary, golden.CROSS_CXX, driver, sources, impls, ["-static"], system_includes)
    return [golden.QEMU, str(binary)]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return aarch64_program(tmp_path_factory.mktemp("decode_arm64"), "decode_step_golden_test.cc", SOURCES, IMPLS)


def write_tensor(directory: Path, name: str, value: np.ndarray | None) -> None:
    if value is not None:
        (directory / f"{name}.bin").write_bytes(np.ascontiguousarray(value).tobytes())


def read_tensor(directory: Path, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer((directory / f"{name}.bin").read_bytes(), dtype=dtype).reshape(shape)


def run_op(command: list[str], op: str, directory: Path) -> str:
    """Run the program's ``op`` on the files in ``directory``; assert it ran on the NEON level; return its stdout."""
    result = subprocess.run([*command, op, str(directory)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # On AArch64 NEON is baseline: the dispatcher has one level and names it "neon".
    assert result.stdout.split()[:2] == ["isa", "neon"], result.stdout
    return result.stdout


SSU_CASES = [(t, s, d, g) for t in (F32, F16, bfloat16) for s in dict.fromkeys((F32, t)) for d, g in ((F32, 2), (t, 1))]


@pytest.mark.parametrize(("t", "s", "d", "groups"), SSU_CASES, ids=lambda v: str(v))
def test_selective_state_update_on_arm64(program, tmp_path: Path, t, s, d, groups) -> None:
    inputs = ssu_inputs(np.random.default_rng(30), t=t, s=s, d_type=d, groups=groups, state_size=37, head_dim=3)
    inputs["dt"][0, 0] = np.asarray(25.0, dtype=t)  # past softplus' threshold
    batch, heads, head_dim, n = inputs["state"].shape
    meta = [ELEM[t], ELEM[s], ELEM[d], batch, heads, head_dim, n, groups, 1, 1, 1]
    (tmp_path / "meta.txt").write_text(" ".join(map(str, meta)))
    for name in SSU_NAMES:
        write_tensor(tmp_path, name, inputs[name])
    run_op(program, "ssu", tmp_path)
    out = read_tensor(tmp_path, "out", t, (batch, heads, head_dim))
    state = read_tensor(tmp_path, "present_state", s, inputs["state"].shape)
    ok, msg = ssu_ref.budget_report(out, state, *(inputs[k] for k in SSU_NAMES))
    assert ok, msg


@pytest.mark.parametrize("t", [F32, F16, bfloat16], ids=str)
@pytest.mark.parametrize(("state_len", "cols", "bias"), [(4, 1, True), (3, 1, False), (4, 70, True)])
def test_causal_conv1d_update_on_arm64(program, tmp_path: Path, t, state_len: int, cols: int, bias: bool) -> None:
    inputs = conv_inputs(np.random.default_rng(31), t=t, channels=67, state_len=state_len, new_columns=cols, bias=bias)
    inputs["x"][0, 3] = np.asarray(-95.0, dtype=t)  # exp's underflow in the sigmoid
    batch, channels, _ = inputs["x"].shape
    (tmp_path / "meta.txt").write_text(" ".join(map(str, [ELEM[t], batch, channels, cols, state_len, 4, 1, int(bias)])))
    for name in ("x", "conv_state", "weight", "bias"):
        write_tensor(tmp_path, name, inputs[name])
    run_op(program, "conv", tmp_path)
    y = read_tensor(tmp_path, "y", t, inputs["x"].shape)
    state = read_tensor(tmp_path, "present_state", t, inputs["conv_state"].shape)
    ok, msg = conv_ref.budget_report(y, state, *(inputs[k] for k in ("x", "conv_state", "weight", "bias")))
    assert ok, msg
