"""The int4 decode GEMV's kernels and launch settings side by side, at the real-width projection shapes (GPU).

Each column is one bench library (``name=path``; libraries built with other compile-time settings, e.g.
``-DMAMBAFUSE_NBITS_BULK_CHUNK=2048 -DMAMBAFUSE_NBITS_BULK_STAGES=4``) under one set of the run-time knobs of
docs/decode_matmul.md (Kernels): ``bulk`` (the default), ``mma`` (the register-load kernel), ``mma+waves``,
``mma+contiguous``, ``mma+contiguous+prefetch16``. Timing as in bench_cuda_gemv.py: ≥ 32 calls a CUDA graph, median
of 7 replays, L2 cold; "% copy" against a copy of the same bytes. Each column's output is checked against the
first column's (1 % of the largest value), so a setting that computes something else fails loudly.

``--dequant`` times instead each library's dequantization for the M > 8 path (``mambafuse_dequantize_int4_launch``)
at each shape, against a copy of the bytes it reads and writes, its output checked against PyTorch's
dequantization in the layout that library writes (W as (N, K padded to whole blocks), or (K, N) before).

``--floor name=path`` adds a last column, unchecked: a bench library built with ``-DMAMBAFUSE_NBITS_TRAFFIC_FLOOR``,
whose bulk kernel asks for and waits on every tile as the kernel does and computes nothing (it writes zeros). It is
what the kernel's launch, copies and waits cost at each shape without its arithmetic: a reference, not a bound.

    python3 benchmarks/sweep_cuda_int4.py --lib default=build/cuda/cuda/libmambafuse_cuda_gemv_bench.so \\
        --configs bulk,mma --rows 1,4
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import platform
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_cuda_gemv import (  # noqa: E402
    ONNX_FLOAT16,
    SHAPES,
    Int4Weights,
    _copy_time,
    _time_graph,
    dequant_launcher,
    nbits_launcher,
)
from contrib_ops.cuda.tools.check_int4_gemv import dequantized  # noqa: E402

FLOOR = "traffic floor"  # the --floor column's name
KNOBS = ("MAMBAFUSE_NBITS_KERNEL", "MAMBAFUSE_NBITS_GRID", "MAMBAFUSE_NBITS_ORDER", "MAMBAFUSE_NBITS_PREFETCH")
CONFIGS = {
    "bulk": {},
    "mma": {"MAMBAFUSE_NBITS_KERNEL": "mma"},
    "mma+waves": {"MAMBAFUSE_NBITS_KERNEL": "mma", "MAMBAFUSE_NBITS_GRID": "waves"},
    "mma+contiguous": {"MAMBAFUSE_NBITS_KERNEL": "mma", "MAMBAFUSE_NBITS_ORDER": "contiguous"},
    "mma+contiguous+prefetch16": {
        "MAMBAFUSE_NBITS_KERNEL": "mma",
        "MAMBAFUSE_NBITS_ORDER": "contiguous",
        "MAMBAFUSE_NBITS_PREFETCH": "16",
    },
}


def _row(shape: str, m: int, q: Int4Weights, columns, args) -> list[float]:
    """µs per call of each column at one shape and M, each checked against the first column's output."""
    k, n = q.k, q.n
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    y = torch.empty(m, n, device="cuda", dtype=torch.float16)

    def call(launch, i: int) -> None:
        zp = q.zp[i].data_ptr() if args.zero_points else None
        stream = torch.cuda.current_stream().cuda_stream
        rc = launch(ONNX_FLOAT16, m, k, n, args.block_size, a.data_ptr(), q.b[i].data_ptr(),
                    q.scales[i].data_ptr(), zp, y.data_ptr(), stream)  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"the int4 GEMV launch returned {rc}")

    times, first = [], None
    for name, launch, config in columns:
        for key in KNOBS:
            os.environ.pop(key, None)
        os.environ.update(CONFIGS[config])
        call(launch, 0)
        torch.cuda.synchronize()
        if name == FLOOR:
            pass  # computes nothing
        elif first is None:
            first = y.float().clone()
        else:
            error = (y.float() - first).abs().max().item()
            if error > 1e-2 * max(first.abs().max().item(), 1e-3):
                raise RuntimeError(f"{shape} M={m} {config}: differs from the first column by {error}")
        count = len(q.b)
        fns = [functools.partial(call, launch, i) for i in range(count)]
        times.append(_time_graph(torch, fns, count * max(1, 32 // count)))
    for key in KNOBS:
        os.environ.pop(key, None)
    return times


def _dequant_row(shape: str, q: Int4Weights, libs, args) -> list[float]:
    """µs per dequantization of each library at one shape, each output checked against PyTorch's."""
    k, n, bs = q.k, q.n, args.block_size
    k_pad = q.blocks * bs
    w = torch.empty(n * k_pad, device="cuda", dtype=torch.float16)
    zero_points = q.zp[0].reshape(n, -1) if args.zero_points else None
    ref = dequantized(q.b[0], q.scales[0].reshape(n, q.blocks), zero_points, k=k, block_size=bs, dtype=torch.float16)

    def call(fn, i: int) -> None:
        zp_ptr = q.zp[i].data_ptr() if args.zero_points else None
        rc = fn(ONNX_FLOAT16, k, n, bs, q.b[i].data_ptr(), q.scales[i].data_ptr(), zp_ptr, w.data_ptr(),
                torch.cuda.current_stream().cuda_stream)  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"the dequantization launch returned {rc}")

    times = []
    for name, fn in libs:
        w.fill_(float("nan"))
        call(fn, 0)
        torch.cuda.synchronize()
        by_rows = torch.equal(w.reshape(n, k_pad)[:, :k], ref)
        by_k = torch.equal(w[: k * n].reshape(k, n), ref.t())
        if not (by_rows or by_k):
            raise RuntimeError(f"{shape} {name}: the dequantized weight differs from PyTorch's")
        count = len(q.b)
        times.append(
            _time_graph(torch, [functools.partial(call, fn, i) for i in range(count)], count * max(1, 32 // count))
        )
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", action="append", required=True, help="name=libmambafuse_cuda_gemv_bench.so")
    parser.add_argument("--configs", default="bulk,mma", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--shapes", default="in_proj,out_proj,mlp_up,mlp_down,qkv,o_proj")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--zero-points", action="store_true", help="with MatMulNBits' zero points (default: none)")
    parser.add_argument("--dequant", action="store_true", help="time the M > 8 path's dequantization instead")
    parser.add_argument("--floor", help="name=bench library built with -DMAMBAFUSE_NBITS_TRAFFIC_FLOOR (unchecked)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    def library(flag: str, item: str):
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            parser.error(f"{flag} {item!r}: expected name=path to a bench library")
        return name, ctypes.CDLL(path)

    launcher = dequant_launcher if args.dequant else nbits_launcher
    libs = [(name, launcher(lib)) for name, lib in (library("--lib", item) for item in args.lib)]
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    shapes = args.shapes.split(",")
    if any(s not in SHAPES for s in shapes):
        parser.error(f"shapes must be among {', '.join(SHAPES)}")
    if args.dequant:
        return _dequant_main(args, libs)
    columns = [(lib_name, launch, c) for lib_name, launch in libs for c in configs]
    if args.floor:
        columns.append((FLOOR, nbits_launcher(library("--floor", args.floor)[1]), "bulk"))
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    environment = (
        f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"Python {platform.python_version()}; block size {args.block_size}"
    )
    print(environment, "\n")
    names = [lib_name if lib_name == FLOOR else f"{lib_name} {c}" if len(libs) > 1 else c for lib_name, _, c in columns]
    print(f"| shape (K→N) | M | zp | {' | '.join(names)} | copy µs |")
    print("|---" * (len(columns) + 4) + "|")
    for shape in shapes:
        k, n = SHAPES[shape]
        q = Int4Weights(torch, k, n, args.block_size)
        copy = _copy_time(torch, q.nbytes)
        for m in (int(r) for r in args.rows.split(",")):
            cells = _row(shape, m, q, columns, args)
            zp = "yes" if args.zero_points else "no"
            cells = [f"{t:.1f} ({100 * copy / t:.0f} %)" for t in cells]
            print(f"| {shape} ({k}→{n}) | {m} | {zp} | {' | '.join(cells)} | {copy:.1f} |", flush=True)
    return 0


def _dequant_main(args, libs) -> int:
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; block size "
          f"{args.block_size}; the M > 8 path's dequantization to float16\n")  # fmt: skip
    print(f"| shape (K→N) | zp | {' | '.join(name for name, _ in libs)} | copy µs |")
    print("|---" * (len(libs) + 3) + "|")
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        q = Int4Weights(torch, k, n, args.block_size)
        moved = q.nbytes + 2 * n * q.blocks * args.block_size  # read, and the float16 weight written
        copy = _copy_time(torch, moved)
        cells = [f"{t:.1f} ({100 * copy / t:.0f} %)" for t in _dequant_row(shape, q, libs, args)]
        zp = "yes" if args.zero_points else "no"
        print(f"| {shape} ({k}→{n}) | {zp} | {' | '.join(cells)} | {copy:.1f} |", flush=True)
        del q
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
