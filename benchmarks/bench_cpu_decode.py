"""Decode on the CPU: a 24-chain model (24 Mamba layers' worth), one row, fused vs unfused.

Per-Run latency (ORT_ENABLE_ALL, before and after interleaved in one process) and per-chain kernel time
from ONNX Runtime's profiler, at real widths: C = 8192 / 8 groups (Nemotron-H-8B) and C = 7680 / 8
groups, fp32 and fp16, with 1 and 2 intra-op threads.

    python -m benchmarks.bench_cpu_decode [--runs 300] [--threads 1,2] [--no-save]
"""

from __future__ import annotations

import argparse

from benchmarks._common import DECODE_SPECS, ChainSpec, append_results, chain_pair, environment_line
from fusion import report

CHAINS = 24
WIDTHS = [(8192, 1024), (7680, 960)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--no-save", action="store_true", help="print only, do not append to RESULTS.md")
    args = parser.parse_args()
    threads_list = [int(t) for t in args.threads.split(",")]
    header = (
        "| C / gs | dtype | threads | Run before (us) | Run after (us) | Run speedup | saved per chain (us) "
        "| profiled: chain kernels before (us/chain) | profiled: fused kernel (us/chain) |"
    )
    rows = [header, "|" + "---|" * 9]
    env_lines = []
    for threads in threads_list:
        env_lines.append(f"- threads={threads}: {environment_line(threads)}")
        for channels, group_size in WIDTHS:
            for dtype, fields in DECODE_SPECS.items():
                spec = ChainSpec(channels=channels, group_size=group_size, **fields)
                before, after = chain_pair(spec, CHAINS)
                result = report.measure(
                    before, after, runs=args.runs, warmup=30, threads=threads, dims={"batch": 1, "seq": 1}
                )
                b = result.before["CPUExecutionProvider"]
                a = result.after["CPUExecutionProvider"]
                per_chain_before = b.kernel_us_per_run / CHAINS
                per_chain_after = a.kernel_us_by_op.get("GatedGroupRMSNorm", float("nan")) / CHAINS
                run_before, run_after = b.latency_us["median"], a.latency_us["median"]
                row = (
                    f"| {channels} / {group_size} | {dtype} | {threads} | {run_before:.1f} | {run_after:.1f} "
                    f"| {run_before / run_after:.2f}x | {(run_before - run_after) / CHAINS:.1f} "
                    f"| {per_chain_before:.2f} | {per_chain_after:.2f} |"
                )
                rows.append(row)
                print(row, flush=True)
    lines = [
        f"{CHAINS} chains in sequence (a residual Add after each, as between layers), rows = 1, medians of "
        f"{args.runs} interleaved runs. The Run columns are the measurement; 'saved per chain' is their "
        f"difference / {CHAINS}. The profiled columns are medians of 10 runs under ONNX Runtime's profiler, "
        "which adds a fixed cost to every kernel: it inflates the 12-kernel unfused chain far more than the "
        "one fused kernel (and with 2 threads, much more), so do not read speed-ups off them.",
        *env_lines,
        "",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_save:
        append_results("CPU decode: 24-chain model, rows = 1", lines)


if __name__ == "__main__":
    main()
