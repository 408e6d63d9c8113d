"""GatedGroupRMSNorm on the GPU: the fused CUDA kernel against mamba_ssm's Triton ``rmsnorm_fn``, torch.compile,
PyTorch eager, the unfused ORT chain, and a device-to-device copy of the same bytes; a K-layer chain model per ORT
Run before vs after fusion, with and without ORT's CUDA graphs; the vector path's launch variants.

Method (every kernel-time column the same way): calls captured in one CUDA graph, time per call = graph replay
time / calls, median of 7 replays. "hot": every call on one buffer set (at 1 and 512 rows it stays in the 60 MB
L2 across calls); "cold": the calls rotate through enough buffer sets that the graph touches >= 4 x L2 between
two uses of a set. The bandwidth ceiling is a ``copy_`` of the same byte count (reads + writes = the kernel's),
measured the same way, hot and cold, in the same process. ORT numbers are per ``run_with_iobinding``, medians
with the min-max spread of their repeats.

One process, one GPU. Needs torch with CUDA, the library built with -DMAMBAFUSE_CUDA=ON -DMAMBAFUSE_CUDA_TOOLS=ON
(``--build``), for the ORT columns onnxruntime-gpu (skipped without a CUDA provider), and for the Triton column
mamba_ssm's ``ops/triton/layernorm_gated.py`` given by path (``--mamba-layernorm``; benchmark-only, never
committed). ``--baseline-build`` adds a second build's kernel (e.g. the previous commit) in the same process.

    python benchmarks/bench_cuda.py --build build/cuda --mamba-layernorm .bench-vendor/layernorm_gated.py \
        --markdown $OUT/bench_cuda.md
"""

# The timing closures below are called inside the loop iteration that defines them (B023 does not apply).
# ruff: noqa: B023

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import onnxruntime as ort
except ImportError:  # the kernel-only columns need no ORT
    ort = None

FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16
ONNX_OF = {torch.float16: FLOAT16, torch.bfloat16: BFLOAT16, torch.float32: FLOAT}
NAME_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
EPS = 1e-5
L2_BYTES = 60 * 2**20  # H200; refreshed from the device in main()


# --- timing -------------------------------------------------------------------------------------------


def per_call_us(fn: Callable[[int], object], iters: int = 200, repeats: int = 5) -> float:
    """Median over repeats of (events around `iters` back-to-back calls) / iters: host launch cost included."""
    for _ in range(10):
        fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(0)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def graph_us(fn: Callable[[int], object], calls: int = 50, repeats: int = 7, sets: int = 1) -> float:
    """Median kernel time per call, `calls` calls captured in one CUDA graph; call i uses buffer set i % sets."""
    calls = sets * max(1, math.ceil(calls / sets))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(3, sets) if sets > 1 else 3):
            fn(i % sets)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % sets)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def wall_stats(fn: Callable[[], object], iters: int = 100, repeats: int = 7) -> tuple[float, float, float]:
    """(median, min, max) over repeats of the mean host wall time per call (ORT Runs return when done)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times), min(times), max(times)


def cold_sets(set_bytes: int) -> int:
    """Buffer sets to rotate through so that a set comes back only after >= 4 x L2 of other traffic."""
    return max(2, math.ceil(4 * L2_BYTES / set_bytes))


# --- the implementations --------------------------------------------------------------------------------


def torch_reference(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """HF NemotronHRMSNormGated / Zamba2RMSNormGated forward (norm_before_gate=False), the contract's order."""
    h = y.float() * F.silu(z.float())
    grouped = h.view(*h.shape[:-1], -1, group_size)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + EPS)
    return w * normed.view(h.shape).to(y.dtype)


