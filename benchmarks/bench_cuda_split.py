"""ONNX Runtime's CUDA Split over the last axis by its output count: which kernel runs and its GPU time per Run.

The conv parts pass (fusion/rules/conv_parts.py) gives the in-projection's Split at most MAX_SPLIT_OUTPUTS
outputs. This measures why, on the shapes of a Nemotron-H-8B prefill (float16, 2048 tokens): the projection
(1, L, 18560) cut into 3, 4 and 5 parts, and the conv output (1, L, 10240) and its B and C (1, L, 2048). GPU time
and kernel names are CUPTI's (torch.profiler), every kernel and copy of the Runs (IO binding, inputs and outputs
on the device, no CUDA graph); bandwidth is bytes read and written over that time.

    python benchmarks/bench_cuda_split.py [--tokens 2048] [--runs 50]
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
from onnx import TensorProto, helper, numpy_helper

CASES = {
    "projection, 3 parts (z, xBC, dt)": (18560, [8192, 10240, 128]),
    "projection, 4 parts (z, x, BC, dt)": (18560, [8192, 8192, 2048, 128]),
    "projection, 5 parts (z, x, B, C, dt)": (18560, [8192, 8192, 1024, 1024, 128]),
    "conv output, 3 parts (x, B, C)": (10240, [8192, 1024, 1024]),
    "BC, 2 parts (B, C)": (2048, [1024, 1024]),
}


def split_model(width: int, sizes: list[int]) -> bytes:
    names = [f"y{i}" for i in range(len(sizes))]
    graph = helper.make_graph(
        [helper.make_node("Split", ["x", "sizes"], names, axis=-1)],
        "split",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, "L", width])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [1, "L", s]) for n, s in zip(names, sizes, strict=True)],
        [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model.SerializeToString()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    import onnxruntime as ort
    import torch
    from torch.profiler import ProfilerActivity, profile

    ort.preload_dlls()
    print(
        f"{torch.cuda.get_device_name()}, onnxruntime {ort.__version__}, torch {torch.__version__}; float16, "
        f"{args.tokens} tokens, medians of {args.runs} Runs"
    )
    print("| Split | kernels per Run (name: µs) | GPU µs per Run | GB/s (read + written) |")
    print("|---|---|---|---|")
    for label, (width, sizes) in CASES.items():
        session = ort.InferenceSession(split_model(width, sizes), providers=["CUDAExecutionProvider"])
        x = torch.randn(1, args.tokens, width, device="cuda").half()
        outs = [torch.empty(1, args.tokens, s, device="cuda", dtype=torch.float16) for s in sizes]
        binding = session.io_binding()
        binding.bind_input("x", "cuda", 0, np.float16, list(x.shape), x.data_ptr())
        for i, out in enumerate(outs):
            binding.bind_output(f"y{i}", "cuda", 0, np.float16, list(out.shape), out.data_ptr())
        for _ in range(5):
            session.run_with_iobinding(binding)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.runs):
                session.run_with_iobinding(binding)
            torch.cuda.synchronize()
        per_name: dict[str, float] = collections.defaultdict(float)
        for event in prof.events():
            device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
            if device_us > 0:
                per_name[event.name[:48]] += device_us / args.runs
        total = sum(per_name.values())
        for i, out in enumerate(outs):  # the Split is exact: each output is its slice of x
            start = sum(sizes[:i])
            if not torch.equal(out, x[..., start : start + sizes[i]]):
                raise SystemExit(f"{label}: output {i} is not its slice")
        moved = 2 * x.numel() * 2
        kernels = "; ".join(f"{name}: {us:.1f}" for name, us in sorted(per_name.items(), key=lambda kv: -kv[1]))
        print(f"| {label} | {kernels} | {total:.1f} | {moved / total / 1e3:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
