"""A Nemotron-H-8B-shaped model on the GPU: one decode step and a 2048-token prefill, before vs after fusion.

Nemotron-H-8B's widths (hidden 4096, 128 Mamba heads x 64 = C 8192 in 8 groups, state 128, MLP 21504,
32/8 attention heads of 128; models/build.py's "real" config) with the first 8 layers of its 52-layer
pattern, ``M-M-M-M*`` (4 Mamba-2, 3 MLP, 1 attention), vocabulary 1024, random weights, in fp16 and bf16,
fused with fusion.rewrite as its command does by default. Two exporters, as users get the model:

- torch dynamo (models/export.py; ``.bench-vendor/nemotron/``): a decode graph and a prefill graph. The
  prefill graph is measured twice: as exported, its sequence symbolic ("prefill-dynamic"; the rewriter
  proves y's width through the chunked scan's ops, so no broadcast guard), and with the sequence pinned to
  2048 and constant-folded by onnxscript's optimizer ("prefill");
- Microsoft's mobius (``--builder mobius``; ``.bench-vendor/nemotron-mobius/``): ``mobius build --ep cuda``
  (models/mobius.py's wrapper) of a random-weight Hugging Face checkpoint of the same config, the graph
  onnxruntime-genai runs: one graph for prefill and decode, its caches as inputs (conv / SSM states, key /
  value), com.microsoft GroupQueryAttention, CausalConvWithState and LinearAttention. Decode is 1 token after
  a past of 8, prefill 2048 tokens after none.

Two halves, because the weights (~2 GB a dtype) cannot travel to the GPU machine but the graphs can:

    python benchmarks/bench_gpu_nemotron.py export [--builder mobius]   # here: export, fuse, strip
    python benchmarks/bench_gpu_nemotron.py run --graphs .bench-vendor/nemotron .bench-vendor/nemotron-mobius \\
        --library build/cuda/libmambafuse_ops.so

``export`` keeps every tensor under 64 KB (norm weights, A, D, dt bias, shape constants) and every integer
tensor in the graph and turns the larger floating-point ones (projections, embeddings, conv weights) into
external data of one file per dtype, laid out the same for every graph of a folder (before and after fusion
share it), which is not written. ``run`` writes that file on the GPU machine with seeded random values (std
0.02; the same bytes for both graphs), then measures with the CUDA execution provider and IO binding
(inputs and outputs on the GPU), per Run: median and min-max of 7 repeats, the before and after sessions
side by side and their repeats interleaved; with ORT's CUDA graph where ORT
can capture (every symbolic dimension pinned with ``add_free_dimension_override_by_name``, mobius'
expression-named ``past_seq_len + seq_len`` too; always pinned, so "prefill-dynamic" differs from "prefill"
only in what is left of the graph's shape arithmetic); and from ORT's profiler (no CUDA graph): where the
nodes ran, the kernel time of the gated-norm chains before fusion (the nodes the rewrite removed) and of the
fused nodes after, per Run. GPU time is CUPTI's (torch.profiler): the chains' as (GPU time before) - (GPU time
after) + (fused kernels), each total the sum over a Run's kernels of each one's median duration over the Runs
(every Run launches the same sequence), so that a few slow outliers do not move a difference of two totals.
``run --device cpu [--prefill-tokens N]`` is a smoke test of the script.

The decode step's variants, side by side (``step``): ``export`` also writes the decode graph with the gated norm
alone fused ("norm"; ``rewrite_model(decode_steps=False)``) and as ``mambafuse optimize`` writes it ("optimize"),
beside the unfused one and ``mambafuse rewrite``'s ("after": the norm, CausalConv1dUpdate and SelectiveStateUpdate);
"gemv" is "optimize" with ``--opt-in decode_matmul`` (the weight MatMuls as DecodeMatMul), and "int4-before" /
"int4-optimize" / "int4-gemv" are the step quantized to int4 as docs/models.md's policy says (ORT's
MatMulNBitsQuantizer, block 32, symmetric, the LM head kept), unfused, optimized, and optimized with ``--opt-in
decode_matmul_nbits`` (its packed weights are random bytes on the GPU machine, its scales drawn with std SCALE_STD;
the int4 rows' logits are compared with the int4 step unfused); "int4-before-fpaintb" / "int4-optimize-fpaintb" run
the int4 graphs with ONNX Runtime's ``ep.cuda.fpa_intb_gemm`` session setting on (off by default: its CUDA
MatMulNBits then prepacks the weights for the weight-only GEMV and GEMM kernels it carries from TensorRT-LLM, for
float16 / bfloat16 A, block 32, 64 or 128, N a multiple of 64). ``step`` runs the variants in one process with the
library registered, interleaved, with and without ORT's CUDA graph; counts the kernels of a Run and sums their GPU
time by kernel family (CUPTI; families by kernel name); puts the Run beside the weight-streaming floor (the bytes of
weights a step reads / the device's copy bandwidth, measured in the same process); and prints each variant's largest
logit difference from the unfused step, so that a variant computing something else shows:

    python benchmarks/bench_gpu_nemotron.py step --graphs .bench-vendor/nemotron \\
        --library build/cuda/libmambafuse_ops.so

The prefill's variants the same way (``step --mode prefill`` or ``prefill-dynamic``): ``export`` writes each prefill
graph also as ``mambafuse optimize`` writes it and as it wrote it before its SquaredRelu fusion
("optimize-relu-unfused": the MLP's squared ReLU as ORT's Relu and Mul; ``step_variant`` also writes
"optimize-whole-conv", before the conv parts pass), and ``export --builder mobius`` its
graph as written by ``optimize`` and by ``optimize --opt-in linear_attention_scan`` ("optimize-scan": ORT's
LinearAttention as MambaChunkScan); in place of the floor, a prefill's Run is put beside the GPU time of its own
MatMul kernels (the prefill target: within 1.3x of them):

    python benchmarks/bench_gpu_nemotron.py step --mode prefill --dtypes fp16 \\
        --graphs .bench-vendor/nemotron --library build/cuda/libmambafuse_ops.so

A mobius build is one graph for prompt and decode (``mobius_step_inputs``), so ``step --mode decode`` on its folder
times a decode step (1 token after a past of 8) through each of its variants (MOBIUS_VARIANTS), the opt-in scan and
conv nodes too, beside the graph as built.

``step --graph-attribution`` also says where a Run with ORT's CUDA graph spends its wall time, per variant: its Runs
made back to back under torch.profiler, each Run's host start and end beside CUPTI's records of the kernels and copies
the graph replays (``run_attribution``: before the first kernel, the kernels' span, busy and idle within it, after the
last kernel, the gap to the next Run, the copies; where CUPTI reports none, it says so):

    python benchmarks/bench_gpu_nemotron.py step --mode prefill --dtypes fp16 --graph-attribution \\
        --graphs .bench-vendor/nemotron-mobius --library build/cuda/libmambafuse_ops.so

Only the projections' and the embedding's weights are random on the GPU machine: a tensor the fused graph
bakes into its nodes (Mamba's A, folded to (H, P, N) by the exporter, and read per head by the rewrite) keeps
its values, or the unfused and the fused step would compute different things.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: The first 8 layers of Nemotron-H-8B's 52-layer pattern (benchmarks/nemotron_h_8b_graph.py: PATTERN).
LAYERS = ["linear_attention", "mlp", "linear_attention", "mlp", "linear_attention", "mlp", "linear_attention"]
LAYERS += ["full_attention"]
KEEP_BYTES = 64 * 1024
DTYPES = ("fp16", "bf16")
#: What ``export`` makes (dynamo: "prefill" is the dynamic-sequence pair and the pinned one) and what ``run``
#: measures: "prefill" is the pinned, constant-folded pair, "prefill-dynamic" the graph as exported.
EXPORT_MODES = ("decode", "prefill")
MODES = ("decode", "prefill", "prefill-dynamic")
BUILDERS = ("dynamo", "mobius")
PREFILL_TOKENS = 2048
VOCAB = 1024  # models/build.py's "real" configs
#: The ONNX element types ``_externalize`` moves out (``write_weights`` regenerates them as random values).
FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
}


# --- export (CPU, here) ------------------------------------------------------------------------------------


#: The ops whose weights ``run`` may replace with random values: the projections and the embedding. A step
#: with random projection weights does the same work; a random A, dt bias or conv weight would not be what
#: the fused graph reads (the rewrite bakes those into its nodes' inputs, and it proved them from the values).
RANDOM_OK = {"MatMul", "Gemm", "Gather", "DecodeMatMul", "MatMulNBits", "DecodeMatMulNBits"}
#: The 4-bit products, whose packed weights (uint8, input 1) are random bytes and whose scales (input 2) are drawn
#: small enough that a dequantized weight has about the 16-bit weights' spread.
NBITS_OPS = {"MatMulNBits", "DecodeMatMulNBits"}
SCALE_STD = 0.005


def _row_constant(array: np.ndarray) -> np.ndarray | None:
    """Return one value per leading index if `array` is constant along its other axes (Mamba's A folded to
    (H, P, N), D to (H, P)), else None."""
    if array.ndim < 2:
        return None
    rows = array.reshape(array.shape[0], -1)
    return rows[:, 0].copy() if bool(np.all(rows == rows[:, :1])) else None


def _externalize(model: onnx.ModelProto, layout: dict[str, tuple[int, int]], location: str) -> list[dict]:
    """Point the floating-point initializers over KEEP_BYTES at `location` (offsets from `layout`, shared by
    name); return the manifest of those tensors. Those that only projections and the embedding read are
    written as random values on the GPU machine; those constant along all but their first axis carry their
    values in the manifest ("fill": one per row) and are written exactly; any other stays in the graph, as
    does every integer tensor (random values would change what the graph computes)."""
    consumers: dict[str, set[str]] = {}
    scales = set()
    # a Slice of a weight whose every reader is a MatMul (the conv parts pass's in-projection by part) reads it as a
    # projection does: the parts are the same products of the same (random) weight in every variant
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            op = node.op_type if node.op_type != "Gather" or index == 0 else "?"
            if op == "Slice":
                op = "MatMul" if index == 0 and readers.get(node.output[0], {"?"}) == {"MatMul"} else "?"
            consumers.setdefault(name, set()).add(op)
            if node.op_type in NBITS_OPS and index == 2:
                scales.add(name)
            elif node.op_type in NBITS_OPS and index > 2:  # zero points: kept exactly
                consumers[name].add("?")
    manifest = []
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            raise SystemExit(f"{tensor.name}: export left external data; load it first")
        size = len(tensor.raw_data)
        packed = tensor.data_type == onnx.TensorProto.UINT8 and consumers.get(tensor.name, {"?"}) <= NBITS_OPS
        if size <= KEEP_BYTES or (tensor.data_type not in FLOAT_TYPES and not packed):
            continue
        entry_fill = None
        if not consumers.get(tensor.name, {"?"}) <= RANDOM_OK:
            fill = _row_constant(onnx.numpy_helper.to_array(tensor))
            if fill is None:
                continue  # stays in the graph
            entry_fill = [float(v) for v in fill.astype(np.float32)]
        if tensor.name not in layout:
            end = max((o + n for o, n in layout.values()), default=0)
            layout[tensor.name] = ((end + 4095) // 4096 * 4096, size)  # 4 KiB aligned
        offset, length = layout[tensor.name]
        if length != size:
            raise SystemExit(f"{tensor.name}: {size} bytes here, {length} in another graph")
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        record = {"name": tensor.name, "dims": list(tensor.dims), "type": tensor.data_type}
        if tensor.name in scales:
            record["scales"] = True
        if entry_fill is not None:
            record["fill"] = entry_fill
        manifest.append(record)
    return manifest


def _write_meta(out: Path, dtype: str, builder: str, layout: dict, location: str, graphs: dict) -> None:
    """Write ``<dtype>.json``: the builder, the data file's layout (and each tensor's element type, for
    ``write_weights``) and the graphs by ``<mode>-<before|after>``."""
    types = {w["name"]: w["type"] for entry in graphs.values() for w in entry["weights"]}
    fills = {w["name"]: w["fill"] for entry in graphs.values() for w in entry["weights"] if "fill" in w}
    scales = sorted({w["name"] for entry in graphs.values() for w in entry["weights"] if w.get("scales")})
    size = max(o + n for o, n in layout.values())
    meta = {"builder": builder, "location": location, "bytes": size, "layout": layout, "types": types}
    meta["fill"] = fills
    meta["scales"] = scales
    (out / f"{dtype}.json").write_text(json.dumps({**meta, "graphs": graphs}, indent=1))


def fused_count(path: Path) -> int:
    """Return how many GatedGroupRMSNorm nodes the graph at `path` has (its weights are not read)."""
    model = onnx.load(str(path), load_external_data=False)
    return sum(node.op_type == "GatedGroupRMSNorm" for node in model.graph.node)


def fuse(source: Path, fused: Path, label: str) -> int:
    """Fuse `source` into `fused` as the command line does by default; return the fused node count."""
    from fusion import rewrite

    if rewrite.main([str(source), "-o", str(fused)]) != 0:
        raise SystemExit(f"{label}: the rewrite failed")
    return fused_count(fused)


def quantize_int4(source: Path, target: Path) -> Path:
    """Write the step at `source` with its projections in int4 as docs/models.md's policy says (ONNX Runtime's
    ``MatMulNBitsQuantizer``, block 32, symmetric; the LM head kept in 16 bits) to `target`; return it."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(source))
    head = [n.name for n in model.graph.node if n.op_type == "MatMul" and "logits" in n.output]
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True, nodes_to_exclude=head)
    quantizer.process()
    onnx.save(quantizer.model.model, str(target), save_as_external_data=True, location=target.name + ".data")
    return target


