"""Shared setup of the benchmarks: the environment line, chain models, and the RESULTS.md writer."""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

import onnx

import contrib_ops
from fusion import report
from fusion._chains import BFLOAT16, FLOAT, FLOAT16, ChainSpec, build_chain, build_chain_sequence, half_decode
from fusion.rewrite import rewrite_model

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

#: Exported decode spellings (docs/forms.md): fp32 -> form A with dynamic shapes, fp16 -> form C.
DECODE_SPECS = {
    "fp32": dict(shape_as="dynamic", leading=("batch", "seq")),
    "fp16": dict(**half_decode(FLOAT16), shape_as="dynamic", leading=("batch", "seq")),
}
#: Exported prefill spellings: fp32 -> form A, fp16 -> form B (y already f32, f16 gate, f16 output).
PREFILL_SPECS = {
    "fp32": dict(shape_as="dynamic", leading=("batch", "seq")),
    "fp16": dict(z_dtype=FLOAT16, cast_z=True, trailing_cast=FLOAT16, shape_as="dynamic", leading=("batch", "seq")),
}


def chain_pair(spec: ChainSpec, count: int = 1) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Return (unfused, fused) models of ``count`` chains in sequence (with residual Adds, as between the
    layers of a model); fails if a chain did not fuse."""
    model = build_chain(spec) if count == 1 else build_chain_sequence(spec, count, residual=True)
    fused, result = rewrite_model(model)
    if result.fused != count:
        raise SystemExit(f"benchmark setup: expected {count} fused chains, got {result.fused}: {result.summary()}")
    return model, fused


def without_output_identity(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return ``model`` without the Identity through which ``build_chain`` names its output.

    In prefill that Identity is a copy of the whole output (64 MB at 2048 x 8192 fp32) that no exported model
    has: there the chain feeds the out-projection. Measured against ORT's Add over the same bytes it would
    count against the op (fp32, one thread: 10.6 ms with it, 8.9 ms without)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    last = model.graph.node[-1]
    if last.op_type != "Identity" or last.output[0] not in {o.name for o in model.graph.output}:
        return model
    source = last.input[0]
    del model.graph.node[-1]
    for node in model.graph.node:
        node.output[:] = [last.output[0] if name == source else name for name in node.output]
        node.input[:] = [last.output[0] if name == source else name for name in node.input]
    return model


def status_kb(field: str) -> int:
    """A field of this process's /proc/self/status in kB (VmRSS: the resident set; VmHWM: its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset this process's resident-set high-water mark (VmHWM) to the current resident set (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def environment_line(threads: int) -> str:
    """Return one line saying where the numbers come from."""
    env = report.environment(threads)
    return (
        f"{env['cpu']} ({env['cpu_count']} logical CPUs), kernel variant {contrib_ops.cpu_isa()}, "
        f"{threads} intra-op thread(s), onnxruntime {env['onnxruntime']}, python {env['python']}"
    )


def append_results(title: str, lines: list[str]) -> None:
    """Append a section to benchmarks/RESULTS.md with the command that produced it."""
    command = (
        "python -m "
        + ".".join(Path(sys.argv[0]).with_suffix("").parts[-2:])
        + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = [f"\n## {title}\n", f"`{command}` — {stamp}\n", *lines, ""]
    with RESULTS.open("a") as f:
        f.write("\n".join(text) + "\n")


__all__ = [
    "BFLOAT16",
    "DECODE_SPECS",
    "FLOAT",
    "FLOAT16",
    "PREFILL_SPECS",
    "ChainSpec",
    "append_results",
    "chain_pair",
    "environment_line",
]
