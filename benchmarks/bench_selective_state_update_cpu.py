"""SelectiveStateUpdate and the Mamba-2 mixer's decode work on CPU: fused vs unfused vs ORT's contrib ops.

One process, one setup per width, every variant interleaved, at 1 and 2 intra-op threads:

- state update alone: the fused op (library registered) / the same node unfused (its model-local function,
  the stock ops of transformers' fallback in the exported types, inlined by ONNX Runtime without the
  library) / ORT's ``com.microsoft::LinearAttention(update_rule="gated")`` with the glue it needs for the
  same work (softplus, dt * x, B and C expanded to heads, the D skip; state in its (B, H, N, P) layout,
  float only) / a copy of the state's bytes (torch ``copy_`` into a preallocated tensor at the same thread
  count, and numpy ``copyto``: the faster is the reference). The op reads the state once and writes it
  once, so a same-bytes copy is what it cannot beat.
- the mixer's decode work without in_proj/out_proj: conv update, the split of xBC into x, B, C and the
  state update, as the fused ops / the exported conv spelling (Concat, Slice, Conv, Slice, Sigmoid, Mul)
  plus the state update's function body / ``CausalConvWithState`` + ``LinearAttention`` with their glue.

Outputs are bound to preallocated buffers (IO binding), so no variant pays for a copy of its results.
Targets (issue 27; reported, never asserted): state update >= 85 % of the copy's bandwidth; mixer work
>= 3x faster than unfused and no slower than ORT's two contrib ops.

Where the bytes come from decides the copy's speed: interleaved (the default), each call finds what the
other variants' calls left of its buffers in the last-level cache, a mix that the host's other jobs shift;
``--cold`` reads a buffer of twice the last-level cache before every timed call, so every variant and the
copy start from memory: a real decode step's regime, whose layers' states together are far larger than the
cache (Nemotron-H-8B: 52 Mamba layers of 4 MB in fp32).

    python -m benchmarks.bench_selective_state_update_cpu [--record] [--repeats 200] [--cold]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import torch

import contrib_ops
from benchmarks._common import append_results, environment_line
from fusion.rules import attach_functions

F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
NAMES = {F32: "fp32", F16: "fp16"}


@dataclass(frozen=True)
class Width:
    name: str
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int = 4

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.groups * self.state_size


WIDTHS = (
    # NVIDIA Nemotron-H-8B: 128 Mamba heads of 64, 8 groups, d_state 128, conv 4 (conv dim 10240).
    Width("Nemotron-H-8B", heads=128, head_dim=64, state_size=128, groups=8),
    # Zyphra Zamba2-1.2B: hidden 2048, expand 2 (64 heads of 64), 1 group, d_state 64, conv 4.
    Width("Zamba2-1.2B", heads=64, head_dim=64, state_size=64, groups=1),
)


#: The state-update row of the same op on a one-element state: a Run's cost besides the kernel's work.
FIXED_COST = "fused, one element (a Run's fixed cost)"


def _vi(name: str, elem: int, shape: list[int]) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, elem, shape)


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return oh.make_node(
        "Constant", [], [name], value=oh.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
    )


def _model(nodes, inputs, outputs, *, ms: bool = False) -> onnx.ModelProto:
    opsets = [oh.make_opsetid("", 18), oh.make_opsetid("ai.mambafuse", 1)]
    if ms:
        opsets.append(oh.make_opsetid("com.microsoft", 1))
    model = oh.make_model(oh.make_graph(nodes, "bench", inputs, outputs), opset_imports=opsets, ir_version=10)
    attach_functions(model)
    return model


def state_update_models(w: Width, t: int, batch: int) -> dict[str, onnx.ModelProto]:
    """Return {"fused"/"unfused": the one-node model, "ort": the LinearAttention form} of one state update."""
    h, p, n, g = w.heads, w.head_dim, w.state_size, w.groups
    ins = [
        _vi("state", t, [batch, h, p, n]),
        _vi("x", t, [batch, h, p]),
        _vi("dt", t, [batch, h]),
        _vi("dt_bias", t, [h]),
        _vi("A", F32, [h]),
        _vi("B", t, [batch, g, n]),
        _vi("C", t, [batch, g, n]),
        _vi("D", t, [h]),
    ]
    node = oh.make_node("SelectiveStateUpdate", [i.name for i in ins], ["out", "present_state"], domain="ai.mambafuse")
    one = _model([node], ins, [_vi("out", t, [batch, h, p]), _vi("present_state", t, [batch, h, p, n])])
    models = {"fused": one, "unfused": one}
    if t == F32:  # ORT's CPU LinearAttention is float only
        nodes = linear_attention_nodes(w, batch, "x", "dt", "B", "C", "state_t", "out", "present_state_t")
        la_ins = [i for i in ins if i.name != "state"] + [_vi("state_t", t, [batch, h, n, p])]
        models["ort"] = _model(
            nodes, la_ins, [_vi("out", t, [batch, h, p]), _vi("present_state_t", t, [batch, h, n, p])], ms=True
        )
    return models


def linear_attention_nodes(w: Width, batch: int, x: str, dt: str, b: str, c: str, state: str, out: str, present: str):
    """Return the nodes of one state update through LinearAttention(update_rule="gated"): q = C, k = B (each
    expanded to the heads), v = softplus(dt + dt_bias) x, decay = A softplus(...), then + x D."""
    h, p, n, g = w.heads, w.head_dim, w.state_size, w.groups
    nodes = [
        _const("hpn", [batch, 1, h * n]),
        _const("hp1", [batch, 1, h * p]),
        _const("bh1", [batch, 1, h]),
        _const("la_bhp", [batch, h, p]),
        _const("bghn", [batch, g, h // g, n]),
        _const("ax2", [2]),
        _const("ax1", [-1]),
        oh.make_node("Add", [dt, "dt_bias"], ["d1"]),
        oh.make_node("Softplus", ["d1"], ["d"]),
        oh.make_node("Mul", ["d", "A"], ["decay_bh"]),
        oh.make_node("Reshape", ["decay_bh", "bh1"], ["decay"]),
        oh.make_node("Unsqueeze", ["d", "ax1"], ["d3"]),
        oh.make_node("Mul", ["d3", x], ["dx"]),
        oh.make_node("Reshape", ["dx", "hp1"], ["v"]),
    ]
    for src, dst in ((b, "k"), (c, "q")):
        nodes += [
            oh.make_node("Unsqueeze", [src, "ax2"], [f"{dst}_u"]),
            oh.make_node("Expand", [f"{dst}_u", "bghn"], [f"{dst}_e"]),
            oh.make_node("Reshape", [f"{dst}_e", "hpn"], [dst]),
        ]
    nodes += [
        oh.make_node(
            "LinearAttention",
            ["q", "k", "v", state, "decay"],
            ["o", present],
            domain="com.microsoft",
            update_rule="gated",
            q_num_heads=h,
            kv_num_heads=h,
            scale=1.0,
        ),
        oh.make_node("Reshape", ["o", "la_bhp"], ["o3"]),
        oh.make_node("Unsqueeze", ["D", "ax1"], ["D2"]),
        oh.make_node("Mul", [x, "D2"], ["xD"]),
        oh.make_node("Add", ["o3", "xD"], [out]),
    ]
    return nodes


def mixer_models(w: Width, t: int, batch: int) -> dict[str, onnx.ModelProto]:
    """Return the mixer's decode work (conv update, split, state update) as fused ops, unfused, and ORT's."""
    h, p, n, g, k, cd = w.heads, w.head_dim, w.state_size, w.groups, w.conv_kernel, w.conv_dim
    conv_ins = [_vi("xBC", t, [batch, cd, 1]), _vi("weight", t, [cd, 1, k]), _vi("bias", t, [cd])]
    ssm_ins = [
        _vi("ssm_state", t, [batch, h, p, n]),
        _vi("dt", t, [batch, h]),
        _vi("dt_bias", t, [h]),
        _vi("A", F32, [h]),
        _vi("D", t, [h]),
    ]
    split = [
        _const("sizes", [w.d_inner, g * n, g * n]),
        _const("bhp", [batch, h, p]),
        _const("bgn", [batch, g, n]),
        oh.make_node("Split", ["y2", "sizes"], ["xs", "Bs", "Cs"], axis=1),
        oh.make_node("Reshape", ["xs", "bhp"], ["x"]),
        oh.make_node("Reshape", ["Bs", "bgn"], ["B"]),
        oh.make_node("Reshape", ["Cs", "bgn"], ["C"]),
    ]
    outs = [_vi("out", t, [batch, h, p]), _vi("present_state", t, [batch, h, p, n])]
    ssu = oh.make_node(
        "SelectiveStateUpdate",
        ["ssm_state", "x", "dt", "dt_bias", "A", "B", "C", "D"],
        ["out", "present_state"],
        domain="ai.mambafuse",
    )
    squeeze = [_const("ax_last", [-1]), oh.make_node("Squeeze", ["y", "ax_last"], ["y2"])]

    # transformers' conv state holds K columns.
    fused_conv = [
        oh.make_node(
            "CausalConv1dUpdate", ["xBC", "conv_state", "weight", "bias"], ["y", "present_conv"], domain="ai.mambafuse"
        )
    ]
    conv_state = _vi("conv_state", t, [batch, cd, k])
    conv_out = _vi("present_conv", t, [batch, cd, k])
    fused = _model(fused_conv + squeeze + split + [ssu], conv_ins + [conv_state] + ssm_ins, outs + [conv_out])

    # The exported spelling: Concat, Slice (present), Conv (group = C), Slice (last column), Sigmoid, Mul.
    exported_conv = [
        _const("minus_k", [-k]),
        _const("minus_1", [-1]),
        _const("big", [2**62]),
        oh.make_node("Concat", ["conv_state", "xBC"], ["window"], axis=-1),
        oh.make_node("Slice", ["window", "minus_k", "big", "ax_last"], ["present_conv"]),
        oh.make_node("Conv", ["window", "weight", "bias"], ["conv"], group=cd),
        oh.make_node("Slice", ["conv", "minus_1", "big", "ax_last"], ["v"]),
        oh.make_node("Sigmoid", ["v"], ["sig"]),
        oh.make_node("Mul", ["v", "sig"], ["y"]),
    ]
    unfused = _model(
        squeeze[:1] + exported_conv + squeeze[1:] + split + [ssu], conv_ins + [conv_state] + ssm_ins, outs + [conv_out]
    )
    models = {"fused": fused, "unfused": unfused}
    if t == F32:
        # ORT's contrib ops: CausalConvWithState (state K - 1 columns), LinearAttention (state (B, H, N, P)).
        ort_conv = [
            oh.make_node(
                "CausalConvWithState",
                ["xBC", "weight", "bias", "conv_state"],
                ["y", "present_conv"],
                domain="com.microsoft",
                activation="silu",
            )
        ]
        la_nodes = linear_attention_nodes(w, batch, "x", "dt", "B", "C", "ssm_state_t", "out", "present_state_t")
        ssm_ins_t = [i for i in ssm_ins if i.name != "ssm_state"] + [_vi("ssm_state_t", t, [batch, h, n, p])]
        models["ort"] = _model(
            ort_conv + squeeze + split + la_nodes,
            conv_ins + [_vi("conv_state", t, [batch, cd, k - 1])] + ssm_ins_t,
            [outs[0], _vi("present_state_t", t, [batch, h, n, p]), _vi("present_conv", t, [batch, cd, k - 1])],
            ms=True,
        )
    return models


def _feeds(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dtype = NP[vi.type.tensor_type.elem_type]
        if vi.name == "A":
            feeds[vi.name] = -np.exp(rng.uniform(-1, 2, shape)).astype(dtype)
        elif vi.name == "dt":
            feeds[vi.name] = (rng.standard_normal(shape) - 2).astype(dtype)
        else:
            feeds[vi.name] = (0.5 * rng.standard_normal(shape)).astype(dtype)
    return feeds


def aligned(a: np.ndarray, alignment: int = 64) -> np.ndarray:
    """Return a copy of ``a`` whose data starts at a multiple of ``alignment`` bytes, as ONNX Runtime's CPU
    allocator places its tensors (numpy's large arrays start 16 to 48 bytes past one: every 64-byte vector
    access then spans two cache lines)."""
    raw = np.empty(a.nbytes + alignment, dtype=np.uint8)
    offset = -raw.ctypes.data % alignment
    out = raw[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def bound_runner(
    model: onnx.ModelProto, threads: int, library: bool, feeds: dict[str, np.ndarray], *, align: bool = False
) -> Callable[[], None]:
    """Return a function that runs ``model`` once on ``feeds`` with inputs and outputs bound to fixed buffers
    (at 64-byte boundaries with ``align``, else where numpy puts them)."""
    place = aligned if align else (lambda a: a)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    sess = contrib_ops.session(model, session_options=options, use_library=library)
    binding = sess.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(place(value)))
    first = sess.run(None, feeds)
    for meta, value in zip(sess.get_outputs(), first, strict=True):
        binding.bind_ortvalue_output(meta.name, ort.OrtValue.ortvalue_from_numpy(place(np.empty_like(value))))
    return lambda: sess.run_with_iobinding(binding)


def copy_runners(nbytes: int, threads: int, *, align: bool = False) -> dict[str, Callable[[], None]]:
    place = aligned if align else (lambda a: a)
    src = place(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8))
    dst = place(np.empty_like(src))
    t_src, t_dst = torch.from_numpy(place(src.copy())), torch.from_numpy(place(np.empty_like(src)))

    def torch_copy() -> None:
        torch.set_num_threads(threads)
        t_dst.copy_(t_src)

    return {"copy (torch)": torch_copy, "copy (numpy)": lambda: np.copyto(dst, src)}


def cache_evictor() -> Callable[[], None]:
    """Return a function that reads twice the last-level cache's size (32 MiB where the OS does not say), which
    leaves none of the caller's earlier data in the caches."""
    try:
        llc = os.sysconf("SC_LEVEL3_CACHE_SIZE") or os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError):
        llc = 0
    buffer = np.ones(2 * max(llc, 32 << 20) // 8, dtype=np.float64)
    return lambda: float(buffer.sum())


def measure(
    runners: dict[str, Callable[[], None]], repeats: int, evict: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Interleave the runners ``repeats`` times (after a warm-up); return each one's times in microseconds.
    ``evict`` (untimed) runs before every timed call."""
    for run in runners.values():
        for _ in range(5):
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            if evict is not None:
                evict()
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cold", action="store_true", help="evict the caches before every timed call")
    parser.add_argument(
        "--numpy-buffers",
        action="store_true",
        help="bind numpy's own arrays (16 to 48 bytes past a 64-byte boundary), not 64-byte aligned copies",
    )
    parser.add_argument("--state-update-only", action="store_true", help="leave out the mixer's decode work")
    parser.add_argument("--note", action="append", default=[], help="a line for the recorded section (repeatable)")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    evict = cache_evictor() if args.cold else None
    align = not args.numpy_buffers
    lines = [*args.note, *([""] if args.note else [])]
    lines += [f"- {environment_line(t)}" for t in args.threads[:1]]
    regime = (
        "caches evicted before every timed call (--cold)"
        if args.cold
        else "interleaved, caches as the other calls leave them"
    )
    lines.append(
        f"- torch {torch.__version__}, numpy {np.__version__}, batch {args.batch}, {args.repeats} interleaved repeats, "
        f"{regime}, {'numpy' if args.numpy_buffers else '64-byte aligned'} buffers; "
        "us = microseconds per call (min / median)"
    )
    lines += [
        "",
        "| width | type | threads | work | variant | min us | median us | vs fused (median) | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines))
    rng = np.random.default_rng(0)
    for w in WIDTHS:
        for t in (F32, F16):
            ssu = state_update_models(w, t, args.batch)
            mixer = mixer_models(w, t, args.batch)
            ssu_feeds = _feeds(ssu["fused"], rng)
            mixer_feeds = _feeds(mixer["fused"], rng)
            # The same op on one element: what a Run costs besides the kernel's work (ORT's and Python's).
            one = state_update_models(Width("one element", 1, 1, 1, 1), t, 1)["fused"]
            one_feeds = _feeds(one, rng)
            state_bytes = ssu_feeds["state"].nbytes
            for threads in args.threads:
                runners = {
                    "fused": bound_runner(ssu["fused"], threads, True, ssu_feeds, align=align),
                    FIXED_COST: bound_runner(one, threads, True, one_feeds, align=align),
                    "unfused": bound_runner(ssu["unfused"], threads, False, ssu_feeds, align=align),
                }
                if "ort" in ssu:
                    la_feeds = {k: v for k, v in ssu_feeds.items() if k != "state"}
                    la_feeds["state_t"] = np.ascontiguousarray(ssu_feeds["state"].transpose(0, 1, 3, 2))
                    runners["ORT LinearAttention"] = bound_runner(ssu["ort"], threads, False, la_feeds, align=align)
                runners.update(copy_runners(state_bytes, threads, align=align))
                times = measure(runners, args.repeats, evict)
                fused_median = float(np.median(times["fused"]))
                copy_median = min(float(np.median(times[k])) for k in ("copy (torch)", "copy (numpy)"))
                copy_min = min(min(times[k]) for k in ("copy (torch)", "copy (numpy)"))
                fixed_min = min(times[FIXED_COST])
                for name, ts in times.items():
                    note = ""
                    if name == "fused":
                        gbps = 2 * state_bytes / (fused_median * 1e-6) / 1e9
                        share, share_min = copy_median / fused_median, copy_min / min(ts)
                        net = copy_min / max(min(ts) - fixed_min, 1e-9)
                        note = (
                            f"{share_min:.0%} / {share:.0%} (min / median) of the faster copy's bandwidth "
                            f"({gbps:.1f} GB/s read+write at the median); {net:.0%} at the min less a Run's "
                            "fixed cost"
                        )
                    elif name.startswith("copy"):
                        note = f"{2 * state_bytes / 1e6:.1f} MB moved"
                    row = (
                        f"| {w.name} | {NAMES[t]} | {threads} | state update | {name} | {min(ts):.0f} | "
                        f"{np.median(ts):.0f} | {np.median(ts) / fused_median:.2f}x | {note} |"
                    )
                    print(row, flush=True)
                    lines.append(row)
                if args.state_update_only:
                    continue
                runners = {
                    "fused": bound_runner(mixer["fused"], threads, True, mixer_feeds, align=align),
                    "unfused": bound_runner(mixer["unfused"], threads, False, mixer_feeds, align=align),
                }
                if "ort" in mixer:
                    ort_feeds = {k: v for k, v in mixer_feeds.items() if k != "ssm_state"}
                    ort_feeds["ssm_state_t"] = np.ascontiguousarray(mixer_feeds["ssm_state"].transpose(0, 1, 3, 2))
                    ort_feeds["conv_state"] = np.ascontiguousarray(mixer_feeds["conv_state"][:, :, 1:])
                    runners["ORT contrib ops"] = bound_runner(mixer["ort"], threads, False, ort_feeds, align=align)
                times = measure(runners, args.repeats, evict)
                fused_median = float(np.median(times["fused"]))
                for name, ts in times.items():
                    row = (
                        f"| {w.name} | {NAMES[t]} | {threads} | mixer decode | {name} | {min(ts):.0f} | "
                        f"{np.median(ts):.0f} | {np.median(ts) / fused_median:.2f}x | |"
                    )
                    print(row, flush=True)
                    lines.append(row)
    if args.record:
        append_results("Decode-step ops on CPU: SelectiveStateUpdate and the mixer's decode work (issue 27)", lines)


if __name__ == "__main__":
    main()