def optimize_without(model, *, conv_parts: bool = True, squared_relu: bool = True, projection_parts: bool = True):
    """``optimize_model`` without its conv parts pass (``conv_parts=False``), without the SquaredRelu fusion
    (``squared_relu=False``) or with the conv parts read from the projection's Split rather than from a MatMul per
    part (``projection_parts=False``): what it wrote before each, for the side-by-side."""
    import contextlib
    from unittest import mock

    from fusion.optimize import optimize_model
    from fusion.rules import registry

    with contextlib.ExitStack() as stack:
        if not conv_parts:
            stack.enter_context(mock.patch("fusion.optimize._conv_parts", lambda _model: ({}, [])))
        if not projection_parts:
            stack.enter_context(mock.patch("fusion.rules.conv_parts._projection", lambda *_: None))
        if not squared_relu:
            kept = tuple(f for f in registry.FUSIONS if f is not registry.SQUARED_RELU)
            stack.enter_context(mock.patch.object(registry, "FUSIONS", kept))
        return optimize_model(model)


#: The variants ``optimize_without`` writes: name -> its keywords.
WITHOUT = {
    "optimize-whole-conv": {"conv_parts": False},
    "optimize-relu-unfused": {"squared_relu": False},
    "optimize-split-projection": {"projection_parts": False},
}


def step_variant(source: Path, folder: Path, name: str) -> Path:
    """Write the ``name`` variant of the decode step at `source` into `folder` and return its path: "norm" is
    the gated norm alone fused (``rewrite_model(decode_steps=False)``), "optimize" is ``mambafuse optimize``
    (onnxscript's ORT fusions, then every mambafuse fusion), "optimize-whole-conv" that without its conv parts
    pass (the prompt convs left whole, as before it), "optimize-relu-unfused" that without the SquaredRelu
    fusion (Relu + Mul, as before it), "optimize-scan" that with ``--opt-in
    linear_attention_scan`` (mobius builds), "optimize-scan-widened" that with the scan reading the float32 x, B,
    C and state the build widened (as before it read the 16-bit ones), "optimize-scan-conv" that with ``--opt-in
    causal_conv_with_state`` too, "optimize-scan-conv-parts" that with its convs cut by part although they read a
    cache (as before the conv parts pass left such convs whole), "after-scan" / "after-scan-conv" ``mambafuse
    rewrite`` with those opt-ins (what ``mambafuse genai`` writes), "gemv" that with ``--opt-in decode_matmul``;
    "int4-before" the step quantized (``quantize_int4``), "int4-optimize" and "int4-gemv" (``--opt-in
    decode_matmul_nbits``) that optimized. ("after" is ``mambafuse rewrite``'s default: every mambafuse fusion.)"""
    import onnx_ir as ir

    from fusion.optimize import optimize_model
    from fusion.rewrite import rewrite_model

    if name.startswith("int4-"):
        quantized = folder / "model.int4.onnx"
        if not quantized.is_file():
            quantize_int4(source, quantized)
        if name == "int4-before":
            return quantized
        source = quantized
    if name == "norm":
        model, report = rewrite_model(ir.load(source), decode_steps=False)
    elif name in ("optimize", "int4-optimize"):
        model, report = optimize_model(ir.load(source))
    elif name in WITHOUT:
        model, report = optimize_without(ir.load(source), **WITHOUT[name])
    elif name == "optimize-scan":  # a mobius build's LinearAttention as MambaChunkScan (an opt-in rule)
        model, report = optimize_model(ir.load(source), opt_in=["linear_attention_scan"])
    elif name == "optimize-scan-conv":  # and ORT's CausalConvWithState as CausalConv1d (a second opt-in)
        model, report = optimize_model(ir.load(source), opt_in=["linear_attention_scan", "causal_conv_with_state"])
    elif name == "optimize-scan-conv-parts":  # that with the convs cut by part, as before cache graphs kept them
        from unittest import mock

        with mock.patch("fusion.rules.conv_parts._graph_input_behind", lambda _value: None):
            model, report = optimize_model(ir.load(source), opt_in=["linear_attention_scan", "causal_conv_with_state"])
    elif name in ("after-scan", "after-scan-conv"):  # what mambafuse genai writes: rewrite_model with the opt-ins
        opt_in = ["linear_attention_scan"] + (["causal_conv_with_state"] if name == "after-scan-conv" else [])
        model, report = rewrite_model(ir.load(source), opt_in=opt_in)
    elif name == "optimize-scan-widened":  # that with the scan reading the float32 x, B, C and state, as before
        from unittest import mock

        with mock.patch("fusion.rules.linear_attention_scan._widened", lambda _value: None):
            model, report = optimize_model(ir.load(source), opt_in=["linear_attention_scan"])
    elif name in ("gemv", "int4-gemv"):
        opt_in = "decode_matmul_nbits" if name == "int4-gemv" else "decode_matmul"
        model, report = optimize_model(ir.load(source), opt_in=[opt_in])
    else:
        raise ValueError(f"unknown step variant {name!r}")
    target = folder / f"model.{name}.onnx"
    ir.save(model, target, external_data=f"model.{name}.onnx.data")
    print(f"  {name}: {report.summary().splitlines()[0]}", flush=True)
    return target


def save_stripped(source: Path, target: Path, layout: dict[str, tuple[int, int]], location: str) -> list[dict]:
    """Save the graph at `source` as `target` with its large tensors moved into the shared `layout` of
    `location` (``_externalize``); return their manifest."""
    model = onnx.load(str(source), load_external_data=True)
    manifest = _externalize(model, layout, location)
    onnx.save(model, str(target))
    return manifest


#: The dynamo exporter's default opset (18) for fp16, as users get it; bf16 needs 23: at opset 18 Conv and
#: Softplus do not take bf16, and ONNX Runtime refuses the graph ("Type 'tensor(bfloat16)' of input parameter
#: ... of operator (Conv) ... is invalid").
DYNAMO_OPSET = {"fp16": 18, "bf16": 23}