class FusedKernel:
    """The CUDA kernel alone, launched through the benchmark C entry point on PyTorch's current stream."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.mambafuse_cuda_launch.restype = ctypes.c_int
        self.lib.mambafuse_cuda_launch.argtypes = (
            [ctypes.c_void_p] * 4
            + [ctypes.c_int] * 6
            + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        )
        self.lib.mambafuse_cuda_choose.restype = ctypes.c_int
        self.lib.mambafuse_cuda_choose.argtypes = (
            [ctypes.c_void_p] * 4
            + [ctypes.c_int] * 3
            + [
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_int),
                ctypes.POINTER(ctypes.c_int),
            ]
        )

    def __call__(self, y, z, w, out, group_size: int, path: int = 0) -> None:
        t = ONNX_OF[y.dtype]
        rc = self.lib.mambafuse_cuda_launch(
            y.data_ptr(),
            z.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            t,
            ONNX_OF[z.dtype],
            ONNX_OF[w.dtype],
            t,
            t,
            t,
            y.numel() // y.shape[-1],
            y.shape[-1],
            group_size,
            EPS,
            torch.cuda.current_stream().cuda_stream,
            path,
        )
        if rc != 0:
            raise RuntimeError(f"mambafuse_cuda_launch returned {rc}")

    def choice(self, y, z, w, out, group_size: int) -> str:
        warps, chunks = ctypes.c_int(0), ctypes.c_int(0)
        path = self.lib.mambafuse_cuda_choose(
            y.data_ptr(),
            z.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            ONNX_OF[y.dtype],
            ONNX_OF[z.dtype],
            ONNX_OF[w.dtype],
            y.numel() // y.shape[-1],
            y.shape[-1],
            group_size,
            0,
            ctypes.byref(warps),
            ctypes.byref(chunks),
        )
        return "warp" if path == 1 else f"vector {chunks.value}c x {warps.value}w"


def load_mamba_rmsnorm(path: Path | None):
    if path is None or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("mamba_layernorm_gated", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.rmsnorm_fn


# --- ORT models -------------------------------------------------------------------------------------------


def chain_nodes(prefix: str, y: str, z: str, w: str, out: str, rows: int, channels: int, group_size: int, dtype: int):
    """Form C of docs/forms.md (fp16/bf16 decode export): 15 stock nodes."""
    p = prefix
    groups = channels // group_size
    consts = [
        onnx.numpy_helper.from_array(np.array([rows, groups, group_size], np.int64), f"{p}shape_g"),
        onnx.numpy_helper.from_array(np.array([rows, channels], np.int64), f"{p}shape_c"),
        onnx.numpy_helper.from_array(np.array(2.0, np.float32), f"{p}two"),
        onnx.numpy_helper.from_array(np.array(EPS, np.float32), f"{p}eps"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), f"{p}axes"),
    ]
    nodes = [
        oh.make_node("Cast", [y], [f"{p}yf"], to=FLOAT),
        oh.make_node("Cast", [z], [f"{p}zf"], to=FLOAT),
        oh.make_node("Sigmoid", [f"{p}zf"], [f"{p}sig"]),
        oh.make_node("Mul", [f"{p}zf", f"{p}sig"], [f"{p}silu"]),
        oh.make_node("Mul", [f"{p}yf", f"{p}silu"], [f"{p}h"]),
        oh.make_node("Reshape", [f"{p}h", f"{p}shape_g"], [f"{p}hg"]),
        oh.make_node("Pow", [f"{p}hg", f"{p}two"], [f"{p}sq"]),
        oh.make_node("ReduceMean", [f"{p}sq", f"{p}axes"], [f"{p}ms"], keepdims=1),
        oh.make_node("Add", [f"{p}ms", f"{p}eps"], [f"{p}mse"]),
        oh.make_node("Sqrt", [f"{p}mse"], [f"{p}rms"]),
        oh.make_node("Reciprocal", [f"{p}rms"], [f"{p}inv"]),
        oh.make_node("Mul", [f"{p}hg", f"{p}inv"], [f"{p}n"]),
        oh.make_node("Reshape", [f"{p}n", f"{p}shape_c"], [f"{p}nc"]),
        oh.make_node("Cast", [f"{p}nc"], [f"{p}nh"], to=dtype),
        oh.make_node("Mul", [w, f"{p}nh"], [out]),
    ]
    return nodes, consts


def layered_model(
    layers: int,
    rows: int,
    channels: int,
    group_size: int,
    dtype: int,
    fused: bool,
    rng,
    residual: bool = False,
) -> onnx.ModelProto:
    """`layers` chains in series (each layer's output is the next layer's y; one gate), unfused or fused; with
    `residual`, each layer's output is its chain's plus its y (an Add between layers, as in a model)."""
    np_dtype = np.float16 if dtype == FLOAT16 else np.float32
    nodes, inits = [], []
    y = "y"
    for k in range(layers):
        w = (1.0 + 0.1 * rng.standard_normal(channels)).astype(np_dtype)
        w_init = onnx.numpy_helper.from_array(w, f"w{k}")
        if dtype == BFLOAT16:  # numpy has no bf16: store f32 and cast once at load (constant-folded by ORT)
            inits.append(w_init)
            nodes.append(oh.make_node("Cast", [f"w{k}"], [f"w{k}_bf16"], to=BFLOAT16))
            w_name = f"w{k}_bf16"
        else:
            inits.append(w_init)
            w_name = f"w{k}"
        out = "out" if k == layers - 1 else f"y{k + 1}"
        layer_out = out
        if residual:
            out = f"n{k}"
        if fused:
            nodes.append(
                oh.make_node(
                    "GatedGroupRMSNorm",
                    [y, "z", w_name],
                    [out],
                    domain="ai.mambafuse",
                    epsilon=EPS,
                    group_size=group_size,
                )
            )
        else:
            chain, consts = chain_nodes(f"l{k}_", y, "z", w_name, out, rows, channels, group_size, dtype)
            nodes += chain
            inits += consts
        if residual:
            nodes.append(oh.make_node("Add", [out, y], [layer_out]))
        y = layer_out
    graph = oh.make_graph(
        nodes,
        "layers",
        [
            oh.make_tensor_value_info("y", dtype, [rows, channels]),
            oh.make_tensor_value_info("z", dtype, [rows, channels]),
        ],
        [oh.make_tensor_value_info("out", dtype, [rows, channels])],
        initializer=inits,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("ai.mambafuse", 1)])


# --- the benchmark -----------------------------------------------------------------------------------------


def environment() -> str:
    props = torch.cuda.get_device_properties(0)
    ort_version = ort.__version__ if ort is not None else "not installed"
    return (
        f"{props.name} ({props.multi_processor_count} SMs, {props.L2_cache_size // 2**20} MB L2), torch "
        f"{torch.__version__}, onnxruntime {ort_version}, CUDA {torch.version.cuda}, Python {platform.python_version()}"
    )


def ort_cuda_available() -> bool:
    if ort is None:
        return False
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    return "CUDAExecutionProvider" in ort.get_available_providers()


class Buffers:
    """`sets` independent (y, z, out) sets of one shape and dtype, one weight."""

    def __init__(self, rows: int, channels: int, dtype: torch.dtype, sets: int, gen: torch.Generator) -> None:
        self.y = [torch.randn(rows, channels, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
        self.z = [2 * torch.randn(rows, channels, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
        self.out = [torch.empty_like(self.y[0]) for _ in range(sets)]
        self.w = (1 + 0.5 * torch.randn(channels, device="cuda", generator=gen)).to(dtype)
        # The copy baseline: as many bytes read + written as the kernel (y, z, w read; out written).
        moved = 3 * self.y[0].numel() * self.y[0].element_size() + self.w.numel() * self.w.element_size()
        self.moved = moved
        self.copy_src = [torch.ones(moved // 8, dtype=torch.float32, device="cuda") for _ in range(sets)]
        self.copy_dst = [torch.empty_like(c) for c in self.copy_src]
        self.set_bytes = moved  # the traffic one call of the kernel (or the copy) puts through L2


def kernel_table(args, kernel: FusedKernel, baseline: FusedKernel | None, rmsnorm_fn, compiled, emit) -> None:
    emit("### Kernel time per call inside a CUDA graph, µs: hot (one buffer set) / cold (rotating > 4 x L2)")
    emit()
    cols = ["dtype", "C", "rows", "fused path", "fused", "mamba_ssm Triton", "fused / Triton"]
    if baseline is not None:
        cols.insert(5, "previous kernel")
    cols += [
        "torch.compile",
        "copy_ (memcpy) / copy kernel, same bytes",
        "fused % of the faster copy",
        "fused TB/s",
        "launch + host, fused / Triton",
    ]
    emit("| " + " | ".join(cols) + " |")
    emit("|" + "---|" * len(cols))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for channels in (7680, 8192):
            group_size = channels // 8
            for rows in [int(r) for r in args.rows.split(",")]:
                probe = Buffers(rows, channels, dtype, 1, gen)
                sets = 1 if rows == 1 else cold_sets(probe.set_bytes)
                b = Buffers(rows, channels, dtype, sets, gen)

                # Decode-sized calls last ~2 µs: more of them per graph and more replays steady the median.
                calls, repeats = (400, 15) if rows == 1 else (50, 7)

                def run(impl: Callable[[int], object], hot_only: bool = False) -> tuple[float, float | None]:
                    hot = graph_us(lambda i: impl(0), calls=calls, repeats=repeats)
                    cold = None if hot_only or sets == 1 else graph_us(impl, sets=sets)
                    return hot, cold

                def fused(i: int) -> None:
                    kernel(b.y[i], b.z[i], b.w, b.out[i], group_size)

                fused(0)
                expected = torch_reference(b.y[0], b.z[0], b.w, group_size)
                max_diff = (b.out[0].float() - expected.float()).abs().max().item()
                results = {"fused": run(fused)}
                if baseline is not None:
                    results["previous"] = run(lambda i: baseline(b.y[i], b.z[i], b.w, b.out[i], group_size))
                if rmsnorm_fn is not None:

                    def triton_call(i: int):
                        return rmsnorm_fn(
                            b.y[i], b.w, None, z=b.z[i], eps=EPS, group_size=group_size, norm_before_gate=False
                        )

                    results["triton"] = run(triton_call)
                if compiled is not None and dtype_name in args.compile_dtypes.split(","):
                    results["compile"] = run(lambda i: compiled(b.y[i], b.z[i], b.w, group_size))
                # Two copies of the same bytes: copy_ (a memcpy node in a graph: the copy engines) and an
                # elementwise kernel (x * 1 into another buffer, 16-byte vectorized); the faster is the ceiling.
                results["memcpy"] = run(lambda i: b.copy_dst[i].copy_(b.copy_src[i]))
                results["copy kernel"] = run(lambda i: torch.mul(b.copy_src[i], 1.0, out=b.copy_dst[i]))
                (mh, mc), (kh, kc) = results["memcpy"], results["copy kernel"]
                results["copy"] = (min(mh, kh), None if mc is None else min(mc, kc))

                def fmt(key: str) -> str:
                    if key not in results:
                        return "n/a"
                    hot, cold = results[key]
                    return f"{hot:.2f}" if cold is None else f"{hot:.2f} / {cold:.2f}"

                def ratio(a: str, c: str) -> str:
                    if a not in results or c not in results:
                        return "n/a"
                    (ah, ac), (ch, cc) = results[a], results[c]
                    text = f"{ah / ch:.2f}"
                    return text if ac is None or cc is None else f"{text} / {ac / cc:.2f}"

                fh, fc = results["fused"]
                ch, cc = results["copy"]
                pct = f"{100 * ch / fh:.0f} %" if fc is None else f"{100 * ch / fh:.0f} / {100 * cc / fc:.0f} %"
                tbs = (
                    f"{b.moved / fh / 1e6:.2f}"
                    if fc is None
                    else f"{b.moved / fh / 1e6:.2f} / {b.moved / fc / 1e6:.2f}"
                )
                launch = f"{per_call_us(fused):.1f}"
                if rmsnorm_fn is not None:
                    launch += f" / {per_call_us(triton_call):.1f}"
                row = [dtype_name, str(channels), str(rows), kernel.choice(b.y[0], b.z[0], b.w, b.out[0], group_size)]
                row += [fmt("fused")]
                if baseline is not None:
                    row.append(fmt("previous"))
                row += [
                    fmt("triton"),
                    ratio("fused", "triton"),
                    fmt("compile"),
                    fmt("memcpy") + " ; " + fmt("copy kernel"),
                ]
                row += [pct, tbs, launch]
                emit("| " + " | ".join(row) + " |")
                print(f"  (sets {sets}; max |fused - torch eager| = {max_diff:g})", flush=True)
    emit()
    emit(
        "A 1-element fill in the same kind of graph (the per-kernel floor of a graph replay): "
        f"{graph_us(lambda i: FILL.fill_(1.0), calls=400, repeats=15):.2f} µs."
    )


def cupti_us(call: Callable[[], object], calls: int = 200) -> float:
    """GPU time per call from CUPTI (torch.profiler): every kernel the call launches, summed, / calls. This is
    what the end-to-end benchmark (benchmarks/bench_gpu_nemotron.py) reports per node, unlike a graph replay's
    time per call, which includes the gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    total = 0.0
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        total += device_us if device_us is not None else getattr(event, "self_cuda_time_total", 0.0)
    return total / calls


