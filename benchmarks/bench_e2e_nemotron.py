"""End to end on the CPU: one decode step of a real-width Nemotron-H (models/, "real" config), before vs after.

Exports the Nemotron-H-8B-width model (hidden 4096, 128 Mamba heads x 64 = C 8192 in 8 groups, 3 layers:
2 Mamba-2 + 1 attention, vocab 1024, random weights) with torch's dynamo exporter as a decode step with
its cache, fuses it with ``python -m fusion.rewrite``, and measures both with ``fusion.report`` on the
step's real inputs (the next token and the cache that ``generate()`` filled for an 8-token prompt).

    python -m benchmarks.bench_e2e_nemotron [--dtypes fp32,fp16] [--threads 1,2] [--runs 100] [--no-save]

Needs the models extra (torch, transformers); writes ~1.6 GB of temporary model files.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx

from benchmarks._common import append_results, environment_line
from fusion import report, rewrite


def decode_step_inputs(dtype: str, input_names: list[str]) -> dict[str, np.ndarray]:
    """Return the exported graph's inputs for one decode step of the seeded real-width model."""
    import torch

    from models import export
    from models.build import build_model

    model = build_model("nemotron_h", "real", dtype)
    with torch.no_grad():
        inputs = export.decode_inputs(model)
    leaves, _ = torch.utils._pytree.tree_flatten(inputs["cache"])
    cache_names = [n for n in input_names if n not in ("input_ids", "position_ids")]
    if len(cache_names) != len(leaves):
        raise SystemExit(f"{len(cache_names)} cache inputs in the graph, {len(leaves)} cache tensors")
    feeds = {"input_ids": inputs["input_ids"].numpy(), "position_ids": inputs["position_ids"].numpy()}
    feeds |= {name: leaf.detach().float().numpy() for name, leaf in zip(cache_names, leaves, strict=True)}
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32,fp16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    from models import export

    rows = [
        "| dtype | threads | nodes before -> after | dispatches per Run before -> after | Run median before (ms) "
        "| after (ms) | speed-up | max abs diff over outputs |",
        "|" + "---|" * 8,
    ]
    env_lines = []
    with tempfile.TemporaryDirectory(prefix="nemotron-real-") as tmp:
        for dtype in args.dtypes.split(","):
            folder = Path(tmp) / dtype
            folder.mkdir()
            source = folder / "model.onnx"
            record = export.export_model("nemotron_h", "dynamo", dtype, "decode", size="real", out=source)
            fused = folder / "model.fused.onnx"
            if rewrite.main([str(source), "-o", str(fused)]) != 0:
                raise SystemExit("the rewrite failed")
            exported = onnx.load(str(source), load_external_data=False)
            feeds = decode_step_inputs(dtype, [i.name for i in exported.graph.input])
            for threads in [int(t) for t in args.threads.split(",")]:
                result = report.measure(
                    source, fused, runs=args.runs, warmup=10, threads=threads, inputs=feeds, profile_runs=3
                )
                b, a = result.before["CPUExecutionProvider"], result.after["CPUExecutionProvider"]
                rows.append(
                    f"| {dtype} | {threads} | {result.before_nodes} -> {result.after_nodes} "
                    f"| {b.kernels_per_run} -> {a.kernels_per_run} | {b.latency_us['median'] / 1e3:.2f} "
                    f"| {a.latency_us['median'] / 1e3:.2f} | {b.latency_us['median'] / a.latency_us['median']:.2f}x "
                    f"| {result.max_abs_error:.2g} |"
                )
                print(rows[-1], flush=True)
                if dtype == args.dtypes.split(",")[0]:
                    env_lines.append(f"- threads={threads}: {environment_line(threads)}")
            print(f"{dtype}: {record.num_mamba_layers} Mamba layers; fused {result.fused_nodes}", flush=True)
    lines = [
        "Nemotron-H at Nemotron-H-8B width (C = 8192, 8 groups), 3 layers (2 Mamba-2, 1 attention), vocab 1024, "
        f"dynamo decode step with its cache, real inputs; medians of {args.runs} interleaved runs.",
        *env_lines,
        "",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_save:
        append_results("CPU end to end: real-width Nemotron-H decode step", lines)


if __name__ == "__main__":
    main()
