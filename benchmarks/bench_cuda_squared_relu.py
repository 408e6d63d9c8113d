"""Nemotron-H's squared-ReLU MLP activation on CUDA: what ONNX Runtime runs now against one pass over the bytes.

The MLP's up-projection output h (tokens x 21504 at Nemotron-H-8B widths) goes through relu(h)^2. After
``mambafuse optimize`` ORT runs it as ``Relu`` then ``Mul(r, r)`` (the squares pass; before it ``Pow(r, 2)``).
Beside those: ``ai.mambafuse::SquaredRelu``, what ``optimize`` writes now (the library's kernel, with
``--library``); the same function as one elementwise pass by ``torch.compile`` (``relu(h) * relu(h)``, one Triton
kernel); and a device copy of the same bytes (the floor of any one pass). GPU time per call from CUPTI
(torch.profiler), no CUDA graph, inputs and outputs on the device (IO binding); every variant's result but Pow's is
checked against relu(h)^2 rounded once to float16, bit for bit.

    python3 benchmarks/bench_cuda_squared_relu.py [--library build/cuda/libmambafuse_ops.so] [--tokens 2048]
        [--width 21504] [--runs 50]
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def ort_model(square: str) -> bytes:
    """Relu then the square, as ``Mul(r, r)`` or ``Pow(r, 2)``; or "op", the one SquaredRelu node."""
    nodes = [helper.make_node("Relu", ["h"], ["r"])]
    initializers = []
    opsets = [helper.make_opsetid("", 18)]
    if square == "op":
        nodes = [helper.make_node("SquaredRelu", ["h"], ["y"], domain="ai.mambafuse")]
        opsets.append(helper.make_opsetid("ai.mambafuse", 1))
    elif square == "mul":
        nodes.append(helper.make_node("Mul", ["r", "r"], ["y"]))
    else:
        nodes.append(helper.make_node("Pow", ["r", "two"], ["y"]))
        initializers.append(numpy_helper.from_array(np.array(2.0, np.float16), "two"))
    graph = helper.make_graph(
        nodes,
        "squared_relu",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["L", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["L", "W"])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model.SerializeToString()


def gpu_us(torch, step, runs: int) -> tuple[float, dict[str, float]]:
    """GPU µs per call of ``step`` and per kernel name, from CUPTI."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    per_name: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        device_us = getattr(event, "self_device_time_total", 0.0)
        if device_us > 0:
            per_name[event.name[:40]] += device_us / runs
    return sum(per_name.values()), dict(per_name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=21504)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--library", default=None, help="the mambafuse library (its CUDA build): adds SquaredRelu")
    args = parser.parse_args()
    import onnxruntime as ort
    import torch

    ort.preload_dlls()
    h = torch.randn(args.tokens, args.width, device="cuda").half()
    ort_variants = ("mul", "pow", "op") if args.library else ("mul", "pow")
    out = {name: torch.empty_like(h) for name in (*ort_variants, "copy")}
    steps = {}
    for square in ort_variants:
        options = ort.SessionOptions()
        if square == "op":
            options.register_custom_ops_library(args.library)
            options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        session = ort.InferenceSession(ort_model(square), options, providers=["CUDAExecutionProvider"])
        binding = session.io_binding()
        binding.bind_input("h", "cuda", 0, np.float16, list(h.shape), h.data_ptr())
        binding.bind_output("y", "cuda", 0, np.float16, list(h.shape), out[square].data_ptr())
        steps[square] = lambda s=session, b=binding: s.run_with_iobinding(b)
    fused = torch.compile(lambda x: torch.relu(x) * torch.relu(x))
    result: dict[str, object] = {}

    def fused_step() -> None:
        result["y"] = fused(h)  # a new output from torch's caching allocator: no kernel but the compiled one

    steps["fused"] = fused_step
    steps["copy"] = lambda: out["copy"].copy_(h)
    labels = {
        "pow": "ORT Relu + Pow(r, 2) (before the squares pass)",
        "mul": "ORT Relu + Mul(r, r) (optimize before SquaredRelu)",
        "op": "ai.mambafuse::SquaredRelu (what optimize writes)",
        "fused": "one pass (torch.compile, Triton)",
        "copy": "device copy of the same bytes",
    }
    moved = 2 * h.numel() * h.element_size()
    print(
        f"{torch.cuda.get_device_name()}, onnxruntime {ort.__version__}, torch {torch.__version__}; float16 "
        f"({args.tokens}, {args.width}), {moved / 1e6:.0f} MB read + written by one pass; {args.runs} calls"
    )
    print("| variant | kernels (name: µs per call) | GPU µs per call | x a copy |")
    print("|---|---|---|---|")
    copy_us, _ = gpu_us(torch, steps["copy"], args.runs)
    for name in (*ort_variants, "fused", "copy"):
        total, kernels = gpu_us(torch, steps[name], args.runs)
        text = "; ".join(f"{k}: {us:.1f}" for k, us in sorted(kernels.items(), key=lambda kv: -kv[1]))
        print(f"| {labels[name]} | {text} | {total:.1f} | {total / copy_us:.2f} |", flush=True)
    expected = torch.relu(h.float()).square().half()
    checked = [(name, out[name]) for name in ort_variants if name != "pow"] + [("fused", result["y"])]
    for name, y in checked:
        if not torch.equal(y, expected):
            raise SystemExit(f"{name}: not the once-rounded square of relu(h)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
