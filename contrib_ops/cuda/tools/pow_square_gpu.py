"""ONNX Runtime's CUDA ``Pow(x, 2)`` against ``Mul(x, x)`` and against the square rounded once to the type, for
every float16 value and 2^24 float32 ones: whether ``optimize``'s squares pass (fusion/rules/square.py) changes
any bit of what ORT's CUDA provider computed, and which of the two is the rounded square where they differ.

    python3 contrib_ops/cuda/tools/pow_square_gpu.py        # onnxruntime-gpu importable; prints a line per case
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def session(element_type: int, form: str) -> ort.InferenceSession:
    """A one-node graph, y = Pow(x, 2) or Mul(x, x), on the CUDA provider with ORT's graph optimizations off."""
    if form == "pow":
        nodes = [helper.make_node("Pow", ["x", "two"], ["y"])]
        initializers = [helper.make_tensor("two", element_type, [], [2.0])]
    else:
        nodes, initializers = [helper.make_node("Mul", ["x", "x"], ["y"])], []
    graph = helper.make_graph(
        nodes,
        "square",
        [helper.make_tensor_value_info("x", element_type, [None])],
        [helper.make_tensor_value_info("y", element_type, [None])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])


def main() -> int:
    ort.preload_dlls()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
        return 2
    cases = [
        (TensorProto.FLOAT16, np.arange(1 << 16, dtype=np.uint16).view(np.float16), np.uint16),
        (TensorProto.FLOAT, np.random.default_rng(0).standard_normal(1 << 24).astype(np.float32) * 30, np.uint32),
    ]
    for element_type, x, bits in cases:
        name = x.dtype.name
        with np.errstate(all="ignore"):
            rounded = (x.astype(np.float64) ** 2).astype(x.dtype)  # exact in float64, then one rounding
        known = ~np.isnan(x)
        out = {form: session(element_type, form).run(None, {"x": x})[0][known].view(bits) for form in ("pow", "mul")}
        for form, y in out.items():
            wrong = int((y != rounded[known].view(bits)).sum())
            print(f"{name} {form}: {wrong} of {int(known.sum())} differ from x² rounded")
        print(f"{name}: Pow and Mul differ at {int((out['pow'] != out['mul']).sum())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
