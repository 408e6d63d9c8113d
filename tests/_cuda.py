"""Whether ONNX Runtime can run the CUDA execution provider here: one check for every GPU test module."""

from __future__ import annotations

import contextlib

import onnx
import onnx.helper as oh

CUDA = "CUDAExecutionProvider"


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
