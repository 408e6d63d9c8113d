"""GatedGroupRMSNorm on the GPU: the fused CUDA kernel against the unfused ORT chain, PyTorch eager,
torch.compile and mamba_ssm's Triton ``rmsnorm_fn``, per launch and inside a CUDA graph; a K-layer chain
model per ORT Run before vs after fusion, with and without ORT's CUDA graphs; bandwidth against a
device-to-device copy; and the vector path's warps-per-group sweep that justifies the launch heuristic.

One process, one GPU. Needs torch with CUDA, onnxruntime-gpu, the library built with -DMAMBAFUSE_CUDA=ON
-DMAMBAFUSE_CUDA_TOOLS=ON (``--build``), and for the Triton column mamba_ssm's
``ops/triton/layernorm_gated.py`` given by path (``--mamba-layernorm``; benchmark-only, never committed).

    python benchmarks/bench_cuda.py --build build/cuda --mamba-layernorm .bench-vendor/layernorm_gated.py \
        --markdown $OUT/bench_cuda.md
"""

# The timing closures below are called inside the loop iteration that defines them (B023 does not apply).
# ruff: noqa: B023

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FLOAT, FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16
ONNX_OF = {torch.float16: FLOAT16, torch.bfloat16: BFLOAT16, torch.float32: FLOAT}
NAME_OF = {torch.float16: "fp16", torch.bfloat16: "bf16"}
EPS = 1e-5


# --- timing -------------------------------------------------------------------------------------------


