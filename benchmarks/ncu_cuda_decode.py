"""The SelectiveStateUpdate kernels that benchmarks/bench_cuda_decode_ops.py times, launched once each inside an
NVTX range, for Nsight Compute: ours (and optionally a second build's, e.g. the previous commit), mamba_ssm's
Triton kernel and the two copies of the same bytes, at one model width, batch and state type, after a warm-up
outside the range. Run under ncu with the range filter (ncu flushes the caches between kernels by default,
so every kernel reads a cold state, as in the benchmark):

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python benchmarks/ncu_cuda_decode.py --build build/cuda --model zamba2-2.7b --batch 1 --state fp16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_cuda_decode_ops import (  # noqa: E402
    MODELS,
    Ours,
    load_triton_ssu,
    ours_ssu,
    ssu_buffers,
    triton_ssu_call,
)
from benchmarks.ncu_cuda import profile  # noqa: E402

STATES = {"fp32": torch.float32, "fp16": torch.float16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, required=True)
    parser.add_argument("--baseline-build", type=Path, default=None)
    parser.add_argument("--mamba-ssm", type=Path, default=REPO / ".bench-vendor" / "mamba_ssm_triton")
    parser.add_argument("--model", default="nemotron-h-8b", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--state", default="fp32", choices=sorted(STATES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1

    w = MODELS[args.model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    c, states, presents = ssu_buffers(w, args.batch, torch.float16, STATES[args.state], 1, gen)
    state, present = states[0], presents[0]
    out = torch.empty_like(c["x"])
    calls = {}
    for name, build in (("ours", args.build), ("previous", args.baseline_build)):
        if build is not None:
            call = ours_ssu(Ours(build), c, out)
            calls[name] = lambda call=call: call(state, present)
    triton_ssu, note = load_triton_ssu(args.mamba_ssm)
    if triton_ssu is not None:
        triton, triton_state = triton_ssu_call(triton_ssu, w, args.batch, c), state.clone()
        calls["triton"] = lambda: triton(triton_state)
    else:
        print(f"no Triton kernel: {note}")
    calls["copy"] = lambda: present.copy_(state)
    calls["copy kernel"] = lambda: torch.mul(state, 1, out=present)
    profile(calls)
    print(f"profiled {', '.join(calls)} at {w.name} B = {args.batch}, {args.state} state")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