def cupti_table(args, kernel: FusedKernel, rmsnorm_fn, emit) -> None:
    """Decode size (1 row, L2-resident as in a model's step): the kernels' durations as CUPTI measures them, with
    the two floors a fused kernel cannot go under: a copy of the same bytes and a 1-element fill."""
    emit()
    emit("### One row, GPU time per call as CUPTI measures it (µs; mean of 200 calls, buffers L2-resident)")
    emit()
    emit("| dtype | C | fused | mamba_ssm Triton | copy kernel, same bytes | 1-element fill |")
    emit("|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for dtype_name in args.dtypes.split(","):
        for channels in (7680, 8192):
            group_size = channels // 8
            b = Buffers(1, channels, DTYPES[dtype_name], 1, gen)
            row = [
                dtype_name,
                str(channels),
                f"{cupti_us(lambda: kernel(b.y[0], b.z[0], b.w, b.out[0], group_size)):.2f}",
            ]
            if rmsnorm_fn is None:
                row.append("n/a")
            else:
                triton = cupti_us(
                    lambda: rmsnorm_fn(
                        b.y[0], b.w, None, z=b.z[0], eps=EPS, group_size=group_size, norm_before_gate=False
                    )
                )
                row.append(f"{triton:.2f}")
            row.append(f"{cupti_us(lambda: torch.mul(b.copy_src[0], 1.0, out=b.copy_dst[0])):.2f}")
            row.append(f"{cupti_us(lambda: FILL.fill_(1.0)):.2f}")
            emit("| " + " | ".join(row) + " |")


FILL = None
VARIANT_VARIABLES = (
    "MAMBAFUSE_CUDA_CHUNKS",
    "MAMBAFUSE_CUDA_WARPS_PER_GROUP",
    "MAMBAFUSE_CUDA_GRID",
    "MAMBAFUSE_CUDA_SPECIALIZED",
)


#: The launch configurations of the variant tables: (chunks per thread, warps per group, grid, specialized
#: uniform-type kernel).
VARIANTS = [
    ("1", "4", "wave", "1"),
    ("1", "4", "wave", "0"),
    ("1", "4", "full", "1"),
    ("2", "2", "full", "1"),
    ("2", "2", "full", "0"),
    ("2", "2", "wave", "1"),
    ("2", "4", "full", "1"),
    ("4", "1", "wave", "1"),
    ("4", "1", "full", "1"),
]


def variants_table(args, kernel: FusedKernel, emit) -> None:
    """The launch configurations ChooseCudaLaunch picks among (hot and cold), and the warp path, per dtype."""
    names = [f"{c}c x {w}w {g}{'' if sp == '1' else ' generic'}" for c, w, g, sp in VARIANTS]
    for dtype_name in args.variant_dtypes.split(","):
        emit()
        emit(
            f"### Vector path: launch variants (µs per call in a CUDA graph, hot / cold; {dtype_name}; "
            '"generic": the specialized kernel switched off)'
        )
        emit()
        emit("| C / group | rows | warp path | " + " | ".join(names) + " | launcher's choice |")
        emit("|---|---|---|" + "---|" * len(names) + "---|")
        gen = torch.Generator(device="cuda").manual_seed(1)
        for channels in (7680, 8192):
            for rows in [int(r) for r in args.rows.split(",")]:
                emit("| " + " | ".join(_variant_row(kernel, DTYPES[dtype_name], rows, channels, gen)) + " |")


def _variant_row(kernel: FusedKernel, dtype: torch.dtype, rows: int, channels: int, gen: torch.Generator) -> list[str]:
    """One row of a variant table: the warp path, every launch variant, the launcher's choice."""
    group_size = channels // 8
    probe = Buffers(rows, channels, dtype, 1, gen)
    sets = 1 if rows == 1 else cold_sets(probe.set_bytes)
    b = Buffers(rows, channels, dtype, sets, gen)

    def timed(path: int) -> str:
        calls, repeats = (400, 15) if rows == 1 else (50, 7)
        hot = graph_us(lambda i: kernel(b.y[0], b.z[0], b.w, b.out[0], group_size, path), calls, repeats)
        if sets == 1:
            return f"{hot:.2f}"
        cold = graph_us(lambda i: kernel(b.y[i], b.z[i], b.w, b.out[i], group_size, path), sets=sets)
        return f"{hot:.2f} / {cold:.2f}"

    row = [f"{channels} / {group_size}", str(rows), timed(1)]
    for chunks, warps, grid, specialized in VARIANTS:
        os.environ.update(
            MAMBAFUSE_CUDA_CHUNKS=chunks,
            MAMBAFUSE_CUDA_WARPS_PER_GROUP=warps,
            MAMBAFUSE_CUDA_GRID=grid,
            MAMBAFUSE_CUDA_SPECIALIZED=specialized,
        )
        row.append(timed(2))
    for key in VARIANT_VARIABLES:
        os.environ.pop(key, None)
    row.append(kernel.choice(b.y[0], b.z[0], b.w, b.out[0], group_size))
    return row


def ort_value(t: torch.Tensor):
    from onnxruntime.capi import _pybind_state as C

    return ort.OrtValue(C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(t), False))


