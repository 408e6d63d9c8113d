"""One Mamba-2 mixer's prompt conv and its Splits on the CPU, before and after ``mambafuse optimize``'s conv parts
pass (fusion/rules/conv_parts.py), side by side in one process.

The subgraph is what the prefill exports have around the conv, at Nemotron-H-8B widths: the in-projection's output
P (1, L, 18560) split into z (8192), xBC (10240) and dt (128); the prompt conv over xBC (K = 4, SiLU, a zero
initial state); its output split into x (8192), B (1024) and C (1024). After the pass: one Split of P into z, x,
BC and dt, a conv for x and one for B and C, and a Split of the latter's output. Both run the mambafuse library's
CPU kernels; the outputs are checked bit for bit.
Times are medians of interleaved repeats.

    python -m benchmarks.bench_conv_parts_cpu [--lengths 512,2048] [--dtypes fp32,fp16] [--threads 1,2] [--runs 20]
        [--no-save]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import contrib_ops
from benchmarks._common import append_results, environment_line
from fusion.rules.conv_parts import split_conv_parts

Z, X, GN, H, K, S = 8192, 8192, 1024, 128, 4, 3
DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}


def mixer_conv(elem_type: int, np_type: type) -> onnx.ModelProto:
    """The subgraph before the pass (the module docstring)."""
    rng = np.random.default_rng(0)
    conv = X + 2 * GN
    width = Z + conv + H
    initializers = [
        numpy_helper.from_array(np.array([Z, conv, H], np.int64), "projection_sizes"),
        numpy_helper.from_array(np.array([X, GN, GN], np.int64), "conv_sizes"),
        numpy_helper.from_array((0.5 * rng.standard_normal((conv, 1, K))).astype(np_type), "weight"),
        numpy_helper.from_array((0.1 * rng.standard_normal(conv)).astype(np_type), "bias"),
        numpy_helper.from_array(np.zeros((1, conv, S), np_type), "initial_state"),
    ]
    nodes = [
        helper.make_node("Split", ["P", "projection_sizes"], ["z", "xBC", "dt"], axis=-1),
        helper.make_node(
            "CausalConv1d",
            ["xBC", "weight", "bias", "initial_state"],
            ["y", "final_state"],
            domain="ai.mambafuse",
            state_width=S,
        ),
        helper.make_node("Split", ["y", "conv_sizes"], ["x", "B", "C"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mixer_conv",
        [helper.make_tensor_value_info("P", elem_type, [1, "L", width])],
        [helper.make_tensor_value_info(name, elem_type, None) for name in ("z", "x", "B", "C", "dt")],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.mambafuse", 1)]
    )
    model.ir_version = 10
    return model


def by_part(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = ir.from_proto(model)
    counts, refused = split_conv_parts(graph)
    if counts["CausalConv1d by part"] != 1 or refused:
        raise SystemExit(f"the conv parts pass did not rewrite the subgraph: {counts}, {refused}")
    return ir.to_proto(graph)


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return contrib_ops.session(model.SerializeToString(), session_options=options, use_library=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--dtypes", default="fp32,fp16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    lines = [
        "| dtype | L | threads | convs whole + 2 Splits (ms) | by part (ms) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for dtype in args.dtypes.split(","):
        elem_type, np_type = DTYPES[dtype]
        before = mixer_conv(elem_type, np_type)
        after = by_part(before)
        for length in [int(v) for v in args.lengths.split(",")]:
            feeds = {"P": np.random.default_rng(1).standard_normal((1, length, Z + X + 2 * GN + H)).astype(np_type)}
            for threads in [int(v) for v in args.threads.split(",")]:
                sessions = {"before": session(before, threads), "after": session(after, threads)}
                outputs = {name: s.run(None, feeds) for name, s in sessions.items()}
                for a, b in zip(outputs["after"], outputs["before"], strict=True):
                    if a.tobytes() != b.tobytes():
                        raise SystemExit("the conv by part computed other bits")
                times: dict[str, list[float]] = {"before": [], "after": []}
                for _ in range(args.runs):
                    for name, s in sessions.items():
                        start = time.perf_counter()
                        s.run(None, feeds)
                        times[name].append(time.perf_counter() - start)
                before_ms, after_ms = (1e3 * statistics.median(times[n]) for n in ("before", "after"))
                ratio = before_ms / after_ms
                line = f"| {dtype} | {length} | {threads} | {before_ms:.2f} | {after_ms:.2f} | {ratio:.2f}x |"
                print(line, flush=True)
                lines.append(line)
    env = environment_line(max(int(v) for v in args.threads.split(",")))
    print(env)
    if not args.no_save:
        append_results("Prompt conv by part on the CPU (conv parts pass)", [env, "", *lines])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