def per_call_us(fn: Callable[[], object], iters: int = 200, repeats: int = 5) -> float:
    """Median over repeats of (events around `iters` back-to-back calls) / iters: host launch cost included."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def graph_us(fn: Callable[[], object], per_graph: int = 50, repeats: int = 7) -> float:
    """Median kernel time per call with `per_graph` calls captured in one CUDA graph (launch gaps removed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    return statistics.median(times)


def wall_us(fn: Callable[[], object], iters: int = 200, repeats: int = 5) -> float:
    """Median host wall time per call (for ORT Runs, which return when their outputs are ready)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times)


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
        return "warp" if path == 1 else f"vector, {chunks.value} chunk(s)/thread, {warps.value} warp(s)/group"


def load_mamba_rmsnorm(path: Path | None):
    if path is None or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("mamba_layernorm_gated", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.rmsnorm_fn


# --- ORT models -------------------------------------------------------------------------------------------


def chain_nodes(prefix: str, y: str, z: str, w: str, out: str, rows: int, channels: int, group_size: int, dtype: int):
    """Form C of DESIGN.md §2 (fp16/bf16 decode export): 15 stock nodes."""
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
    layers: int, rows: int, channels: int, group_size: int, dtype: int, fused: bool, rng
) -> onnx.ModelProto:
    """`layers` chains in series (each layer's output is the next layer's y; one gate), unfused or fused."""
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
        y = out
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


# --- the benchmark -----------------------------------------------------------------------------------------


def environment() -> str:
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, onnxruntime {ort.__version__}, "
        f"CUDA {torch.version.cuda}, Python {platform.python_version()}"
    )


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = graph_us(lambda: dst.copy_(src), per_graph=10)
    return 2 * src.numel() * src.element_size() / (t * 1e-6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=REPO / "build" / "cuda")
    parser.add_argument("--mamba-layernorm", type=Path, default=REPO / ".bench-vendor" / "layernorm_gated.py")
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer sizes (smoke run)")
    args = parser.parse_args(argv)

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    library = args.build / "libmambafuse_ops.so"
    kernel = FusedKernel(args.build / "cuda" / "libmambafuse_cuda_bench.so")
    rmsnorm_fn = load_mamba_rmsnorm(args.mamba_layernorm)
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    bandwidth = copy_bandwidth()
    emit(f"Environment: {environment()}. Device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write).")
    emit()
    emit("### Per call: launch on a stream (host cost included) / kernel time inside a CUDA graph, µs")
    emit()
    emit(
        "| dtype | C | rows | fused path | fused kernel | unfused ORT chain (per Run) "
        "| fused ORT node (per Run) | torch eager "
        "| torch.compile | mamba_ssm Triton | fused BW (% of copy) |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    dtypes = [torch.float16, torch.bfloat16]
    rows_list = [1, 512] if args.quick else [1, 512, 8192]
    # One compiled graph per (dtype, shape): a static-shape compile for each configuration, as a user would get.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    compiled = torch.compile(torch_reference, dynamic=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in dtypes:
        for channels in (7680, 8192):
            group_size = channels // 8
            for rows in rows_list:
                y = torch.randn(rows, channels, device="cuda", dtype=dtype, generator=gen)
                z = 2 * torch.randn(rows, channels, device="cuda", dtype=dtype, generator=gen)
                w = (1 + 0.5 * torch.randn(channels, device="cuda", generator=gen)).to(dtype)
                out = torch.empty_like(y)

                def fused():
                    kernel(y, z, w, out, group_size)

                fused()
                expected = torch_reference(y, z, w, group_size)
                max_diff = (out.float() - expected.float()).abs().max().item()
                row = [NAME_OF[dtype], str(channels), str(rows), kernel.choice(y, z, w, out, group_size)]
                t_graph = graph_us(fused)
                row.append(f"{per_call_us(fused):.1f} / {t_graph:.2f}")
                for fuse in (False, True):
                    model = layered_model(1, rows, channels, group_size, ONNX_OF[dtype], fuse, np.random.default_rng(0))
                    run = ort_runner(model, library, {"y": y, "z": z}, out, graph=False)
                    row.append(f"{wall_us(run, iters=50):.1f}")
                row.append(
                    f"{per_call_us(lambda: torch_reference(y, z, w, group_size)):.1f} / "
                    f"{graph_us(lambda: torch_reference(y, z, w, group_size)):.2f}"
                )
                row.append(
                    f"{per_call_us(lambda: compiled(y, z, w, group_size)):.1f} / "
                    f"{graph_us(lambda: compiled(y, z, w, group_size)):.2f}"
                )
                if rmsnorm_fn is not None:

                    def triton_call():
                        return rmsnorm_fn(y, w, None, z=z, eps=EPS, group_size=group_size, norm_before_gate=False)

                    row.append(f"{per_call_us(triton_call):.1f} / {graph_us(triton_call):.2f}")
                else:
                    row.append("n/a")
                moved = y.numel() * y.element_size() * 3 + w.numel() * w.element_size()
                row.append(
                    f"{moved / (t_graph * 1e-6) / 1e12:.2f} TB/s ({100 * moved / (t_graph * 1e-6) / bandwidth:.0f} %)"
                )
                emit("| " + " | ".join(row) + " |")
                # torch eager uses rsqrt and another summation order: 1 ulp of the output type apart at most
                # (the budget against the float64 reference is tests/test_kernel_cuda.py's job).
                emit(f"  (max |fused - torch eager| = {max_diff:g})")

    emit()
    emit("### Vector path: kernel variants (kernel time inside a CUDA graph, µs; fp16)")
    emit()
    emit("| C / group | rows | warp path | 1 chunk/thread | 4 chunks x1 warp | x2 | x4 | x8 | launcher's choice |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for channels in (7680, 8192):
        group_size = channels // 8
        for rows in rows_list:
            y = torch.randn(rows, channels, device="cuda", dtype=torch.float16, generator=gen)
            z = torch.randn(rows, channels, device="cuda", dtype=torch.float16, generator=gen)
            w = torch.ones(channels, device="cuda", dtype=torch.float16)
            out = torch.empty_like(y)
            row = [
                f"{channels} / {group_size}",
                str(rows),
                f"{graph_us(lambda: kernel(y, z, w, out, group_size, 1)):.2f}",
            ]
            os.environ["MAMBAFUSE_CUDA_CHUNKS"] = "1"
            row.append(f"{graph_us(lambda: kernel(y, z, w, out, group_size, 2)):.2f}")
            os.environ["MAMBAFUSE_CUDA_CHUNKS"] = "4"
            for warps in (1, 2, 4, 8):
                os.environ["MAMBAFUSE_CUDA_WARPS_PER_GROUP"] = str(warps)
                row.append(f"{graph_us(lambda: kernel(y, z, w, out, group_size, 2)):.2f}")
            os.environ.pop("MAMBAFUSE_CUDA_WARPS_PER_GROUP", None)
            os.environ.pop("MAMBAFUSE_CUDA_CHUNKS", None)
            row.append(kernel.choice(y, z, w, out, group_size))
            emit("| " + " | ".join(row) + " |")

    emit()
    layers = 24
    emit(f"### Decode: a K = {layers} chain model, 1 row, C = 7680, 8 groups; ORT per Run (IO binding), µs")
    emit()
    emit("| dtype | unfused | fused | speed-up | unfused + CUDA graph | fused + CUDA graph | speed-up |")
    emit("|---|---|---|---|---|---|---|")
    for dtype in dtypes:
        y = torch.randn(1, 7680, device="cuda", dtype=dtype, generator=gen)
        z = torch.randn(1, 7680, device="cuda", dtype=dtype, generator=gen)
        out = torch.empty_like(y)
        results = {}
        for graph in (False, True):
            for fuse in (False, True):
                model = layered_model(layers, 1, 7680, 960, ONNX_OF[dtype], fuse, np.random.default_rng(1))
                results[(graph, fuse)] = wall_us(ort_runner(model, library, {"y": y, "z": z}, out, graph), iters=100)
        emit(
            f"| {NAME_OF[dtype]} | {results[(False, False)]:.0f} | {results[(False, True)]:.0f} | "
            f"{results[(False, False)] / results[(False, True)]:.1f}x | {results[(True, False)]:.0f} | "
            f"{results[(True, True)]:.0f} | {results[(True, False)] / results[(True, True)]:.1f}x |"
        )
    if args.markdown is not None:
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
