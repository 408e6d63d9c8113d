"""The decode projections on the GPU, side by side in one process: our DecodeMatMul / DecodeMatMulNBits GEMVs
vs cuBLAS (``torch.matmul``, float16) vs ONNX Runtime's ``com.microsoft::MatMulNBits`` (int4), each against a copy
of the same bytes, at Nemotron-H-8B's projection shapes and M = 1, 2, 4, 8; a few prefill rows (M = 64, 512, 2048)
for the M > 8 path against ORT's MatMul / MatMulNBits.

Timing. Ours (through the C entry points of ``libmambafuse_cuda_gemv_bench.so``, a MAMBAFUSE_CUDA_TOOLS=ON build),
cuBLAS and the copy are launched on PyTorch's stream and buffers, 32 or more calls captured in one CUDA graph, the
graph replayed 7 times and timed with CUDA events; per call: the median replay / calls. L2 is cold: each call
reads the next of R copies of the weight, R chosen so the copies hold >= 200 MB (4x the H200's 50 MB L2). The copy
moves the bytes the product reads (weight, scales, zero points) as a device-to-device copy of half that size read
and written, also rotated over >= 200 MB; "% copy" is the copy's time over ours (the fraction of the copy's rate).
ORT's nodes (and ours inside ORT, for the prefill rows) run in ORT sessions with its CUDA graph and io_binding on
the same device buffers; a session of R nodes and one of 2R nodes (each node its own weight copy, one shared A) are
each timed over 40 Runs, and the per-node time is (median Run(2R) - median Run(R)) / R, which removes the Run's
fixed host cost. The weights enter ORT as graph inputs, so MatMulNBits runs its default (non-prepacked) kernels.

    python3 benchmarks/bench_cuda_gemv.py --bench-lib build/cuda/cuda/libmambafuse_cuda_gemv_bench.so \\
        --library build/cuda/libmambafuse_ops.so [--markdown out.md]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import math
import platform
import statistics
import sys
import time

SHAPES = {
    "in_proj": (4096, 18560),
    "out_proj": (8192, 4096),
    "mlp_up": (4096, 21504),
    "mlp_down": (21504, 4096),
    "qkv": (4096, 6144),
    "o_proj": (4096, 4096),
    "lm_head": (4096, 131072),
}
COLD_BYTES = 200 * 2**20
ONNX_FLOAT16 = 10


def _time_graph(torch, fns, calls: int, repeats: int = 7) -> float:
    """Median µs per call of a CUDA graph of ``calls`` calls cycling through ``fns``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / calls)
    return statistics.median(times)


def _copies(nbytes: int) -> int:
    return max(2, math.ceil(COLD_BYTES / nbytes))


