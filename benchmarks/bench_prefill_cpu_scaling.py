"""Thread scaling of the prefill ops' CPU kernels on a many-core host: the exported subgraph vs the fused node.

Two steps, because the host measured (the GPU machine's 16-core CPU) has no transformers to export with:

    python -m benchmarks.bench_prefill_cpu_scaling export DIR     # here: transformers' functions, torch.onnx (dynamo)
    python -m benchmarks.bench_prefill_cpu_scaling time DIR       # there: ORT with the library (MAMBAFUSE_LIBRARY)

``export`` writes four models at Nemotron-H-8B widths: transformers' ``mamba2_chunk_scan`` (H 128, P 64, G 8, N 128,
chunk 128, with D and dt_bias) and the prompt's conv chain (C 10240, K 4, SiLU), each exported with a dynamic prompt
length (traced at a length that is not a multiple of the chunk) and fused by the rules. ``time`` runs each at 2048
tokens, float32, at 1, 2, 4, 8 and 16 intra-op threads: the exported graph, the fused node with the library's
kernel, and the fused node without the library (its model-local function); the min of the Runs in a few seconds.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

T = 2048
HEADS, HEAD_DIM, GROUPS, STATE, CHUNK = 128, 64, 8, 128, 128
CONV_DIM, WIDTH = 10240, 4


def export(folder: Path) -> None:
    import onnx
    import onnx_ir as ir
    import torch
    from transformers.models.mamba2 import modeling_mamba2 as modeling

    from fusion.rules import causal_conv1d as conv_rules
    from fusion.rules import mamba_chunk_scan as scan_rules
    from fusion.rules.registry import attach_functions

    folder.mkdir(parents=True, exist_ok=True)
    scan = getattr(modeling.mamba2_chunk_scan, "__wrapped__", modeling.mamba2_chunk_scan)

    class Scan(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A = torch.nn.Parameter(-torch.rand(HEADS) - 0.5)
            self.D = torch.nn.Parameter(torch.randn(HEADS))
            self.dt_bias = torch.nn.Parameter(torch.randn(HEADS) * 0.1)

        def forward(self, x, dt, B, C):
            return scan(x, dt, self.A, B, C, CHUNK, D=self.D, dt_bias=self.dt_bias, dt_softplus=True)

    class Conv(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(CONV_DIM, CONV_DIM, WIDTH, groups=CONV_DIM, padding=WIDTH - 1)

        def forward(self, x):
            return torch.nn.functional.silu(self.conv(x.transpose(1, 2))[..., : x.shape[1]]).transpose(1, 2)

    traced = 2 * CHUNK + 5  # not a multiple of the chunk: the export keeps the slice back to the prompt
    seq = torch.export.Dim("seq", min=2)
    scan_args = (
        torch.randn(1, traced, HEADS, HEAD_DIM),
        torch.randn(1, traced, HEADS),
        torch.randn(1, traced, GROUPS, STATE),
        torch.randn(1, traced, GROUPS, STATE),
    )
    for name, module, args, fuse in (
        ("scan", Scan(), scan_args, scan_rules.fuse_mamba_chunk_scan),
        ("conv", Conv(), (torch.randn(1, traced, CONV_DIM),), conv_rules.fuse_causal_conv1d),
    ):
        path = folder / f"{name}.onnx"
        names = ["x", "dt", "B", "C"][: len(args)]
        program = torch.onnx.export(
            module, args, dynamo=True, optimize=True, dynamic_shapes=({1: seq},) * len(args), input_names=names
        )
        program.save(str(path))
        model = ir.load(str(path))
        if fuse(model) != 1:
            raise SystemExit(f"{name}: the rule did not fuse the export")
        proto = ir.serde.serialize_model(model)
        attach_functions(proto)
        onnx.save(proto, str(folder / f"{name}_fused.onnx"))
        print("wrote", path, folder / f"{name}_fused.onnx")


def measure(folder: Path, threads_list: list[int], seconds: float) -> None:
    import onnxruntime as ort

    import contrib_ops

    rng = np.random.default_rng(0)
    feeds = {
        "scan": {
            "x": rng.standard_normal((1, T, HEADS, HEAD_DIM)).astype(np.float32),
            "dt": rng.standard_normal((1, T, HEADS)).astype(np.float32),
            "B": rng.standard_normal((1, T, GROUPS, STATE)).astype(np.float32),
            "C": rng.standard_normal((1, T, GROUPS, STATE)).astype(np.float32),
        },
        "conv": {"x": rng.standard_normal((1, T, CONV_DIM)).astype(np.float32)},
    }

    def best(session, inputs) -> float:
        session.run(None, inputs)
        start, fastest = time.perf_counter(), float("inf")
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            session.run(None, inputs)
            fastest = min(fastest, time.perf_counter() - t0)
        return fastest * 1e3

    def options(threads: int):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        return so

    print(f"host CPUs {os.cpu_count()}, onnxruntime {ort.__version__}, {T} tokens, float32, min ms of the Runs")
    print("| op | threads | exported ms | fused, kernel ms | speed-up | fused, function body ms |")
    print("|---|---|---|---|---|---|")
    for name, op in (("scan", "MambaChunkScan"), ("conv", "CausalConv1d")):
        for threads in threads_list:
            exported = best(ort.InferenceSession(str(folder / f"{name}.onnx"), options(threads)), feeds[name])
            fused_path = str(folder / f"{name}_fused.onnx")
            kernel = best(
                contrib_ops.session(fused_path, session_options=options(threads), use_library=True), feeds[name]
            )
            body = best(ort.InferenceSession(fused_path, options(threads)), feeds[name])
            print(
                f"| {op} | {threads} | {exported:.1f} | {kernel:.1f} | {exported / kernel:.1f}x | {body:.1f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("export", "time"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if args.step == "export":
        export(args.folder)
    else:
        measure(args.folder, [int(t) for t in args.threads.split(",")], args.seconds)


if __name__ == "__main__":
    main()
