"""CausalConv1d's channels-last CUDA kernel built several ways and timed side by side (GPU).

Each ``--variant NAME=[SOURCE.cu] [FLAGS]`` is one build of a kernel source (default: this checkout's
``contrib_ops/cuda/causal_conv1d_impl.cu``) with nvcc and the given flags, e.g. the compile-time settings at the
top of that file (``-DMAMBAFUSE_CONV_VECTOR_BYTES=16``, ``-DMAMBAFUSE_CONV_UNROLL=8``,
``-DMAMBAFUSE_CONV_MIN_BLOCKS=1``, ``-DMAMBAFUSE_CONV_HALF_PRODUCT=0``, ``-DMAMBAFUSE_CONV_FUSED_SUM=1``), or an
older source to compare against. The script writes a small C entry point beside it, builds one shared library a
variant, and launches each on PyTorch's stream and buffers.

Work: x [B, T, C] channels-last (the in_proj's layout), K = 4, bias, SiLU, no initial state, the final state
returned, at conv dim C (default 10240, Nemotron-H-8B's 8192 + 2·8·128). Timing as in bench_cuda_prefill.py: 20
calls in one CUDA graph, median of 7 replays; the variants of one shape are timed in turns, three rounds, and each
cell is the median of its three medians (so a drift of the clock or the temperature falls on every variant alike).
L2 warm (back-to-back calls on the same buffers). "% copy": a device copy of the same bytes (x read, y written)
timed the same way, over the variant's time.

Checks: every variant's y and final state must equal the first variant's bit for bit (the settings change how the
work is laid out, never the arithmetic), and the first variant's y must match PyTorch's conv1d + silu within 4 ulps
of T at its magnitude (32 for float32); a variant that fails either stops the run. Variants named in ``--inexact``
(a different arithmetic, e.g. ``-DMAMBAFUSE_CONV_FUSED_SUM=1``) are held to the PyTorch check instead.

    python3 benchmarks/sweep_cuda_conv.py --variant v8= --variant v16=-DMAMBAFUSE_CONV_VECTOR_BYTES=16 \\
        --batches 1,4 --lengths 2048 [--markdown out.md]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_cuda_prefill import _time_graph, emit_table  # noqa: E402

DEFAULT_SOURCE = REPO / "contrib_ops" / "cuda" / "causal_conv1d_impl.cu"
TYPES = {"float16": 10, "bfloat16": 16, "float32": 1}
ENTRY = r"""
#include <cuda_runtime.h>
#include "causal_conv1d_launcher.h"
extern "C" __attribute__((visibility("default"))) int sweep_conv_launch(
    const void* x, const void* weight, const void* bias, void* y, void* final_state, int type, long long batch,
    long long channels, long long length, void* stream) {
  mambafuse::CausalConv1dCpuArgs a;
  a.x = x; a.weight = weight; a.bias = bias; a.initial_state = nullptr; a.y = y; a.final_state = final_state;
  a.type = static_cast<mambafuse::ElemType>(type);
  a.batch = batch; a.channels = channels; a.length = length; a.state_len = 3; a.width = 4;
  a.silu = true; a.channels_last = true;
  if (mambafuse::CheckCausalConv1dCudaArgs(a) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchCausalConv1d(a, static_cast<cudaStream_t>(stream)));
}
"""


def _parse_variant(spec: str) -> tuple[str, Path, list[str]]:
    """NAME=[SOURCE.cu] [FLAGS] -> (name, source, flags)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {spec!r}: expected NAME=[SOURCE.cu] [FLAGS]")
    words = shlex.split(rest)
    sources = [Path(w) for w in words if w.endswith(".cu")]
    if len(sources) > 1:
        raise SystemExit(f"--variant {spec!r}: more than one source")
    source = sources[0] if sources else DEFAULT_SOURCE
    if not source.is_file():
        raise SystemExit(f"--variant {spec!r}: no source file {source}")
    return name, source, [w for w in words if not w.endswith(".cu")]


def _build(name: str, source: Path, flags: list[str], arch: str, nvcc: str, work: Path) -> Path:
    """One variant's shared library (ptxas' register and spill report printed)."""
    entry = work / "entry.cu"
    entry.write_text(ENTRY)
    out = work / f"lib{name}.so"
    include = REPO / "contrib_ops"
    command = [nvcc, "-O3", "-std=c++17", f"-arch=sm_{arch}", "--expt-relaxed-constexpr", "-shared",
               "-Xcompiler=-fPIC", "-Xptxas", "-v", f"-I{include / 'cuda'}", f"-I{include}", f"-I{include / 'cpu'}",
               *flags, str(source), str(entry), "-o", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"building {name} failed:\n{done.stderr}")
    lines = done.stderr.splitlines()
    for i, line in enumerate(lines):
        if "ChannelsLastKernel" in line and "Compiling" in line:
            kernel = line.split("ChannelsLastKernel")[1].split("EEEv")[0]
            usage = next((x for x in lines[i + 1 : i + 4] if "registers" in x), "").split(":")[-1].strip()
            spills = next((x for x in lines[i + 1 : i + 4] if "spill" in x), "").strip()
            print(f"  {name}: ChannelsLastKernel{kernel}: {usage}; {spills}", flush=True)
    return out


