"""The prefill ops on the GPU, side by side in one process: our MambaChunkScan CUDA kernels vs mamba_ssm's Triton
``mamba_chunk_scan_combined``, our CausalConv1d vs PyTorch's depthwise conv1d (cuDNN) with its SiLU, and each vs a
copy of the same bytes, every one timed the same way.

Each call is launched on PyTorch's stream on PyTorch's buffers (ours through the C entry point
``mambafuse_chunk_scan_launch`` of ``libmambafuse_cuda_prefill_bench.so``, a MAMBAFUSE_CUDA_TOOLS=ON build), 20
calls captured in one CUDA graph, the graph replayed and timed with CUDA events; per call: the median of 7 replays
(min-max beside it). L2: the calls of a graph run back to back on the same buffers, so whatever of them fits in
the H200's 50 MB L2 stays there between calls (at 2048 tokens and more the inputs and outputs exceed it).

Work: batch B, T tokens, widths (H, P, G, N) of Nemotron-H-8B (128, 64, 8, 128), Zamba2-2.7B (80, 64, 1, 64) and
Bamba-9B (128, 64, 1, 128) — their checkpoints' configs. Inputs in float16 (x, dt, B, C; dt_bias and D float32 as
the models keep them, A float32), softplus on the time step, no initial state, the final state returned.
Differences that are the op's: our out is float32 (the contract: the exported graph computes the scan in float32
and casts after), Triton's is float16; our state is float32, and so is Triton's. The copy moves the bytes our
kernel must move (reads x, dt, B, C; writes out and the final state), as one tensor copy of half that size read
and written. Both kernels' results are compared (a loose tolerance: Triton rounds its products to float16).

The prompt's conv (``--conv-channels``, default Nemotron-H-8B's 10240 = 8192 + 2·8·128; K = 4, float16, bias, SiLU,
no initial state, the final state of K − 1 columns returned): ours reads x as the graph has it, channels-last
[B, T, C], and writes y the same way; PyTorch's ``conv1d`` gets x channels-first [B, C, T+3] already padded (its best
case: the padding and transposes the exported graph adds are left out), then ``silu``. The copy moves x and y's
bytes.

``--one-token`` times a one-token prompt instead (a decode step through the op, as a mobius build runs its cache),
both state layouts, an initial float32 state (and a float16 one, a mobius float16 cache's): the step kernel (the
default for one token) against the chunked kernel on the same token (what ran before the step kernel) and a copy of
the step's bytes (the state read and written, x, dt, B, C and out); then the conv on one token at each width's conv
dim against a copy of its bytes (run it with an older build's library for the kernel that ran before).

Run on the GPU machine:

    python3 benchmarks/bench_cuda_prefill.py --bench-lib build/cuda/cuda/libmambafuse_cuda_prefill_bench.so \\
        --triton .bench-vendor/mamba_ssm_ssd [--markdown out.md]

``--triton`` is a folder that holds mamba_ssm's package (``mamba_ssm/ops/triton/ssd_*.py`` and what they import,
with einops); without it the Triton column is left out.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
from pathlib import Path

WIDTHS = {
    "nemotron-h-8b": (128, 64, 8, 128),
    "zamba2-2.7b": (80, 64, 1, 64),
    "bamba-9b": (128, 64, 1, 128),
}
ONNX_FLOAT, ONNX_FLOAT16 = 1, 10
PATHS = {"chunked": 1, "sequential": 2, "step": 3}
WARPS_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CUDA_WARPS"
STATE_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CUDA_STATE"


def _time_graph(torch, fn, calls: int = 20, repeats: int = 7) -> tuple[float, float, float]:
    """(median, min, max) µs a call of ``fn`` over ``repeats`` replays of a graph of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
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
    return statistics.median(times), min(times), max(times)