def export(out: Path, dtypes: list[str], modes: list[str]) -> None:
    """Export with torch dynamo, fuse, strip; prefill as exported ("prefill-dynamic") and pinned ("prefill")."""
    from models import build
    from models import export as exporter

    # The "real" config with 8 layers instead of 3 (in this process only).
    build.CONFIGS["nemotron_h"]["real"] = dict(build.CONFIGS["nemotron_h"]["real"], layers_block_type=LAYERS)
    out.mkdir(parents=True, exist_ok=True)
    for dtype in dtypes:
        layout: dict[str, tuple[int, int]] = {}
        location = f"weights-{dtype}.bin"
        entries = {}
        for mode in modes:
            key = "prefill-dynamic" if mode == "prefill" else mode
            with tempfile.TemporaryDirectory(prefix="nemotron-gpu-") as tmp:
                t0 = time.perf_counter()
                source = Path(tmp) / "model.onnx"
                record = exporter.export_model(
                    "nemotron_h", "dynamo", dtype, mode, opset=DYNAMO_OPSET[dtype], size="real", out=source
                )
                fused = Path(tmp) / "model.fused.onnx"
                count = fuse(source, fused, f"{dtype} {key}")
                variants = [("before", source), ("after", fused)]
                if mode == "decode":  # the step's variants (``step``): norm only, and optimize
                    names = (
                        "norm",
                        "optimize",
                        "optimize-relu-unfused",
                        "gemv",
                        "int4-before",
                        "int4-optimize",
                        "int4-gemv",
                    )
                    variants += [(name, step_variant(source, Path(tmp), name)) for name in names]
                else:  # the prefill as ``mambafuse optimize`` writes it, too
                    names = ("optimize", "optimize-split-projection")
                    variants += [(name, step_variant(source, Path(tmp), name)) for name in names]
                for name, path in variants:
                    target = out / f"{dtype}-{key}-{name}.onnx"
                    manifest = save_stripped(path, target, layout, location)
                    entries[f"{key}-{name}"] = {"graph": target.name, "weights": manifest}
                print(
                    f"{dtype} {key}: {record.num_mamba_layers} Mamba layers, {count} chains fused; exported and "
                    f"fused in {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
        _write_meta(out, dtype, "dynamo", layout, location, entries)
        if "prefill" in modes:
            t0 = time.perf_counter()
            pin_prefill(out, dtype)
            print(f"{dtype} prefill: pinned to {PREFILL_TOKENS} tokens in {time.perf_counter() - t0:.0f} s", flush=True)


def pin_prefill(out: Path, dtype: str) -> None:
    """Write the "prefill" pair: the dynamic-sequence graph with its sequence pinned to PREFILL_TOKENS and
    constant-folded (onnxscript's optimizer), before and after fusion.

    The dynamic-sequence real-width export spells each chain's group count as the chunked scan's
    ``8 * min(s, 128 * ceil(s / 128)) // s``; the rewriter proves what it can and reads y through
    ``Expand(y, Shape(z))`` where it cannot (the broadcast guard). Pinned and folded, the group count is 8 and
    the shape arithmetic is gone: the graph ORT runs once add_free_dimension_override_by_name has pinned the
    sequence, measured beside the dynamic one ("prefill-dynamic").
    """
    import onnx_ir as ir
    import onnxscript.optimizer

    meta = json.loads((out / f"{dtype}.json").read_text())
    weights = out / meta["location"]
    created = not weights.exists()
    if created:  # the rewriter wants the data file to exist; a sparse one, never read
        with open(weights, "wb") as f:
            f.truncate(meta["bytes"])
    try:
        dynamic = meta["graphs"]["prefill-dynamic-before"]
        model = onnx.load(str(out / dynamic["graph"]), load_external_data=False)
        # the large tensors _externalize kept in the graph (their values matter: the conv's weights)
        kept = {t.name for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
        for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:  # every mention of seq
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param == "seq":
                    dim.dim_value = PREFILL_TOKENS
        pinned = out / f"{dtype}-prefill-pinned.onnx"
        onnx.save(model, str(pinned))
        folded = ir.load(str(pinned))
        onnxscript.optimizer.optimize(folded, num_iterations=2)
        source = out / f"{dtype}-prefill-before.onnx"
        ir.save(folded, str(source))
        pinned.unlink()
        fused = out / f"{dtype}-prefill-after.onnx"
        count = fuse(source, fused, f"{dtype} prefill")
        print(f"{dtype} prefill: {count} chains fused in the pinned graph", flush=True)
        variants = [("before", source), ("after", fused)]
        for name in ("optimize", "optimize-split-projection"):
            optimized = out / f"{dtype}-prefill-{name}.onnx"
            model, report = optimize_without(ir.load(str(source)), **WITHOUT.get(name, {}))
            ir.save(model, str(optimized))  # its weights stay where they are in the shared file
            print(f"{dtype} prefill: {name}: {report.summary().splitlines()[0]}", flush=True)
            variants.append((name, optimized))
        for _, path in variants:  # still the shared layout
            for t in onnx.load(str(path), load_external_data=False).graph.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    entry = {e.key: e.value for e in t.external_data}
                    if meta["layout"].get(t.name, [None])[0] != int(entry["offset"]):
                        raise SystemExit(f"{path.name}: {t.name} left the shared layout")
                elif len(t.raw_data) > KEEP_BYTES and t.data_type in FLOAT_TYPES and not _kept(t.name, kept):
                    raise SystemExit(f"{path.name}: folding made a {len(t.raw_data)}-byte tensor {t.name}")
        for name, path in variants:
            meta["graphs"][f"prefill-{name}"] = {"graph": path.name, "weights": dynamic["weights"]}
        (out / f"{dtype}.json").write_text(json.dumps(meta, indent=1))
    finally:
        if created:
            weights.unlink()


def _kept(name: str, kept: set[str]) -> bool:
    """Whether the in-graph tensor ``name`` is one of ``kept`` or a part of one (the conv parts pass cuts a conv's
    weight and bias by channels into ``<name>_channels_<start>_<end>``)."""
    return name in kept or any(name.startswith(f"{k}_channels_") for k in kept)


#: mobius' names for its dtypes.
MOBIUS_DTYPES = {"fp16": "f16", "bf16": "bf16"}


#: The Hugging Face checkpoint name (models/mobius.py's CHECKPOINTS) of the "real" config with LAYERS.
REAL8_CHECKPOINT = "nemotron_h-real8"
#: The variants ``export --builder mobius`` writes besides "before" and "after" (``step_variant``): one graph each,
#: measured by ``step --mode decode`` and ``--mode prefill`` alike, since the build serves both.
MOBIUS_VARIANTS = (
    "optimize",
    "optimize-scan",
    "optimize-scan-conv",
    "optimize-scan-conv-parts",
    "after-scan",
    "after-scan-conv",
)


def write_real8_checkpoint(folder: Path) -> None:
    """Write models/build.py's "real" Nemotron-H config with LAYERS and random weights as a Hugging Face folder at
    `folder` (~4 GB in fp32), unless one is there."""
    from models import build, mobius

    if (folder / "config.json").is_file():
        return
    config = {**build.CONFIGS["nemotron_h"]["real"], "layers_block_type": LAYERS}
    mobius.CHECKPOINTS[REAL8_CHECKPOINT] = mobius._checkpoint("nemotron_h", config)  # this process only
    t0 = time.perf_counter()
    mobius.write_checkpoint(REAL8_CHECKPOINT, folder)
    print(f"checkpoint: {folder} written in {time.perf_counter() - t0:.0f} s", flush=True)


def export_mobius(out: Path, dtypes: list[str], checkpoint: Path | None) -> None:
    """Build with Microsoft's mobius (``--ep cuda``, the graph onnxruntime-genai runs), fuse, strip.

    The checkpoint is models/build.py's "real" Nemotron-H config with LAYERS, random weights, saved as a
    Hugging Face folder (``checkpoint``, or a temporary one; ~4 GB in fp32); mobius runs in a subprocess per
    dtype, through models/mobius.py's wrapper (its 0.1.0 workarounds). One graph serves prefill and decode.
    """
    from models import mobius

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nemotron-mobius-") as tmp:
        folder = checkpoint or Path(tmp) / "checkpoint"
        write_real8_checkpoint(folder)
        for dtype in dtypes:
            t0 = time.perf_counter()
            build_dir = Path(tmp) / f"build-{dtype}"
            env = {k: v for k, v in os.environ.items() if k != mobius.WORKAROUND_ENV}  # mobius' default graph
            argv = ["build", "--model", str(folder), str(build_dir), "--dtype", MOBIUS_DTYPES[dtype], "--ep", "cuda"]
            done = subprocess.run([sys.executable, "-m", "models.mobius", "mobius", *argv], cwd=REPO, env=env)
            if done.returncode != 0:
                raise SystemExit(f"{dtype}: mobius build failed (exit {done.returncode})")
            built = time.perf_counter() - t0
            source, fused = build_dir / "model.onnx", build_dir / "model.fused.onnx"
            count = fuse(source, fused, f"{dtype} mobius")
            if count != LAYERS.count("linear_attention"):
                raise SystemExit(
                    f"{dtype} mobius: {count} GatedGroupRMSNorm nodes, expected {LAYERS.count('linear_attention')}"
                    " (one per Mamba layer); run python -m fusion.rewrite --debug on the build for the reasons"
                )
            layout: dict[str, tuple[int, int]] = {}
            location = f"weights-{dtype}.bin"
            entries = {}
            variants = [("before", source), ("after", fused)]
            variants += [(name, step_variant(source, build_dir, name)) for name in MOBIUS_VARIANTS]
            for name, path in variants:
                target = out / f"{dtype}-{name}.onnx"
                manifest = save_stripped(path, target, layout, location)
                for mode in ("decode", "prefill"):  # one graph for both
                    entries[f"{mode}-{name}"] = {"graph": target.name, "weights": manifest}
            _write_meta(out, dtype, "mobius", layout, location, entries)
            shutil.rmtree(build_dir)
            print(
                f"{dtype} mobius: built in {built:.0f} s, {count} chains fused, total {time.perf_counter() - t0:.0f} s",
                flush=True,
            )


def strip_node_metadata(folder: Path) -> None:
    """Drop every node's metadata and doc string from the graphs of `folder`, in place: the exporters' stack
    traces and source names (dynamo: ~1 MB a graph), which ORT never reads and the GPU machine's 64 MiB
    transfer limit pays for."""
    for path in sorted(folder.glob("*.onnx")):
        model = onnx.load(str(path), load_external_data=False)
        nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
        if not any(n.metadata_props or n.doc_string for n in nodes):
            continue
        for node in nodes:
            del node.metadata_props[:]
            node.ClearField("doc_string")
        onnx.save(model, str(path))


def print_sizes(folder: Path) -> None:
    """Print each file of `folder` and the total (what travels to the GPU machine)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("weights-"))
    for path in files:
        print(f"  {path.name}: {path.stat().st_size / 1e6:.2f} MB")
    print(f"{folder}: {sum(p.stat().st_size for p in files) / 1e6:.2f} MB (weights files excluded)", flush=True)


# --- run (GPU machine) -------------------------------------------------------------------------------------


def write_weights(folder: Path, dtype: str) -> None:
    """Write the external data file of `dtype` with seeded N(0, 0.02) values, one seed per tensor name, in each
    tensor's element type (json "types"; older folders: `dtype`); a tensor with a "fill" gets its exact
    values."""
    meta = json.loads((folder / f"{dtype}.json").read_text())
    target = folder / meta["location"]
    if target.is_file() and target.stat().st_size == meta["bytes"]:
        return
    import ml_dtypes

    numpy_types = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    default_type = onnx.TensorProto.FLOAT16 if dtype == "fp16" else onnx.TensorProto.BFLOAT16
    with open(target, "wb") as f:
        f.truncate(meta["bytes"])
        for name, (offset, length) in meta["layout"].items():
            element = meta.get("types", {}).get(name, default_type)
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
            if element == onnx.TensorProto.UINT8:  # packed 4-bit weights: any bytes are weights
                f.seek(offset)
                f.write(np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes())
                continue
            numpy_type = numpy_types[FLOAT_TYPES[element]]
            count = length // np.dtype(numpy_type).itemsize
            if name in meta.get("scales", ()):
                values = np.random.default_rng(seed).standard_normal(count, dtype=np.float32) * SCALE_STD
            elif name in meta.get("fill", {}):  # exact: one value per row (_externalize)
                fill = np.asarray(meta["fill"][name], np.float32)
                values = np.repeat(fill, count // len(fill))
            else:
                values = np.random.default_rng(seed).standard_normal(count, dtype=np.float32) * 0.02
            f.seek(offset)
            f.write(values.astype(numpy_type).tobytes())


def run(args: argparse.Namespace) -> None:
    import onnxruntime as ort
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        ort.preload_dlls()
    global PREFILL_TOKENS
    PREFILL_TOKENS = args.prefill_tokens
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    device_name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "CPU (smoke test)"
    emit(
        f"Environment: {device_name}, onnxruntime {ort.__version__}, torch {torch.__version__}; CUDA EP, IO binding; "
        f"{len(LAYERS)} layers (4 Mamba-2, 3 MLP, 1 attention), vocabulary {VOCAB}, random weights; Run times are "
        f"medians (min–max) of 7 repeats of {args.runs} Runs (prefill: {max(5, args.runs // 5)})."
    )
    emit()
    emit(
        "| export | dtype | step | ORT CUDA graph | nodes before -> after | Run before (µs) | Run after (µs) "
        "| speed-up | GPU time: chains -> fused kernels (µs per Run) "
        "| host dispatch: chain nodes -> fused nodes (µs per Run) |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for folder, dtype in [(f, d) for f in args.graphs for d in args.dtypes.split(",")]:
        write_weights(folder, dtype)
        meta = json.loads((folder / f"{dtype}.json").read_text())
        builder = meta.get("builder", "dynamo")
        for mode in args.modes.split(","):
            if f"{mode}-before" not in meta["graphs"]:  # mobius: one graph, no separate dynamic prefill
                print(f"  {builder} {dtype}: no {mode} graphs in {folder}", flush=True)
                continue
            paths = {name: folder / meta["graphs"][f"{mode}-{name}"]["graph"] for name in ("before", "after")}
            graphs = {name: onnx.load(str(path), load_external_data=False) for name, path in paths.items()}
            feeds, dims = (mobius_step_inputs if builder == "mobius" else step_inputs)(graphs["before"], mode)
            tokens = feeds["input_ids"][0].shape[-1]  # the pinned prefill graph has its own, PREFILL_TOKENS at export
            step = "decode" if mode == "decode" else f"prefill {tokens}" + (", dynamic" if "dynamic" in mode else "")
            try:
                prof = {name: profile(ort, torch, path, feeds, dims, args.library) for name, path in paths.items()}
            except Exception as error:  # noqa: BLE001 - e.g. a graph ORT rejects; reported, the rest still runs
                emit(f"| {builder} | {dtype} | {step} | | | {str(error).splitlines()[0][:300]} | | | | |")
                continue
            # The chains: every node the profile shows before fusion and not after (the rewrite's removed nodes,
            # with what ORT's optimizer made of them and the CPU<->GPU copies of their shape arithmetic).
            replaced = set(prof["before"]["by_node"]) - set(prof["after"]["by_node"])
            chain_us = sum(prof["before"]["by_node"][n] for n in replaced) / prof["before"]["runs"]
            fused_us = sum(t for (_, op), t in prof["after"]["by_op"].items() if op == "GatedGroupRMSNorm")
            fused_us /= prof["after"]["runs"]
            # GPU side (CUPTI): the chains' GPU time is what fusion removed plus what the fused kernels take.
            try:
                gpu_runs = 200 if mode == "decode" else 10  # the difference of two totals: enough Runs to steady it
                gpu = {
                    name: gpu_kernels(ort, torch, path, feeds, dims, args.library, gpu_runs)
                    for name, path in paths.items()
                }
                gpu_fused = gpu["after"]["robust_fused"]
                gpu_chains = gpu["before"]["robust_total"] - gpu["after"]["robust_total"] + gpu_fused
                gpu_text = f"{gpu_chains:.1f} -> {gpu_fused:.1f} ({100 * gpu_fused / max(gpu_chains, 1e-9):.1f} %)"
                mean_fused = gpu["after"]["fused"]
                mean_chains = gpu["before"]["total"] - gpu["after"]["total"] + mean_fused
            except Exception as error:  # noqa: BLE001 - no CUPTI (e.g. the CPU smoke test)
                gpu, gpu_text = None, f"n/a ({str(error).splitlines()[0][:80]})"

            for graph in [m == "yes" for m in args.graph_modes.split(",")]:
                runs = args.runs if mode == "decode" else max(5, args.runs // 5)  # prefill: ~10 ms a Run
                try:
                    stats = measure(ort, torch, paths, feeds, dims, args.library, graph, runs)
                except Exception as error:  # noqa: BLE001 - reported in the table (e.g. capture refused)
                    stats = {name: {"error": str(error).splitlines()[0][:200]} for name in paths}
                b, a = stats["before"], stats["after"]
                if "error" in b or "error" in a:
                    emit(
                        f"| {builder} | {dtype} | {step} | {'yes' if graph else 'no'} | | {b.get('error') or fmt(b)} | "
                        f"{a.get('error') or fmt(a)} | | | |"
                    )
                    continue
                nodes = f"{len(graphs['before'].graph.node)} -> {len(graphs['after'].graph.node)}"
                emit(
                    f"| {builder} | {dtype} | {step} | {'yes' if graph else 'no'} | {nodes} | {fmt(b)} | {fmt(a)} | "
                    f"{b['median'] / a['median']:.2f}x | "
                    f"{gpu_text} | {chain_us:.1f} -> {fused_us:.1f} ({100 * fused_us / max(chain_us, 1e-9):.1f} %) |"
                )
            placement = ", ".join(f"{p} {c}" for p, c in sorted(prof["after"]["providers"].items()))
            placement_before = ", ".join(f"{p} {c}" for p, c in sorted(prof["before"]["providers"].items()))
            where = ", ".join(f"{op} {t:.0f}" for op, t in prof["after"]["top_ops"])
            gpu_where = ""
            if gpu is not None:
                after = gpu["after"]
                shortest_name, shortest_us = min(gpu["before"]["shortest"], after["shortest"], key=lambda kv: kv[1])
                gpu_where = (
                    f" GPU time per Run before {gpu['before']['total']:.0f} µs, after {after['total']:.0f} µs; "
                    "largest after: " + "; ".join(f"{name[:60]} {t:.0f}" for name, t in after["top"]) + ". "
                    f"From mean durations instead of medians: chains {mean_chains:.1f} -> fused {mean_fused:.1f} µs "
                    f"({100 * mean_fused / max(mean_chains, 1e-9):.1f} %). "
                    f"Fused kernel {after['fused_per_call']:.2f} µs a call ({after['fused_calls']:.0f} a Run); "
                    f"10 % of the chains would be {0.1 * gpu_chains / max(after['fused_calls'], 1):.2f} µs a call; "
                    f"the shortest kernel of the step: {shortest_us:.2f} µs ({shortest_name[:60]})."
                )
            notes.append(
                f"- {builder} {dtype} {step}: nodes by provider before: {placement_before}; after: {placement}. "
                f"Host time per Run in ORT's profiler after fusion, by op type (µs): {where}; "
                f"all nodes {prof['after']['total']:.0f} µs "
                f"(before {prof['before']['total']:.0f} µs; {len(replaced)} chain nodes).{gpu_where}"
            )
            print(notes[-1], flush=True)
    emit()
    for note in notes:
        emit(note)
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


#: A step's variants (``export`` writes them, ``step`` measures them side by side).
STEP_VARIANTS = {
    "before": "unfused",
    "norm": "gated norm fused",
    "after": "mambafuse rewrite",
    "optimize": "mambafuse optimize",
    "optimize-whole-conv": "optimize, convs whole (no conv parts pass)",
    "optimize-relu-unfused": "optimize, squared ReLU as Relu + Mul (no SquaredRelu)",
    "optimize-split-projection": "optimize, conv parts from the projection's Split (no MatMul per part)",
    "optimize-scan": "optimize --opt-in linear_attention_scan",
    "optimize-scan-widened": "optimize --opt-in linear_attention_scan, x, B, C and the state read widened to float",
    "optimize-scan-conv": "optimize --opt-in linear_attention_scan,causal_conv_with_state",
    "optimize-scan-conv-parts": "the same, its convs cut by part though they read a cache",
    "after-scan": "mambafuse rewrite --opt-in linear_attention_scan",
    "after-scan-conv": "mambafuse rewrite --opt-in linear_attention_scan,causal_conv_with_state",
    "gemv": "optimize + DecodeMatMul",
    "int4-before": "int4 unfused",
    "int4-optimize": "int4 optimize",
    "int4-gemv": "int4 optimize + DecodeMatMulNBits",
    "int4-before-fpaintb": "int4 unfused, ORT fpA_intB",
    "int4-optimize-fpaintb": "int4 optimize, ORT fpA_intB",
}
#: Variants that run another variant's graph with ONNX Runtime session settings: (the graph's variant, settings).
STEP_SETTINGS = {
    "int4-before-fpaintb": ("int4-before", {"ep.cuda.fpa_intb_gemm": "1"}),
    "int4-optimize-fpaintb": ("int4-optimize", {"ep.cuda.fpa_intb_gemm": "1"}),
}
#: The family of the projections' kernels (the first entry of KERNEL_FAMILIES that names GEMMs).
MATMUL_FAMILY = "MatMul (GEMM/GEMV)"
#: Kernel families by CUPTI kernel name (first match wins): our three ops by their kernels' names, then what
#: ONNX Runtime's CUDA EP and the libraries it calls name their kernels.
KERNEL_FAMILIES = (
    ("GatedGroupRMSNorm", ("cuda_kernels::WarpPathKernel", "cuda_kernels::VectorPathKernel")),
    ("SelectiveStateUpdate", ("ssu_kernels::",)),
    ("CausalConv1dUpdate", ("ConvUpdateKernel",)),
    ("MambaChunkScan", ("RegisterStateScan", "ChunkedScan", "SequentialScan")),
    (
        "CausalConv1d",
        ("ChannelsLastKernel", "ChannelsFirstKernel", "ConvStepKernel", "AnyWidthKernel", "FinalStateKernel"),
    ),
    # ORT's ops of the builders' Mamba-2 mixers (mobius: LinearAttention, CausalConvWithState), before the
    # attention and conv families their names would otherwise fall in
    ("Mamba-2 ops (ORT)", ("LinearAttention", "CausalConv")),
    # before the GEMMs: fused attention kernels' names can contain "cutlass" or "gemm"
    ("attention / softmax", ("Softmax", "softmax", "Attention", "attention", "flash", "fmha", "mha", "MHA")),
    (
        MATMUL_FAMILY,
        (
            "gemm",
            "gemv",
            "Gemv",
            "DecodeMatMul",
            "MatMulNBits",
            "MatMulFloatInt4",
            "MatMulFloat4Bits",
            "Dequantize",
            "xmma",
            "cutlass",
            "cublas",
            "splitk",
            "splitK",
            "nvjet",
        ),
    ),
    ("Conv (cuDNN)", ("cudnn", "conv2d", "Conv")),
    ("copies and memsets", ("memcpy", "memset", "Memcpy", "Memset")),
    ("norms (ORT)", ("LayerNorm", "layer_norm", "SkipLayerNorm", "RMSNorm")),
    ("reductions", ("reduce", "Reduce")),
    ("transpose / concat / slice / gather", ("Transpose", "transpose", "Concat", "Slice", "Gather", "Expand", "Split")),
    # SquaredRelu's kernels with the elementwise ones they replace (ORT's Relu and Mul)
    (
        "elementwise",
        ("ElementWise", "Elementwise", "elementwise", "Unary", "Binary", "Cast", "Impl", "Where", "Pow", "SquaredRelu"),
    ),
)


def kernel_family(name: str) -> str:
    """Return the family of a kernel by its CUPTI name (KERNEL_FAMILIES), "other" if none matches."""
    for family, keys in KERNEL_FAMILIES:
        if any(key in name for key in keys):
            return family
    return "other"


def weight_bytes_per_step(model: onnx.ModelProto) -> int:
    """Return the bytes of weights one decode step reads: every initializer (external ones by their dims and
    type), one row of each Gather table (the embedding: one row per token)."""
    gathered = {node.input[0] for node in model.graph.node if node.op_type == "Gather"}
    total = 0
    for tensor in model.graph.initializer:
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        size = count * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        total += size // tensor.dims[0] if tensor.name in gathered and len(tensor.dims) == 2 else size
    return total


def copy_bandwidth(torch, megabytes: int = 1024, repeats: int = 20) -> float:
    """Return the device's copy bandwidth in bytes per second (read + written) from CUDA events around a
    device-to-device copy of `megabytes` (far larger than L2): the median of `repeats`."""
    if DEVICE == "cpu":  # the smoke test: numpy's copy rate
        source = np.ones(megabytes << 20, np.uint8)
        t0 = time.perf_counter()
        source.copy()
        return 2 * source.nbytes / (time.perf_counter() - t0)
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = _cuda_seconds(torch, lambda: target.copy_(source), repeats)
    return 2 * (megabytes << 20) / seconds


def _cuda_seconds(torch, work, repeats: int) -> float:
    """Return the median of ``repeats`` timings of ``work()`` by CUDA events, after 3 untimed calls."""
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[3:])


def gemv_read_rate(torch, dtype: str, repeats: int = 20) -> float:
    """Return the rate (bytes of weight per second) at which torch's cuBLAS streams a 4096 x 21504 weight
    (176 MB in 16-bit, larger than L2) in a 1 x 4096 product: the MLP's up projection at batch 1."""
    if DEVICE == "cpu":  # the smoke test
        return float("nan")
    torch_type = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype])
    weight = torch.randn(4096, 21504, device="cuda").to(torch_type)
    x = torch.randn(1, 4096, device="cuda").to(torch_type)
    seconds = _cuda_seconds(torch, lambda: torch.matmul(x, weight), repeats)
    return weight.numel() * weight.element_size() / seconds


