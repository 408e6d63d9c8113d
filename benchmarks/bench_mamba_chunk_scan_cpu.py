"""MambaChunkScan on CPU: the kernel vs the op's function body vs the exported chunked scan, and ORT's MatMul rate.

One process, one setup per (width, type, prompt length), the variants interleaved, at 1 and 2 intra-op threads:

- fused: the one-node model with the library registered (the kernel; its chunk size, or each of ``--chunk-sizes``
  through MAMBAFUSE_CHUNK_SCAN_CHUNK, which the kernel reads per call);
- function body: the same node without the library, so ONNX Runtime inlines the op's model-local function
  (fusion/function/mamba_chunk_scan.py, a token-by-token Scan); seconds a call, so timed after one warm-up
  ``--function-repeats`` times on its own, up to ``--function-max-length`` tokens;
- exported: transformers' own torch fallback ``mamba2_chunk_scan`` (the function every Mamba-2 prefill export
  traces) exported with ``torch.onnx.export(dynamo=True, optimize=True)`` at the model's chunk size
  (Nemotron-H-8B 128, Zamba2-2.7B 256: their configs) and run in ONNX Runtime;
- ORT LinearAttention: ``com.microsoft::LinearAttention(update_rule="gated")``, the node mobius builds run the
  scan as (one node, float only), on the same work in its own form: q = C and k = B repeated to the heads
  (B, T, H N), v = u = x d (B, T, H P), decay = a = A d (B, T, H), all computed beforehand at the op's rounding
  points, and the zero state in its (B, H, N, P) layout. It does less than the kernel (no softplus, no x d, no group
  repeat, no D skip). Before timing, a small case checks that it and the kernel compute the same outputs within the
  op's budget (``linear_attention_check``); the column is left out where that fails;
- fused, LA layout: what fusion/rules/linear_attention_scan.py writes in place of that node: the kernel on x, the
  time step d (``dt_softplus=0``), A, B, C and the (B, H, N, P) state as it is (``state_layout=1``); with
  ``--lengths 1`` this is a decode step (T = 1) against LinearAttention's;
- fused, Transposes: the same between a Transpose of the state in and of the final state back (the rule's form
  before ``state_layout``), for comparison;
- ORT MatMul: one float32 MatMul [M, 256] x [256, 256] of the same nominal FLOP count as the kernel's work,
  2 T (G Q N + H Q P + 2 H N P) at the kernel's chunk size Q, so the kernel's arithmetic rate reads as a share
  of ORT's (MLAS's) GEMM rate on this CPU (target >= 50 %). The count is the SSD algorithm's with the full
  Q x Q intra-chunk product; the kernel computes only its causal half, so the share is a conservative one.

Inputs and outputs are bound to fixed buffers (IO binding). Peak memory (``--memory``): each variant in a fresh
process, the resident set's high-water mark during one Run above the resident set before it (VmHWM reset through
/proc/self/clear_refs): what the Run allocates (ORT's arena, the outputs) beyond the inputs and the session.

    python -m benchmarks.bench_mamba_chunk_scan_cpu [--lengths 512 2048] [--threads 1 2] [--memory] [--record]
    python -m benchmarks.bench_mamba_chunk_scan_cpu --types fp32 --lengths 1 --no-export --function-max-length 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh

from benchmarks._common import append_results, environment_line, reset_peak_rss, status_kb
from benchmarks.bench_selective_state_update_cpu import bound_runner, measure

F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
NP = {F32: np.float32, F16: np.float16}
TYPE_NAMES = {F32: "fp32", F16: "fp16"}
DOMAIN = "ai.mambafuse"
CHUNK_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CHUNK"
#: The kernel's default chunk size (contrib_ops/cpu/mamba_chunk_scan_impl.h).
KERNEL_CHUNK = 64
#: The MatMul's K and N: a shape at which MLAS runs at its full rate.
MATMUL_WIDTH = 256


@dataclass(frozen=True)
class Width:
    name: str
    heads: int
    head_dim: int
    groups: int
    state_size: int
    model_chunk: int  # the config's chunk_size: what the export traces

    def flops(self, length: int, chunk: int) -> int:
        """The SSD algorithm's nominal FLOP count at chunk size ``chunk``: C Bᵀ per group, the intra-chunk
        product, the readout of the carried state and the chunk state per head."""
        g, h, p, n = self.groups, self.heads, self.head_dim, self.state_size
        return 2 * length * (g * chunk * n + h * chunk * p + 2 * h * n * p)


WIDTHS = {
    # NVIDIA Nemotron-H-8B-Base-8K: 128 Mamba heads of 64, 8 groups, d_state 128, chunk_size 128.
    "Nemotron-H-8B": Width("Nemotron-H-8B", heads=128, head_dim=64, groups=8, state_size=128, model_chunk=128),
    # Zyphra Zamba2-2.7B: 80 Mamba heads of 64, 1 group, d_state 64, chunk_size 256.
    "Zamba2-2.7B": Width("Zamba2-2.7B", heads=80, head_dim=64, groups=1, state_size=64, model_chunk=256),
    # state-spaces/mamba2-130m: 24 heads of 64, 1 group, d_state 128, chunk_size 256 (the smallest Mamba-2).
    "Mamba2-130M": Width("Mamba2-130M", heads=24, head_dim=64, groups=1, state_size=128, model_chunk=256),
}
NAMES = ("x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state")


def _vi(name: str, elem: int, shape: list[int]) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, elem, shape)


def _input_infos(w: Width, t: int, length: int) -> list[onnx.ValueInfoProto]:
    h, p, g, n = w.heads, w.head_dim, w.groups, w.state_size
    return [
        _vi("x", t, [1, length, h, p]),
        _vi("dt", t, [1, length, h]),
        _vi("dt_bias", t, [h]),
        _vi("A", F32, [h]),
        _vi("B", t, [1, length, g, n]),
        _vi("C", t, [1, length, g, n]),
        _vi("D", F32, [h]),
        _vi("initial_state", F32, [1, h, p, n]),
    ]


def _outputs(w: Width, length: int) -> list[onnx.ValueInfoProto]:
    return [
        _vi("out", F32, [1, length, w.heads, w.head_dim]),
        _vi("final_state", F32, [1, w.heads, w.head_dim, w.state_size]),
    ]


def op_model(w: Width, t: int, length: int, *, with_function: bool) -> onnx.ModelProto:
    """The one-node model: without the initial state (a prompt with no cache) for the kernel; the function body
    takes every input (zeros for the state)."""
    from fusion.function.mamba_chunk_scan import make_function

    infos = _input_infos(w, t, length)
    if not with_function:
        infos = infos[:-1]
    node = oh.make_node("MambaChunkScan", [i.name for i in infos], ["out", "final_state"], domain=DOMAIN)
    graph = oh.make_graph([node], "chunk_scan", infos, _outputs(w, length))
    return oh.make_model(
        graph,
        opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)],
        ir_version=10,
        functions=[make_function(18)] if with_function else [],
    )


def linear_attention_model(w: Width, length: int) -> onnx.ModelProto:
    """ORT's ``LinearAttention(update_rule="gated")`` on the scan's work (float only): q = C and k = B repeated to
    the heads, v = x d, decay = A d, the state (B, H, N, P)."""
    h, p, n = w.heads, w.head_dim, w.state_size
    node = oh.make_node(
        "LinearAttention",
        ["q", "k", "v", "past_state", "decay"],
        ["o", "present_state"],
        domain="com.microsoft",
        update_rule="gated",
        q_num_heads=h,
        kv_num_heads=h,
        scale=1.0,
    )
    infos = [
        _vi("q", F32, [1, length, h * n]),
        _vi("k", F32, [1, length, h * n]),
        _vi("v", F32, [1, length, h * p]),
        _vi("past_state", F32, [1, h, n, p]),
        _vi("decay", F32, [1, length, h]),
    ]
    outputs = [_vi("o", F32, [1, length, h * p]), _vi("present_state", F32, [1, h, n, p])]
    graph = oh.make_graph([node], "linear_attention", infos, outputs)
    return oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("com.microsoft", 1)], ir_version=10
    )


def linear_attention_feeds(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """LinearAttention's inputs for the op's ``feeds`` (float32): the contract's d, a and u, B and C repeated to the
    heads, the initial state transposed to (B, H, N, P)."""
    from fusion.reference.mamba_chunk_scan import discretize

    x = feeds["x"]
    batch, length, heads, head_dim = x.shape
    _, a, u = discretize(x, feeds["dt"], feeds["dt_bias"], feeds["A"])

    def by_head(value: np.ndarray) -> np.ndarray:
        return np.repeat(value, heads // value.shape[2], axis=2).reshape(batch, length, -1)

    return {
        "q": by_head(feeds["C"]),
        "k": by_head(feeds["B"]),
        "v": u.reshape(batch, length, heads * head_dim),
        "past_state": np.ascontiguousarray(feeds["initial_state"].transpose(0, 1, 3, 2)),
        "decay": a,
    }


def la_layout_model(w: Width, length: int, *, transposes: bool = False) -> onnx.ModelProto:
    """The kernel where linear_attention_scan.py puts it: MambaChunkScan on the time step d (no softplus, no bias, no
    D) and the (B, H, N, P) state as it is (``state_layout=1``), or (``transposes``) between a Transpose of the state
    in and of the final state back (float only)."""
    h, p, g, n = w.heads, w.head_dim, w.groups, w.state_size
    scan_inputs = ["x", "d", "", "A", "B", "C", ""]
    if transposes:
        nodes = [
            oh.make_node("Transpose", ["past_state"], ["initial_state"], perm=[0, 1, 3, 2]),
            oh.make_node(
                "MambaChunkScan", [*scan_inputs, "initial_state"], ["out", "final_state"], domain=DOMAIN, dt_softplus=0
            ),
            oh.make_node("Transpose", ["final_state"], ["present_state"], perm=[0, 1, 3, 2]),
        ]
    else:
        nodes = [
            oh.make_node(
                "MambaChunkScan",
                [*scan_inputs, "past_state"],
                ["out", "present_state"],
                domain=DOMAIN,
                dt_softplus=0,
                state_layout=1,
            )
        ]
    infos = [
        _vi("x", F32, [1, length, h, p]),
        _vi("d", F32, [1, length, h]),
        _vi("A", F32, [h]),
        _vi("B", F32, [1, length, g, n]),
        _vi("C", F32, [1, length, g, n]),
        _vi("past_state", F32, [1, h, n, p]),
    ]
    outputs = [_vi("out", F32, [1, length, h, p]), _vi("present_state", F32, [1, h, n, p])]
    graph = oh.make_graph(nodes, "la_layout", infos, outputs)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)], ir_version=10)


def la_layout_feeds(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from fusion.reference.mamba_chunk_scan import discretize

    d, _, _ = discretize(feeds["x"], feeds["dt"], feeds["dt_bias"], feeds["A"])
    return {
        "x": feeds["x"],
        "d": d,
        "A": feeds["A"],
        "B": feeds["B"],
        "C": feeds["C"],
        "past_state": np.ascontiguousarray(feeds["initial_state"].transpose(0, 1, 3, 2)),
    }


def linear_attention_check() -> str:
    """Return "" where ORT's LinearAttention and the kernel (in LA's layout) both meet the op's budget on a small
    case with an initial state, 2 groups of 4 heads and 150 tokens; else what failed."""
    import contrib_ops
    from fusion.reference.mamba_chunk_scan import budget_report

    w = Width("check", heads=8, head_dim=16, groups=2, state_size=8, model_chunk=64)
    length = 150
    feeds = make_feeds(w, F32, length)
    feeds["initial_state"] = np.random.default_rng(2).standard_normal(feeds["initial_state"].shape).astype(np.float32)
    x, D = feeds["x"], feeds["D"]
    args = (x, feeds["dt"], feeds["dt_bias"], feeds["A"], feeds["B"], feeds["C"], D, feeds["initial_state"])
    failures = []
    la = contrib_ops.session(linear_attention_model(w, length), use_library=False)
    o, present = la.run(None, linear_attention_feeds(feeds))
    out = o.reshape(x.shape) + D[None, None, :, None] * x
    ok, summary = budget_report(out, present.transpose(0, 1, 3, 2), *args)
    if not ok:
        failures.append(f"LinearAttention: {summary}")
    for name, transposes in (("fused, LA layout", False), ("fused, Transposes", True)):
        fused = contrib_ops.session(la_layout_model(w, length, transposes=transposes), use_library=True)
        out, present = fused.run(None, la_layout_feeds(feeds))
        ok, summary = budget_report(out + D[None, None, :, None] * x, present.transpose(0, 1, 3, 2), *args)
        if not ok:
            failures.append(f"{name}: {summary}")
    return "; ".join(failures)


def exported_model(w: Width, t: int, length: int, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """transformers' mamba2_chunk_scan at the model's chunk size, through torch.onnx.export(dynamo=True,
    optimize=True), inputs named as the op's."""
    import torch
    from transformers.models.mamba2 import modeling_mamba2

    scan = getattr(modeling_mamba2.mamba2_chunk_scan, "__wrapped__", modeling_mamba2.mamba2_chunk_scan)

    class ChunkScan(torch.nn.Module):
        def forward(self, x, dt, dt_bias, A, B, C, D):  # noqa: N803 (the op's names)
            return scan(x, dt, A, B, C, w.model_chunk, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True)

    names = NAMES[:-1]
    args = tuple(torch.from_numpy(feeds[n]) for n in names)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exported.onnx"
        torch.onnx.export(
            ChunkScan(),
            args,
            str(path),
            dynamo=True,
            optimize=True,
            input_names=list(names),
            output_names=["out", "final_state"],
            external_data=False,
        )
        model = onnx.load(str(path))
    return model


