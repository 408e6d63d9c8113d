"""The CUDA variant of the custom-op library compiles here whenever nvcc is present (no GPU needed), with every
tool that -DMAMBAFUSE_CUDA_TOOLS=ON adds (the self-checks and the benchmarks' launchers); the library it
produces still loads and runs its CPU kernel in a CPU-only onnxruntime (static cudart, libcuda opened only at
the first CUDA call), and the tools start there too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent

#: The targets of the CUDA build with -DMAMBAFUSE_CUDA_TOOLS=ON and the file each builds (relative to the
#: build directory): the library, and the tools that the GPU scripts (contrib_ops/cuda/tools/*.sh,
#: benchmarks/gpu_session.sh) and the CUDA benchmarks run.
CUDA_TARGETS = {
    "mambafuse_ops": "libmambafuse_ops.so",
    "mambafuse_cuda_kernels": "cuda/libmambafuse_cuda_kernels.a",
    "mambafuse_cuda_selfcheck": "cuda/mambafuse_cuda_selfcheck",
    "mambafuse_cuda_bench": "cuda/libmambafuse_cuda_bench.so",
    "mambafuse_cuda_decode_selfcheck": "cuda/mambafuse_cuda_decode_selfcheck",
    "mambafuse_cuda_decode_bench": "cuda/libmambafuse_cuda_decode_bench.so",
    "mambafuse_cuda_half_product_check": "cuda/mambafuse_cuda_half_product_check",
}
#: The C entry points each launcher library exports, as benchmarks/bench_cuda.py, ncu_cuda.py and
#: bench_cuda_decode_ops.py call them through ctypes.
LAUNCHER_ENTRY_POINTS = {
    "cuda/libmambafuse_cuda_bench.so": ("mambafuse_cuda_launch", "mambafuse_cuda_choose"),
    "cuda/libmambafuse_cuda_decode_bench.so": (
        "mambafuse_ssu_launch",
        "mambafuse_ssu_describe",
        "mambafuse_conv_update_launch",
    ),
}
#: The self-checks' exit status and message when the machine has no CUDA device (tools/cuda_*selfcheck.cc).
NO_DEVICE = 77


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


def _build(build: Path, *options: str) -> None:
    """Configure ``contrib_ops`` into ``build`` for sm_90 with the tools and ``options``, build every default target,
    and keep configure's and the build's output in build.log; a failure fails the test (a compile break is never
    a skip). Skips where nvcc is missing."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): the CUDA variant is not compiled here")
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
        *options,
    ]
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    if (root := _ort_root()) is not None:
        configure.append(f"-DONNXRUNTIME_ROOT={root}")
    log = build / "build.log"
    for command in (configure, [cmake, "--build", str(build), "--parallel", str(os.cpu_count() or 2)]):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        log.write_text((log.read_text() if log.exists() else "") + result.stdout + result.stderr)
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("cuda-build")
    # CMake's file API: configure writes every target it declares, with the files it builds, to .cmake/api.
    (build / ".cmake" / "api" / "v1" / "query").mkdir(parents=True)
    (build / ".cmake" / "api" / "v1" / "query" / "codemodel-v2").touch()
    _build(build)
    return build


@pytest.mark.parametrize("omit", ["", "head;bc;x;out"], ids=["all-traffic", "state-only"])
def test_traffic_floor_build_makes_only_the_benchmark_entry_points(tmp_path: Path, omit: str) -> None:
    """-DMAMBAFUSE_SSU_TRAFFIC_FLOOR=ON (the benchmark's no-arithmetic state update, wrong results by design)
    builds the decode benchmark's launcher and no op library and no self-check, warning-free in contrib_ops/cuda;
    so does the floor with every part but the state's own traffic left out (MAMBAFUSE_SSU_TRAFFIC_FLOOR_OMIT)."""
    _build(tmp_path, "-DMAMBAFUSE_SSU_TRAFFIC_FLOOR=ON", f"-DMAMBAFUSE_SSU_TRAFFIC_FLOOR_OMIT={omit}")
    assert (tmp_path / CUDA_TARGETS["mambafuse_cuda_decode_bench"]).is_file()
    built = [path for name, path in CUDA_TARGETS.items() if name != "mambafuse_cuda_decode_bench"]
    built = [path for path in built if (tmp_path / path).is_file() and not path.endswith(".a")]
    assert not built, f"a traffic-floor build made {built}"
    log = (tmp_path / "build.log").read_text()
    assert not [line for line in log.splitlines() if "contrib_ops/cuda/" in line and "warning" in line.lower()]


