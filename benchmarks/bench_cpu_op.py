"""The op alone on the CPU: one GatedGroupRMSNorm node in a session, [1, 7680] with group_size 960.

Median of 1000 ``Run`` calls (host wall time, Python included) next to a one-node Identity session over
the same input (the fixed cost of a Run), and the kernel's own time from ONNX Runtime's profiler.

A second table times the math core alone (contrib_ops/tests/kernel_bench.cc, built here with the
library's flags, no ONNX Runtime): one decode row per call, at every instruction-set level this CPU runs,
on ordinary values and on rows whose y values are float32 subnormals (what chains without residual Adds
decay into), the two interleaved and their ratio printed.

    python -m benchmarks.bench_cpu_op [--runs 1000] [--no-save]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx.helper as oh
import onnxruntime as ort

import contrib_ops
from benchmarks._common import append_results, environment_line
from contrib_ops.tests import golden
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


KERNEL_CASES = [
    # (label, kernel_bench arguments)
    ("fp32 C=7680 gs=960", ["--channels=7680", "--group-size=960", "--type=f32"]),
    ("fp32 C=8192 gs=1024", ["--channels=8192", "--group-size=1024", "--type=f32"]),
    ("fp16 C=7680 gs=960", ["--channels=7680", "--group-size=960", "--type=f16"]),
    ("bf16 C=7680 gs=960", ["--channels=7680", "--group-size=960", "--type=bf16"]),
]


def _isa_levels() -> list[str]:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    levels = ["baseline"]
    if {"avx2", "fma", "f16c", "bmi2"} <= flags:
        levels.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        levels.append("avx512")
    return levels


def kernel_math_table(rounds: int = 5) -> list[str]:
    """Return the rows of the math-core table: min-of-medians per decode row, normal and subnormal values."""
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    binary = Path(tempfile.mkdtemp(prefix="mambafuse_bench_")) / "kernel_bench"
    golden.compile_program(
        binary, cxx=os.environ.get("CXX", "c++"), x86_dispatch=x86, driver=golden.TESTS_DIR / "kernel_bench.cc"
    )

    def timed(isa: str, extra: list[str]) -> float:
        env = dict(os.environ, MAMBAFUSE_CPU_ISA=isa)
        out = subprocess.run([str(binary), *extra], capture_output=True, text=True, check=True, env=env).stdout
        return float(re.search(r"median ([0-9.]+) us", out).group(1))

    rows = [
        "| ISA | row | normal values (us per row) | subnormal y (us per row) | subnormal / normal |",
        "|---|---|---|---|---|",
    ]
    for isa in _isa_levels() if x86 else ["baseline"]:
        for label, extra in KERNEL_CASES:
            normal, subnormal = [], []
            for _ in range(rounds):  # interleaved: the same machine load for both
                normal.append(timed(isa, extra))
                if "--type=f32" in extra:
                    subnormal.append(timed(isa, [*extra, "--values=denormal"]))
            n = min(normal)
            if subnormal:
                d = min(subnormal)
                row = f"| {isa} | {label} | {n:.2f} | {d:.2f} | {d / n:.2f}x |"
            else:
                row = f"| {isa} | {label} | {n:.2f} | | |"
            rows.append(row)
            print(row, flush=True)
    return rows


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
        "",
        "The math core alone (contrib_ops/tests/kernel_bench.cc, one thread, data in cache as in a decode "
        "step): the lowest of 5 interleaved medians of 200 x 20 calls; subnormal: y ~ 1e-39, z ordinary.",
        "",
        *kernel_math_table(),
    ]
    print("\n".join(lines))
    if not args.no_save:
        append_results("CPU: the op alone, decode row", lines)


if __name__ == "__main__":
    main()