def _row(torch, libs: dict, inexact: list[str], args, batch: int, length: int) -> str:
    """One shape: every variant checked, then timed in turns; the table's row."""
    names = list(libs)
    dtype = getattr(torch, args.dtype)
    c = args.channels
    x = torch.randn(batch, length, c, device="cuda", dtype=dtype)
    w = (torch.randn(c, 4, device="cuda") * 0.5).to(dtype)
    bias = torch.randn(c, device="cuda", dtype=dtype)
    outs = {n: (torch.empty_like(x), torch.empty(batch, c, 3, device="cuda", dtype=dtype)) for n in names}

    def call(name: str) -> None:
        y, state = outs[name]
        rc = libs[name].sweep_conv_launch(
            x.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), state.data_ptr(), TYPES[args.dtype],
            batch, c, length, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"{name}: launch returned {rc}")

    for name in names:
        call(name)
    torch.cuda.synchronize()
    first_y, first_state = outs[names[0]]
    ref = torch.nn.functional.silu(
        torch.nn.functional.conv1d(
            torch.nn.functional.pad(x.transpose(1, 2).float(), (3, 0)),
            w.float()[:, None, :],
            bias.float(),
            groups=c,
        )
    ).transpose(1, 2)
    ulps = 32 if dtype == torch.float32 else 4  # the contract's roundings; the tests check it exactly
    budget = ulps * torch.finfo(dtype).eps * ref.abs().clamp_min(1.0)
    for name in [names[0], *inexact]:
        y, state = outs[name]
        if not bool(((y.float() - ref).abs() <= budget).all()):
            raise SystemExit(f"{name} differs from PyTorch's conv1d + silu at B={batch}, T={length}")
        if not torch.equal(state, x[:, -3:, :].transpose(1, 2)):
            raise SystemExit(f"{name}: the final state is not x's last 3 rows at B={batch}, T={length}")
    for name in names[1:]:
        if name in inexact:
            continue
        y, state = outs[name]
        if not (torch.equal(y.view(torch.int16 if y.element_size() == 2 else torch.int32),
                            first_y.view(torch.int16 if y.element_size() == 2 else torch.int32))
                and torch.equal(state, first_state)):  # fmt: skip
            raise SystemExit(f"{name} differs from {names[0]} at B={batch}, T={length}")
    runs = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            runs[name].append(_time_graph(torch, lambda n=name: call(n))[0])
    src = torch.empty(x.numel() * x.element_size(), device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = _time_graph(torch, lambda: dst.copy_(src))[0]
    cells = []
    for name in names:
        us = statistics.median(runs[name])
        cells.append(f"{us:.1f} ({copy / us:.0%})")
    return f"| {batch} | {length} | {copy:.1f} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME=[SOURCE.cu] [FLAGS]")
    parser.add_argument("--channels", type=int, default=10240)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--dtype", choices=TYPES, default="float16")
    parser.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--inexact", default="", help="variants whose arithmetic differs (checked against PyTorch, not bit for bit)"
    )
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    variants = [_parse_variant(v) for v in args.variant]
    if len({v[0] for v in variants}) != len(variants):
        raise SystemExit("--variant: names must differ")

    import torch

    torch.backends.cudnn.allow_tf32 = False  # the float32 reference in float32
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    work = Path(tempfile.mkdtemp(prefix="sweep_conv_"))
    print(f"building {len(variants)} variants for sm_{arch} in {work}", flush=True)
    libs = {}
    for name, source, flags in variants:
        lib = ctypes.CDLL(str(_build(name, source, flags, arch, args.nvcc, work)))
        lib.sweep_conv_launch.restype = ctypes.c_int
        lib.sweep_conv_launch.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_longlong] * 3
        lib.sweep_conv_launch.argtypes += [ctypes.c_void_p]
        libs[name] = lib

    inexact = [n for n in args.inexact.split(",") if n]
    if unknown := sorted(set(inexact) - set(libs)):
        raise SystemExit(f"--inexact: no variant {', '.join(unknown)}")
    names = list(libs)
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"{args.dtype}; C = {args.channels}, K = 4, bias, SiLU; CUDA graph of 20 calls, median of 7 replays, median "
        f"of {args.rounds} interleaved rounds, µs a call; L2 warm",
        "",
        "variants: " + "; ".join(f"{n} = {s.name} {' '.join(f)}".strip() for n, s, f in variants),
        "",
        "| B | T | copy µs | " + " | ".join(f"{n} µs (% copy)" for n in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    torch.manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        for length in (int(t) for t in args.lengths.split(",")):
            line = _row(torch, libs, inexact, args, batch, length)
            print(line, flush=True)
            lines.append(line)
            torch.cuda.empty_cache()
    emit_table(lines, args.markdown)


if __name__ == "__main__":
    main()