def _time_copy(torch, moved: int) -> tuple[float, float, float]:
    """``_time_graph`` of a device copy that reads and writes ``moved`` bytes in all (one tensor of half of them)."""
    src = torch.empty(moved // 2, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _time_graph(torch, lambda: dst.copy_(src))


def emit_table(lines: list[str], markdown: Path | None) -> None:
    """Print the table (the rows were printed as they came; this is the whole of it) and write it to ``markdown``."""
    text = "\n".join(lines)
    print(text)
    if markdown is not None:
        markdown.write_text(text + "\n")


def _flops(length: int, batch: int, widths: tuple[int, int, int, int], chunk: int) -> float:
    """The chunked algorithm's nominal FLOPs at chunk ``chunk``: C·Bᵀ per group, the intra-chunk product, the chunk
    states and their readout per head (2T·(G·Q·N + H·Q·P + 2·H·N·P)), causal halves not skipped."""
    h, p, g, n = widths
    return 2.0 * batch * length * (g * chunk * n + h * chunk * p + 2 * h * n * p)


def _with_env(variable: str, value: str, fn):
    """``fn()`` with ``variable`` set (the launcher reads it at each launch, so a graph captured inside keeps the
    kernel it chose)."""
    os.environ[variable] = value
    try:
        return fn()
    finally:
        del os.environ[variable]


def _measure(torch, launch, combined, name: str, batch: int, length: int, sequential: bool) -> str:
    """One row of the table: every column's timing for these widths, batch and prompt length."""
    widths = WIDTHS[name]
    h, pd, g, n = widths
    dev = "cuda"
    x = torch.randn(batch, length, h, pd, device=dev, dtype=torch.float16)
    dt = (torch.randn(batch, length, h, device=dev) - 2).to(torch.float16)
    dt_bias = (torch.rand(h, device=dev) * 0.5).to(torch.float16)  # our op takes dt_bias in T
    a = -torch.exp(torch.rand(h, device=dev) * 2)
    bm = torch.randn(batch, length, g, n, device=dev, dtype=torch.float16)
    cm = torch.randn(batch, length, g, n, device=dev, dtype=torch.float16)
    d = torch.randn(h, device=dev)
    out = torch.empty(batch, length, h, pd, device=dev, dtype=torch.float32)
    state = torch.empty(batch, h, pd, n, device=dev, dtype=torch.float32)

    def ours(path: int) -> None:
        rc = launch(
            x.data_ptr(), dt.data_ptr(), dt_bias.data_ptr(), a.data_ptr(), bm.data_ptr(), cm.data_ptr(),
            d.data_ptr(), None, out.data_ptr(), state.data_ptr(), ONNX_FLOAT16, ONNX_FLOAT, ONNX_FLOAT,
            batch, length, h, pd, g, n, 1, 0.0, float("inf"), path, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"mambafuse_chunk_scan_launch returned {rc}")

    chunked = PATHS["chunked"]
    times = {"chunked": _with_env(STATE_VARIABLE, "shared", lambda: _time_graph(torch, lambda: ours(chunked)))}
    if sequential:
        times["sequential"] = _time_graph(torch, lambda: ours(PATHS["sequential"]))
    times["chunked8"] = _with_env(WARPS_VARIABLE, "8", lambda: _time_graph(torch, lambda: ours(chunked)))
    times["registers"] = _with_env(STATE_VARIABLE, "registers", lambda: _time_graph(torch, lambda: ours(chunked)))
    _with_env(STATE_VARIABLE, "registers", lambda: ours(chunked))
    torch.cuda.synchronize()
    out_registers = out.clone()
    _with_env(STATE_VARIABLE, "shared", lambda: ours(chunked))
    torch.cuda.synchronize()
    diff_kernels = f"{(out_registers - out).abs().max().item():.2e}"
    diff = "-"
    if combined is not None:
        bias = dt_bias.float()

        def triton():
            return combined(
                x, dt, a, bm, cm, chunk_size=256, D=d, dt_bias=bias, dt_softplus=True, return_final_states=True
            )

        times["triton"] = _time_graph(torch, triton)
        y_triton, _ = triton()
        torch.cuda.synchronize()
        diff = f"{(y_triton.float() - out_registers).abs().max().item():.2e}"
    moved = sum(t.numel() * t.element_size() for t in (x, dt, bm, cm, out, state))
    times["copy"] = _time_copy(torch, moved)

    def cell(key: str) -> str:
        if key not in times:
            return "-"
        med, lo, hi = times[key]
        return f"{med:.1f} ({lo:.1f}-{hi:.1f})"

    best = times["registers"][0]
    ratio = f"{times['chunked'][0] / best:.2f}x"
    ratio_triton = f"{times['triton'][0] / best:.2f}x" if "triton" in times else "-"
    tflops = _flops(length, batch, widths, 64) / (best * 1e-6) / 1e12
    return (
        f"| {name} {widths} | {batch} | {length} | {cell('chunked')} | {cell('registers')} | {cell('chunked8')} | "
        f"{cell('sequential')} | {cell('triton')} | {cell('copy')} | {ratio} | {ratio_triton} | "
        f"{best / times['copy'][0]:.2f} | {tflops:.1f} | {diff_kernels} | {diff} |"
    )


def _measure_step(torch, launch, name: str, batch: int, state_layout: int, state_type: int = ONNX_FLOAT) -> str:
    """One row of the one-token table: the step kernel, the chunked kernel and a copy of the step's bytes."""
    h, pd, g, n = WIDTHS[name]
    dev = "cuda"
    x = torch.randn(batch, 1, h, pd, device=dev, dtype=torch.float16)
    dt = torch.randn(batch, 1, h, device=dev) - 2  # float32, as mobius builds pass it
    dt_bias = torch.rand(h, device=dev) * 0.5
    a = -torch.exp(torch.rand(h, device=dev) * 2)
    bm = torch.randn(batch, 1, g, n, device=dev, dtype=torch.float16)
    cm = torch.randn(batch, 1, g, n, device=dev, dtype=torch.float16)
    d = torch.randn(h, device=dev)
    dims = (batch, h, n, pd) if state_layout == 1 else (batch, h, pd, n)
    initial = torch.randn(*dims, device=dev).to(torch.float16 if state_type == ONNX_FLOAT16 else torch.float32)
    out = torch.empty(batch, 1, h, pd, device=dev, dtype=torch.float32)
    state = torch.empty(*dims, device=dev)
    results = {}

    def ours(path: int) -> None:
        rc = launch(
            x.data_ptr(), dt.data_ptr(), dt_bias.data_ptr(), a.data_ptr(), bm.data_ptr(), cm.data_ptr(),
            d.data_ptr(), initial.data_ptr(), out.data_ptr(), state.data_ptr(), ONNX_FLOAT16, ONNX_FLOAT, ONNX_FLOAT,
            state_type, batch, 1, h, pd, g, n, 1, 0.0, float("inf"), state_layout, path,
            torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"mambafuse_chunk_scan_launch_layout returned {rc}")

    times = {}
    for key, path in (("step", PATHS["step"]), ("chunked", PATHS["chunked"])):
        times[key] = _time_graph(torch, lambda path=path: ours(path))
        ours(path)
        torch.cuda.synchronize()
        results[key] = (out.clone(), state.clone())
    moved = sum(t.numel() * t.element_size() for t in (x, dt, bm, cm, out, initial, state))
    times["copy"] = _time_copy(torch, moved)
    diff = max((a - b).abs().max().item() for a, b in zip(results["step"], results["chunked"], strict=True))

    def cell(key: str) -> str:
        med, lo, hi = times[key]
        return f"{med:.2f} ({lo:.2f}-{hi:.2f})"

    step = times["step"][0]
    return (
        f"| {name} {WIDTHS[name]} | {batch} | {'(N, P)' if state_layout else '(P, N)'}, "
        f"{'fp16' if state_type == ONNX_FLOAT16 else 'fp32'} in | {cell('step')} | "
        f"{cell('chunked')} | {cell('copy')} | {times['chunked'][0] / step:.2f}x | {step / times['copy'][0]:.2f} | "
        f"{moved / (step * 1e-6) / 1e9:.0f} | {diff:.1e} |"
    )


def _one_token_table(torch, lib, widths: list[str], batches: list[int]) -> list[str]:
    launch = lib.mambafuse_chunk_scan_launch_layout
    launch.restype = ctypes.c_int
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    launch.argtypes = [p] * 10 + [i] * 4 + [i64] * 6 + [i, f, f, i, i, p]
    lines = [
        "| widths (H, P, G, N) | B | state layout, initial state type | step µs | chunked µs | copy µs | "
        "chunked / step | step / copy | "
        "step GB/s | max abs diff step vs chunked |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in widths:
        for batch in batches:
            for state_layout, state_type in ((0, ONNX_FLOAT), (1, ONNX_FLOAT), (1, ONNX_FLOAT16)):
                line = _measure_step(torch, launch, name, batch, state_layout, state_type)
                print(line, flush=True)
                lines.append(line)
    lines += [
        "",
        "One token (a decode step through MambaChunkScan), float16 x, B, C; float32 dt, dt_bias, D, A, the final "
        "state and the initial state where not fp16 (a mobius build's float16 cache: fp16). "
        "chunked / step > 1: the step kernel faster. step / copy: its time in copies of the same bytes (1: the "
        "memory floor; a launch's fixed cost dominates at these sizes).",
        "",
        "| conv (C) | B | CausalConv1d µs | copy µs | conv / copy |",
        "|---|---|---|---|---|",
    ]
    conv = lib.mambafuse_causal_conv1d_launch_rounding
    conv.restype = ctypes.c_int
    conv.argtypes = [p] * 6 + [i] + [i64] * 5 + [i, i, i, p]
    for name in widths:
        for batch in batches:
            line = _measure_conv_step(torch, lib, name, batch)
            print(line, flush=True)
            lines.append(line)
    lines += [
        "",
        "One token through CausalConv1d (float16, K = 4, bias, SiLU, rounded once, a float16 initial state of 3 "
        "columns, channels-last: a mobius build's conv under --opt-in causal_conv_with_state); copy: its bytes.",
    ]
    return lines


#: The conv dims (d_inner + 2 G N) of the widths above, for the one-token conv rows.
CONV_CHANNELS = {"nemotron-h-8b": 10240, "zamba2-2.7b": 5248, "bamba-9b": 8448}


def _measure_conv_step(torch, lib, name: str, batch: int) -> str:
    """One row of the one-token conv table: CausalConv1d on one token (float16, K = 4, bias, SiLU, rounded once as
    a mobius build's node, an initial state of K - 1 columns) and a copy of its bytes."""
    dev, width, channels = "cuda", 4, CONV_CHANNELS[name]
    x = torch.randn(batch, 1, channels, device=dev, dtype=torch.float16)
    w = (torch.randn(channels, width, device=dev) * 0.5).to(torch.float16)
    bias = torch.randn(channels, device=dev, dtype=torch.float16)
    initial = torch.randn(batch, channels, width - 1, device=dev, dtype=torch.float16)
    y = torch.empty_like(x)
    state = torch.empty_like(initial)

    def ours() -> None:
        rc = lib.mambafuse_causal_conv1d_launch_rounding(
            x.data_ptr(), w.data_ptr(), bias.data_ptr(), initial.data_ptr(), y.data_ptr(), state.data_ptr(),
            ONNX_FLOAT16, batch, channels, 1, width - 1, width, 1, 1, 1, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"mambafuse_causal_conv1d_launch_rounding returned {rc}")

    times = {"ours": _time_graph(torch, ours)}
    moved = sum(t.numel() * t.element_size() for t in (x, w, bias, initial, y, state))
    times["copy"] = _time_copy(torch, moved)
    cells = " | ".join(f"{v[0]:.2f} ({v[1]:.2f}-{v[2]:.2f})" for v in times.values())
    return f"| {name} (C = {channels}) | {batch} | {cells} | {times['ours'][0] / times['copy'][0]:.2f} |"


def _measure_conv(torch, lib, channels: int, batch: int, length: int) -> str:
    """One row of the conv table."""
    dev, width = "cuda", 4
    x = torch.randn(batch, length, channels, device=dev, dtype=torch.float16)
    w = (torch.randn(channels, width, device=dev) * 0.5).to(torch.float16)
    bias = torch.randn(channels, device=dev, dtype=torch.float16)
    y = torch.empty_like(x)
    state = torch.empty(batch, channels, width - 1, device=dev, dtype=torch.float16)

    def ours() -> None:
        rc = lib.mambafuse_causal_conv1d_launch(
            x.data_ptr(), w.data_ptr(), bias.data_ptr(), None, y.data_ptr(), state.data_ptr(), ONNX_FLOAT16,
            batch, channels, length, width - 1, width, 1, 1, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"mambafuse_causal_conv1d_launch returned {rc}")

    x_first = torch.nn.functional.pad(x.transpose(1, 2).contiguous(), (width - 1, 0))
    w_torch = w[:, None, :].contiguous()

    def cudnn():
        return torch.nn.functional.silu(torch.nn.functional.conv1d(x_first, w_torch, bias, groups=channels))

    times = {"ours": _time_graph(torch, ours), "cudnn": _time_graph(torch, cudnn)}
    ours()
    torch.cuda.synchronize()
    diff = (cudnn().transpose(1, 2).float() - y.float()).abs().max().item()
    moved = 2 * x.numel() * x.element_size()
    times["copy"] = _time_copy(torch, moved)
    med = {k: v[0] for k, v in times.items()}
    cells = " | ".join(f"{v[0]:.1f} ({v[1]:.1f}-{v[2]:.1f})" for v in times.values())
    return (
        f"| {channels} | {batch} | {length} | {cells} | {med['cudnn'] / med['ours']:.2f}x | "
        f"{med['copy'] / med['ours']:.0%} | {diff:.2e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-lib", type=Path, required=True)
    parser.add_argument("--triton", type=Path, default=None)
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--widths", default=",".join(WIDTHS))
    parser.add_argument("--conv-channels", default="10240")
    parser.add_argument("--skip-scan", action="store_true")
    parser.add_argument("--skip-sequential", action="store_true", help="leave out the sequential kernel's column")
    parser.add_argument("--one-token", action="store_true", help="time a one-token prompt (a decode step) instead")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()

    import torch

    lib = ctypes.CDLL(str(args.bench_lib))
    if args.one_token:
        torch.manual_seed(0)
        header = [
            f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; Python {platform.python_version()}; "
            f"CUDA graph of 20 calls, median (min-max) µs a call of 7 replays; L2 warm (back-to-back calls)",
            "",
        ]
        batches = [int(b) for b in args.batches.split(",")]
        emit_table(header + _one_token_table(torch, lib, args.widths.split(","), batches), args.markdown)
        return
    launch = lib.mambafuse_chunk_scan_launch
    launch.restype = ctypes.c_int
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    launch.argtypes = [p] * 10 + [ctypes.c_int] * 3 + [i64] * 6 + [ctypes.c_int, ctypes.c_float, ctypes.c_float]
    launch.argtypes += [ctypes.c_int, p]
    combined = None
    if args.triton is not None:
        sys.path.insert(0, str(args.triton))
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as combined  # noqa: PLC0415

    lines = [
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; Python {platform.python_version()}; "
        f"CUDA graph of 20 calls, median (min-max) µs a call of 7 replays; L2 warm (back-to-back calls)",
        "",
        "| widths (H, P, G, N) | B | T | ours, state in shared memory µs | ours, state in registers µs | "
        "any widths, 8 warps µs | ours, sequential µs | mamba_ssm Triton µs | copy µs | shared / registers | "
        "Triton / registers | registers / copy | registers TFLOP/s (Q 64) | max abs diff registers vs shared | "
        "max abs diff registers vs Triton |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    torch.manual_seed(0)
    for name in [] if args.skip_scan else args.widths.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for length in (int(t) for t in args.lengths.split(",")):
                line = _measure(torch, launch, combined, name, batch, length, not args.skip_sequential)
                print(line, flush=True)
                lines.append(line)
                torch.cuda.empty_cache()
    lines += [
        "",
        "| conv dim C (K 4) | B | T | ours µs | PyTorch conv1d + silu µs | copy µs | PyTorch / ours | "
        "copy / ours (share of copy bandwidth) | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lib.mambafuse_causal_conv1d_launch.restype = ctypes.c_int
    lib.mambafuse_causal_conv1d_launch.argtypes = [p] * 6 + [ctypes.c_int] + [i64] * 5 + [ctypes.c_int] * 2 + [p]
    for channels in (int(c) for c in args.conv_channels.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for length in (int(t) for t in args.lengths.split(",")):
                line = _measure_conv(torch, lib, channels, batch, length)
                print(line, flush=True)
                lines.append(line)
                torch.cuda.empty_cache()
    lines += [
        "",
        "shared / registers and Triton / registers > 1: the register-state kernel faster. registers / copy: its time "
        "in copies of the same bytes (1: the memory floor). At these widths the half path's kernels: the state in "
        "registers (RegisterStateScan, the default) and in shared memory (MAMBAFUSE_CHUNK_SCAN_CUDA_STATE=shared).",
    ]
    emit_table(lines, args.markdown)


if __name__ == "__main__":
    main()
