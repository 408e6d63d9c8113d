"""Nemotron-H's squared-ReLU MLP activation on the CPU: ONNX Runtime's ``Relu`` + ``Mul(r, r)`` (what ``optimize``
wrote before the SquaredRelu fusion) against ``ai.mambafuse::SquaredRelu`` (the library's CPU kernel), side by side
in one process.

The activation is the MLP's up-projection output at Nemotron-H-8B widths (L tokens × 21504): L = 1 is a decode
step's, 512 and 2048 a prompt's. The outputs are checked bit for bit; times are medians of interleaved repeats.

    python -m benchmarks.bench_squared_relu_cpu [--lengths 1,512,2048] [--dtypes fp32,fp16] [--threads 1,2]
        [--runs 30] [--no-save]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import contrib_ops
from benchmarks._common import append_results, environment_line

WIDTH = 21504
DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}


def activation(elem_type: int, fused: bool) -> onnx.ModelProto:
    """``y = relu(h)^2`` as Relu + Mul, or as the one SquaredRelu node."""
    if fused:
        nodes = [helper.make_node("SquaredRelu", ["h"], ["y"], domain="ai.mambafuse")]
    else:
        nodes = [helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Mul", ["r", "r"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "squared_relu",
        [helper.make_tensor_value_info("h", elem_type, ["L", WIDTH])],
        [helper.make_tensor_value_info("y", elem_type, ["L", WIDTH])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.mambafuse", 1)]
    )
    model.ir_version = 10
    return model


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return contrib_ops.session(model.SerializeToString(), session_options=options, use_library=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1,512,2048")
    parser.add_argument("--dtypes", default="fp32,fp16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    lines = [
        "| dtype | L | threads | Relu + Mul (µs) | SquaredRelu (µs) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for dtype in args.dtypes.split(","):
        elem_type, np_type = DTYPES[dtype]
        for length in [int(v) for v in args.lengths.split(",")]:
            feeds = {"h": (3 * np.random.default_rng(length).standard_normal((length, WIDTH))).astype(np_type)}
            for threads in [int(v) for v in args.threads.split(",")]:
                sessions = {name: session(activation(elem_type, name == "fused"), threads) for name in ("ort", "fused")}
                outputs = {name: s.run(None, feeds)[0] for name, s in sessions.items()}
                if outputs["fused"].tobytes() != outputs["ort"].tobytes():
                    raise SystemExit(f"{dtype} L={length}: SquaredRelu computed other bits than Relu + Mul")
                times: dict[str, list[float]] = {name: [] for name in sessions}
                for _ in range(args.runs):
                    for name, s in sessions.items():
                        start = time.perf_counter()
                        s.run(None, feeds)
                        times[name].append(time.perf_counter() - start)
                ort_us, fused_us = (1e6 * statistics.median(times[n]) for n in ("ort", "fused"))
                line = f"| {dtype} | {length} | {threads} | {ort_us:.1f} | {fused_us:.1f} | {ort_us / fused_us:.2f}x |"
                print(line, flush=True)
                lines.append(line)
    env = environment_line(max(int(v) for v in args.threads.split(",")))
    print(env)
    if not args.no_save:
        append_results("SquaredRelu on the CPU: Relu + Mul vs the fused op", [env, "", *lines])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
