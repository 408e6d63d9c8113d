"""End to end on the CPU: the prefill of a real-width Nemotron-H (models/, "real" config), before vs after.

Exports the Nemotron-H-8B-width model (hidden 4096, 128 Mamba heads x 64 = C 8192 in 8 groups, state 128, chunk
128; 3 layers: 2 Mamba-2 + 1 attention, vocab 1024, random weights) with torch's dynamo exporter as a prefill
(``input_ids`` of any length -> logits), fuses it with ``python -m fusion.rewrite`` (the gated norms and the chunked
scans: ``MambaChunkScan``), and measures both with ``fusion.report`` in one process, the Runs interleaved, on
prompts of ``--lengths`` tokens. The scan is about 1 % of the prefill's FLOPs at this width (the projections are the
rest), so the whole-model ratio is bounded by how much of the unfused prefill the exported scan's ~80 nodes take:
the table gives both the Run times and the kernel dispatches.

    python -m benchmarks.bench_e2e_nemotron_prefill [--dtypes fp32] [--threads 1,2] [--lengths 512,2048]
        [--runs 5] [--no-save]

Needs the models extra (torch, transformers) and the mambafuse library (for the fused nodes' kernels).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._common import append_results, environment_line
from fusion import report, rewrite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    from models import export

    rows = [
        "| dtype | tokens | threads | nodes before -> after | fused | Run median before (ms) | after (ms) | speed-up "
        "| max abs diff over logits |",
        "|" + "---|" * 9,
    ]
    env_lines = []
    with tempfile.TemporaryDirectory(prefix="nemotron-real-prefill-") as tmp:
        for dtype in args.dtypes.split(","):
            folder = Path(tmp) / dtype
            folder.mkdir()
            source = folder / "model.onnx"
            export.export_model("nemotron_h", "dynamo", dtype, "prefill", size="real", out=source)
            fused = folder / "model.fused.onnx"
            if rewrite.main([str(source), "-o", str(fused)]) != 0:
                raise SystemExit("the rewrite failed")
            for length in [int(n) for n in args.lengths.split(",")]:
                rng = np.random.default_rng(length)
                feeds = {"input_ids": rng.integers(0, 1024, size=(1, length)).astype(np.int64)}
                for threads in [int(t) for t in args.threads.split(",")]:
                    result = report.measure(
                        source, fused, runs=args.runs, warmup=1, threads=threads, inputs=feeds, profile_runs=1
                    )
                    b, a = result.before["CPUExecutionProvider"], result.after["CPUExecutionProvider"]
                    rows.append(
                        f"| {dtype} | {length} | {threads} | {result.before_nodes} -> {result.after_nodes} "
                        f"| {result.fused_nodes} | {b.latency_us['median'] / 1e3:.1f} "
                        f"| {a.latency_us['median'] / 1e3:.1f} "
                        f"| {b.latency_us['median'] / a.latency_us['median']:.2f}x | {result.max_abs_error:.2g} |"
                    )
                    print(rows[-1], flush=True)
                    if length == int(args.lengths.split(",")[0]) and dtype == args.dtypes.split(",")[0]:
                        env_lines.append(f"- threads={threads}: {environment_line(threads)}")
    lines = [
        "Nemotron-H at Nemotron-H-8B width (C = 8192, 8 groups, state 128, chunk 128), 3 layers (2 Mamba-2, "
        f"1 attention), vocab 1024, dynamo prefill export; medians of {args.runs} interleaved Runs.",
        *env_lines,
        "",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_save:
        append_results("CPU end to end: real-width Nemotron-H prefill", lines)


if __name__ == "__main__":
    main()
