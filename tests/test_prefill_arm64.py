"""The prefill CPU math cores (MambaChunkScan, CausalConv1d) on AArch64 (NEON) against the references at their
budgets (docs/mamba_chunk_scan.md, docs/causal_conv1d.md).

contrib_ops/tests/prefill_golden_test.cc links the two math cores without ONNX Runtime; the scan core is built on
Eigen's headers, which the library's build also takes from the cmeel-eigen wheel (`make deps` installs it). The
program is built as tests/test_decode_step_arm64.py builds the decode program: on Linux x86-64 cross-compiled
(static) with aarch64-linux-gnu-g++ and run under qemu-aarch64, on an arm64 host natively. A missing cross
toolchain or Eigen on Linux x86-64 is a failure, not a skip (`make deps` installs both).

The scan runs every work item in its own call and the conv splits its items over three calls, as the ops' thread
pools do. Each result is judged by the reference's ``budget_report``; the last tests show that the same check
rejects an output a wrong kernel would give.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from contrib_ops.tests import golden
from fusion.reference import causal_conv1d as conv_ref
from fusion.reference import mamba_chunk_scan as scan_ref
from fusion.reference._bounds import bfloat16
from tests.test_causal_conv1d_kernel import make_inputs as conv_inputs
from tests.test_decode_step_arm64 import (
    ELEM,
    LINUX_X86_64,
    NATIVE_ARM64,
    aarch64_program,
    read_tensor,
    run_op,
    write_tensor,
)
from tests.test_mamba_chunk_scan_kernel import NAMES as SCAN_NAMES
from tests.test_mamba_chunk_scan_kernel import make_inputs as scan_inputs

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
DTYPES = (F32, F16, bfloat16)
SOURCES = ["gated_group_rms_norm_math.cc", "mamba_chunk_scan_math.cc", "causal_conv1d_math.cc"]
IMPLS = ["gated_group_rms_norm_impl.cc", "mamba_chunk_scan_impl.cc", "causal_conv1d_impl.cc"]
#: The scan kernel's chunk size (contrib_ops/cpu/mamba_chunk_scan_impl.h, kDefaultChunkSize).
Q = 64
CONV_NAMES = ("x", "weight", "bias", "initial_state")


def eigen_include_dir() -> Path | None:
    """Return the directory holding Eigen/Core as the library's CMake finds it: MAMBAFUSE_EIGEN_INCLUDE_DIR, else
    the cmeel-eigen wheel of this Python (``<site-packages>/cmeel.prefix/include/eigen3``); None when neither has
    it."""
    candidates = [os.environ.get("MAMBAFUSE_EIGEN_INCLUDE_DIR", "")]
    candidates += [os.path.join(p or os.getcwd(), "cmeel.prefix", "include", "eigen3") for p in sys.path]
    return next((Path(c) for c in candidates if c and (Path(c) / "Eigen" / "Core").is_file()), None)


def _eigen() -> Path:
    eigen = eigen_include_dir()
    if eigen is None:
        pytest.fail(
            "Eigen 3.4's headers were not found (MambaChunkScan's core needs them): `make deps` installs cmeel-eigen "
            "into .venv, or set MAMBAFUSE_EIGEN_INCLUDE_DIR to the directory holding Eigen/Core",
            pytrace=False,
        )
    return eigen


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    build = tmp_path_factory.mktemp("prefill_arm64")
    return aarch64_program(build, "prefill_golden_test.cc", SOURCES, IMPLS, [_eigen()])


# --- MambaChunkScan ---------------------------------------------------------------------------------------------


def run_scan(
    program: list[str],
    directory: Path,
    inputs: dict[str, np.ndarray | None],
    *,
    dt_softplus: int = 1,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    chunk_size: int = Q,
    min_items: int = 1,
) -> tuple[np.ndarray, np.ndarray, str]:
    """Return (out, final_state, the program's stdout) of the AArch64 scan core on ``inputs``."""
    x, d, state = inputs["x"], inputs["D"], inputs["initial_state"]
    batch, length, heads, head_dim = x.shape
    _, _, groups, n = inputs["B"].shape
    t = x.dtype
    meta = [
        ELEM[t],
        ELEM[F32 if d is None else d.dtype],
        ELEM[F32 if state is None else state.dtype],
        batch,
        length,
        heads,
        head_dim,
        groups,
        n,
        dt_softplus,
        int(inputs["dt_bias"] is not None),
        int(d is not None),
        int(state is not None),
        chunk_size,
        min_items,
    ]
    (directory / "meta.txt").write_text(" ".join(map(str, meta)))
    for name in SCAN_NAMES:
        write_tensor(directory, name, inputs[name])
    write_tensor(directory, "dt_limits", np.array([dt_min, dt_max], np.float32))
    stdout = run_op(program, "scan", directory)
    out = read_tensor(directory, "out", F32, (batch, length, heads, head_dim))
    final_state = read_tensor(directory, "final_state", F32, (batch, heads, head_dim, n))
    return out, final_state, stdout


def _type_id(value: object) -> str:
    return {F32: "f32", F16: "f16", bfloat16: "bf16", None: "none"}.get(value, str(value))  # type: ignore[call-overload]


#: (T, D's type, initial_state's type, dt_bias): D and the state in float, in T, or absent.
SCAN_TYPE_CASES = [
    *((t, F32, F32, True) for t in DTYPES),
    *((t, t, t, True) for t in DTYPES),
    *((t, None, None, False) for t in DTYPES),
]


@pytest.mark.parametrize(("t", "d_type", "state_type", "dt_bias"), SCAN_TYPE_CASES, ids=_type_id)
@pytest.mark.parametrize("length", [Q - 1, Q, Q + 1, 2 * Q + 2])
def test_mamba_chunk_scan_on_arm64(program, tmp_path: Path, t, d_type, state_type, dt_bias: bool, length: int):
    """Prompts around the chunk size (one short chunk, one full, a full and a one-token one, two and a short one),
    G = 2 < H = 4, odd P = 7 and N = 19 (remainders in every vector loop)."""
    rng = np.random.default_rng(length)
    inputs = scan_inputs(
        rng, t, length=length, head_dim=7, state_size=19, dt_bias=dt_bias, d_type=d_type, state_type=state_type
    )
    out, state, _ = run_scan(program, tmp_path, inputs)
    ok, message = scan_ref.budget_report(out, state, **inputs)
    assert ok, message


@pytest.mark.parametrize("t", DTYPES, ids=_type_id)
def test_mamba_chunk_scan_model_shape_on_arm64(program, tmp_path: Path, t) -> None:
    """A Mamba-2 head's P = 64 and N = 128, one group for 4 heads, 130 tokens (Eigen's blocked products)."""
    inputs = scan_inputs(
        np.random.default_rng(40), t, batch=1, length=130, heads=4, head_dim=64, groups=1, state_size=128
    )
    out, state, _ = run_scan(program, tmp_path, inputs)
    ok, message = scan_ref.budget_report(out, state, **inputs)
    assert ok, message


def test_mamba_chunk_scan_head_blocks_on_arm64(program, tmp_path: Path) -> None:
    """A group's heads split over several work items (each recomputes C·Bᵀ for its block), one batch row, 6 heads
    of one group, at least 6 items wanted."""
    inputs = scan_inputs(np.random.default_rng(41), F16, batch=1, length=100, heads=6, head_dim=32, groups=1)
    out, state, stdout = run_scan(program, tmp_path, inputs, min_items=6)
    heads_per_block = int(re.search(r"heads_per_block (\d+)", stdout).group(1))  # type: ignore[union-attr]
    assert heads_per_block < 6, stdout
    ok, message = scan_ref.budget_report(out, state, **inputs)
    assert ok, message


@pytest.mark.parametrize(
    ("chunk_size", "attrs"),
    [(16, {}), (Q, {"dt_softplus": 0, "dt_min": 0.01, "dt_max": 0.2}), (Q, {"dt_min": 0.05, "dt_max": 0.5})],
    ids=["chunk16", "no-softplus-limits", "softplus-limits"],
)
def test_mamba_chunk_scan_chunk_size_and_time_step_on_arm64(program, tmp_path: Path, chunk_size: int, attrs) -> None:
    """Another chunk size (MAMBAFUSE_CHUNK_SCAN_CHUNK's), softplus off, the model's time_step_limit."""
    inputs = scan_inputs(np.random.default_rng(42), bfloat16, length=90)
    if attrs.get("dt_softplus", 1) == 0:  # the budget needs a non-negative time step
        for name in ("dt", "dt_bias"):
            inputs[name] = np.abs(inputs[name].astype(F32) / 4).astype(bfloat16)
    out, state, _ = run_scan(program, tmp_path, inputs, chunk_size=chunk_size, **attrs)
    ok, message = scan_ref.budget_report(out, state, **inputs, **attrs)
    assert ok, message


# --- CausalConv1d -----------------------------------------------------------------------------------------------


def run_conv(
    program: list[str],
    directory: Path,
    inputs: dict[str, np.ndarray | None],
    *,
    state_width: int = 4,
    channels_last: int = 1,
    activation: str = "silu",
    calls: int = 3,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (y, final_state) of the AArch64 conv core on ``inputs``."""
    x, weight = inputs["x"], inputs["weight"]
    batch = x.shape[0]
    length, channels = (x.shape[1], x.shape[2]) if channels_last else (x.shape[2], x.shape[1])
    meta = [
        ELEM[x.dtype],
        batch,
        channels,
        length,
        state_width,
        weight.shape[-1],
        int(activation == "silu"),
        int(inputs["bias"] is not None),
        int(inputs["initial_state"] is not None),
        channels_last,
        calls,
    ]
    (directory / "meta.txt").write_text(" ".join(map(str, meta)))
    for name in CONV_NAMES:
        write_tensor(directory, name, inputs[name])
    run_op(program, "conv", directory)
    y = read_tensor(directory, "y", x.dtype, x.shape)
    final_state = read_tensor(directory, "final_state", x.dtype, (batch, channels, state_width))
    return y, final_state


def conv_report(y, final_state, inputs, **attrs) -> tuple[bool, str]:
    return conv_ref.budget_report(y, final_state, *(inputs[n] for n in CONV_NAMES), **attrs)


@pytest.mark.parametrize("t", DTYPES, ids=_type_id)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize("length", [3, Q, Q + 1, 150])
def test_causal_conv1d_on_arm64(program, tmp_path: Path, t, channels_last: int, length: int) -> None:
    """Both layouts, a prompt shorter than the state and around the channels-last kernel's 64-token blocks, 37
    channels (a vector remainder); one x at -95 (exp's underflow in the sigmoid)."""
    inputs = conv_inputs(np.random.default_rng(length), t=t, length=length, channels_last=channels_last)
    inputs["x"][0, 1, 1] = np.asarray(-95.0, dtype=t)
    y, state = run_conv(program, tmp_path, inputs, channels_last=channels_last)
    ok, message = conv_report(y, state, inputs, channels_last=channels_last, state_width=4)
    assert ok, message


@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize(
    ("width", "state_width", "bias", "state", "activation"),
    [
        (4, 3, False, False, "silu"),
        (4, 6, True, False, "none"),
        (2, 1, False, True, "none"),
        (1, 0, True, True, "silu"),
    ],
    ids=["bare-S=K-1", "no-state-wide", "K2", "K1"],
)
def test_causal_conv1d_options_on_arm64(
    program, tmp_path: Path, channels_last: int, width: int, state_width: int, bias: bool, state: bool, activation: str
) -> None:
    """Without bias or initial state, no activation, other kernel and state widths."""
    inputs = conv_inputs(
        np.random.default_rng(width * 10 + state_width),
        t=F16,
        length=70,
        width=width,
        state_width=state_width,
        bias=bias,
        state=state,
        channels_last=channels_last,
    )
    y, final_state = run_conv(
        program, tmp_path, inputs, state_width=state_width, channels_last=channels_last, activation=activation
    )
    attrs = {"channels_last": channels_last, "state_width": state_width, "activation": activation}
    ok, message = conv_report(y, final_state, inputs, **attrs)
    assert ok, message


# --- the checks above can fail ----------------------------------------------------------------------------------


def test_the_scan_check_rejects_a_wrong_result(program, tmp_path: Path) -> None:
    """The AArch64 result passes; the same result with one output or state element moved to 3x its budget, or a
    kernel that ignored the initial state or D, does not."""
    inputs = scan_inputs(np.random.default_rng(50), F32, length=Q + 1, head_dim=7, state_size=19)
    out, state, _ = run_scan(program, tmp_path, inputs)
    assert scan_ref.budget_report(out, state, **inputs)[0]
    ref_out, ref_state, tol_out, tol_state = scan_ref.budget_bounds(**inputs)
    for name, actual, ref, tol in (("out", out, ref_out, tol_out), ("final_state", state, ref_state, tol_state)):
        index = np.unravel_index(int(np.argmax(tol)), tol.shape)
        wrong = actual.copy()
        wrong[index] = np.float32(ref[index] + 3 * tol[index])
        outputs = (wrong, state) if name == "out" else (out, wrong)
        ok, message = scan_ref.budget_report(*outputs, **inputs)
        assert not ok and f"{name}: 1 of" in message, message
    for dropped in ("initial_state", "D"):
        wrong_out, wrong_state, _ = run_scan(program, tmp_path, {**inputs, dropped: None})
        ok, message = scan_ref.budget_report(wrong_out, wrong_state, **inputs)
        assert not ok, f"a scan without {dropped} passed: {message}"


@pytest.mark.parametrize("t", [F32, bfloat16], ids=_type_id)
def test_the_conv_check_rejects_a_wrong_result(program, tmp_path: Path, t) -> None:
    """The AArch64 result passes; with one y off by 5 % or one state element changed, or from a kernel that ignored
    the bias or the initial state, it does not."""
    inputs = conv_inputs(np.random.default_rng(51), t=t, length=Q + 1)
    y, state = run_conv(program, tmp_path, inputs)
    assert conv_report(y, state, inputs, state_width=4)[0]
    wrong_y = y.copy()
    wrong_y[1, 10, 5] = np.asarray(y[1, 10, 5].astype(np.float64) * 1.05 + 1e-3, dtype=t)
    ok, message = conv_report(wrong_y, state, inputs, state_width=4)
    assert not ok and "y: 1 " in message, message
    wrong_state = state.copy()
    wrong_state[0, 2, 1] = np.asarray(state[0, 2, 1].astype(np.float64) + 0.5, dtype=t)
    ok, message = conv_report(y, wrong_state, inputs, state_width=4)
    assert not ok, message
    for dropped in ("bias", "initial_state"):
        wrong_y, wrong_state = run_conv(program, tmp_path, {**inputs, dropped: None})
        ok, message = conv_report(wrong_y, wrong_state, inputs, state_width=4)
        assert not ok, f"a conv without {dropped} passed: {message}"


# --- the code is NEON code --------------------------------------------------------------------------------------

#: A 4-lane float32 multiply or multiply-add: the vector code of both cores (Eigen's GEMM kernels, the conv's taps).
NEON_FLOAT_MATH = re.compile(r"\bf(mul|mla)\s+v\d+\.4s")


@pytest.mark.parametrize("source", ["mamba_chunk_scan_math.cc", "causal_conv1d_math.cc"])
def test_prefill_cores_are_neon_code_on_aarch64(tmp_path: Path, source: str) -> None:
    """Each core compiles, with the library's flags, to 4-lane float32 NEON arithmetic."""
    if NATIVE_ARM64 and sys.platform.startswith("linux"):
        cxx = os.environ.get("CXX", "g++")
    elif LINUX_X86_64:
        problem = golden.cross_tools_problem()
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        cxx = golden.CROSS_CXX
    else:
        pytest.skip("reads GCC's AArch64 assembly; Apple clang: see contrib_ops/APPLE.md")
    assembly = tmp_path / "core.s"
    command = [
        cxx,
        "-std=c++17",
        *golden.cmake_flags("_math_flags"),
        f"-I{golden.CPU_DIR}",
        f"-isystem{_eigen()}",
        "-S",
        str(golden.CPU_DIR / source),
        "-o",
        str(assembly),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert NEON_FLOAT_MATH.search(assembly.read_text()), f"no 4-lane float32 NEON arithmetic in {source} on AArch64"
