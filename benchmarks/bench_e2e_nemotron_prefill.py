"""End to end on the CPU: the prefill of a real-width Nemotron-H (models/, "real" config), before vs after.

Exports the Nemotron-H-8B-width model (hidden 4096, 128 Mamba heads x 64 = C 8192 in 8 groups, state 128, chunk
128; 3 layers: 2 Mamba-2 + 1 attention, vocab 1024, random weights) with torch's dynamo exporter as a prefill
(``input_ids`` of any length -> logits), fuses it with ``python -m fusion.rewrite`` (the gated norms and the chunked
scans: ``MambaChunkScan``), and measures both with ``fusion.report`` in one process, the Runs interleaved, on
prompts of ``--lengths`` tokens. The scan is about 1 % of the prefill's FLOPs at this width (the projections are the
rest), so the whole-model ratio is bounded by how much of the unfused prefill the exported scan's ~80 nodes take:
the table gives both the Run times and the kernel dispatches.

    python -m benchmarks.bench_e2e_nemotron_prefill [--dtypes fp32] [--threads 1,2] [--lengths 512,2048]
        [--runs 5] [--separate] [--rounds 2] [--no-save]

``--separate`` runs each model in a process of its own (the two sessions of a 2048-token real-width prefill do not
fit together in 24 GB): per round a process for the unfused model, then one for the fused, ``--runs`` Runs each
after a warm-up, ``--rounds`` rounds; medians over all of a model's Runs. Each process also reports its peak
memory: the resident set's high-water mark during its first Run above the resident set before it (the session and
its weights excluded), and the logits are compared across the processes.

Needs the models extra (torch, transformers) and the mambafuse library (for the fused nodes' kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from benchmarks._common import append_results, environment_line, reset_peak_rss, status_kb
from fusion import report, rewrite

VOCAB = {"real": 1024, "tiny": 64}  # models/build.py's vocabularies


def _feeds(length: int, vocab: int = VOCAB["real"]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(length)
    return {"input_ids": rng.integers(0, vocab, size=(1, length)).astype(np.int64)}


def child(model: str, length: int, threads: int, runs: int, logits_path: str, vocab: int) -> None:
    """One model in this process: a warm-up Run (its peak memory measured), then ``runs`` timed Runs; prints JSON."""
    import onnxruntime as ort

    import contrib_ops

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = contrib_ops.session(model, session_options=options)
    feeds = _feeds(length, vocab)
    before = status_kb("VmRSS")
    reset_peak_rss()
    logits = session.run(None, feeds)[0]
    peak_mb = (status_kb("VmHWM") - before) / 1024
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    np.save(logits_path, logits)
    print(json.dumps({"ms": times, "peak_mb": peak_mb, "session_mb": before / 1024}))


def _in_child(model: Path, length: int, threads: int, runs: int, logits_path: Path, vocab: int) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_e2e_nemotron_prefill",
            "--child",
            str(model),
            str(length),
            str(threads),
            str(runs),
            str(logits_path),
            str(vocab),
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    if result.returncode != 0:
        raise SystemExit(f"the run of {model.name} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure_separately(source: Path, fused: Path, length: int, threads: int, runs: int, rounds: int, vocab: int) -> str:
    """A table row from each model in processes of its own, alternated ``rounds`` times."""
    results: dict[str, list[dict]] = {"before": [], "after": []}
    logits = {}
    with tempfile.TemporaryDirectory(prefix="prefill-logits-") as tmp:
        for _ in range(rounds):
            for what, model in (("before", source), ("after", fused)):
                path = Path(tmp) / f"{what}.npy"
                results[what].append(_in_child(model, length, threads, runs, path, vocab))
                logits[what] = np.load(path)
    median = {what: statistics.median(t for r in rs for t in r["ms"]) for what, rs in results.items()}
    peak = {what: max(r["peak_mb"] for r in rs) for what, rs in results.items()}
    nodes = {what: onnx.load(str(m), load_external_data=False) for what, m in (("before", source), ("after", fused))}
    diff = float(np.max(np.abs(logits["before"].astype(np.float64) - logits["after"].astype(np.float64))))
    return (
        f"| {length} | {threads} | {report.count_nodes(nodes['before'])} -> {report.count_nodes(nodes['after'])} "
        f"| {report.count_fused(nodes['after'])} | {median['before']:.1f} | {median['after']:.1f} "
        f"| {median['before'] / median['after']:.2f}x | {peak['before']:.0f} | {peak['after']:.0f} "
        f"| {peak['before'] / peak['after']:.1f}x | {diff:.2g} |"
    )


def export_and_fuse(folder: Path, dtype: str, size: str) -> tuple[Path, Path]:
    """Export the Nemotron-H prefill into ``folder`` and fuse it with ``rewrite``; return both models' paths."""
    from models import export

    folder.mkdir()
    source = folder / "model.onnx"
    export.export_model("nemotron_h", "dynamo", dtype, "prefill", size=size, out=source)
    fused = folder / "model.fused.onnx"
    if rewrite.main([str(source), "-o", str(fused)]) != 0:
        raise SystemExit("the rewrite failed")
    return source, fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--separate", action="store_true", help="each model in processes of its own (see above)")
    parser.add_argument("--rounds", type=int, default=2, help="with --separate: process pairs per row")
    parser.add_argument("--size", default="real", choices=["real", "tiny"], help="tiny: a quick check of the script")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, length, threads, runs, logits_path, vocab = args.child
        child(model, int(length), int(threads), int(runs), logits_path, int(vocab))
        return
    if args.separate:
        main_separate(args)
        return

    rows = [
        "| dtype | tokens | threads | nodes before -> after | fused | Run median before (ms) | after (ms) | speed-up "
        "| max abs diff over logits |",
        "|" + "---|" * 9,
    ]
    env_lines = []
    with tempfile.TemporaryDirectory(prefix="nemotron-real-prefill-") as tmp:
        for dtype in args.dtypes.split(","):
            source, fused = export_and_fuse(Path(tmp) / dtype, dtype, args.size)
            for length in [int(n) for n in args.lengths.split(",")]:
                feeds = _feeds(length, VOCAB[args.size])
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


