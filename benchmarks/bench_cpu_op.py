"""The op alone on the CPU: one GatedGroupRMSNorm node in a session, [1, 7680] with group_size 960.

Median of 1000 ``Run`` calls (host wall time, Python included) next to a one-node Identity session over
the same input (the fixed cost of a Run), and the kernel's own time from ONNX Runtime's profiler.

    python -m benchmarks.bench_cpu_op [--runs 1000] [--no-save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx.helper as oh
import onnxruntime as ort

import contrib_ops
from benchmarks._common import append_results, environment_line
from fusion.report import profile_kernels
from tests._ops import FLOAT, FLOAT16, make_model, one_node_model, random_inputs

SHAPE, GROUP_SIZE = (1, 7680), 960


def timed(session: ort.InferenceSession, feeds: dict[str, np.ndarray], runs: int) -> float:
    for _ in range(50):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rows = ["| dtype | Run median (us) | Identity Run median (us) | kernel (profiler, us) |", "|---|---|---|---|"]
    for name, elem in (("fp32", FLOAT), ("fp16", FLOAT16)):
        rng = np.random.default_rng(0)
        y, z, w = random_inputs(rng, SHAPE, elem, elem, elem)
        feeds = {"y": y, "z": z, "w": w}
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        op = contrib_ops.session(
            one_node_model(elem, elem, elem, shape=list(SHAPE), group_size=GROUP_SIZE), session_options=options
        )
        graph = oh.make_graph(
            [oh.make_node("Identity", ["y"], ["out"])],
            "identity",
            [oh.make_tensor_value_info("y", elem, list(SHAPE))],
            [oh.make_tensor_value_info("out", elem, list(SHAPE))],
        )
        identity = ort.InferenceSession(
            make_model(graph).SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        run_us = timed(op, feeds, args.runs)
        identity_us = timed(identity, {"y": y}, args.runs)
        profiled = ort.SessionOptions()
        profiled.intra_op_num_threads = 1
        profiled.enable_profiling = True
        session = contrib_ops.session(
            one_node_model(elem, elem, elem, shape=list(SHAPE), group_size=GROUP_SIZE), session_options=profiled
        )
        for _ in range(args.runs + 1):
            session.run(None, feeds)
        profile = Path(session.end_profiling())
        runs = profile_kernels(json.loads(profile.read_text()))[1:]
        profile.unlink()
        kernel_us = statistics.median(run[0]["dur"] for run in runs)
        row = f"| {name} | {run_us:.1f} | {identity_us:.1f} | {kernel_us:.1f} |"
        rows.append(row)
        print(row, flush=True)
    lines = [
        f"One node, Y/Z/W {list(SHAPE)} / [{SHAPE[-1]}], group_size {GROUP_SIZE}, medians of {args.runs} runs.",
        f"- {environment_line(1)}",
        "",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_save:
        append_results("CPU: the op alone, decode row", lines)


if __name__ == "__main__":
    main()
