"""CausalConv1dUpdate on CPU: the fused op vs the exported spelling vs ORT's ``CausalConvWithState``.

One process, one setup per width, the variants interleaved, at 1 and 2 intra-op threads, decode (L = 1):

- fused: ``ai.mambafuse::CausalConv1dUpdate`` with the library, state of K columns (transformers' cache);
- unfused: the exported spelling (Concat, Slice for the present state, Conv with group = C, Slice of the last
  column, Sigmoid, Mul), the same state;
- ORT: ``com.microsoft::CausalConvWithState(activation="silu")``, state of K - 1 columns (float only).

Outputs are bound to preallocated buffers (IO binding). The state moved per call is small (Nemotron-H-8B:
10240 x 4 floats, 160 KB), so per-call overheads weigh.

    python -m benchmarks.bench_causal_conv1d_update_cpu [--record] [--repeats 300]
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx.helper as oh
import torch

from benchmarks._common import append_results, environment_line
from benchmarks.bench_selective_state_update_cpu import (
    F16,
    F32,
    NAMES,
    NP,
    WIDTHS,
    _const,
    _model,
    _vi,
    bound_runner,
    measure,
)


def conv_models(conv_dim: int, width: int, t: int, batch: int) -> dict[str, object]:
    ins = [_vi("x", t, [batch, conv_dim, 1]), _vi("weight", t, [conv_dim, 1, width]), _vi("bias", t, [conv_dim])]
    state = _vi("conv_state", t, [batch, conv_dim, width])
    outs = [_vi("y", t, [batch, conv_dim, 1]), _vi("present_state", t, [batch, conv_dim, width])]
    fused = _model(
        [
            oh.make_node(
                "CausalConv1dUpdate",
                ["x", "conv_state", "weight", "bias"],
                ["y", "present_state"],
                domain="ai.mambafuse",
            )
        ],
        ins + [state],
        outs,
    )
    exported = [
        _const("ax_last", [-1]),
        _const("minus_k", [-width]),
        _const("minus_1", [-1]),
        _const("big", [2**62]),
        oh.make_node("Concat", ["conv_state", "x"], ["window"], axis=-1),
        oh.make_node("Slice", ["window", "minus_k", "big", "ax_last"], ["present_state"]),
        oh.make_node("Conv", ["window", "weight", "bias"], ["conv"], group=conv_dim),
        oh.make_node("Slice", ["conv", "minus_1", "big", "ax_last"], ["v"]),
        oh.make_node("Sigmoid", ["v"], ["sig"]),
        oh.make_node("Mul", ["v", "sig"], ["y"]),
    ]
    models = {"fused": fused, "unfused": _model(exported, ins + [state], outs)}
    if t == F32:
        models["ORT CausalConvWithState"] = _model(
            [
                oh.make_node(
                    "CausalConvWithState",
                    ["x", "weight", "bias", "conv_state"],
                    ["y", "present_state"],
                    domain="com.microsoft",
                    activation="silu",
                )
            ],
            ins + [_vi("conv_state", t, [batch, conv_dim, width - 1])],
            [outs[0], _vi("present_state", t, [batch, conv_dim, width - 1])],
            ms=True,
        )
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    lines = [f"- {environment_line(args.threads[0])}"]
    lines.append(
        f"- torch {torch.__version__}, numpy {np.__version__}, batch {args.batch}, L = 1, "
        f"{args.repeats} interleaved repeats; us = microseconds per call (min / median)"
    )
    lines += [
        "",
        "| width | conv dim | type | threads | variant | min us | median us | vs fused (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    rng = np.random.default_rng(0)
    for w in WIDTHS:
        for t in (F32, F16):
            models = conv_models(w.conv_dim, w.conv_kernel, t, args.batch)
            feeds = {
                "x": rng.standard_normal((args.batch, w.conv_dim, 1)).astype(NP[t]),
                "weight": (0.3 * rng.standard_normal((w.conv_dim, 1, w.conv_kernel))).astype(NP[t]),
                "bias": (0.1 * rng.standard_normal(w.conv_dim)).astype(NP[t]),
                "conv_state": rng.standard_normal((args.batch, w.conv_dim, w.conv_kernel)).astype(NP[t]),
            }
            for threads in args.threads:
                runners = {}
                for name, model in models.items():
                    f = dict(feeds)
                    if name.startswith("ORT"):
                        f["conv_state"] = np.ascontiguousarray(feeds["conv_state"][:, :, 1:])
                    runners[name] = bound_runner(model, threads, name == "fused", f)
                times = measure(runners, args.repeats)
                fused_median = float(np.median(times["fused"]))
                for name, ts in times.items():
                    row = (
                        f"| {w.name} | {w.conv_dim} | {NAMES[t]} | {threads} | {name} | {min(ts):.1f} | "
                        f"{np.median(ts):.1f} | {np.median(ts) / fused_median:.2f}x |"
                    )
                    print(row, flush=True)
                    lines.append(row)
    if args.record:
        append_results("Decode-step ops on CPU: CausalConv1dUpdate (issue 27)", lines)


if __name__ == "__main__":
    main()
