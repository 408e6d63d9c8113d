"""Whether ONNX Runtime can run the CUDA execution provider here (one check for every GPU test module), the
sessions and feeds the CUDA kernel tests share, and the host emulation's build (the kernels' logic without a GPU)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

import contrib_ops
from fusion.reference._bounds import bfloat16

CUDA = "CUDAExecutionProvider"
REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "contrib_ops" / "cuda" / "tools"


def with_supported_ir(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with an IR version onnxruntime-gpu 1.31 reads (a newer onnx writes one it rejects)."""
    model.ir_version = min(model.ir_version, 10)
    return model


def cuda_problem(ort) -> str | None:
    """Return why a CUDA session cannot be created with ``ort``, or None when it can.

    Calls ``ort.preload_dlls()`` first (the CUDA/cuDNN libraries of the installed PyTorch, where
    onnxruntime-gpu needs them; a failed preload shows up as a missing provider or a failed session).
    """
    if hasattr(ort, "preload_dlls"):
        with contextlib.suppress(Exception):
            ort.preload_dlls()
    if CUDA not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    graph = oh.make_graph(
        [oh.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.FLOAT16)],
        "probe",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT16, [1])],
    )
    model = with_supported_ir(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)]))
    try:
        ort.InferenceSession(model.SerializeToString(), providers=[CUDA])
    except Exception as error:  # noqa: BLE001
        return f"the CUDA execution provider cannot create a session: {str(error).splitlines()[0][:300]}"
    return None


def cuda_session(model: onnx.ModelProto, profile_prefix: str | None = None, **provider_options: str):
    """A CUDA session with the library and no CPU fallback (a node without a CUDA kernel fails the session)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return contrib_ops.session(
        with_supported_ir(model), providers=[(CUDA, provider_options)], session_options=options, use_library=True
    )


def feeds_of(inputs: Iterable[tuple[str, np.ndarray | None]]) -> dict[str, np.ndarray]:
    """numpy feeds of (name, value) pairs, absent ones left out: bfloat16 values enter as float32 (the tests'
    one-node models cast them on the GPU, exactly)."""
    return {name: (v.astype(np.float32) if v.dtype == bfloat16 else v) for name, v in inputs if v is not None}


#: The ONNX element type numbers the emulated libraries' entry points take.
ONNX_TYPE = {np.dtype(np.float32): 1, np.dtype(np.float16): 10, np.dtype(bfloat16): 16}


def host_pointer(a: np.ndarray | None) -> int | None:
    """The address of ``a``'s data for an emulated kernel (None for an absent optional input)."""
    return None if a is None else a.ctypes.data


def build_emulation(script: str, out: Path, *arguments: str, cxx_flags: str = "") -> None:
    """Build CUDA kernels for the host emulation with ``contrib_ops/cuda/tools/<script> <out> <arguments>`` (g++
    with ``cxx_flags`` added); skip where there is no g++ or no CUDA headers ($CUDA_HOME/include)."""
    include = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include" / "cuda_fp16.h"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None or not include.is_file():
        pytest.skip("the host emulation needs g++ (C++20) and the CUDA headers ($CUDA_HOME/include)")
    env = dict(os.environ, CXX=f"{cxx} {cxx_flags}".strip())
    command = ["bash", str(TOOLS / script), str(out), *arguments]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"


def run_module_under_tsan(module: str, runtime: str, *arguments: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m <module> <arguments>`` from the repository root with the ThreadSanitizer runtime ``runtime``
    preloaded (a ThreadSanitizer library cannot be loaded into an uninstrumented Python otherwise) and ``env`` added;
    a report does not stop the run, and one makes its exit status 66."""
    full = dict(os.environ, LD_PRELOAD=runtime, TSAN_OPTIONS="halt_on_error=0 report_signal_unsafe=0 exitcode=66")
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), full.get("PYTHONPATH", "")])
    full.update(env)
    command = [sys.executable, "-m", module, *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=full, cwd=REPO, check=False, timeout=1200)


def emulated_library(script: str, library: str, out: Path, cxx_flags: str = "") -> ctypes.CDLL:
    """Build CUDA kernels for the host emulation with ``contrib_ops/cuda/tools/<script>`` into ``out``
    (``build_emulation``, g++ with ``cxx_flags`` added) and load ``<library>`` from there."""
    build_emulation(script, out, cxx_flags=cxx_flags)
    return ctypes.CDLL(str(out / library))