def ort_runner(model: onnx.ModelProto, library: Path, feeds: dict[str, torch.Tensor], out: torch.Tensor, graph: bool):
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if graph else {})
    model.ir_version = min(model.ir_version, 10)  # onnxruntime-gpu 1.31 rejects a newer onnx's IR version
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
    binding = session.io_binding()
    for name, tensor in feeds.items():
        binding.bind_ortvalue_input(name, ort_value(tensor))
    binding.bind_ortvalue_output("out", ort_value(out))
    return lambda: session.run_with_iobinding(binding)


def fmt_stats(stats: tuple[float, float, float]) -> str:
    median, low, high = stats
    return f"{median:.0f} ({low:.0f}–{high:.0f})"


def ort_tables(args, library: Path, emit) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    emit()
    emit(
        "### ORT per Run (IO binding, no CUDA graph), one layer: unfused chain vs fused node, µs, median (min–max of 7)"
    )
    emit()
    emit("| dtype | C | rows | unfused chain | fused node | speed-up |")
    emit("|---|---|---|---|---|---|")
    for dtype_name in ("fp16", "bf16"):
        dtype = DTYPES[dtype_name]
        for channels in (7680, 8192):
            for rows in [int(r) for r in args.rows.split(",")]:
                y = torch.randn(rows, channels, device="cuda", dtype=dtype, generator=gen)
                z = torch.randn(rows, channels, device="cuda", dtype=dtype, generator=gen)
                out = torch.empty_like(y)
                stats = []
                for fuse in (False, True):
                    model = layered_model(
                        1, rows, channels, channels // 8, ONNX_OF[dtype], fuse, np.random.default_rng(0)
                    )
                    stats.append(wall_stats(ort_runner(model, library, {"y": y, "z": z}, out, graph=False), iters=50))
                emit(
                    f"| {dtype_name} | {channels} | {rows} | {fmt_stats(stats[0])} | {fmt_stats(stats[1])} "
                    f"| {stats[0][0] / stats[1][0]:.1f}x |"
                )
    layers = 24
    emit()
    emit(
        f"### Decode: a K = {layers} chain model, 1 row, C = 7680, 8 groups; ORT per Run (IO binding), µs, "
        "median (min–max) of 7 repeats of 100 Runs"
    )
    emit()
    emit(
        "| dtype | residual Adds | unfused | fused | speed-up | unfused + CUDA graph | fused + CUDA graph | speed-up |"
    )
    emit("|---|---|---|---|---|---|---|---|")
    for dtype_name in ("fp16", "bf16"):
        dtype = DTYPES[dtype_name]
        y = torch.randn(1, 7680, device="cuda", dtype=dtype, generator=gen)
        z = torch.randn(1, 7680, device="cuda", dtype=dtype, generator=gen)
        out = torch.empty_like(y)
        for residual in (True, False):
            results = {}
            for graph in (False, True):
                for fuse in (False, True):
                    model = layered_model(
                        layers, 1, 7680, 960, ONNX_OF[dtype], fuse, np.random.default_rng(1), residual=residual
                    )
                    results[(graph, fuse)] = wall_stats(ort_runner(model, library, {"y": y, "z": z}, out, graph))
            emit(
                f"| {dtype_name} | {'yes' if residual else 'no'} | {fmt_stats(results[(False, False)])} | "
                f"{fmt_stats(results[(False, True)])} | {results[(False, False)][0] / results[(False, True)][0]:.1f}x "
                f"| {fmt_stats(results[(True, False)])} | {fmt_stats(results[(True, True)])} | "
                f"{results[(True, False)][0] / results[(True, True)][0]:.1f}x |"
            )


