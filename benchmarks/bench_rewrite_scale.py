"""The rewriter on a full-size checkpoint's graph: wall time and peak memory at 13 / 26 / 52 layers.

Builds the Nemotron-H-8B-shaped decode graph (benchmarks/nemotron_h_8b_graph.py: real weight sizes as a
sparse external data file, tens of GB) and runs ``python -m fusion.rewrite`` on it in a child process,
measuring its wall time and peak RSS (``wait4``). Checks that every Mamba layer's chain fused and that
the output references the input's external data instead of copying it. Then, at 13 layers (fp16), loads
the fused model in ONNX Runtime with the library and runs one decode step.

    python -m benchmarks.bench_rewrite_scale [--layers 13,26,52] [--dtype fp32] [--no-save] [--no-session]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

import contrib_ops
from benchmarks._common import append_results, environment_line
from benchmarks.nemotron_h_8b_graph import PATTERN, build
from fusion import report


def run_measured(argv: list[str]) -> tuple[float, int, str]:
    """Run a child process; return (wall seconds, peak RSS in bytes, combined output)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{out}")
    return wall, usage.ru_maxrss * 1024, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="13,26,52")
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--no-session", action="store_true", help="skip the ORT load of the 13-layer model")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rows = [
        "| layers | Mamba chains | graph nodes before -> after | weights (sparse) | rewrite wall (s) | peak RSS (MB) "
        "| output data |",
        "|" + "---|" * 7,
    ]
    with tempfile.TemporaryDirectory(prefix="nh8b-", dir=os.environ.get("TMPDIR")) as tmp:
        for layers in [int(x) for x in args.layers.split(",")]:
            folder = Path(tmp) / f"l{layers}"
            model = build(layers, folder, args.dtype)
            data_size = (folder / "model.data").stat().st_size
            wall, rss, out = run_measured([sys.executable, "-m", "fusion.rewrite", str(model), "--json"])
            fused_path = folder / "model.fused.onnx"
            fused = onnx.load(str(fused_path), load_external_data=False)
            chains = PATTERN[:layers].count("M")
            fused_nodes = report.count_fused(fused)
            if fused_nodes != chains:
                raise SystemExit(f"{layers} layers: {fused_nodes} fused nodes, expected {chains}\n{out}")
            locations = {
                e.value
                for t in fused.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL
                for e in t.external_data
                if e.key == "location"
            }
            extra_files = sorted(
                p.name for p in folder.iterdir() if p.name not in {"model.onnx", "model.data", fused_path.name}
            )
            if locations != {"model.data"} or extra_files:
                raise SystemExit(f"output does not reference model.data only: {locations}, extra files {extra_files}")
            before_nodes = len(onnx.load(str(model), load_external_data=False).graph.node)
            row = (
                f"| {layers} | {chains} | {before_nodes} -> {len(fused.graph.node)} | {data_size / 1e9:.1f} GB "
                f"| {wall:.2f} | {rss / 1e6:.0f} "
                f"| references model.data ({fused_path.stat().st_size / 1e3:.0f} KB graph) |"
            )
            rows.append(row)
            print(row, flush=True)
        session_line = "ORT session check skipped (--no-session)."
        if not args.no_session:
            folder = Path(tmp) / "session"
            model = build(13, folder, "fp16")
            run_measured([sys.executable, "-m", "fusion.rewrite", str(model)])
            t0 = time.perf_counter()
            sess = contrib_ops.session(str(folder / "model.fused.onnx"))
            load_s = time.perf_counter() - t0
            feeds = report.make_inputs(onnx.load(str(folder / "model.fused.onnx"), load_external_data=False))
            t0 = time.perf_counter()
            logits = sess.run(None, feeds)[0]
            run_s = time.perf_counter() - t0
            weights = (folder / "model.data").stat().st_size
            session_line = (
                f"13 layers fp16 ({weights / 1e9:.1f} GB of weights): the fused model loads in ONNX Runtime with the "
                f"library in {load_s:.1f} s and runs a decode step in {run_s:.2f} s (logits {list(logits.shape)}, "
                f"finite: {bool(np.isfinite(logits).all())})."
            )
            print(session_line)
    lines = [
        f"Nemotron-H-8B-shaped decode graph, {args.dtype} weights as sparse external data; rewrite in a child "
        "process (wall time and peak RSS from wait4).",
        f"- {environment_line(1)}",
        "",
        *rows,
        "",
        session_line,
    ]
    if not args.no_save:
        append_results("Rewriter scale: full-size checkpoint graph", lines)


if __name__ == "__main__":
    main()
