"""What the model-local function costs: a fused model run without the library (``--no-library``) vs the original.

A fused model carries each op's model-local function, so that it runs where mambafuse is not installed
(``mambafuse genai --no-library``, Olive's evaluators, ``mambafuse report --no-library``): ONNX Runtime then
inlines the function's stock-op body. That body is the op's definition in stock ops (its rounding points as Cast
pairs, silu as ``z / (1 + exp(-z))``, the RMS as ReduceMean / Sqrt / Div), not the original graph's spelling,
so it need not run as fast as the original. This measures by how much, on whole decode steps:

- the mobius builds of ``tests/fixtures/mobius`` (cpu target, default variant: f32 and f16 of Nemotron-H,
  Zamba2 and Mamba2), fed their stored decode step (an 8-token prompt's cache, one new token);
- the torch dynamo decode exports of ``tests/fixtures/models`` (Nemotron-H and Zamba2, fp32 and fp16), fed their
  stored sample step.

Per model, three sessions in one process on the same feeds: the original, the fused model through its function
(no library registered) and the fused model with the library. ``--runs`` rounds, each running all three once
in a rotating order (interleaved: drift hits every variant alike), after ``--warmup`` rounds; one intra-op
thread by default, ORT_ENABLE_ALL. Reported: median and min per variant, the ratios of medians to the original,
and the nodes ONNX Runtime runs after its optimizations (a node is one kernel dispatch on the CPU).

    python -m benchmarks.bench_function_body [--runs 1000] [--warmup 100] [--threads 1] [--only REGEX]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import contrib_ops
from benchmarks._common import environment_line
from fusion.rewrite import load, rewrite_model, save
from models import mobius
from models import runtime as fixtures_runtime
from models.fixtures import FIXTURE_DIR

MOBIUS_BUILDS = [
    f"{checkpoint}-{dtype}-default-cpu"
    for checkpoint in ("nemotron_h-g4", "zamba2-g2", "mamba2-g4")
    for dtype in ("f32", "f16")
]
DYNAMO_EXPORTS = [
    f"{family}-dynamo-{dtype}-decode" for family in ("nemotron_h", "zamba2") for dtype in ("fp32", "fp16")
]
VARIANTS = ("original", "function", "library")


def _session(path: Path, threads: int, library: bool, optimized: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.optimized_model_filepath = str(optimized)
    return contrib_ops.session(str(path), session_options=options, use_library=library)


def _cases(work: Path) -> list[tuple[str, Path, dict[str, np.ndarray]]]:
    """Return (name, original model, decode-step feeds) of every model measured."""
    cases = []
    builds = mobius.extract_builds(work / "mobius")
    for stem in MOBIUS_BUILDS:
        record = next(r for r in mobius.load_manifest()["builds"] if r["stem"] == stem)
        refs = mobius.load_references(record["references"])
        cases.append((f"mobius {stem}", builds / stem / "model.onnx", mobius.reference_feeds(refs, "decode")))
    manifest = fixtures_runtime.load_manifest()["fixtures"]
    references = fixtures_runtime.load_references()
    for stem in DYNAMO_EXPORTS:
        record = manifest[stem]
        path = FIXTURE_DIR / record["file"]
        cases.append((f"dynamo {stem}", path, fixtures_runtime.feeds(record, references[stem])))
    return cases


def _fused(original: Path, folder: Path) -> tuple[Path, str]:
    """Write the fused model (function attached) into ``folder``; return its path and its fused ops."""
    fused, report = rewrite_model(load(original))
    output = folder / "fused.onnx"
    save(fused, output)
    ops = {"GatedGroupRMSNorm": report.fused, **{op: entry["fused"] for op, entry in report.decode.items()}}
    return output, ", ".join(f"{op} {count}" for op, count in ops.items() if count)


def _interleaved(runners: dict[str, Callable[[], object]], runs: int, warmup: int) -> dict[str, list[float]]:
    """Return each runner's times (us) over ``runs`` rounds, every round running each once in a rotated order."""
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(runs):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runners[name]()
            times[name].append((time.perf_counter() - start) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="interleaved rounds (default 1000)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed rounds first (default 100)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--only", help="regex on the model name (e.g. 'mobius.*f32')")
    args = parser.parse_args()

    print(environment_line(args.threads))
    print(
        f"{args.runs} interleaved rounds after {args.warmup}; medians (min) in us; ratios of medians (of mins) to "
        "the original's; nodes = nodes ONNX Runtime runs after its optimizations (original / function / library)"
    )
    header = (
        "| model | fused ops | original | function body | library | function / original | library / original | nodes |"
    )
    print(header)
    print("|" + "---|" * 8)
    with tempfile.TemporaryDirectory(prefix="bench-function-body-") as tmp:
        work = Path(tmp)
        for index, (name, original, feeds) in enumerate(_cases(work)):
            if args.only and not re.search(args.only, name):
                continue
            folder = work / f"case{index}"
            folder.mkdir()
            fused, ops = _fused(original, folder)
            paths = {"original": original, "function": fused, "library": fused}
            sessions, nodes = {}, {}
            for variant in VARIANTS:
                optimized = folder / f"{variant}.optimized.onnx"
                sessions[variant] = _session(paths[variant], args.threads, variant == "library", optimized)
                nodes[variant] = len(onnx.load(str(optimized), load_external_data=False).graph.node)
                os.unlink(optimized)
            outputs = [o.name for o in sessions["original"].get_outputs()]
            runners = {v: functools.partial(sessions[v].run, outputs, feeds) for v in VARIANTS}
            times = _interleaved(runners, args.runs, args.warmup)
            median = {v: statistics.median(times[v]) for v in VARIANTS}
            least = {v: min(times[v]) for v in VARIANTS}
            cells = [f"{median[v]:.1f} ({least[v]:.1f})" for v in VARIANTS]
            ratios = [
                f"{median[v] / median['original']:.2f}x ({least[v] / least['original']:.2f}x)"
                for v in ("function", "library")
            ]
            print(
                f"| {name} | {ops} | {' | '.join(cells)} | {' | '.join(ratios)} "
                f"| {nodes['original']} / {nodes['function']} / {nodes['library']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