def cpu_outputs(ort, torch, path, feeds, dims, library, runs, with_outputs=True):
    """The smoke test's stand-in for ``gpu_kernels``: no GPU figures, the outputs of one Run on the CPU."""
    session = session_for(ort, path, dims, library, False)
    binding, keep = bind(ort, torch, session, feeds)
    session.run_with_iobinding(binding)
    outputs = [t.float().numpy() if t.is_floating_point() else t.numpy() for t in keep[len(feeds) :]]
    return {"launches": float("nan"), "robust": {}, "robust_total": float("nan")}, outputs


def run_step(args: argparse.Namespace) -> None:
    """A step's variants side by side (STEP_VARIANTS): Run time with and without ORT's CUDA graph, kernels and
    GPU time per Run by kernel family (CUPTI); the decode step against its weight-streaming floor, a prefill
    against its own MatMul kernels' GPU time (the prefill target: within 1.3x of them)."""
    import onnxruntime as ort
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        ort.preload_dlls()
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    decode = args.mode == "decode"
    global PREFILL_TOKENS
    PREFILL_TOKENS = args.prefill_tokens
    runs = args.runs if decode else max(5, args.runs // 5)  # a prefill Run takes ~10 ms
    gpu_runs = 200 if decode else 10
    copy_rate = copy_bandwidth(torch, 1024 if DEVICE == "cuda" else 64)
    device_name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "CPU (smoke test)"
    emit(
        f"Environment: {device_name}, onnxruntime {ort.__version__}, torch "
        f"{torch.__version__}; CUDA EP, IO binding, the mambafuse library registered in every session; "
        f"{len(LAYERS)} layers (4 Mamba-2, 3 MLP, 1 attention), vocabulary {VOCAB}, random weights; batch 1, "
        + (f"one token after a past of {PAST}" if decode else f"a {args.mode} of {PREFILL_TOKENS} tokens")
        + f". Run times: medians (min-max) of 7 interleaved repeats of {runs} Runs. "
        f"Device copy bandwidth (1 GiB device-to-device, read + written): {copy_rate / 1e12:.2f} TB/s."
    )
    families = [family for family, _ in KERNEL_FAMILIES] + ["other"]
    family_rows = []
    largest: list[str] = []
    idle_lines: list[str] = []
    unknown: set[str] = set()
    for folder, dtype in [(f, d) for f in args.graphs for d in args.dtypes.split(",")]:
        write_weights(folder, dtype)
        meta = json.loads((folder / f"{dtype}.json").read_text())
        builder = meta.get("builder", "dynamo")
        names = [
            v
            for v in STEP_VARIANTS
            if f"{args.mode}-{v}" in meta["graphs"]
            or (v in STEP_SETTINGS and f"{args.mode}-{STEP_SETTINGS[v][0]}" in meta["graphs"])
        ]
        if "before" not in names:
            emit(f"\n{builder} {dtype}: no {args.mode} graphs in {folder}")
            continue
        graph_of = {v: STEP_SETTINGS[v][0] if v in STEP_SETTINGS else v for v in names}
        paths = {v: folder / meta["graphs"][f"{args.mode}-{graph_of[v]}"]["graph"] for v in names}
        settings = {v: STEP_SETTINGS[v][1] for v in names if v in STEP_SETTINGS}
        graphs = {v: onnx.load(str(path), load_external_data=False) for v, path in paths.items()}
        feeds, dims = (mobius_step_inputs if builder == "mobius" else step_inputs)(graphs["before"], args.mode)
        emit()
        if decode:
            weights = weight_bytes_per_step(graphs["before"])
            floor_us = weights / copy_rate * 1e6
            gemv = gemv_read_rate(torch, dtype)
            emit(
                f"### {builder} {dtype}: weights read per step {weights / 1e9:.3f} GB; weight-streaming floor "
                f"{floor_us:.0f} µs at the copy bandwidth (torch's cuBLAS GEMV streams a 4096 x 21504 weight at "
                f"{gemv / 1e12:.2f} TB/s: {weights / gemv * 1e6:.0f} µs)"
            )
        else:
            emit(f"### {builder} {dtype} {args.mode}, {feeds['input_ids'][0].shape[-1]} tokens")
        absent = [v for v in MOBIUS_VARIANTS if v not in names] if builder == "mobius" else []
        if absent:  # a folder exported before them: say so rather than leave the rows out silently
            emit()
            emit(f"({folder} has no {', '.join(absent)} graphs, exported before them: `export --builder mobius`)")
        emit()
        gpu, outputs, family_of = {}, {}, {}
        for v, path in paths.items():
            if DEVICE == "cuda":
                gpu[v], outputs[v] = gpu_kernels(
                    ort, torch, path, feeds, dims, args.library, gpu_runs, with_outputs=True, settings=settings.get(v)
                )
            else:
                gpu[v], outputs[v] = cpu_outputs(
                    ort, torch, path, feeds, dims, args.library, gpu_runs, with_outputs=True
                )
            family_of[v] = {name: kernel_family(name) for name in gpu[v]["robust"]}
            unknown.update(name for name, family in family_of[v].items() if family == "other")
        timing = {}
        for graph in (False, True):
            try:
                timing[graph] = measure(ort, torch, paths, feeds, dims, args.library, graph, runs, settings)
            except Exception as error:  # noqa: BLE001 - reported in the table (e.g. capture refused)
                timing[graph] = {v: {"error": str(error).splitlines()[0][:200]} for v in paths}
        bound = "x floor" if decode else "x its MatMuls"
        emit(
            "| variant | nodes | kernels per Run | GPU time per Run (µs) | Run, CUDA graph (µs) | speed-up "
            f"| {bound} | Run, no CUDA graph (µs) | speed-up | logits vs unfused (max abs diff; int4 vs int4) |"
        )
        emit("|---|---|---|---|---|---|---|---|---|---|")
        for v in names:
            by_family = dict.fromkeys(families, 0.0)
            for name, us in gpu[v]["robust"].items():
                by_family[family_of[v][name]] += us
            cells = []
            for graph in (True, False):
                stats, base = timing[graph][v], timing[graph]["before"]
                if "error" in stats or "error" in base:
                    cells += [stats.get("error", ""), "", ""] if graph else [stats.get("error", ""), ""]
                    continue
                cells += [fmt(stats), f"{base['median'] / stats['median']:.2f}x"]
                if graph and decode:  # against the floor of the bytes this variant reads (int4's are fewer)
                    cells.append(f"{stats['median'] / (weight_bytes_per_step(graphs[v]) / copy_rate * 1e6):.2f}x")
                elif graph:  # against the GPU time of this variant's own MatMul kernels
                    matmul_us = by_family[MATMUL_FAMILY]
                    cells.append(f"{stats['median'] / matmul_us:.2f}x" if matmul_us > 0 else "n/a")
            # an int4 step against the int4 step unfused: quantization is not what the fusions may change
            baseline = "int4-before" if v.startswith("int4-") and "int4-before" in outputs else "before"
            against_fp16 = " (vs fp16: no int4 unfused graph)" if v.startswith("int4-") and baseline == "before" else ""
            diff = max(
                float(np.max(np.abs(a.astype(np.float32) - b.astype(np.float32)))) if a.size else 0.0
                for a, b in zip(outputs[v][:1], outputs[baseline][:1], strict=True)
            )
            emit(
                f"| {STEP_VARIANTS[v]} | {len(graphs[v].graph.node)} | {gpu[v]['launches']:.0f} | "
                f"{gpu[v]['robust_total']:.0f} | " + " | ".join(cells) + f" | {diff:.2e}{against_fp16} |"
            )
            family_rows.append((f"{builder} {dtype} {STEP_VARIANTS[v]}", by_family))
            rest = sorted(
                ((us, n) for n, us in gpu[v]["robust"].items() if family_of[v][n] != MATMUL_FAMILY), reverse=True
            )
            largest.append(
                f"- {builder} {dtype} {STEP_VARIANTS[v]}: " + "; ".join(f"{n[:70]} {us:.0f}" for us, n in rest[:8])
            )
            if gpu[v].get("gaps") is not None:
                idle_lines.append(
                    f"- {builder} {dtype} {STEP_VARIANTS[v]}: idle {gpu[v]['idle']:.0f} of a {gpu[v]['span']:.0f} µs "
                    "span; " + "; ".join(f"{us:.0f} after {a[:50]} before {b[:50]}" for us, a, b in gpu[v]["gaps"])
                )
        if args.graph_attribution:
            found = graph_attribution_lines(
                ort, torch, f"{builder} {dtype}", paths, feeds, dims, args.library, runs, settings, timing, gpu
            )
            for line in found:
                emit(line)
    emit()
    emit("GPU time per Run by kernel family (µs; CUPTI, no CUDA graph; families by kernel name):")
    emit()
    shown = [f for f in families if any(row[f] >= 0.5 for _, row in family_rows)]
    emit("| step | " + " | ".join(shown) + " |")
    emit("|---" * (len(shown) + 1) + "|")
    for label, row in family_rows:
        emit(f"| {label} | " + " | ".join(f"{row[f]:.0f}" for f in shown) + " |")
    if unknown:
        emit()
        emit("Kernels counted as other: " + "; ".join(n[:80] for n in sorted(unknown)[:12]))
    emit()
    emit(
        "The GPU's idle time within a Run (CUPTI, no CUDA graph; medians over the Runs; the largest gaps by position):"
    )
    emit()
    for line in idle_lines:
        emit(line)
    emit()
    emit("The largest kernels outside the MatMuls (µs per Run, by kernel name):")
    emit()
    for line in largest:
        emit(line)
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


#: The ``--graph-attribution`` table's columns after the variant, and what each is.
ATTRIBUTION_COLUMNS = (
    ("Run, unprofiled", "the Run with ORT's CUDA graph as the table above times it (no profiler)"),
    ("Run, profiled", "the same Run under the profiler (time.perf_counter around run_with_iobinding)"),
    (
        "before first GPU work",
        "from the Run's host start (time.time_ns() before run_with_iobinding) to the start of its first kernel or copy",
    ),
    ("GPU span", "from that start to the end of the Run's last kernel or copy"),
    ("busy", "the part of the span with at least one kernel or copy running (their union)"),
    ("idle", "the rest of the span: no kernel or copy running"),
    ("after last GPU work", "from the last kernel's or copy's end to the Run's host end (run_with_iobinding returned)"),
    ("GPU gap to the next Run", "from a Run's last kernel or copy end to the next Run's first start"),
    (
        "host gap to the next Run",
        "from a Run's host end to the next Run's host start (the Python loop and the profiler's ranges)",
    ),
    ("kernels + copies (without the graph)", "CUPTI's records per Run with the graph (the count without it)"),
    ("copies (µs)", "the time of the Run's memcpy and memset records"),
)


def graph_attribution_lines(ort, torch, label, paths, feeds, dims, library, runs, settings, timing, gpu) -> list[str]:
    """The ``--graph-attribution`` table of one builder and dtype: where a Run with ORT's CUDA graph spends its wall
    time (``graph_run_profile``), a row per variant of ``paths`` whose CUDA graph Run ``timing`` measured, what each
    column is, and each variant's host CUDA API calls per Run."""
    lines = [
        "",
        f"Where a Run with ORT's CUDA graph spends its wall time ({label}; {runs} Runs back to back under "
        "torch.profiler with CPU and CUDA activities, CUPTI's kernel and copy records; µs, medians over the Runs, each "
        "column its own median, so that the parts need not add up exactly):",
        "",
        "| variant | " + " | ".join(column for column, _ in ATTRIBUTION_COLUMNS) + " |",
        "|---" * (len(ATTRIBUTION_COLUMNS) + 1) + "|",
    ]
    empty = len(ATTRIBUTION_COLUMNS) - 1
    call_lines = []
    for v, path in paths.items():
        name, graph_run = STEP_VARIANTS[v], timing[True][v]
        if "error" in graph_run:
            lines.append(f"| {name} | {graph_run['error']} |" + " |" * empty)
            continue
        if DEVICE != "cuda":
            lines.append(f"| {name} | needs the CUDA device (--device cuda) |" + " |" * empty)
            continue
        try:
            found = graph_run_profile(ort, torch, path, feeds, dims, library, runs, settings.get(v))
        except Exception as error:  # noqa: BLE001 - reported in the table; the other variants still run
            lines.append(f"| {name} | {str(error).splitlines()[0][:200]} |" + " |" * empty)
            continue
        profiled = statistics.median(found["walls"])
        if found["missing"]:
            lines.append(f"| {name} | {graph_run['median']:.0f} | {profiled:.0f} | {found['missing']} |" + " |" * 8)
            continue
        cells = [f"{found[key]:.0f}" for key in ("before", "span", "busy", "idle", "after", "gpu_gap", "host_gap")]
        cells.append(f"{found['kernels']:.0f} + {found['copies']:.0f} ({gpu[v]['launches']:.0f})")
        cells.append(f"{found['copy_us']:.1f}")
        lines.append(f"| {name} | {graph_run['median']:.0f} | {profiled:.0f} | " + " | ".join(cells) + " |")
        share = f"{found['measured']} of {found['runs']} Runs with GPU work"
        # a range that opens after its Run started or closes before it ended: the two clocks disagree by as much
        clocks = "; THE CLOCKS DISAGREE" if found["range_opens"] < -1.0 or found["range_closes"] < -1.0 else ""
        call_lines.append(
            f"- {label} {name} ({share}; its record_function range opens {found['range_opens']:.1f} µs before "
            f"the Run's time.time_ns() start and closes {found['range_closes']:.1f} µs after its end, a few µs each "
            f"where the profiler's clock is time.time_ns()'s{clocks}): host CUDA API calls per Run, µs (calls): "
            + "; ".join(f"{call} {us:.0f} ({count:.0f})" for call, us, count in found["calls"][:6])
        )
    lines.append("")
    lines += [f"- {column}: {meaning}." for column, meaning in ATTRIBUTION_COLUMNS]
    lines.append("")
    return lines + call_lines


def fmt(stats: dict) -> str:
    return f"{stats['median']:.0f} ({stats['min']:.0f}–{stats['max']:.0f})"


#: Decode cache shapes of the real config (batch 1, an 8-token prompt): the dynamo export leaves every cache
#: dimension symbolic, so they are set here by the leaf's name.
PAST = 8
CACHE_SHAPES = {
    "conv_states": [1, 8192 + 2 * 8 * 128, 4],  # [batch, conv dim (x, B, C), conv kernel]
    "recurrent_states": [1, 128, 64, 128],  # [batch, Mamba heads, head dim, state]
    "keys": [1, 8, PAST, 128],  # [batch, KV heads, past, head dim]
    "values": [1, 8, PAST, 128],
}


def step_inputs(model: onnx.ModelProto, mode: str) -> tuple[dict[str, tuple[np.ndarray, int]], dict[str, int]]:
    """Seeded inputs of one step, (array, element type) by name, and the value of every symbolic dimension
    (the same values pin them for ORT's CUDA graph)."""
    rng = np.random.default_rng(0)
    initializers = {t.name for t in model.graph.initializer}
    feeds: dict[str, tuple[np.ndarray, int]] = {}
    dims: dict[str, int] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        kind = next((k for k in CACHE_SHAPES if f".{k}" in value.name), None)
        shape = []
        for i, d in enumerate(tensor.shape.dim):
            if kind is not None:
                size = CACHE_SHAPES[kind][i]
            elif d.dim_param:
                size = 1 if i == 0 else (1 if mode == "decode" else PREFILL_TOKENS)
            else:
                size = d.dim_value
            if d.dim_param and dims.setdefault(d.dim_param, size) != size:
                raise SystemExit(f"{value.name}: dimension {d.dim_param} is {dims[d.dim_param]} and {size}")
            shape.append(size)
        if tensor.elem_type == onnx.TensorProto.INT64:
            array = (
                np.full(shape, PAST, np.int64)
                if value.name == "position_ids"
                else rng.integers(3, VOCAB, shape).astype(np.int64)
            )
        else:
            array = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        feeds[value.name] = (array, tensor.elem_type)
    return feeds, dims


def mobius_step_inputs(model: onnx.ModelProto, mode: str) -> tuple[dict[str, tuple[np.ndarray, int]], dict[str, int]]:
    """Seeded inputs of one step of a mobius graph and the value of every symbolic dimension, as step_inputs.

    Decode: 1 new token after a past of PAST (key / value of PAST positions, conv / SSM states N(0, 0.1));
    prefill: PREFILL_TOKENS after none (zero-length key / value). mobius names the attention mask's length
    by an expression, ``past_seq_len + seq_len``: a name like any other for the dimension overrides.
    """
    rng = np.random.default_rng(0)
    past, new = (PAST, 1) if mode == "decode" else (0, PREFILL_TOKENS)
    sizes = {"batch": 1, "sequence_len": new, "past_sequence_len": past, "past_seq_len + seq_len": past + new}
    feeds: dict[str, tuple[np.ndarray, int]] = {}
    dims: dict[str, int] = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        shape = []
        for d in tensor.shape.dim:
            if d.dim_param and d.dim_param not in sizes:
                raise SystemExit(f"{value.name}: unknown mobius dimension {d.dim_param!r}; add it to sizes")
            shape.append(sizes[d.dim_param] if d.dim_param else d.dim_value)
            if d.dim_param:
                dims[d.dim_param] = sizes[d.dim_param]
        if value.name == "input_ids":
            array = rng.integers(3, VOCAB, shape).astype(np.int64)
        elif value.name == "attention_mask":
            array = np.ones(shape, np.int64)
        elif tensor.elem_type in FLOAT_TYPES:
            array = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        else:
            raise SystemExit(f"{value.name}: an input of element type {tensor.elem_type} this script cannot make")
        feeds[value.name] = (array, tensor.elem_type)
    return feeds, dims


#: "cuda"; "cpu" only to smoke-test this script without a GPU (--device cpu).
DEVICE = "cuda"

TORCH_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT64: "int64",
}
ORT_OUTPUT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int64)": "int64",
}


