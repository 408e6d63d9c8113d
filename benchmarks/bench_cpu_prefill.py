"""Prefill on the CPU: rows 2048 x C = 8192 (8 groups), fused vs unfused, against the memory bandwidth.

Effective bandwidth = bytes of Y, Z, W read + O written, per second. The reference is a STREAM-like
pass over the same bytes in the same process with the same threads: ONNX Runtime's own Add(Y, Z) -> O
(two reads and one write of the same tensors), so both sides use ORT's thread pool alike. The chains are
measured without the Identity that names the test chain's output (``without_output_identity``): a copy of
the output that exported models do not have.

A second table sweeps the row count (1 ... 8192 rows of C = 8192): fused vs unfused at every size, to
show the fused node is never the slower one (small sizes: ORT's per-node costs; large: memory).

    python -m benchmarks.bench_cpu_prefill [--rows 2048] [--runs 30] [--threads 1,2]
        [--sweep 1,4,16,64,256,1024,2048,8192] [--no-save]
"""

from __future__ import annotations

import argparse
import statistics
import time

import onnx.helper as oh
import onnxruntime as ort

import contrib_ops
from benchmarks._common import (
    PREFILL_SPECS,
    ChainSpec,
    append_results,
    chain_pair,
    environment_line,
    without_output_identity,
)
from fusion import report

CHANNELS, GROUP_SIZE = 8192, 1024


def add_model(elem_type: int, shape: list[int]) -> bytes:
    graph = oh.make_graph(
        [oh.make_node("Add", ["y", "z"], ["out"])],
        "stream_add",
        [oh.make_tensor_value_info(n, elem_type, shape) for n in "yz"],
        [oh.make_tensor_value_info("out", elem_type, shape)],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10).SerializeToString()


def session(model: bytes, threads: int, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if threads > 1:
        # Each session has its own thread pool, whose threads spin after a Run; with the sessions called in
        # turn on a machine with no spare cores, one session's spinning threads would slow the next one's
        # Run (measured: 8x at 256 rows). No spinning for any of them keeps the comparison fair.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return contrib_ops.session(model, session_options=options, use_library=library)


def interleaved_medians(calls: dict[str, tuple[ort.InferenceSession, dict]], runs: int) -> dict[str, float]:
    """Return the median seconds per Run of each session, the sessions called in turn (same conditions)."""
    for sess, inputs in calls.values():
        sess.run(None, inputs)  # warm-up: first-run allocations
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, (sess, inputs) in calls.items():
            t0 = time.perf_counter()
            sess.run(None, inputs)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def sweep(rows_list: list[int], threads_list: list[int], runs: int) -> list[str]:
    """Return the rows of the fused-vs-unfused sweep table."""
    lines = [
        "| dtype | threads | " + " | ".join(f"{r} rows" for r in rows_list) + " |",
        "|" + "---|" * (2 + len(rows_list)),
    ]
    for threads in threads_list:
        for dtype, fields in PREFILL_SPECS.items():
            spec = ChainSpec(channels=CHANNELS, group_size=GROUP_SIZE, **fields)
            before, after = (without_output_identity(m) for m in chain_pair(spec))
            unfused = session(before.SerializeToString(), threads, library=False)
            fused = session(after.SerializeToString(), threads, library=True)
            cells = []
            for rows in rows_list:
                feeds = report.make_inputs(before, {"batch": 1, "seq": rows})
                # Enough runs for a stable median at small sizes, few at 8192 rows (~0.3 s unfused).
                n = max(5, min(runs * 20, int(runs * 2048 / rows)))
                med = interleaved_medians({"unfused": (unfused, feeds), "fused": (fused, feeds)}, n)
                cells.append(
                    f"{med['unfused'] * 1e3:.3g} / {med['fused'] * 1e3:.3g} ms = "
                    f"**{med['unfused'] / med['fused']:.2f}x**"
                )
            row = f"| {dtype} | {threads} | " + " | ".join(cells) + " |"
            lines.append(row)
            print(row, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--sweep", default="1,4,16,64,256,1024,2048,8192", help="row counts; empty: no sweep")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rows = [
        "| dtype | threads | unfused (ms) | fused (ms) | speedup | fused GB/s | ORT Add GB/s (same bytes) "
        "| fused / Add bandwidth |",
        "|" + "---|" * 8,
    ]
    env_lines = []
    for threads in [int(t) for t in args.threads.split(",")]:
        env_lines.append(f"- threads={threads}: {environment_line(threads)}")
        for dtype, fields in PREFILL_SPECS.items():
            spec = ChainSpec(channels=CHANNELS, group_size=GROUP_SIZE, **fields)
            before, after = (without_output_identity(m) for m in chain_pair(spec))
            feeds = report.make_inputs(before, {"batch": 1, "seq": args.rows})
            sessions = {
                "unfused": session(before.SerializeToString(), threads, library=False),
                "fused": session(after.SerializeToString(), threads, library=True),
            }
            # Same tensors as the op: Y and Z in their types (form B: Y f32, Z f16), one output.
            y, z = feeds["y"], feeds["z"]
            elem = oh.np_dtype_to_tensor_dtype(y.dtype)
            adds = session(add_model(elem, list(y.shape)), threads, library=False)
            add_feeds = {"y": y, "z": z.astype(y.dtype)}
            out_bytes = sessions["fused"].run(None, feeds)[0].nbytes
            op_bytes = y.nbytes + z.nbytes + CHANNELS * (2 if dtype == "fp16" else 4) + out_bytes
            add_bytes = 3 * y.nbytes
            calls = {
                "unfused": (sessions["unfused"], feeds),
                "fused": (sessions["fused"], feeds),
                "add": (adds, add_feeds),
            }
            med = interleaved_medians(calls, args.runs)
            fused_bw = op_bytes / med["fused"] / 1e9
            add_bw = add_bytes / med["add"] / 1e9
            row = (
                f"| {dtype} | {threads} | {med['unfused'] * 1e3:.2f} | {med['fused'] * 1e3:.2f} "
                f"| {med['unfused'] / med['fused']:.2f}x | {fused_bw:.1f} | {add_bw:.1f} "
                f"| {fused_bw / add_bw:.0%} |"
            )
            rows.append(row)
            print(row, flush=True)
    lines = [
        f"rows = {args.rows}, C = {CHANNELS}, group_size = {GROUP_SIZE}; exported prefill spellings "
        f"(fp32: form A, fp16: form B — y f32, gate f16, output f16); medians of {args.runs} interleaved runs.",
        *env_lines,
        "",
        *rows,
    ]
    if args.sweep:
        rows_list = [int(r) for r in args.sweep.split(",")]
        lines += [
            "",
            f"Sweep over rows (C = {CHANNELS}): unfused / fused median per Run = speed-up (> 1: fused faster).",
            "",
            *sweep(rows_list, [int(t) for t in args.threads.split(",")], args.runs),
        ]
    print("\n".join(lines))
    if not args.no_save:
        append_results(f"CPU prefill: {args.rows} x {CHANNELS}", lines)


if __name__ == "__main__":
    main()
