"""What int4 weights do to a Mamba-2 model's outputs, per quantization policy, and that fusing keeps them.

Decode exports of every family (tests/fixtures/models/transformers-5.25, torch dynamo, fp32, random weights; and
5.24's Nemotron-H and Zamba2), quantized the way onnxruntime-genai users deploy them: ONNX Runtime's
``MatMulNBitsQuantizer``, 4 bits, block 32, symmetric, into ``com.microsoft::MatMulNBits``. Policies (what stays
in the model's precision; the conv, A, D, dt_bias and the norms are not MatMuls and always stay):

- ``all``: every MatMul with a constant weight (the quantizer's default), the LM head included;
- ``keep-out_proj``: every Mamba-2 mixer's out-projection kept (the MatMul that reads its gated norm);
- ``keep-out_proj+head``: the LM head kept too.

Each policy at ``accuracy_level`` 0 (the quantizer's default: float32 products on the CPU) and 4 (A rounded to
int8 per block of 32 before the products, what onnxruntime-genai's builder writes for the CPU, where ONNX Runtime's
int4 kernel runs 2-3x faster at a decode step's single row: benchmarks/bench_cpu_gemv.py).

Per model, policy and level, against the fp32 original on its stored sample step: the logits' largest absolute
error (and relative to their largest magnitude), the fp32 model's smallest top-2 margin over the greedy steps, and
greedy token agreement over 16 steps (the prompt's cache, then each token fed back). Then ``mambafuse rewrite`` of
the quantized model: every Mamba-2 op fused in every layer, and its greedy tokens against the quantized original's
(through the model-local functions, so the library is not needed).

    python -m benchmarks.bench_int4_quality [--steps 16] [--levels 0,4] [--markdown OUT.md]
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from fusion.rewrite import rewrite_model
from models.fixtures import FIXTURE_DIR, TF525_FIXTURE_DIR
from models.runtime import feeds, greedy_decode, load_manifest, load_references

OPS = ("GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate")
MODELS = [
    *((TF525_FIXTURE_DIR, f"{family}-dynamo-fp32-decode") for family in (
        "nemotron_h", "zamba2", "mamba2", "bamba", "granitemoehybrid", "falcon_h1",
    )),
    (FIXTURE_DIR, "nemotron_h-dynamo-fp32-decode"),
    (FIXTURE_DIR, "zamba2-dynamo-fp32-decode"),
]  # fmt: skip
POLICIES = ("all", "keep-out_proj", "keep-out_proj+head")


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _kept(model: onnx.ModelProto, policy: str) -> list[str]:
    """Return the names of the MatMuls the policy keeps: the out-projections are the MatMuls that read a fused
    gated norm (found by fusing a copy), the head the MatMul that writes the logits."""
    if policy == "all":
        return []
    fused, _ = rewrite_model(model)
    # the norm's output, through the layout ops and Casts between it and the projection
    reach = {n.output[0] for n in fused.graph.node if n.op_type == "GatedGroupRMSNorm"}
    for node in fused.graph.node:
        if node.op_type in ("Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze") and node.input[0] in reach:
            reach.add(node.output[0])
    kept = [n.name for n in fused.graph.node if n.op_type == "MatMul" and n.input[0] in reach]
    if policy.endswith("+head"):
        kept += [n.name for n in model.graph.node if n.op_type == "MatMul" and "logits" in n.output]
    names = {n.name for n in model.graph.node}
    missing = [name for name in kept if name not in names]
    if missing or not kept:
        raise SystemExit(f"policy {policy}: MatMuls not found in the original: {missing or 'none'}")
    return kept


def _quantize(model: onnx.ModelProto, exclude: list[str], accuracy_level: int = 0) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        onnx.ModelProto.FromString(model.SerializeToString()),
        bits=4,
        block_size=32,
        is_symmetric=True,
        nodes_to_exclude=exclude,
        accuracy_level=accuracy_level or None,
    )
    quantizer.process()
    return quantizer.model.model


def _row(label, original, policy, level, record, refs, step, base_logits, base_tokens, margin, args) -> str:
    """One table row: the model quantized by ``policy`` at accuracy ``level`` against the fp32 original, and fused."""
    quantized = _quantize(original, _kept(original, policy), level)
    session = _session(quantized)
    logits = session.run(["logits"], step)[0].astype(np.float64)
    error = float(np.max(np.abs(logits - base_logits)))
    relative = error / float(np.max(np.abs(base_logits)))
    tokens = greedy_decode(session, record, refs, args.steps)
    fused, _ = rewrite_model(quantized)
    counts = {op: sum(n.op_type == op for n in fused.graph.node) for op in OPS}
    all_fused = set(counts.values()) == {record["num_mamba_layers"]}
    fused_tokens = greedy_decode(_session(fused), record, refs, args.steps)
    nbits = sum(n.op_type == "MatMulNBits" for n in quantized.graph.node)
    return (
        f"| {label} | {policy} | {level} | {nbits} | {error:.3g} ({relative:.2g}) | {margin:.3g} | "
        f"{sum(a == b for a, b in zip(tokens, base_tokens, strict=True))}/{args.steps} | "
        f"{'all, every layer' if all_fused else counts} | "
        f"{sum(a == b for a, b in zip(fused_tokens, tokens, strict=True))}/{args.steps} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_int4_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="greedy steps (default 16)")
    parser.add_argument("--levels", default="0,4", help="MatMulNBits accuracy levels (default 0,4)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    levels = [int(level) for level in args.levels.split(",")]
    rows = [
        "| model | policy | accuracy_level | MatMulNBits | logit error: max abs (of max logit) "
        "| fp32 top-2 margin (min) | greedy tokens = fp32 | fused ops | fused tokens = quantized |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for directory, stem in MODELS:
        record = load_manifest(directory)["fixtures"][stem]
        refs = load_references(directory)[stem]
        original = onnx.load(directory / record["file"])
        base = _session(original)
        base_logits_per_step: list[np.ndarray] = []
        base_tokens = greedy_decode(base, record, refs, args.steps, logits=base_logits_per_step)
        step = feeds(record, refs)
        base_logits = base.run(["logits"], step)[0].astype(np.float64)
        margin = min(
            float(np.diff(np.sort(step_logits.astype(np.float64))[-2:])[0]) for step_logits in base_logits_per_step
        )
        for policy in POLICIES:
            for level in levels:
                rows.append(
                    _row(
                        f"{directory.name}/{stem}",
                        original,
                        policy,
                        level,
                        record,
                        refs,
                        step,
                        base_logits,
                        base_tokens,
                        margin,
                        args,
                    )
                )
                print(rows[-1], flush=True)
    environment = (
        f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, {platform.processor() or platform.machine()}, "
        "CPU EP, 1 intra-op thread"
    )
    text = "\n".join(rows) + f"\n\n{environment}\n"
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