def main(argv: Sequence[str] | None = None) -> int:
    global FILL, L2_BYTES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=REPO / "build" / "cuda")
    parser.add_argument("--baseline-build", type=Path, default=None, help="a second build's kernel, same process")
    parser.add_argument("--mamba-layernorm", type=Path, default=REPO / ".bench-vendor" / "layernorm_gated.py")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--dtypes", default="fp16,bf16,fp32")
    parser.add_argument("--rows", default="1,512,8192")
    parser.add_argument("--variant-dtypes", default="fp16", help="the dtypes of the launch-variant table")
    parser.add_argument("--compile-dtypes", default="fp16,bf16", help="torch.compile is compiled per shape: slow")
    parser.add_argument("--skip", default="", help="comma-separated: kernels,cupti,variants,ort")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    L2_BYTES = torch.cuda.get_device_properties(0).L2_cache_size or L2_BYTES
    FILL = torch.zeros(1, device="cuda")
    library = args.build / "libmambafuse_ops.so"
    kernel = FusedKernel(args.build / "cuda" / "libmambafuse_cuda_bench.so")
    baseline = None
    if args.baseline_build is not None:
        baseline = FusedKernel(args.baseline_build / "cuda" / "libmambafuse_cuda_bench.so")
    rmsnorm_fn = load_mamba_rmsnorm(args.mamba_layernorm)
    compiled = None
    if args.compile_dtypes:
        # One compiled graph per (dtype, shape): a static-shape compile for each configuration, as a user would get.
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.cache_size_limit = 64
        compiled = torch.compile(torch_reference, dynamic=False)
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    with_ort = ort_cuda_available()
    emit(f"Environment: {environment()}.")
    emit()
    if "kernels" not in skip:
        kernel_table(args, kernel, baseline, rmsnorm_fn, compiled, emit)
    if "cupti" not in skip:
        cupti_table(args, kernel, rmsnorm_fn, emit)
    if "variants" not in skip:
        variants_table(args, kernel, emit)
    if with_ort and "ort" not in skip:
        ort_tables(args, library, emit)
    elif "ort" not in skip:
        emit()
        emit("(ORT tables skipped: onnxruntime has no CUDAExecutionProvider here.)")
    if args.markdown is not None:
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