def ort_value(ort, torch, tensor):
    """Return an OrtValue over `tensor`'s memory (DLPack, no copy)."""
    from onnxruntime.capi import _pybind_state as C

    capsule = torch.utils.dlpack.to_dlpack(tensor)
    try:
        value = C.OrtValue.from_dlpack(capsule)  # onnxruntime 1.32: (data)
    except TypeError:  # older releases: (data, is_bool_tensor); the capsule is not consumed by a refused call
        value = C.OrtValue.from_dlpack(capsule, False)
    return ort.OrtValue(value)


def session_for(
    ort,
    path: Path,
    dims: dict[str, int],
    library: Path,
    graph: bool,
    profile_prefix: str | None = None,
    settings: dict[str, str] | None = None,
):
    options = ort.SessionOptions()
    for key, value in (settings or {}).items():  # ONNX Runtime's own session settings (STEP_SETTINGS)
        options.add_session_config_entry(key, value)
    if DEVICE == "cuda":  # a GPU-first session (docs/kernels.md): the prefill ops and the weight products on CUDA
        options.add_session_config_entry("mambafuse.prefill_cpu_kernels", "0")
    options.register_custom_ops_library(str(library))
    for name, size in dims.items():  # pinned: the shape arithmetic folds, ORT's CUDA graph can capture
        options.add_free_dimension_override_by_name(name, size)
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if graph else {})
    providers = [provider, "CPUExecutionProvider"] if DEVICE == "cuda" else ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), options, providers=providers)


