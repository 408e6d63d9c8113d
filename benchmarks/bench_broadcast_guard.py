"""What the broadcast guard costs: a prefill chain whose y width the graph does not prove.

Dynamo's dynamic-sequence exports write y's width as an unevaluated expression of the sequence length;
the rewriter then feeds the fused node ``Expand(y, Shape(z))`` (exact for a width of 1 or C, see
fusion/rules/gated_group_rms_norm.py). This measures, in one process and interleaved, the same chain
three ways on the CPU provider: unfused, fused with the guard, and fused where the width is proven (no
guard). Reported: medians, spread and the ratios.

    python -m benchmarks.bench_broadcast_guard [--rows 2048] [--channels 8192] [--threads 1] [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort

import contrib_ops
from benchmarks._common import ChainSpec, append_results, environment_line
from fusion._chains import build_chain, chain_inputs
from fusion.rewrite import rewrite_model


def _unproven_width(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return ``model`` with y's declared width replaced by a symbol (as dynamo's expressions are)."""
    y = next(v for v in model.graph.input if v.name == "y")
    y.type.tensor_type.shape.dim[-1].ClearField("dim_value")
    y.type.tensor_type.shape.dim[-1].dim_param = "width_expression"
    del model.graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--channels", type=int, default=8192)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()

    spec = ChainSpec(
        channels=args.channels, group_size=args.channels // args.groups, leading=(1, "seq"), shape_as="dynamic"
    )
    original = build_chain(spec)
    guarded, report = rewrite_model(_unproven_width(build_chain(spec)))
    proven, _ = rewrite_model(original)
    if report.fused != 1 or not any(n.op_type == "Expand" for n in guarded.graph.node):
        raise SystemExit("setup: the unproven-width chain was not fused with its guard")
    feeds = chain_inputs(spec, leading=(1, args.rows))
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    sessions = {
        "unfused": contrib_ops.session(original, session_options=options, use_library=False),
        "fused, width proven": contrib_ops.session(proven, session_options=options, use_library=True),
        "fused, broadcast guard": contrib_ops.session(guarded, session_options=options, use_library=True),
    }
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(3):
        for session in sessions.values():
            session.run(None, feeds)
    for _ in range(args.runs):  # interleaved, so drift and load hit every variant alike
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(values) for name, values in times.items()}
    lines = [
        environment_line(args.threads),
        "",
        f"{args.rows} x {args.channels} fp32, {args.groups} groups, {args.runs} interleaved runs",
        "",
        "| variant | median ms | min–max ms | vs unfused |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        ratio = medians["unfused"] / medians[name]
        lines.append(f"| {name} | {medians[name]:.2f} | {min(values):.2f}–{max(values):.2f} | {ratio:.2f}x |")
    guard_cost = medians["fused, broadcast guard"] / medians["fused, width proven"]
    lines += ["", f"guard / proven: {guard_cost:.2f}x"]
    print("\n".join(lines))
    np.testing.assert_allclose(  # the three compute the same thing
        sessions["fused, broadcast guard"].run(None, feeds)[0],
        sessions["unfused"].run(None, feeds)[0],
        rtol=1e-4,
        atol=1e-5,
    )
    if args.write:
        append_results("The broadcast guard of unproven widths (CPU, prefill)", lines)


if __name__ == "__main__":
    main()
