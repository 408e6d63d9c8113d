"""The prefill CUDA kernels (MambaChunkScan's chunked, sequential and one-token kernels, CausalConv1d's four) on a
list of cases, for compute-sanitizer: memcheck (out-of-range global and shared accesses), racecheck (shared-memory
hazards between the chunked kernel's phases) and synccheck. Launched through libmambafuse_cuda_prefill_bench.so
on PyTorch's buffers; the results are checked by the pytest suites (tests/test_mamba_chunk_scan_cuda.py,
tests/test_causal_conv1d_cuda.py): this only runs the kernels.

    compute-sanitizer --tool racecheck python3 contrib_ops/cuda/tools/sanitize_prefill.py <bench lib> [--quick]
        [--states shared]

--states picks the half path's kernels (registers: RegisterStateScan, shared: ChunkedScan; both by default).
racecheck runs with --states shared: on RegisterStateScan it reports hazards that are not there. That kernel's
roles meet at the block barrier from their own code with named barriers of part of the block between, which
racecheck does not follow: the same pattern alone, race-free and reading what it should, draws tens of thousands
of reports (racecheck_handoff.cu's `roles` mode; none without the partial barriers). RegisterStateScan's
synchronization is checked by tests/test_prefill_cuda_races.py instead (ThreadSanitizer on the host emulation).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import sys

import torch

TYPES = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("library", help="libmambafuse_cuda_prefill_bench.so")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--states", default="registers,shared", help="comma-separated: registers, shared")
    args = parser.parse_args()
    states = args.states.split(",")
    if any(state not in ("registers", "shared") for state in states):
        parser.error(f"--states takes registers and/or shared, comma-separated, not {args.states!r}")
    quick = args.quick
    lib = ctypes.CDLL(args.library)
    launch = lib.mambafuse_chunk_scan_launch_layout
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    launch.argtypes = [p] * 10 + [ctypes.c_int] * 4 + [i64] * 6 + [ctypes.c_int, ctypes.c_float, ctypes.c_float]
    launch.argtypes += [ctypes.c_int, ctypes.c_int, p]
    # The last two: the chunked kernel's half path (float16 and bfloat16 at P = 64, N = 128 or 64), over four and five
    # chunks (--quick keeps both).
    shapes = [
        (2, 70, 4, 8, 2, 16),
        (1, 130, 2, 17, 1, 33),
        (1, 3, 2, 5, 1, 300),
        (1, 260, 2, 64, 2, 128),
        (1, 200, 2, 64, 1, 64),
    ]
    if quick:
        shapes = shapes[:2] + shapes[-2:]
    # One token (the step kernel, path 3): the models' widths, 4-element vectors, and widths that are not.
    shapes += [(2, 1, 4, 64, 2, 128), (1, 1, 3, 40, 1, 24), (1, 1, 2, 6, 1, 10)]
    cases = 0
    # The chunked path (1) with each half-path kernel where the shape takes it, the sequential one (2) and for one
    # token the step (3).
    runs = [(1, state) for state in states] + [(2, states[0]), (3, states[0])]
    # The optional inputs absent; present; present with a float time step and the states (B, H, N, P) (a mobius
    # build's scan: state_layout 1).
    variants = [(False, False), (True, False), (True, True)]
    for (batch, length, heads, head_dim, groups, n), type_id, (path, state), (extras, mobius) in itertools.product(
        shapes, TYPES, runs, variants
    ):
        if path == 3 and length != 1:
            continue
        os.environ["MAMBAFUSE_CHUNK_SCAN_CUDA_STATE"] = state  # read at each launch
        t = TYPES[type_id]
        dev = "cuda"
        x = torch.randn(batch, length, heads, head_dim, device=dev).to(t)
        dt_type = 1 if mobius else type_id
        dt = torch.randn(batch, length, heads, device=dev).to(TYPES[dt_type])
        bias = torch.randn(heads, device=dev).to(TYPES[dt_type]) if extras else None
        a = -torch.rand(heads, device=dev) - 0.5
        bm = torch.randn(batch, length, groups, n, device=dev).to(t)
        cm = torch.randn(batch, length, groups, n, device=dev).to(t)
        d = torch.randn(heads, device=dev) if extras else None
        state_dims = (n, head_dim) if mobius else (head_dim, n)
        init = torch.randn(batch, heads, *state_dims, device=dev).to(t) if extras else None
        out = torch.empty(batch, length, heads, head_dim, device=dev)
        state = torch.empty(batch, heads, *state_dims, device=dev)

        def ptr(v):
            return None if v is None else v.data_ptr()

        rc = launch(
            ptr(x), ptr(dt), ptr(bias), ptr(a), ptr(bm), ptr(cm), ptr(d), ptr(init), ptr(out), ptr(state),
            type_id, dt_type, 1, type_id, batch, length, heads, head_dim, groups, n, 1, 0.0, float("inf"),
            int(mobius), path, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        torch.cuda.synchronize()
        if rc != 0:
            shape = (batch, length, heads, head_dim, groups, n)
            print(f"launch failed ({rc}): {shape} type {type_id} path {path} state {state} mobius {mobius}")
            return 1
        cases += 1
    conv = lib.mambafuse_causal_conv1d_launch_rounding
    conv.argtypes = [p] * 6 + [ctypes.c_int] + [i64] * 5 + [ctypes.c_int] * 3 + [p]
    # (batch, channels, length, width); lengths 1-4 at K = 4 take the step kernel (131 channels at batch 2: a part
    # block); the last: channels-last over many token tiles, the last tile a part step
    conv_shapes = [(2, 16, 37, 4), (1, 5, 3, 4), (1, 24, 70, 3), (3, 8, 1, 4), (2, 131, 4, 4), (2, 2048, 203, 4)]
    for (batch, channels, length, width), type_id, last, extras in itertools.product(
        conv_shapes, TYPES, (1, 0), (False, True)
    ):
        t = TYPES[type_id]
        dev = "cuda"
        shape = (batch, length, channels) if last else (batch, channels, length)
        x = torch.randn(shape, device=dev).to(t)
        w = torch.randn(channels, width, device=dev).to(t)
        bias = torch.randn(channels, device=dev).to(t) if extras else None
        init = torch.randn(batch, channels, width, device=dev).to(t) if extras else None
        y = torch.empty_like(x)
        state_len = width if extras else width - 1
        state = torch.empty(batch, channels, state_len, device=dev).to(t)
        rc = conv(
            x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(),
            None if init is None else init.data_ptr(), y.data_ptr(), state.data_ptr(), type_id, batch, channels,
            length, state_len, width, 1, last, int(extras), torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        torch.cuda.synchronize()
        if rc != 0:
            print(f"conv launch failed ({rc}): {(batch, channels, length, width)} type {type_id} last {last}")
            return 1
        cases += 1
    print(f"{cases} launches ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
