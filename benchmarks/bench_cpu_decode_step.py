"""One real-width Nemotron-H decode step on the CPU: unfused, norm fused, every mambafuse fusion, ``optimize``.

Exports the Nemotron-H-8B-width model (models/, "real" config: hidden 4096, 128 Mamba heads x 64 in 8 groups,
state 128, conv 4; 3 layers: 2 Mamba-2 + 1 attention; vocabulary 1024; random weights) with torch's dynamo
exporter as a decode step with its cache, and builds four variants of it in this process:

- ``unfused``: the export as it is;
- ``norm``: the gated norm fused (onnxscript's rewriter with ``fusion.rules.rewrite_rules()``);
- ``mambafuse``: ``rewrite_model`` (the gated norm, CausalConv1dUpdate, SelectiveStateUpdate);
- ``optimize``: ``optimize_model`` (onnxscript's ORT fusions, then every mambafuse fusion).

All four run with the mambafuse library registered, on the step's real inputs, interleaved (each round runs
every variant ``--runs`` times; the table gives the median of the rounds' per-Run medians), and the kernel
dispatches per Run come from ORT's profiler in a separate session.

The weight-streaming floor: a decode step at batch 1 reads every projection weight once, so it cannot beat
(bytes of weights read per step) / (the rate at which ONNX Runtime's MatMul streams a weight). Both are
measured here: the bytes from the graph (every initializer, except a Gather's table, of which one row per
token is read), the rate from a 1 x 4096 @ 4096 x 16384 float32 MatMul (256 MB, far larger than the caches)
timed in the same process at the same thread count, and numpy's copy rate beside it for reference.

    python -m benchmarks.bench_cpu_decode_step [--dtypes fp32,fp16] [--threads 1,2] [--runs 20] [--rounds 7]
        [--no-save] [--by-op]

``--by-op`` adds each variant's kernel time by op type from ORT's profiler (where a step's time goes).

Needs the models extra (torch, transformers); writes ~1.6 GB of temporary model files per dtype.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.rewriter

import contrib_ops
from benchmarks._common import append_results, environment_line
from benchmarks.bench_e2e_nemotron import decode_step_inputs
from benchmarks.bench_gpu_nemotron import weight_bytes_per_step as gpu_weight_bytes
from fusion.optimize import optimize_model
from fusion.rewrite import rewrite_model
from fusion.rules import attach_function, rewrite_rules

VARIANTS = ("unfused", "norm", "mambafuse", "optimize")


def _variants(source: Path, folder: Path) -> dict[str, Path]:
    """Write the four variants of ``source`` beside it (weights external, one data file each); return paths."""
    paths = {"unfused": source}
    norm = onnxscript.rewriter.rewrite(ir.load(source), pattern_rewrite_rules=rewrite_rules())
    attach_function(norm)
    fused, _ = rewrite_model(ir.load(source))
    optimized, report = optimize_model(ir.load(source))
    print(report.summary(), flush=True)
    for name, model in (("norm", norm), ("mambafuse", fused), ("optimize", optimized)):
        paths[name] = folder / f"{name}.onnx"
        ir.save(model, paths[name], external_data=f"{name}.onnx.data")
    return paths


def weight_bytes_per_step(path: Path) -> int:
    """Return the bytes of weights one decode step reads (bench_gpu_nemotron's count: every initializer, one
    row of each Gather table), from the graph at ``path`` without its data."""
    return gpu_weight_bytes(onnx.load(str(path), load_external_data=False))


def _session(path: Path, threads: int, profile: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if profile:
        options.enable_profiling = True
    contrib_ops.register(options)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def matmul_read_rate(threads: int, dtype: str, repeats: int = 15) -> float:
    """Return the bytes per second at which ORT's MatMul streams a 256 MB weight (batch-1 row x weight)."""
    from onnx import TensorProto, helper

    elem = TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.FLOAT
    np_type = np.float16 if dtype == "fp16" else np.float32
    k, n = 4096, 16384 if dtype == "fp32" else 32768  # 256 MB either way
    weight = np.random.default_rng(0).standard_normal((k, n)).astype(np_type)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", elem, [1, k])],
        [helper.make_tensor_value_info("y", elem, [1, n])],
        [onnx.numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones((1, k), np_type)
    session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return weight.nbytes / min(times)


def copy_rate(repeats: int = 15) -> float:
    """Return numpy's copy rate (bytes read per second) over a 256 MB buffer."""
    source = np.ones(64 << 20, np.float32)
    target = np.empty_like(source)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return source.nbytes / min(times)


def kernels_per_run(path: Path, threads: int, feeds: dict[str, np.ndarray], runs: int = 3) -> int:
    """Return the kernel dispatches of one Run, from ORT's profiler (node events inside a model_run)."""
    import json

    session = _session(path, threads, profile=True)
    for _ in range(runs):
        session.run(None, feeds)
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink(missing_ok=True)
    kernels = sum(1 for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"))
    return kernels // runs


def time_by_op_type(path: Path, threads: int, feeds: dict[str, np.ndarray], runs: int = 5) -> dict[str, float]:
    """Return the kernel time of one Run by op type in seconds, from ORT's profiler (``runs`` Runs after 2
    warm-up Runs; the node events' durations, which include the profiler's own cost per node)."""
    import json

    session = _session(path, threads, profile=True)
    for _ in range(2 + runs):
        session.run(None, feeds)
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    profile.unlink(missing_ok=True)
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-runs:]
    start = model_runs[0]["ts"]
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e.get("args", {}).get("op_name", "?")
            by_op[op] = by_op.get(op, 0.0) + e["dur"] * 1e-6 / runs
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


def time_variants(
    paths: dict[str, Path], threads: int, feeds: dict[str, np.ndarray], runs: int, rounds: int
) -> dict[str, float]:
    """Return each variant's median Run time in seconds (interleaved rounds; median of the rounds' medians)."""
    sessions = {name: _session(path, threads) for name, path in paths.items()}
    for session in sessions.values():
        for _ in range(3):
            session.run(None, feeds)
    medians: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times))
    return {name: statistics.median(values) for name, values in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32,fp16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--by-op", action="store_true", help="also each variant's kernel time by op type (profiler)")
    args = parser.parse_args()
    from models import export

    header = (
        "| dtype | threads | variant | kernels per Run | Run median (ms) | speed-up vs unfused "
        "| weight floor (ms) | x floor |"
    )
    rows = [header, "|" + "---|" * 8]
    notes = []
    with tempfile.TemporaryDirectory(prefix="decode-step-") as tmp:
        for dtype in args.dtypes.split(","):
            folder = Path(tmp) / dtype
            folder.mkdir()
            source = folder / "model.onnx"
            export.export_model("nemotron_h", "dynamo", dtype, "decode", size="real", out=source)
            paths = _variants(source, folder)
            exported = onnx.load(str(source), load_external_data=False)
            feeds = decode_step_inputs(dtype, [i.name for i in exported.graph.input])
            types = {i.name: i.type.tensor_type.elem_type for i in exported.graph.input}
            feeds = {
                name: value.astype(onnx.helper.tensor_dtype_to_np_dtype(types[name])) for name, value in feeds.items()
            }
            weights = weight_bytes_per_step(source)
            for threads in [int(t) for t in args.threads.split(",")]:
                rate = matmul_read_rate(threads, dtype)
                floor = weights / rate
                notes.append(
                    f"- {dtype}, {threads} thread(s): {weights / 1e6:.1f} MB of weights per step; ORT MatMul streams "
                    f"{rate / 1e9:.2f} GB/s -> floor {floor * 1e3:.2f} ms; numpy copy {copy_rate() / 1e9:.2f} GB/s"
                )
                print(notes[-1], flush=True)
                kernels = {name: kernels_per_run(path, threads, feeds) for name, path in paths.items()}
                if args.by_op:
                    for name, path in paths.items():
                        by_op = time_by_op_type(path, threads, feeds)
                        shown = ", ".join(f"{op} {t * 1e3:.2f}" for op, t in list(by_op.items())[:8])
                        notes.append(
                            f"- {dtype}, {threads} thread(s), {name}: kernel time by op type (ms per Run, ORT's "
                            f"profiler): all {sum(by_op.values()) * 1e3:.2f}; {shown}"
                        )
                        print(notes[-1], flush=True)
                times = time_variants(paths, threads, feeds, args.runs, args.rounds)
                for name in VARIANTS:
                    rows.append(
                        f"| {dtype} | {threads} | {name} | {kernels[name]} | {times[name] * 1e3:.3f} "
                        f"| {times['unfused'] / times[name]:.3f}x | {floor * 1e3:.2f} | {times[name] / floor:.2f} |"
                    )
                    print(rows[-1], flush=True)
    lines = [
        "Nemotron-H at Nemotron-H-8B width (hidden 4096, C = 8192 in 8 groups, 128 heads x 64, state 128), 3 layers "
        "(2 Mamba-2, 1 attention), vocab 1024, dynamo decode step with its cache, real inputs; library registered "
        f"for every variant; {args.rounds} interleaved rounds of {args.runs} Runs.",
        f"- {environment_line(1)}",
        *notes,
        "",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_save:
        append_results("CPU decode step by variant, with the weight-streaming floor", lines)


if __name__ == "__main__":
    main()