class Int4Weights:
    """R copies of a random int4 weight (N, blocks, block_size / 2), its float16 scales and packed zero points."""

    def __init__(self, torch, k: int, n: int, block_size: int, copies: int | None = None):
        self.k, self.n, self.block_size = k, n, block_size
        self.blocks = -(-k // block_size)
        self.nbytes = n * self.blocks * block_size // 2 + n * self.blocks * 2 + n * ((self.blocks + 1) // 2)
        count = copies or _copies(self.nbytes)
        self.b = [torch.randint(0, 256, (n, self.blocks, block_size // 2), dtype=torch.uint8, device="cuda")
                  for _ in range(count)]  # fmt: skip
        self.scales = [(torch.rand(n * self.blocks, device="cuda") * 0.045 + 0.005).half() for _ in range(count)]
        self.zp = [torch.randint(0, 256, (n * ((self.blocks + 1) // 2),), dtype=torch.uint8, device="cuda")
                   for _ in range(count)]  # fmt: skip


def _copy_time(torch, nbytes: int) -> float:
    """µs of a device copy that reads and writes nbytes / 2 each (rotated over >= 200 MB)."""
    half = max(nbytes // 2, 16)
    count = _copies(nbytes)
    src = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(count)]
    dst = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(count)]
    fns = [functools.partial(d.copy_, s) for s, d in zip(src, dst, strict=True)]
    return _time_graph(torch, fns, calls=count * max(1, 32 // count))


# ---------------------------------------------------------------------------------------------------------------
# ORT sessions: R nodes, each its own weight, one A; per-node time from R and 2R nodes
# ---------------------------------------------------------------------------------------------------------------


def _ort_model(op: str, domain: str, m: int, k: int, n: int, count: int, block_size: int = 0):
    import onnx
    import onnx.helper as oh

    f16 = onnx.TensorProto.FLOAT16
    inputs = [oh.make_tensor_value_info("A", f16, [m, k])]
    nodes, outputs = [], []
    for i in range(count):
        if block_size:
            blocks = -(-k // block_size)
            inputs += [
                oh.make_tensor_value_info(f"B{i}", onnx.TensorProto.UINT8, [n, blocks, block_size // 2]),
                oh.make_tensor_value_info(f"S{i}", f16, [n * blocks]),
                oh.make_tensor_value_info(f"Z{i}", onnx.TensorProto.UINT8, [n * ((blocks + 1) // 2)]),
            ]
            attrs = {"K": k, "N": n, "bits": 4, "block_size": block_size}
            nodes.append(oh.make_node(op, ["A", f"B{i}", f"S{i}", f"Z{i}"], [f"Y{i}"], domain=domain, **attrs))
        else:
            inputs.append(oh.make_tensor_value_info(f"B{i}", f16, [k, n]))
            nodes.append(oh.make_node(op, ["A", f"B{i}"], [f"Y{i}"], domain=domain))
        outputs.append(oh.make_tensor_value_info(f"Y{i}", f16, [m, n]))
    opsets = [oh.make_opsetid("", 18), oh.make_opsetid(domain, 1)] if domain else [oh.make_opsetid("", 18)]
    model = oh.make_model(oh.make_graph(nodes, op, inputs, outputs), opset_imports=opsets)
    model.ir_version = 10
    return model


def _ort_node_time(ort, torch, library: str | None, op: str, domain: str, a, weights, outs, *, block_size: int = 0):
    """Per-node µs of ``op`` in ORT's CUDA graph: (Run(2R) - Run(R)) / R, medians of 40 Runs."""
    m, k = a.shape
    n = outs[0].shape[1]
    count = len(weights) // 2
    medians = []
    for nodes in (count, 2 * count):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if library:
            options.add_session_config_entry("mambafuse.prefill_cpu_kernels", "0")
            options.register_custom_ops_library(library)
        model = _ort_model(op, domain, m, k, n, nodes, block_size)
        sess = ort.InferenceSession(
            model.SerializeToString(), options, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})]
        )
        binding = sess.io_binding()
        import numpy as np

        def bind(name, t, np_type, binding=binding):
            binding.bind_input(name, "cuda", 0, np_type, list(t.shape), t.data_ptr())

        bind("A", a, np.float16)
        for i in range(nodes):
            w = weights[i]
            if block_size:
                bind(f"B{i}", w[0], np.uint8)
                bind(f"S{i}", w[1], np.float16)
                bind(f"Z{i}", w[2], np.uint8)
            else:
                bind(f"B{i}", w, np.float16)
            y = outs[i % len(outs)]
            binding.bind_output(f"Y{i}", "cuda", 0, np.float16, list(y.shape), y.data_ptr())
        for _ in range(5):
            sess.run_with_iobinding(binding)
        times = []
        for _ in range(40):
            t0 = time.perf_counter()
            sess.run_with_iobinding(binding)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
        del sess
    return (medians[1] - medians[0]) / count * 1e6


def _launch_dense(dense, m, k, n, a, y, stream_of, w) -> None:
    rc = dense(ONNX_FLOAT16, m, k, n, a.data_ptr(), w.data_ptr(), y.data_ptr(), stream_of())
    assert rc == 0, rc


def _launch_int4(nbits, m, k, n, a, y, stream_of, qw, i) -> None:
    rc = nbits(ONNX_FLOAT16, m, k, n, qw.block_size, a.data_ptr(), qw.b[i].data_ptr(), qw.scales[i].data_ptr(),
               qw.zp[i].data_ptr(), y.data_ptr(), stream_of())  # fmt: skip
    assert rc == 0, rc


def nbits_launcher(lib: ctypes.CDLL):
    """The bench library's int4 GEMV entry point, typed: (type, M, K, N, block_size, A, B, scales, zero points, Y,
    stream) -> 0 or a CUDA error code."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    nbits = lib.mambafuse_decode_matmul_nbits_launch
    nbits.argtypes = [ctypes.c_int, i64, i64, i64, i64, p, p, p, p, p, p]
    return nbits


def dequant_launcher(lib: ctypes.CDLL):
    """The bench library's dequantization entry point (the M > 8 path's first half), typed: (type, K, N,
    block_size, B, scales, zero points, W, stream) -> 0 or a CUDA error code."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dequant = lib.mambafuse_dequantize_int4_launch
    dequant.argtypes = [ctypes.c_int, i64, i64, i64, p, p, p, p, p]
    return dequant


def _environment(torch) -> str:
    import onnxruntime as ort

    props = torch.cuda.get_device_properties(0)
    return (
        f"GPU: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MB; "
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); onnxruntime-gpu {ort.__version__}; "
        f"Python {platform.python_version()}; {platform.platform()}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-lib", required=True, help="libmambafuse_cuda_gemv_bench.so")
    parser.add_argument("--library", help="libmambafuse_ops.so (for our ops inside ORT, the prefill rows)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--prefill-rows", default="64,512,2048")
    parser.add_argument("--prefill-shapes", default="in_proj,mlp_down,qkv")
    parser.add_argument("--no-ort", action="store_true", help="leave ORT's MatMulNBits out")
    parser.add_argument("--markdown")
    args = parser.parse_args()

    import torch

    try:
        import onnxruntime as ort

        ort.preload_dlls()
    except Exception as error:  # noqa: BLE001
        print(f"onnxruntime unavailable ({error}): the ORT columns are left out")
        ort = None
    lib = ctypes.CDLL(args.bench_lib)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    dense = lib.mambafuse_decode_matmul_launch
    dense.argtypes = [ctypes.c_int, i64, i64, i64, p, p, p, p]
    nbits = nbits_launcher(lib)

    torch.manual_seed(0)
    env = _environment(torch)
    print(env, flush=True)
    lines = [
        f"Environment: {env}. L2 cold: weights rotated over >= {COLD_BYTES >> 20} MB of copies.",
        "",
        "| shape (K→N) | M | ours fp16 µs | GB/s | % copy | cuBLAS µs | % copy | cuBLAS/ours "
        "| ours int4 bs32 µs | % copy | ORT NBits bs32 µs | ORT/ours | ours int4 bs128 µs | % copy "
        "| ORT NBits bs128 µs | ORT/ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stream_of = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    copy_cache: dict[int, float] = {}

    def copy_us(nbytes: int) -> float:
        if nbytes not in copy_cache:
            copy_cache[nbytes] = _copy_time(torch, nbytes)
        return copy_cache[nbytes]

    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        wbytes = k * n * 2
        count = _copies(wbytes)
        weights = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02 for _ in range(count)]
        q = {bs: Int4Weights(torch, k, n, bs) for bs in (32, 128)}
        for m in (int(r) for r in args.rows.split(",")):
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            y = torch.empty(m, n, device="cuda", dtype=torch.float16)
            y_ref = torch.empty_like(y)

            ours_dense = functools.partial(_launch_dense, dense, m, k, n, a, y, stream_of)
            ours_int4 = functools.partial(_launch_int4, nbits, m, k, n, a, y, stream_of)

            calls = count * max(1, 32 // count)
            t_ours = _time_graph(torch, [functools.partial(ours_dense, w) for w in weights], calls)
            t_cublas = _time_graph(torch, [functools.partial(torch.matmul, a, w, out=y_ref) for w in weights], calls)
            ours_dense(weights[0])
            torch.matmul(a, weights[0], out=y_ref)
            err = (y.float() - y_ref.float()).abs().max().item()
            c_dense = copy_us(wbytes)
            row = [f"{name} ({k}→{n})", str(m), f"{t_ours:.1f}", f"{wbytes / t_ours / 1e3:.0f}",
                   f"{100 * c_dense / t_ours:.0f} %", f"{t_cublas:.1f}", f"{100 * c_dense / t_cublas:.0f} %",
                   f"{t_cublas / t_ours:.2f}"]  # fmt: skip
            for bs in (32, 128):
                qw = q[bs]
                qcalls = len(qw.b) * max(1, 32 // len(qw.b))
                t_q = _time_graph(torch, [functools.partial(ours_int4, qw, i) for i in range(len(qw.b))], qcalls)
                c_q = copy_us(qw.nbytes)
                t_ort = float("nan")
                if ort is not None and not args.no_ort:
                    outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(2)]
                    ws = [(qw.b[i % len(qw.b)], qw.scales[i % len(qw.b)], qw.zp[i % len(qw.b)])
                          for i in range(2 * max(len(qw.b), 4))]  # fmt: skip
                    try:
                        t_ort = _ort_node_time(ort, torch, None, "MatMulNBits", "com.microsoft", a, ws, outs,
                                               block_size=bs)  # fmt: skip
                    except Exception as error:  # noqa: BLE001
                        print(f"ORT MatMulNBits failed: {str(error)[:300]}")
                row += [f"{t_q:.1f}", f"{100 * c_q / t_q:.0f} %", f"{t_ort:.1f}", f"{t_ort / t_q:.2f}"]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], f"(max |ours - cuBLAS| {err:.2e})", flush=True)
        del weights, q
        torch.cuda.empty_cache()

    if ort is not None and args.library and args.prefill_rows:
        lines += [
            "",
            "Prefill (M > 8: ours = cuBLAS GemmEx, int4 dequantized first), per node in ORT's CUDA graph:",
            "",
            "| shape (K→N) | M | ours DecodeMatMul µs | ORT MatMul µs | ORT/ours | ours DecodeMatMulNBits bs32 µs "
            "| ORT MatMulNBits bs32 µs | ORT/ours |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in args.prefill_shapes.split(","):
            k, n = SHAPES[name]
            weights = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02 for _ in range(4)]
            qw = Int4Weights(torch, k, n, 32, copies=4)
            for m in (int(r) for r in args.prefill_rows.split(",")):
                a = torch.randn(m, k, device="cuda", dtype=torch.float16)
                outs = [torch.empty(m, n, device="cuda", dtype=torch.float16) for _ in range(2)]
                qws = [(qw.b[i], qw.scales[i], qw.zp[i]) for i in range(4)]
                times = []
                for library, op, domain, ws, bs in (
                    (args.library, "DecodeMatMul", "ai.mambafuse", weights, 0),
                    (None, "MatMul", "", weights, 0),
                    (args.library, "DecodeMatMulNBits", "ai.mambafuse", qws, 32),
                    (None, "MatMulNBits", "com.microsoft", qws, 32),
                ):
                    try:
                        times.append(_ort_node_time(ort, torch, library, op, domain, a, ws, outs, block_size=bs))
                    except Exception as error:  # noqa: BLE001
                        print(f"{op} failed: {str(error)[:300]}")
                        times.append(float("nan"))
                row = [f"{name} ({k}→{n})", str(m), f"{times[0]:.1f}", f"{times[1]:.1f}", f"{times[1] / times[0]:.2f}",
                       f"{times[2]:.1f}", f"{times[3]:.1f}", f"{times[3] / times[2]:.2f}"]  # fmt: skip
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
            del weights, qw
            torch.cuda.empty_cache()

    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("Command: " + " ".join(sys.argv) + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
