"""CausalConv1d on CPU (the prompt's conv): the fused op vs the exported chain vs ORT's ``CausalConvWithState``.

One process, one setup per width, the variants interleaved, at 1 and 2 intra-op threads, prompts of ``--lengths``:

- fused: ``ai.mambafuse::CausalConv1d`` with the library, channels-last (the in_proj's ``(B, L, C)`` in and out, as
  the rule writes it), a zero state of K - 1 columns;
- function: the same fused model without the library: ONNX Runtime runs the op's model-local function (what a
  fused model costs where mambafuse is not installed);
- unfused: the chain every exporter writes (Transpose, Conv with group = C and pads K - 1, Slice to L, Sigmoid, Mul,
  Transpose back);
- ORT: ``com.microsoft::CausalConvWithState(activation="silu")`` on the same work in its channels-first layout
  (``(B, C, L)`` in and out, no Transposes: it does less than the chain; float only);
- ORT, mobius form: the same node between the two Transposes a mobius build writes around it (``(B, L, C)`` in and
  out): what ``--opt-in causal_conv_with_state`` replaces with the fused node (float only);
- copy: ORT's ``Identity`` of x (one read, one write of the bytes the op must move at least), the floor.

The weight and bias are initializers, as in a model (a kernel may lay them out once); outputs are bound to
preallocated buffers (IO binding).

    python -m benchmarks.bench_causal_conv1d_cpu [--record] [--repeats 20] [--lengths 512 2048]
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import onnx.helper as oh
from onnx import numpy_helper

from benchmarks._common import append_results, environment_line
from benchmarks.bench_selective_state_update_cpu import F16, F32, NAMES, NP, WIDTHS, _const, _model, _vi, bound_runner
from benchmarks.bench_selective_state_update_cpu import measure as interleaved


def conv_models(conv_dim: int, width: int, t: int, batch: int, length: int) -> dict[str, object]:
    x = _vi("x", t, [batch, length, conv_dim])
    weight, bias = _vi("weight", t, [conv_dim, 1, width]), _vi("bias", t, [conv_dim])
    y = _vi("y", t, [batch, length, conv_dim])
    zero_state = [
        _const("state_shape", [batch, conv_dim, width - 1]),
        oh.make_node("ConstantOfShape", ["state_shape"], ["zero_state"], value=oh.make_tensor("z", t, [1], [0])),
    ]
    fused = _model(
        [
            *zero_state,
            oh.make_node(
                "CausalConv1d",
                ["x", "weight", "bias", "zero_state"],
                ["y", "final_state"],
                domain="ai.mambafuse",
                state_width=width - 1,
                channels_last=1,
            ),
        ],
        [x, weight, bias],
        [y],
    )
    exported = [
        _const("zero", [0]),
        _const("length", [length]),
        _const("axis2", [2]),
        oh.make_node("Transpose", ["x"], ["x_cf"], perm=[0, 2, 1]),
        oh.make_node("Conv", ["x_cf", "weight", "bias"], ["conv"], group=conv_dim, pads=[width - 1, width - 1]),
        oh.make_node("Slice", ["conv", "zero", "length", "axis2"], ["v"]),
        oh.make_node("Sigmoid", ["v"], ["sig"]),
        oh.make_node("Mul", ["v", "sig"], ["silu"]),
        oh.make_node("Transpose", ["silu"], ["y"], perm=[0, 2, 1]),
    ]
    models = {
        "fused": fused,
        "unfused": _model(exported, [x, weight, bias], [y]),
        "copy": _model([oh.make_node("Identity", ["x"], ["y"])], [x], [y]),
    }
    if t == F32:
        models["ORT CausalConvWithState"] = _model(
            [
                *zero_state,
                oh.make_node(
                    "CausalConvWithState",
                    ["x", "weight", "bias", "zero_state"],
                    ["y", "present_state"],
                    domain="com.microsoft",
                    activation="silu",
                ),
            ],
            [_vi("x", t, [batch, conv_dim, length]), weight, bias],
            [_vi("y", t, [batch, conv_dim, length])],
            ms=True,
        )
        models["ORT CausalConvWithState, mobius form"] = _model(
            [
                *zero_state,
                oh.make_node("Transpose", ["x"], ["x_cf"], perm=[0, 2, 1]),
                oh.make_node(
                    "CausalConvWithState",
                    ["x_cf", "weight", "bias", "zero_state"],
                    ["y_cf", "present_state"],
                    domain="com.microsoft",
                    activation="silu",
                ),
                oh.make_node("Transpose", ["y_cf"], ["y"], perm=[0, 2, 1]),
            ],
            [x, weight, bias],
            [y],
            ms=True,
        )
    return models


def weights_as_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with its graph inputs named in ``values`` other than x made initializers of those values."""
    moved = [v.name for v in model.graph.input if v.name in values and v.name != "x"]
    model.graph.initializer.extend(numpy_helper.from_array(values[name], name) for name in moved)
    kept = [v for v in model.graph.input if v.name not in moved]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    lines = [f"- {environment_line(args.threads[0])}"]
    lines.append(
        f"- batch {args.batch}, {args.repeats} interleaved repeats; ms = milliseconds per call (min / median); the "
        "copy moves x's bytes once in and once out"
    )
    lines += [
        "",
        "| width | conv dim | tokens | type | threads | variant | min ms | median ms | vs fused (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    rng = np.random.default_rng(0)
    for w in WIDTHS:
        for length in args.lengths:
            for t in (F32, F16):
                models = conv_models(w.conv_dim, w.conv_kernel, t, args.batch, length)
                x = rng.standard_normal((args.batch, length, w.conv_dim)).astype(NP[t])
                feeds = {
                    "x": x,
                    "weight": (0.3 * rng.standard_normal((w.conv_dim, 1, w.conv_kernel))).astype(NP[t]),
                    "bias": (0.1 * rng.standard_normal(w.conv_dim)).astype(NP[t]),
                }
                # the weight and bias as the models hold them: initializers (kernels may lay them out once)
                models = {name: weights_as_initializers(model, feeds) for name, model in models.items()}
                for threads in args.threads:
                    runners = {}
                    for name, model in {"fused": models["fused"], "function": models["fused"], **models}.items():
                        f = {"x": x}
                        if name == "ORT CausalConvWithState":  # its channels-first layout
                            f["x"] = np.ascontiguousarray(x.transpose(0, 2, 1))
                        runners[name] = bound_runner(model, threads, name == "fused", f)
                    times = interleaved(runners, args.repeats)
                    fused_median = float(np.median(times["fused"]))
                    for name, ts in times.items():
                        row = (
                            f"| {w.name} | {w.conv_dim} | {length} | {NAMES[t]} | {threads} | {name} "
                            f"| {min(ts) / 1e3:.3f} | {np.median(ts) / 1e3:.3f} | {np.median(ts) / fused_median:.2f}x |"
                        )
                        print(row, flush=True)
                        lines.append(row)
    if args.record:
        append_results("Prefill ops on CPU: CausalConv1d (issue 41)", lines)


if __name__ == "__main__":
    main()
