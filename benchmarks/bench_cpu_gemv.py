"""The weights at batch 1 on the CPU: ONNX Runtime's MatMul (float32) and MatMulNBits (int4) at the projection
shapes of a Nemotron-H-8B decode step, in GB/s of weights read against a copy of the same bytes.

Issue 42 asks first whether ORT's own kernels stream a decode step's weights near the machine's bandwidth on the CPU
(a CPU path of our own only where they stay below 85 % of a copy). Per shape ``x (M, K) @ W (K, N)``, M = 1, 2, 4,
8, one process, the variants interleaved, the weights initializers (so ORT prepacks them):

- ``MatMul fp32``: ``MatMul`` with a float32 weight (MLAS's SGEMM path);
- ``MatMulNBits int4, acc 0`` / ``acc 4``: ``com.microsoft::MatMulNBits`` from ORT's ``MatMulNBitsQuantizer`` (4 bits,
  block 32, symmetric; what onnxruntime-genai's builder and Olive write), float32 compute (``accuracy_level`` 0) and
  int8 activations (4, the builder's CPU default);
- ``copy``: numpy's copy of a buffer the size of the float32 weight (read + write), the bandwidth reference;
- ``read``: numpy reading a buffer the size of the int4 weight once (a bitwise-or reduction over 64-bit words, the
  caches emptied first by reading 256 MB): what a GEMV's one pass over its weight cannot beat on one thread.

GB/s is the weight's bytes (float32: 4·K·N; int4: the packed blocks plus the scales) per call. "% of copy" divides
it by the copy's rate in bytes read + written per second, the measure the issue's targets use (a copy moves each
byte twice, a GEMV reads it once, so 100 % is not a ceiling: a read-only stream may go faster than a copy's).
"% of read" divides it by the read's rate: the floor a GEMV is held to.

    python -m benchmarks.bench_cpu_gemv [--shapes in_proj,out_proj,...] [--rows 1,2,4,8] [--threads 1,2]
        [--repeats 15] [--record]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnx.helper as oh
from onnx import numpy_helper

from benchmarks._common import append_results, environment_line
from benchmarks.bench_selective_state_update_cpu import bound_runner, measure

#: The projections of one Nemotron-H-8B decode step (hidden 4096; Mamba-2: 128 heads x 64, 8 groups, state 128;
#: attention 32 heads, 8 KV heads, head dim 128; MLP 21504, squared ReLU, no gate): (K, N).
SHAPES = {
    "in_proj": (4096, 2 * 8192 + 2 * 8 * 128 + 128),
    "out_proj": (8192, 4096),
    "qkv": (4096, 4096 + 2 * 1024),
    "o_proj": (4096, 4096),
    "mlp_up": (4096, 21504),
    "mlp_down": (21504, 4096),
}


def matmul_model(k: int, n: int, weight: np.ndarray) -> onnx.ModelProto:
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "W"], ["y"])],
        "gemv",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["M", k])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(weight, "W")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)


def int4_model(model: onnx.ModelProto, accuracy_level: int) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx.ModelProto.FromString(model.SerializeToString()),
        bits=4,
        block_size=32,
        is_symmetric=True,
        accuracy_level=accuracy_level,
    )
    quantizer.process()
    quantized = quantizer.model.model
    if not any(node.op_type == "MatMulNBits" for node in quantized.graph.node):
        raise SystemExit("the quantizer wrote no MatMulNBits")
    return quantized


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def copy_seconds(nbytes: int, repeats: int) -> float:
    """The median time of numpy copying ``nbytes`` (a buffer the size of the float32 weight)."""
    source = np.ones(nbytes // 4, np.float32)
    target = np.empty_like(source)
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return float(np.median(times[3:]))


def read_seconds(nbytes: int, repeats: int) -> float:
    """The median time of numpy reading ``nbytes`` once (a bitwise-or reduction over 64-bit words), each time after
    reading a 256 MB buffer, so that the bytes come from memory as a decode step's weights do."""
    source = np.ones(max(nbytes // 8, 1), np.uint64)
    evict = np.ones(256 * 2**20 // 8, np.uint64)
    times = []
    for _ in range(repeats + 2):
        np.bitwise_or.reduce(evict)
        start = time.perf_counter()
        np.bitwise_or.reduce(source)
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    threads_list = [int(t) for t in args.threads.split(",")]
    rows_list = [int(m) for m in args.rows.split(",")]
    lines = [f"- threads={t}: {environment_line(t)}" for t in threads_list]
    lines += [
        f"- medians of {args.repeats} interleaved calls; GB/s = the weight's bytes per call; % of copy = that over "
        "numpy's copy rate of the float32 weight's size (bytes read + written); % of read = that over numpy's read "
        "rate of the int4 weight's size from memory (one thread); both measured beside each shape",
        "",
        "| shape (K x N) | threads | M | variant | weight MB | median ms | GB/s | % of copy | % of read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    rng = np.random.default_rng(0)
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        weight = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        fp32 = matmul_model(k, n, weight)
        models = {
            "MatMul fp32": fp32,
            "MatMulNBits int4, acc 0": int4_model(fp32, 0),
            "MatMulNBits int4, acc 4": int4_model(fp32, 4),
        }
        del weight
        sizes = {variant: weight_bytes(model) for variant, model in models.items()}
        for threads in threads_list:
            for m in rows_list:
                x = rng.standard_normal((m, k)).astype(np.float32)
                runners = {variant: bound_runner(model, threads, False, {"x": x}) for variant, model in models.items()}
                times = measure(runners, args.repeats)
                copy_rate = 2 * sizes["MatMul fp32"] / copy_seconds(sizes["MatMul fp32"], args.repeats)
                int4_bytes = sizes["MatMulNBits int4, acc 4"]
                read_rate = int4_bytes / read_seconds(int4_bytes, args.repeats)
                for variant, ts in times.items():
                    seconds = float(np.median(ts)) * 1e-6
                    rate = sizes[variant] / seconds
                    row = (
                        f"| {name} ({k} x {n}) | {threads} | {m} | {variant} | {sizes[variant] / 1e6:.0f} "
                        f"| {seconds * 1e3:.2f} | {rate / 1e9:.1f} | {100 * rate / copy_rate:.0f} % "
                        f"| {100 * rate / read_rate:.0f} % |"
                    )
                    print(row, flush=True)
                    lines.append(row)
                row = (
                    f"| {name} ({k} x {n}) | {threads} | {m} | copy (numpy) | {sizes['MatMul fp32'] / 1e6:.0f} "
                    f"| {2 * sizes['MatMul fp32'] / copy_rate * 1e3:.2f} | {copy_rate / 1e9:.1f} | 100 % "
                    f"| {100 * copy_rate / read_rate:.0f} % |"
                )
                print(row, flush=True)
                lines.append(row)
                row = (
                    f"| {name} ({k} x {n}) | {threads} | {m} | read (numpy) | {int4_bytes / 1e6:.0f} "
                    f"| {int4_bytes / read_rate * 1e3:.2f} | {read_rate / 1e9:.1f} "
                    f"| {100 * read_rate / copy_rate:.0f} % | 100 % |"
                )
                print(row, flush=True)
                lines.append(row)
                del runners
    if args.record:
        append_results("The weights at batch 1 on the CPU: ORT MatMul and MatMulNBits vs a copy (issue 42)", lines)


if __name__ == "__main__":
    main()