def bind(ort, torch, session, feeds) -> tuple[object, list]:
    """IO binding: inputs and outputs as CUDA tensors at fixed addresses (a CUDA graph replays on them); the
    output shapes come from one plain Run with ORT-allocated outputs."""
    inputs = []
    probe = session.io_binding()
    for name, (array, elem_type) in feeds.items():
        tensor = torch.from_numpy(array).to(getattr(torch, TORCH_TYPES[elem_type])).to(DEVICE)
        inputs.append((name, tensor))
        probe.bind_ortvalue_input(name, ort_value(ort, torch, tensor))
    for out in session.get_outputs():
        probe.bind_output(out.name, DEVICE)
    session.run_with_iobinding(probe)  # with enable_cuda_graph this is the warm-up Run; capture comes later
    binding = session.io_binding()
    keep = [t for _, t in inputs]
    for name, tensor in inputs:
        binding.bind_ortvalue_input(name, ort_value(ort, torch, tensor))
    for out, value in zip(session.get_outputs(), probe.get_outputs(), strict=True):
        tensor = torch.empty(value.shape(), dtype=getattr(torch, ORT_OUTPUT_TYPES[out.type]), device=DEVICE)
        keep.append(tensor)
        binding.bind_ortvalue_output(out.name, ort_value(ort, torch, tensor))
    return binding, keep


