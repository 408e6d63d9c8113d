"""The GPU kernels that benchmarks/bench_cuda.py times, launched once each inside an NVTX range, for Nsight Compute.

The fused kernel (and optionally a second build's, e.g. the previous commit), mamba_ssm's Triton kernel and a
copy of the same bytes, at one size, after a warm-up outside the range. Run under ncu with the range filter:

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python benchmarks/ncu_cuda.py --build build/cuda --rows 8192 --channels 7680 --dtype fp16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_cuda import DTYPES, EPS, FusedKernel, load_mamba_rmsnorm  # noqa: E402


def profile(calls: dict[str, Callable[[], object]]) -> None:
    """Each call twice as a warm-up (Triton compiles here) outside the profiled range, then once each inside one
    NVTX range, synchronized after each: what ``ncu --nvtx --nvtx-include "profile/"`` profiles."""
    for call in calls.values():
        call()
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    for call in calls.values():
        call()
        torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, required=True)
    parser.add_argument("--baseline-build", type=Path, default=None)
    parser.add_argument("--mamba-layernorm", type=Path, default=REPO / ".bench-vendor" / "layernorm_gated.py")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--channels", type=int, default=7680)
    parser.add_argument("--dtype", default="fp16")
    args = parser.parse_args()

    dtype = DTYPES[args.dtype]
    group_size = args.channels // 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(args.rows, args.channels, device="cuda", dtype=dtype, generator=gen)
    z = 2 * torch.randn(args.rows, args.channels, device="cuda", dtype=dtype, generator=gen)
    w = (1 + 0.5 * torch.randn(args.channels, device="cuda", generator=gen)).to(dtype)
    out = torch.empty_like(y)
    moved = 3 * y.numel() * y.element_size() + w.numel() * w.element_size()
    src = torch.ones(moved // 8, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    calls = {"fused": lambda: FusedKernel(args.build / "cuda" / "libmambafuse_cuda_bench.so")(y, z, w, out, group_size)}
    if args.baseline_build is not None:
        previous = FusedKernel(args.baseline_build / "cuda" / "libmambafuse_cuda_bench.so")
        calls["previous"] = lambda: previous(y, z, w, out, group_size)
    rmsnorm_fn = load_mamba_rmsnorm(args.mamba_layernorm)
    if rmsnorm_fn is not None:
        calls["triton"] = lambda: rmsnorm_fn(y, w, None, z=z, eps=EPS, group_size=group_size, norm_before_gate=False)
    calls["copy"] = lambda: dst.copy_(src)
    calls["copy kernel"] = lambda: torch.mul(src, 1.0, out=dst)
    profile(calls)
    print(f"profiled {', '.join(calls)} at {args.rows} x {args.channels} {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