def matmul_model(rows: int) -> onnx.ModelProto:
    node = oh.make_node("MatMul", ["a", "b"], ["c"])
    graph = oh.make_graph(
        [node],
        "matmul",
        [_vi("a", F32, [rows, MATMUL_WIDTH]), _vi("b", F32, [MATMUL_WIDTH, MATMUL_WIDTH])],
        [_vi("c", F32, [rows, MATMUL_WIDTH])],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def make_feeds(w: Width, t: int, length: int) -> dict[str, np.ndarray]:
    """Seeded inputs with a prompt's magnitudes (dt in softplus' range, A < 0)."""
    rng = np.random.default_rng(0)
    h, p, g, n = w.heads, w.head_dim, w.groups, w.state_size
    dtype = NP[t]
    return {
        "x": rng.standard_normal((1, length, h, p)).astype(dtype),
        "dt": (rng.standard_normal((1, length, h)) - 2).astype(dtype),
        "dt_bias": rng.standard_normal(h).astype(dtype),
        "A": -np.exp(rng.uniform(-1, 2, h)).astype(np.float32),
        "B": rng.standard_normal((1, length, g, n)).astype(dtype),
        "C": rng.standard_normal((1, length, g, n)).astype(dtype),
        "D": rng.standard_normal(h).astype(np.float32),
        "initial_state": np.zeros((1, h, p, n), np.float32),
    }


def feeds_for(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    wanted = {i.name for i in model.graph.input}
    return {k: v for k, v in feeds.items() if k in wanted}


def with_chunk(run: Callable[[], None], chunk: int | None) -> Callable[[], None]:
    """``run`` with the kernel's chunk size set to ``chunk`` (None: the kernel's own) for the call."""

    def call() -> None:
        if chunk is None:
            os.environ.pop(CHUNK_VARIABLE, None)
        else:
            os.environ[CHUNK_VARIABLE] = str(chunk)
        try:
            run()
        finally:
            os.environ.pop(CHUNK_VARIABLE, None)

    return call


def peak_memory_mb(model: onnx.ModelProto, feeds: dict[str, np.ndarray], threads: int, library: bool) -> float:
    """Run ``model`` once in a fresh process; return the resident set's high-water mark during the Run above the
    resident set before it, in MB."""
    with tempfile.TemporaryDirectory() as tmp:
        model_path, feeds_path = Path(tmp) / "model.onnx", Path(tmp) / "feeds.npz"
        onnx.save(model, str(model_path))
        np.savez(feeds_path, **feeds)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_mamba_chunk_scan_cpu",
                "--memory-child",
                str(model_path),
                str(feeds_path),
                str(threads),
                "1" if library else "0",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_mb"]


def memory_child(model_path: str, feeds_path: str, threads: int, library: bool) -> None:
    import onnxruntime as ort

    import contrib_ops

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    sess = contrib_ops.session(model_path, session_options=options, use_library=library)
    feeds = dict(np.load(feeds_path))
    before = status_kb("VmRSS")
    reset_peak_rss()
    sess.run(None, feeds)
    print(json.dumps({"peak_mb": (status_kb("VmHWM") - before) / 1024}))


def _ms(value: float) -> str:
    """Milliseconds with a tenth's resolution, or three decimals below 10 ms (a decode step's)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    parser.add_argument("--types", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunk-sizes", type=int, nargs="*", default=[], help="also time the kernel at these")
    parser.add_argument("--function-max-length", type=int, default=2048, help="longest prompt timed for the body")
    parser.add_argument("--function-repeats", type=int, default=1)
    parser.add_argument("--no-export", action="store_true", help="leave out the exported chunked scan")
    parser.add_argument(
        "--no-linear-attention", action="store_true", help="leave out ORT's LinearAttention and the LA-layout kernel"
    )
    parser.add_argument("--memory", action="store_true", help="measure each variant's peak memory (subprocesses)")
    parser.add_argument("--note", action="append", default=[], help="a line for the recorded section (repeatable)")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        model_path, feeds_path, threads, library = args.memory_child
        memory_child(model_path, feeds_path, int(threads), library == "1")
        return

    import torch

    lines = [*args.note, *([""] if args.note else [])]
    lines += [f"- {environment_line(t)}" for t in args.threads[:1]]
    la_failure = "" if args.no_linear_attention else linear_attention_check()
    if not args.no_linear_attention:
        lines.append(
            "- ORT LinearAttention: "
            + (
                f"left out, it does not compute the op's outputs within the budget: {la_failure}"
                if la_failure
                else "it and the kernel in its layout meet the op's budget on a check case (150 tokens, 8 heads in "
                "2 groups, an initial state)"
            )
        )
    lines.append(
        f"- torch {torch.__version__}, batch 1, {args.repeats} interleaved repeats ({args.function_repeats} for the "
        f"function body, timed up to {args.function_max_length} tokens); ms = milliseconds per call (min / median); "
        f"the kernel's chunk size {KERNEL_CHUNK}; GFLOP/s at the nominal count 2T(GQN + HQP + 2HNP), Q = "
        f"{KERNEL_CHUNK}; peak MB: a Run's resident-set high-water mark above the resident set before it"
    )
    lines += [
        "",
        "| width | type | T | threads | variant | min ms | median ms | vs fused (median) | GFLOP/s | peak MB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for width_name in args.widths:
        w = WIDTHS[width_name]
        for type_name in args.types:
            t = F32 if type_name == "fp32" else F16
            for length in args.lengths:
                feeds = make_feeds(w, t, length)
                flops = w.flops(length, KERNEL_CHUNK)
                models: dict[str, tuple[onnx.ModelProto, bool]] = {
                    "fused": (op_model(w, t, length, with_function=False), True)
                }
                export_note = ""
                with_la = t == F32 and not args.no_linear_attention and not la_failure
                if with_la:  # ORT's CPU LinearAttention is float only
                    models["fused, LA layout"] = (la_layout_model(w, length), True)
                    models["fused, Transposes"] = (la_layout_model(w, length, transposes=True), True)
                    models["ORT LinearAttention"] = (linear_attention_model(w, length), False)
                la_feeds = {
                    "fused, LA layout": la_layout_feeds(feeds) if with_la else {},
                    "fused, Transposes": la_layout_feeds(feeds) if with_la else {},
                    "ORT LinearAttention": linear_attention_feeds(feeds) if with_la else {},
                }
                if not args.no_export and length > 1:
                    try:
                        models["exported"] = (exported_model(w, t, length, feeds), False)
                        export_note = f"chunk {w.model_chunk}, {len(models['exported'][0].graph.node)} nodes"
                    except Exception as error:  # reported in the table, not fatal: the other rows still stand
                        export_note = f"export failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
                body = op_model(w, t, length, with_function=True)
                rows = max(1, round(flops / (2 * MATMUL_WIDTH * MATMUL_WIDTH)))
                matmul = matmul_model(rows)
                rng = np.random.default_rng(1)
                matmul_feeds = {
                    "a": rng.standard_normal((rows, MATMUL_WIDTH)).astype(np.float32),
                    "b": rng.standard_normal((MATMUL_WIDTH, MATMUL_WIDTH)).astype(np.float32),
                }
                for threads in args.threads:
                    runners: dict[str, Callable[[], None]] = {}
                    fused, _ = models["fused"]
                    runners["fused"] = with_chunk(bound_runner(fused, threads, True, feeds_for(fused, feeds)), None)
                    for chunk in args.chunk_sizes:
                        runners[f"fused, chunk {chunk}"] = with_chunk(
                            bound_runner(fused, threads, True, feeds_for(fused, feeds)), chunk
                        )
                    notes = {"exported": export_note} if export_note else {}
                    for name in la_feeds:
                        if name in models:
                            model, library = models[name]
                            runners[name] = bound_runner(model, threads, library, la_feeds[name])
                    if "ORT LinearAttention" in models:
                        notes["ORT LinearAttention"] = "one node, q k v decay computed beforehand"
                    if "exported" in models:
                        exported, _ = models["exported"]
                        try:
                            runners["exported"] = bound_runner(exported, threads, False, feeds_for(exported, feeds))
                        except Exception as error:
                            notes["exported"] = (
                                f"ORT failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
                            )
                    runners["ORT MatMul"] = bound_runner(matmul, threads, False, matmul_feeds)
                    notes["ORT MatMul"] = f"[{rows}, {MATMUL_WIDTH}] x [{MATMUL_WIDTH}, {MATMUL_WIDTH}], same FLOPs"
                    times = {k: [v / 1e3 for v in ts] for k, ts in measure(runners, args.repeats).items()}
                    if length <= args.function_max_length:
                        # Seconds a call: one warm-up, then its own few repeats (not interleaved with the rest).
                        body_run = bound_runner(body, threads, False, feeds_for(body, feeds))
                        times["function body"] = []
                        for _ in range(args.function_repeats):
                            start = time.perf_counter()
                            body_run()
                            times["function body"].append((time.perf_counter() - start) * 1e3)
                    else:
                        notes["function body"] = f"not timed past {args.function_max_length} tokens"
                    fused_median = float(np.median(times["fused"]))
                    matmul_rate = flops / (min(times["ORT MatMul"]) * 1e-3) / 1e9
                    for name in [*times, *(n for n in notes if n not in times)]:
                        ts = times.get(name)
                        note = notes.get(name, "")
                        rate = f"{flops / (min(ts) * 1e-3) / 1e9:.1f}" if ts else ""
                        if name == "fused" and ts:
                            share = flops / (min(ts) * 1e-3) / 1e9 / matmul_rate
                            note = f"{share:.0%} of ORT MatMul's rate (min)"
                        peak = ""
                        if (
                            args.memory
                            and ts
                            and name in ("fused", "exported", "function body", "ORT MatMul", *la_feeds)
                        ):
                            model, library = {
                                "fused": models["fused"],
                                "function body": (body, False),
                                "ORT MatMul": (matmul, False),
                            }.get(name) or models[name]
                            peak_feeds = (
                                matmul_feeds
                                if name == "ORT MatMul"
                                else la_feeds[name]
                                if name in la_feeds
                                else feeds_for(model, feeds)
                            )
                            peak = f"{peak_memory_mb(model, peak_feeds, threads, library):.0f}"
                        timing = (
                            f"{_ms(min(ts))} | {_ms(float(np.median(ts)))} | {np.median(ts) / fused_median:.2f}x"
                            if ts
                            else " | | "
                        )
                        row = (
                            f"| {w.name} | {type_name} | {length} | {threads} | {name} | {timing} | {rate} | "
                            f"{peak} | {note} |"
                        )
                        print(row, flush=True)
                        lines.append(row)
    if args.record:
        append_results("MambaChunkScan on CPU: kernel vs function body vs exported chunked scan (issue 41)", lines)


if __name__ == "__main__":
    main()