def measure(
    ort, torch, paths: dict[str, Path], feeds, dims, library, graph: bool, runs: int, settings: dict | None = None
) -> dict:
    """Per-Run wall time (a Run returns when its outputs are ready) of each graph in ``paths``: median, min,
    max of 7 repeats of ``runs`` Runs. The sessions live side by side and the repeats interleave (before,
    after, after, before, ...), so clock and thermal drift fall on both alike. ``settings``: ONNX Runtime session
    settings by name."""
    settings = settings or {}
    sessions = {
        name: session_for(ort, path, dims, library, graph, settings=settings.get(name)) for name, path in paths.items()
    }
    bindings = {name: bind(ort, torch, session, feeds) for name, session in sessions.items()}
    for name, session in sessions.items():
        for _ in range(5):
            session.run_with_iobinding(bindings[name][0])
    times: dict[str, list[float]] = {name: [] for name in sessions}
    order = list(sessions)
    for repeat in range(7):
        for name in order if repeat % 2 == 0 else order[::-1]:
            session, binding = sessions[name], bindings[name][0]
            t0 = time.perf_counter()
            for _ in range(runs):
                session.run_with_iobinding(binding)
            times[name].append((time.perf_counter() - t0) * 1e6 / runs)
    del bindings, sessions
    return {
        name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
        for name, values in times.items()
    }


def gpu_kernels(ort, torch, path, feeds, dims, library, runs: int = 10, with_outputs: bool = False, settings=None):
    """GPU time per Run from CUPTI (torch.profiler sees every kernel and copy of the process, ORT's too): all of
    it, the fused kernels' (mambafuse::), and the largest kernels by name; with `with_outputs`, also the Run's
    outputs (numpy, in the session's output order)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    session = session_for(ort, path, dims, library, False, settings=settings)
    binding, keep = bind(ort, torch, session, feeds)
    for _ in range(3):
        session.run_with_iobinding(binding)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            session.run_with_iobinding(binding)
        torch.cuda.synchronize()
    launches = []  # (start, name, µs) of every kernel and copy of the Runs
    for event in prof.events():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if device_us > 0:
            launches.append((event.time_range.start, event.name, device_us))
    outputs = [t.float().cpu().numpy() if t.is_floating_point() else t.cpu().numpy() for t in keep[len(feeds) :]]
    del keep, session
    stats = kernel_stats(launches, runs)
    return (stats, outputs) if with_outputs else stats


def kernel_stats(launches: list[tuple[float, str, float]], runs: int) -> dict:
    """Per-Run GPU figures from the (start, name, µs) launches of ``runs`` Runs: the total, the fused kernels'
    (mambafuse::), their duration per call, the shortest kernel, the largest by name; and the totals again
    from each launch position's median (``robust_*``, see the module docstring)."""
    launches = sorted(launches)
    totals: dict[str, float] = {}
    calls: dict[str, int] = {}
    for _, name, us in launches:
        totals[name] = totals.get(name, 0.0) + us / runs
        calls[name] = calls.get(name, 0) + 1
    # Every Run launches the same kernels in the same order: the k-th kernel of a Run, its median duration over
    # the Runs, summed over k, is a total that a few slow outliers (a preempted kernel, a clock change) do not
    # move; the chains' time is a difference of two ~1 ms totals. (The plain totals where the Runs did not
    # launch the same sequence.)
    robust: dict[str, float] = {}
    per_run = len(launches) // runs
    if per_run and len(launches) == per_run * runs:
        for k in range(per_run):
            same_position = launches[k::per_run]
            if len({name for _, name, _ in same_position}) != 1:
                robust = {}
                break
            name = same_position[0][1]
            robust[name] = robust.get(name, 0.0) + statistics.median(us for _, _, us in same_position)
    if not robust:
        robust = totals
    idle, span, gaps = _idle_time(launches, per_run, runs) if robust is not totals else (float("nan"),) * 2 + ([],)
    fused_keys = [k for k in totals if "mambafuse" in k]
    fused = sum(totals[k] for k in fused_keys)
    fused_calls = sum(calls[k] for k in fused_keys) / runs
    # The floor of any one kernel here: the shortest mean duration of a kernel of the step (copies and memsets
    # are the copy engines', not a kernel's).
    kernels = {k: totals[k] * runs / calls[k] for k in totals if not k.lower().startswith(("memcpy", "memset"))}
    return {
        "launches": len(launches) / runs,
        "robust": robust,
        "total": sum(totals.values()),
        "fused": fused,
        "robust_total": sum(robust.values()),
        "robust_fused": sum(t for k, t in robust.items() if "mambafuse" in k),
        "fused_per_call": fused / fused_calls if fused_calls else float("nan"),
        "fused_calls": fused_calls,
        "shortest": min(kernels.items(), key=lambda kv: kv[1]) if kernels else ("", float("nan")),
        "top": sorted(totals.items(), key=lambda kv: -kv[1])[:5],
        "idle": idle,
        "span": span,
        "gaps": gaps,
    }


def _idle_time(launches: list[tuple[float, str, float]], per_run: int, runs: int) -> tuple[float, float, list]:
    """The GPU's idle time within a Run: per Run, the time from its first kernel's start to its last kernel's end
    (the span) and the part of it with no kernel or copy running (the idle time), both medians over the Runs; and
    the five largest idle gaps by position (median µs, the kernels before and after), where the Run waits on
    something other than the GPU (the host, a copy's synchronization, a CPU node)."""
    spans, idles, by_position = [], [], [[] for _ in range(per_run - 1)]
    for r in range(runs):
        run = launches[r * per_run : (r + 1) * per_run]
        end = run[0][0] + run[0][2]
        idle = 0.0
        for k in range(1, len(run)):
            gap = max(0.0, run[k][0] - end)
            idle += gap
            by_position[k - 1].append(gap)
            end = max(end, run[k][0] + run[k][2])
        spans.append(end - run[0][0])
        idles.append(idle)
    names = [name for _, name, _ in launches[:per_run]]
    gaps = sorted(
        ((statistics.median(g), names[k], names[k + 1]) for k, g in enumerate(by_position) if g), reverse=True
    )[:5]
    return statistics.median(idles), statistics.median(spans), gaps


#: The label of each profiled Run's ``record_function`` range (``graph_run_profile``), then the Run's index.
RUN_LABEL = "mambafuse graph Run "


