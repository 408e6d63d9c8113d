"""The decode-step CPU math cores (SelectiveStateUpdate, CausalConv1dUpdate) on AArch64 (NEON) against the
references at their budgets.

contrib_ops/tests/decode_step_golden_test.cc links the math cores without ONNX Runtime. On Linux x86-64 it is
cross-compiled (static) with aarch64-linux-gnu-g++ and run under qemu-aarch64, as tests/test_kernel_arm64.py
does for the gated norm; on an arm64 host it is built natively. A missing cross toolchain on Linux x86-64 is
a failure, not a skip (`make deps` installs it).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
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


def _compile(output: Path, cxx: str, link_flags: list[str]) -> None:
    base = [cxx, "-std=c++17", *golden.cmake_flags("_warnings"), "-Werror", f"-I{golden.CPU_DIR}"]
    objects = []
    for name in SOURCES:
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
    for path in [*(golden.CPU_DIR / n for n in IMPLS), golden.TESTS_DIR / "decode_step_golden_test.cc"]:
        obj = output.parent / f"{path.name}.o"
        golden._run([*base, "-O2", "-c", str(path), "-o", str(obj)])
        objects.append(obj)
    golden._run([cxx, *map(str, objects), "-o", str(output), "-pthread", *link_flags])


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    build = tmp_path_factory.mktemp("decode_arm64")
    if NATIVE_ARM64:
        _compile(build / "decode_step_golden_test", os.environ.get("CXX", "c++"), [])
        return [str(build / "decode_step_golden_test")]
    if not LINUX_X86_64:
        pytest.skip(f"no AArch64 build path on {sys.platform}/{HOST} (needs Linux x86-64 + qemu, or an arm64 host)")
    problem = golden.cross_tools_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    _compile(build / "decode_step_golden_test.aarch64", golden.CROSS_CXX, ["-static"])
    return [golden.QEMU, str(build / "decode_step_golden_test.aarch64")]


def _write(directory: Path, name: str, value: np.ndarray | None) -> None:
    if value is not None:
        (directory / f"{name}.bin").write_bytes(np.ascontiguousarray(value).tobytes())


def _read(directory: Path, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer((directory / f"{name}.bin").read_bytes(), dtype=dtype).reshape(shape)


def _run(command: list[str], op: str, directory: Path) -> None:
    result = subprocess.run([*command, op, str(directory)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1] in {"neon", "generic", "sse2"}, result.stdout


SSU_CASES = [(t, s, d, g) for t in (F32, F16, bfloat16) for s in dict.fromkeys((F32, t)) for d, g in ((F32, 2), (t, 1))]


@pytest.mark.parametrize(("t", "s", "d", "groups"), SSU_CASES, ids=lambda v: str(v))
def test_selective_state_update_on_arm64(program, tmp_path: Path, t, s, d, groups) -> None:
    inputs = ssu_inputs(np.random.default_rng(30), t=t, s=s, d_type=d, groups=groups, state_size=37, head_dim=3)
    inputs["dt"][0, 0] = np.asarray(25.0, dtype=t)  # past softplus' threshold
    batch, heads, head_dim, n = inputs["state"].shape
    meta = [ELEM[t], ELEM[s], ELEM[d], batch, heads, head_dim, n, groups, 1, 1, 1]
    (tmp_path / "meta.txt").write_text(" ".join(map(str, meta)))
    for name in SSU_NAMES:
        _write(tmp_path, name, inputs[name])
    _run(program, "ssu", tmp_path)
    out = _read(tmp_path, "out", t, (batch, heads, head_dim))
    state = _read(tmp_path, "present_state", s, inputs["state"].shape)
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
        _write(tmp_path, name, inputs[name])
    _run(program, "conv", tmp_path)
    y = _read(tmp_path, "y", t, inputs["x"].shape)
    state = _read(tmp_path, "present_state", t, inputs["conv_state"].shape)
    ok, msg = conv_ref.budget_report(y, state, *(inputs[k] for k in ("x", "conv_state", "weight", "bias")))
    assert ok, msg