def main_separate(args: argparse.Namespace) -> None:
    rows = [
        "| tokens | threads | nodes before -> after | fused | Run median before (ms) | after (ms) | speed-up "
        "| peak MB of a Run before | after | memory ratio | max abs diff over logits |",
        "|" + "---|" * 11,
    ]
    env_lines = [f"- threads={t}: {environment_line(int(t))}" for t in args.threads.split(",")]
    sections = []
    with tempfile.TemporaryDirectory(prefix="nemotron-real-prefill-") as tmp:
        for dtype in args.dtypes.split(","):
            source, fused = export_and_fuse(Path(tmp) / dtype, dtype, args.size)
            dtype_rows = list(rows)
            for length in [int(n) for n in args.lengths.split(",")]:
                for threads in [int(t) for t in args.threads.split(",")]:
                    dtype_rows.append(
                        measure_separately(source, fused, length, threads, args.runs, args.rounds, VOCAB[args.size])
                    )
                    print(f"{dtype} {dtype_rows[-1]}", flush=True)
            sections += [f"{dtype}:", "", *dtype_rows, ""]
    lines = [
        f"Nemotron-H ({args.size} width; real: C = 8192, 8 groups, state 128, chunk 128), 3 layers (2 Mamba-2, "
        f"1 attention), vocab {VOCAB[args.size]}, dynamo prefill export; each model in processes of its own, "
        f"{args.rounds} rounds of a process per model, {args.runs} Runs each after a warm-up Run; medians over "
        "the rounds' Runs. "
        "Peak MB: the resident set's high-water mark during the warm-up Run above the resident set before it "
        "(the larger of the rounds).",
        *env_lines,
        "",
        *sections,
    ]
    print("\n".join(lines))
    if not args.no_save:
        append_results("CPU end to end: real-width Nemotron-H prefill, each model in its own process", lines)


if __name__ == "__main__":
    main()
