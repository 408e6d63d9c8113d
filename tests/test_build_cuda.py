"""The CUDA variant of the custom-op library compiles here whenever nvcc is present (no GPU needed), and the
library it produces still loads and runs its CPU kernel in a CPU-only onnxruntime (static cudart, libcuda
opened only at the first CUDA call)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return str(default) if default.is_file() else None


def _ort_root() -> Path | None:
    """Headers cached by an earlier configure of the CPU build, so this build needs no network."""
    for candidate in (REPO / ".ort-headers", REPO / "build" / "cmake" / "_deps" / "ort-headers"):
        if (candidate / "include" / "onnxruntime" / "onnxruntime_cxx_api.h").is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): the CUDA variant is not compiled here")
    build = tmp_path_factory.mktemp("cuda-build")
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")
    ninja = shutil.which("ninja", path=str(Path(sys.executable).parent)) or shutil.which("ninja")
    assert cmake, "cmake not found"
    configure = [
        cmake,
        "-S",
        str(REPO / "contrib_ops"),
        "-B",
        str(build),
        "-DMAMBAFUSE_CUDA=ON",
        "-DMAMBAFUSE_CUDA_TOOLS=ON",
        "-DMAMBAFUSE_WERROR=OFF",
        f"-DCMAKE_CUDA_COMPILER={nvcc}",
        # One real architecture keeps CI's compile under two minutes; the shipped build has 80, 90 and PTX.
        "-DCMAKE_CUDA_ARCHITECTURES=90-real",
    ]
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    if (root := _ort_root()) is not None:
        configure.append(f"-DONNXRUNTIME_ROOT={root}")
    for command in (configure, [cmake, "--build", str(build), "--parallel", str(os.cpu_count() or 2)]):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        (build / "build.log").write_text(
            (build / "build.log").read_text() + result.stdout + result.stderr
            if (build / "build.log").exists()
            else result.stdout + result.stderr
        )
        # A compile break is a failure, never a skip.
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return build


def test_cuda_variant_compiles_without_warnings(cuda_build: Path) -> None:
    # Warnings are not errors for the whole build (the CPU sources have their own -Werror CI job); the CUDA
    # sources, host and device, must compile without any.
    log = (cuda_build / "build.log").read_text()
    cuda_warnings = [line for line in log.splitlines() if "contrib_ops/cuda/" in line and "warning" in line.lower()]
    assert not cuda_warnings, "\n".join(cuda_warnings[:20])
    for name in ("libmambafuse_ops.so", "cuda/libmambafuse_cuda_bench.so", "cuda/mambafuse_cuda_selfcheck"):
        assert (cuda_build / name).is_file(), f"{name} was not built"


def test_cuda_library_has_no_cuda_runtime_dependency(cuda_build: Path) -> None:
    needed = subprocess.run(
        ["readelf", "-d", str(cuda_build / "libmambafuse_ops.so")], capture_output=True, text=True, check=True
    )
    libraries = [line for line in needed.stdout.splitlines() if "(NEEDED)" in line]
    assert not any("libcuda" in line for line in libraries), libraries  # libcudart and libcuda


def test_cuda_library_runs_its_cpu_kernel_in_cpu_onnxruntime(cuda_build: Path) -> None:
    """A subprocess, so that loading this library does not change what the rest of the session loads."""
    code = """
import numpy as np, onnxruntime as ort
import contrib_ops
from fusion.reference import gated_group_rms_norm, budget_report
from tests._ops import FLOAT16, one_node_model, random_inputs
model = one_node_model(FLOAT16, FLOAT16, FLOAT16, shape=[2, 96], group_size=48)
session = contrib_ops.session(model, providers=["CPUExecutionProvider"], use_library=True)
y, z, w = random_inputs(np.random.default_rng(0), (2, 96), FLOAT16, FLOAT16, FLOAT16)
out = session.run(None, {"y": y, "z": z, "w": w})[0]
ok, message = budget_report(out, gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=48, compute_dtype=np.float64))
assert ok, message
print("ok")
"""
    env = dict(os.environ, MAMBAFUSE_LIBRARY=str(cuda_build / "libmambafuse_ops.so"), PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=False
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]
    np.testing.assert_equal(result.stdout.strip(), "ok")