def test_traffic_floor_rejects_an_unknown_part(tmp_path: Path) -> None:
    """A misspelt part to leave out fails configure and names the part (a silent no-op would measure the whole
    floor under the wrong name)."""
    with pytest.raises(AssertionError, match="'state' is none of head, bc, x, out"):
        _build(tmp_path, "-DMAMBAFUSE_SSU_TRAFFIC_FLOOR=ON", "-DMAMBAFUSE_SSU_TRAFFIC_FLOOR_OMIT=bc;state")


def _declared_targets(build: Path) -> dict[str, list[str]]:
    """Return {target: the files it builds, relative to ``build``} as configure wrote them (CMake's file API)."""
    reply = build / ".cmake" / "api" / "v1" / "reply"
    index = json.loads(max(reply.glob("index-*.json")).read_text())
    codemodel = next(entry for entry in index["objects"] if entry["kind"] == "codemodel")
    configuration = json.loads((reply / codemodel["jsonFile"]).read_text())["configurations"][0]
    targets = {}
    for entry in configuration["targets"]:
        target = json.loads((reply / entry["jsonFile"]).read_text())
        targets[target["name"]] = [artifact["path"] for artifact in target.get("artifacts", [])]
    return targets


def test_cuda_variant_compiles_without_warnings(cuda_build: Path) -> None:
    # Warnings are not errors for the whole build (the CPU sources have their own -Werror CI job); the CUDA
    # sources, host and device, must compile without any.
    log = (cuda_build / "build.log").read_text()
    cuda_warnings = [line for line in log.splitlines() if "contrib_ops/cuda/" in line and "warning" in line.lower()]
    assert not cuda_warnings, "\n".join(cuda_warnings[:20])


def test_every_cuda_target_is_declared_and_built(cuda_build: Path) -> None:
    """The CUDA targets (tools included) are declared with their files, and every target configure declares
    (the CPU ones too) left its files: a target dropped from the build, renamed or not built fails here."""
    declared = _declared_targets(cuda_build)
    missing = sorted(set(CUDA_TARGETS) - set(declared))
    assert not missing, f"targets the CUDA tools build does not declare: {missing} (declared: {sorted(declared)})"
    moved = {name: declared[name] for name, path in CUDA_TARGETS.items() if declared[name] != [path]}
    assert not moved, f"targets that build other files than {CUDA_TARGETS}: {moved}"
    unbuilt = [
        f"{name}: {path}" for name, paths in declared.items() for path in paths if not (cuda_build / path).is_file()
    ]
    assert not unbuilt, f"declared but not built: {unbuilt}"


@pytest.mark.parametrize(
    "tool",
    [
        "cuda/mambafuse_cuda_selfcheck",
        "cuda/mambafuse_cuda_decode_selfcheck",
        "cuda/mambafuse_cuda_half_product_check",
    ],
)
def test_self_check_runs_or_reports_no_device(cuda_build: Path, tool: str) -> None:
    """The self-check links and starts on any machine: without a CUDA device (here) it says so and exits 77,
    the automake code for a skip; with one, its quick list must pass."""
    result = subprocess.run(
        [str(cuda_build / tool), "--quick"], capture_output=True, text=True, timeout=600, check=False
    )
    output = f"{tool} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if result.returncode == NO_DEVICE:
        assert result.stderr.strip() == "no CUDA device", output
    else:
        assert result.returncode == 0, output


def test_launchers_load_and_export_their_entry_points(cuda_build: Path) -> None:
    """The benchmarks' launcher libraries load without a GPU (libcuda is opened at the first CUDA call) and
    export the entry points the benchmarks call. A subprocess, so that the rest of the session loads nothing."""
    code = """
import ctypes, json, sys
missing = []
for path, names in json.loads(sys.argv[1]).items():
    library = ctypes.CDLL(path)
    missing += [f"{path}: {name}" for name in names if not hasattr(library, name)]
print(json.dumps(missing))
"""
    libraries = {str(cuda_build / path): names for path, names in LAUNCHER_ENTRY_POINTS.items()}
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(libraries)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout) == [], f"entry points not exported: {result.stdout}"


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