def graph_run_profile(ort, torch, path, feeds, dims, library, runs: int, settings=None) -> dict:
    """Where a Run with ORT's CUDA graph spends its wall time: ``run_attribution`` of ``runs`` Runs made back to back
    under torch.profiler (CPU and CUDA activities), each Run's host start and end read by time.time_ns() around its
    call (kineto puts its CPU and CUPTI records on that Unix clock) and its wall by time.perf_counter (``walls``, µs).

    Each Run is also a ``record_function`` range, so the Runs show in the profiler's trace and the clocks can be
    checked: ``range_opens`` / ``range_closes``, the median µs by which a range opens before its Run's time.time_ns()
    start and closes after its end, a few µs each (the range's own cost) where the clocks agree."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    # CUPTI loaded before ORT captures: a profiler first attached after a capture can invalidate the captured graph
    # (torch.profiler._utils._init_for_cuda_graphs does the same for torch's own graphs)
    with torch_profile(activities=[ProfilerActivity.CUDA]):
        pass
    session = session_for(ort, path, dims, library, True, settings=settings)
    binding, keep = bind(ort, torch, session, feeds)
    for _ in range(5):  # ORT's regular Runs before the capture, the capture, replays
        session.run_with_iobinding(binding)
    torch.cuda.synchronize()
    walls, unix = [], []
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("mambafuse graph warm-up Run"):  # a profiler's first range costs ~0.5 ms more: not a Run's
            session.run_with_iobinding(binding)
        for index in range(runs):
            with record_function(f"{RUN_LABEL}{index}"):
                unix_start, t0 = time.time_ns(), time.perf_counter()
                session.run_with_iobinding(binding)
                t1, unix_end = time.perf_counter(), time.time_ns()
            walls.append((t1 - t0) * 1e6)
            unix.append((unix_start, unix_end))
        torch.cuda.synchronize()
    del keep, binding, session
    ranges: dict[int, tuple[float, float]] = {}
    records: dict[str, list] = {"kernel": [], "copy": [], "call": []}
    results = prof.profiler.kineto_results  # kineto's records, each with its kind (FunctionEvent has no kind)
    origin = results.trace_start_ns()
    for event in results.events():
        name, on_gpu = event.name(), event.device_type() == DeviceType.CUDA
        start = (event.start_ns() - origin) / 1e3  # µs from the trace's start, CPU and GPU records alike
        end = start + event.duration_ns() / 1e3
        if name.startswith(RUN_LABEL):  # the range on the host (its annotation on the GPU's timeline is not a kernel)
            if not on_gpu:
                ranges[int(name[len(RUN_LABEL) :])] = (start, end)
            continue
        kind = record_kind(event.activity_type() if hasattr(event, "activity_type") else "", name, on_gpu)
        if kind == "call":
            records[kind].append((start, end, name))
        elif kind is not None:
            records[kind].append((start, end))
    hosts = [((a - origin) / 1e3, (b - origin) / 1e3) for a, b in unix]
    found = run_attribution(hosts, records["kernel"], records["copy"], records["call"])
    opens = closes = float("nan")
    if sorted(ranges) == list(range(runs)):
        opens = statistics.median(host[0] - ranges[i][0] for i, host in enumerate(hosts))
        closes = statistics.median(ranges[i][1] - host[1] for i, host in enumerate(hosts))
    return {**found, "walls": walls, "range_opens": opens, "range_closes": closes}


def record_kind(activity: str, name: str, on_gpu: bool) -> str | None:
    """Return what a profiler record is for ``run_attribution``: "kernel", "copy" (a memcpy or memset), "call" (a host
    CUDA runtime or driver API call) or None (anything else: CPU ops, annotations, synchronization records), by
    kineto's activity type, or where the torch build gives none ("") by the record's device and name."""
    if activity:
        kinds = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "copy"}
        return kinds.get(activity, "call" if activity in ("cuda_runtime", "cuda_driver") else None)
    if on_gpu:
        return "copy" if name.lower().startswith(("memcpy", "memset")) else "kernel"
    return "call" if name.startswith("cu") else None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Return the time covered by at least one of the (start, end) `intervals`."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


#: The per-Run figures of ``run_attribution`` that are medians over the Runs with GPU work.
ATTRIBUTED = ("before", "span", "busy", "idle", "after", "kernels", "copies", "copy_us")


def run_attribution(
    runs: list[tuple[float, float]],
    kernels: list[tuple[float, float]],
    copies: list[tuple[float, float]] = (),
    calls: list[tuple[float, float, str]] = (),
) -> dict:
    """Where each Run's host wall time goes, from the Runs' host (start, end) and the GPU's kernel and copy (start,
    end) records on one clock (µs).

    Per Run: ``wall`` (host end - host start); ``before``, from the host start to the first kernel's or copy's start;
    ``span``, from that start to the last one's end; ``busy``, the part of the span with some kernel or copy running
    (their union), ``idle`` the rest; ``after``, from the last end to the host end (negative where the Run returned
    before its GPU work ended): ``before + span + after = wall``. Also its ``kernels``, its ``copies`` and their time
    (``copy_us``), and its host CUDA API ``calls`` ((start, end, name), each in the Run whose host range holds its
    start). Between consecutive Runs: ``gpu_gap``, from one Run's last kernel or copy end to the next one's first start,
    and ``host_gap``, from one Run's host end to the next one's host start.

    A kernel or copy belongs to the last Run whose host start is at or before its start (one that starts before the
    first Run is not counted). Returned: each figure's median over the Runs (``wall`` and ``host_gap`` over all Runs,
    the rest over those with GPU work), ``calls`` as (name, median µs, median count) from the largest, ``runs``,
    ``measured`` (the Runs with GPU work), ``per_run`` (each Run's figures) and ``missing``: None, or why there are no
    GPU figures (no kernel or copy in any Run; the figures are then NaN, not 0).
    """
    hosts = sorted(runs)
    starts = [start for start, _ in hosts]
    work: list[list[tuple[float, float, bool]]] = [[] for _ in hosts]
    for intervals, is_copy in ((kernels, False), (copies, True)):
        for start, end in intervals:
            index = bisect.bisect_right(starts, start) - 1
            if index >= 0:
                work[index].append((start, end, is_copy))
    per_run: list[dict] = []
    for (host_start, host_end), items in zip(hosts, work, strict=True):
        run_calls: dict[str, list[float]] = {}
        for start, end, name in calls:
            if host_start <= start <= host_end:
                run_calls.setdefault(name, []).append(end - start)
        figures = {"wall": host_end - host_start, "calls": run_calls}
        if items:
            first, last = min(s for s, _, _ in items), max(e for _, e, _ in items)
            busy = _union_length([(s, e) for s, e, _ in items])
            figures.update(
                first=first,
                last=last,
                before=first - host_start,
                span=last - first,
                busy=busy,
                idle=last - first - busy,
                after=host_end - last,
                kernels=sum(not is_copy for *_, is_copy in items),
                copies=sum(is_copy for *_, is_copy in items),
                copy_us=sum(e - s for s, e, is_copy in items if is_copy),
            )
        per_run.append(figures)
    measured = [f for f in per_run if "first" in f]
    nan = float("nan")
    result = {
        "runs": len(hosts),
        "measured": len(measured),
        "missing": None,
        "wall": statistics.median(f["wall"] for f in per_run) if per_run else nan,
        "per_run": per_run,
    }
    for key in ATTRIBUTED:
        result[key] = statistics.median(f[key] for f in measured) if measured else nan
    gpu_gaps = [b["first"] - a["last"] for a, b in pairwise(per_run) if "first" in a and "first" in b]
    result["gpu_gap"] = statistics.median(gpu_gaps) if gpu_gaps else nan
    host_gaps = [b[0] - a[1] for a, b in pairwise(hosts)]
    result["host_gap"] = statistics.median(host_gaps) if host_gaps else nan
    names = {name for f in per_run for name in f["calls"]}
    result["calls"] = sorted(
        (
            (
                name,
                statistics.median(sum(f["calls"].get(name, [])) for f in per_run),
                statistics.median(len(f["calls"].get(name, [])) for f in per_run),
            )
            for name in names
        ),
        key=lambda call: (-call[1], call[0]),
    )
    if not measured:
        result["missing"] = (
            f"CUPTI reported no kernel or copy in any of the {len(hosts)} Runs: the CUDA graph's replayed kernels are "
            "not traced on this CUDA / CUPTI"
            if hosts
            else "the profiler recorded no Run (no record_function range)"
        )
    return result


def profile(ort, torch, path, feeds, dims, library, runs: int = 5) -> dict:
    """Kernel time per node and per (node, op type), node counts per provider, from ORT's profiler (no CUDA
    graph; the first 3 Runs are warm-up)."""
    with tempfile.TemporaryDirectory(prefix="ortprof-") as tmp:
        session = session_for(ort, path, dims, library, False, profile_prefix=str(Path(tmp) / "p"))
        binding, keep = bind(ort, torch, session, feeds)
        for _ in range(3 + runs):
            session.run_with_iobinding(binding)
        events = json.loads(Path(session.end_profiling()).read_text())
    model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    measured = model_runs[-runs:]
    start = measured[0]["ts"] if measured else 0
    by_node: dict[str, float] = {}
    by_op: dict[tuple[str, str], float] = {}
    ops: dict[str, float] = {}
    providers: dict[str, int] = {}
    seen = set()
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        node = e["name"][: -len("_kernel_time")]
        op = e.get("args", {}).get("op_name", "?")
        if node not in seen:
            seen.add(node)
            provider = e.get("args", {}).get("provider", "?").replace("ExecutionProvider", "")
            providers[provider] = providers.get(provider, 0) + 1
        if e["ts"] < start:
            continue
        by_node[node] = by_node.get(node, 0.0) + e["dur"]
        by_op[(node, op)] = by_op.get((node, op), 0.0) + e["dur"]
        ops[op] = ops.get(op, 0.0) + e["dur"]
    n = max(1, len(measured))
    top = sorted(((op, t / n) for op, t in ops.items()), key=lambda x: -x[1])[:6]
    return {
        "by_node": by_node,
        "by_op": by_op,
        "providers": providers,
        "runs": n,
        "top_ops": top,
        "total": sum(ops.values()) / n,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export")
    e.add_argument("--builder", choices=BUILDERS, default="dynamo")
    e.add_argument("--out", type=Path, default=None, help="default: .bench-vendor/nemotron[-mobius]")
    e.add_argument("--dtypes", default=",".join(DTYPES))
    e.add_argument("--modes", default=",".join(EXPORT_MODES), help="dynamo only")
    e.add_argument("--pin-prefill-only", action="store_true", help="dynamo: only redo the pinned prefill pair")
    e.add_argument("--checkpoint", type=Path, default=None, help="mobius: the checkpoint folder (made if absent)")
    r = sub.add_parser("run")
    r.add_argument("--graphs", type=Path, nargs="+", default=[REPO / ".bench-vendor" / "nemotron"])
    r.add_argument("--library", type=Path, required=True)
    r.add_argument("--dtypes", default=",".join(DTYPES))
    r.add_argument("--modes", default=",".join(MODES))
    r.add_argument("--runs", type=int, default=50)
    r.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="smaller for a CPU smoke test")
    r.add_argument("--markdown", type=Path, default=None)
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test of this script")
    r.add_argument("--graph-modes", default="no,yes", help="ORT CUDA graph off/on (cpu: no)")
    t = sub.add_parser("step", help="a step's variants side by side, by kernel family (decode: with its floor)")
    t.add_argument("--mode", choices=MODES, default="decode")
    t.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="smaller for a CPU smoke test")
    t.add_argument("--graphs", type=Path, nargs="+", default=[REPO / ".bench-vendor" / "nemotron"])
    t.add_argument("--library", type=Path, required=True)
    t.add_argument("--dtypes", default=",".join(DTYPES))
    t.add_argument("--runs", type=int, default=50)
    t.add_argument("--markdown", type=Path, default=None)
    t.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test of this script")
    t.add_argument(
        "--graph-attribution",
        action="store_true",
        help="also profile each variant's Runs with ORT's CUDA graph (torch.profiler, CUPTI) and print where a Run's "
        "wall time goes: before the first kernel, the kernels' span (busy / idle), after the last kernel",
    )
    args = parser.parse_args()
    if args.command == "step":
        run_step(args)
        return 0
    if args.command == "export":
        out = args.out or REPO / ".bench-vendor" / ("nemotron" if args.builder == "dynamo" else "nemotron-mobius")
        dtypes = args.dtypes.split(",")
        if args.builder == "mobius":
            export_mobius(out, dtypes, args.checkpoint)
        elif args.pin_prefill_only:
            for dtype in dtypes:
                pin_prefill(out, dtype)
        else:
            export(out, dtypes, args.modes.split(","))
        strip_node_metadata(out)  # after the pinning, which reads the exported graph
        print_sizes(out)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
