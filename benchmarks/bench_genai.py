"""Time to first token and tokens/s through onnxruntime-genai: unfused vs ``mambafuse genai``, f32 / f16 / int4.

The tiny mobius builds of ``tests/fixtures/mobius`` (random weights; cpu target; Nemotron-H, Zamba2 and Mamba2 in
f32 and f16), each as four genai folders, in one process:

- ``unfused``: ``mambafuse genai IN OUT --config-only`` (the config edit genai 0.18 needs to load the model type;
  the model unchanged);
- ``fused``: ``mambafuse genai IN OUT`` (the model fused, the library registered through the config);
- ``int4 unfused`` / ``int4 fused``: the same, after ONNX Runtime's ``MatMulNBitsQuantizer`` (4 bits, block 32,
  symmetric, every MatMul with a constant weight; ``--accuracy-level``, default 0 as the quantizer's: 4 has the CPU
  round A to int8 per block, 2-3x faster per projection) wrote the folder's model;
- ``fused, LinearAttention kept`` (a folder for the CPU): ``mambafuse genai IN OUT --keep-builder-ops --opt-in
  causal_conv_with_state``, the folder fused as that command did before it ran the LinearAttention scans as
  ``MambaChunkScan`` too.

``--target cuda`` takes the fixtures' cuda-target genai builds instead (f32 and f16, mobius' default graph); run it
where onnxruntime-genai-cuda is installed, with ``MAMBAFUSE_LIBRARY`` naming the CUDA build of the library. There
the unfused Nemotron-H folders compute wrong values: ONNX Runtime's CUDA ``RMSNormalization`` scales every group of
their grouped norm by the first group's weights (benchmarks/RESULTS.md, "the tiny builds and genai-cuda"), which
the fused ``GatedGroupRMSNorm`` does not, so their tokens are expected to differ.

``--folder PATH`` (repeatable) measures those genai build folders instead of the fixtures (mobius builds with
``--runtime ort-genai``, e.g. the real-width model of ``benchmarks/_genai_real_width.py``), as the same four
variants; ``--work DIR`` keeps the variant folders there and reuses them in a later run (quantizing a real-width
model takes minutes). Every folder's config pins ``--threads`` intra-op threads (default 1). Per round, each folder
generates greedily from the same prompt (``--new`` tokens after it, min_length = max_length so the random model's
EOS does not stop it), in a rotating order; after ``--warmup`` rounds, ``--rounds`` are measured. Time to first
token = ``append_tokens`` (the prompt's forward pass) and the first ``generate_next_token``; tokens/s = the rest of
the tokens over their time. Medians over the rounds, with the range (min–max) after them. The generated tokens of a
fused folder are compared with its unfused one's.

In mobius builds ONNX Runtime's own contrib ops already run the decode step (``CausalConvWithState``,
``LinearAttention``); mambafuse fuses the gated norm there (and, in a float32 folder for the CPU, runs the conv as
``CausalConv1d``), so these numbers show what that is worth through genai: on a tiny model, where per-node overhead
is most of the time, and at real width, where streaming the projection weights is.

    python -m benchmarks.bench_genai [--rounds 7] [--warmup 2] [--new 32] [--only REGEX] [--markdown OUT.md]
        [--folder PATH ...] [--work DIR] [--threads N] [--accuracy-level N] [--target cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from fusion import genai as fusion_genai
from models.mobius import extract_builds

STEMS = {
    target: [
        f"{family}-{dtype}-default-{target}"
        for family in ("nemotron_h-g4", "zamba2-g2", "mamba2-g4")
        for dtype in ("f32", "f16")
    ]
    for target in ("cpu", "cuda")
}
PROMPT = "the red door was on the west side of the old house by the river"
#: A folder for the CPU also as fused before its LinearAttention scans were (``--keep-builder-ops --opt-in
#: causal_conv_with_state``: ORT's LinearAttention kept), the step that default took.
LA_KEPT = "fused, LinearAttention kept"


def _genai(*args: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = fusion_genai.main(list(args))
    if status != 0:
        raise SystemExit(f"mambafuse genai {' '.join(args)} failed ({status}): {err.getvalue().strip()}")


def _pin_threads(folder: Path, threads: int) -> None:
    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    session = config["model"]["decoder"].setdefault("session_options", {})
    session["intra_op_num_threads"] = threads
    session["inter_op_num_threads"] = 1
    config_path.write_text(json.dumps(config, indent=2))


def _quantized_copy(source: Path, dest: Path, accuracy_level: int = 0) -> Path:
    """``source`` with its model.onnx quantized to int4 MatMulNBits at ``accuracy_level`` (every other file
    copied)."""
    import shutil

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    shutil.copytree(source, dest)
    model = onnx.load(dest / "model.onnx")
    quantizer = MatMulNBitsQuantizer(
        model, bits=4, block_size=32, is_symmetric=True, accuracy_level=accuracy_level or None
    )
    quantizer.process()
    for stale in dest.glob("model.onnx*"):
        stale.unlink()
    onnx.save(quantizer.model.model, dest / "model.onnx")
    return dest


def _folders(source: Path, work: Path, threads: int, accuracy_level: int = 0) -> dict[str, Path]:
    """The four variant folders of ``source`` in ``work`` (and LA_KEPT's for a folder for the CPU); folders a
    previous run left there are reused (the int4 ones by their accuracy level)."""
    folders = {}
    level = f"-acc{accuracy_level}" if accuracy_level else ""
    int4_source = work / f"int4{level}-source"
    if not (int4_source / "model.onnx").is_file():
        _quantized_copy(source, int4_source, accuracy_level)
    variants = [
        ("unfused", source, ["--config-only"]),
        ("fused", source, []),
        ("int4 unfused", int4_source, ["--config-only"]),
        ("int4 fused", int4_source, []),
    ]
    if fusion_genai.folder_provider(json.loads((source / "genai_config.json").read_text())) == "cpu":
        variants.append((LA_KEPT, source, ["--keep-builder-ops", "--opt-in", "causal_conv_with_state"]))
    for variant, base, options in variants:
        name = variant.replace(", ", "-").replace(" ", "-").replace("int4", f"int4{level}")
        out = work / name
        if not (out / "genai_config.json").is_file():
            _genai(str(base), str(out), *options)
        _pin_threads(out, threads)
        folders[variant] = out
    return folders


def _provider(folder: Path) -> str:
    """The execution provider the folder's genai config names (``cpu`` where it names none)."""
    return fusion_genai.folder_provider(json.loads((folder / "genai_config.json").read_text()))


def _device(providers: set[str]) -> str:
    """The providers measured, with the GPU's name where CUDA is one of them."""
    text = ", ".join(sorted(providers)) or "cpu"
    if "cuda" in providers:
        with contextlib.suppress(Exception):
            import subprocess

            name = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                .stdout.strip()
                .splitlines()[0]
            )
            text += f" ({name})"
    return text.replace("cpu", "CPU").replace("cuda", "CUDA")


def _generate(model, tokenizer_prompt: np.ndarray, new: int) -> tuple[list[int], float, float]:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    total = tokenizer_prompt.shape[1] + new
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(tokenizer_prompt)
    generator.generate_next_token()
    first = time.perf_counter()
    tokens = [int(generator.get_next_tokens()[0])]
    while len(tokens) < new:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    end = time.perf_counter()
    return tokens, first - start, (new - 1) / (end - first)


def _spread(values: list[float], median: float) -> str:
    """``median (min–max)``, with three significant digits or more (real-width tokens/s are single digits)."""

    def text(value: float) -> str:
        return f"{value:.0f}" if value >= 100 else f"{value:.3g}"

    return f"{text(median)} ({text(min(values))}–{text(max(values))})"


def main(argv: list[str] | None = None) -> int:
    import onnxruntime_genai as og

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_genai", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--new", type=int, default=32, help="tokens generated after the prompt (default 32)")
    parser.add_argument("--only", help="regular expression: the builds to run")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument(
        "--folder", type=Path, action="append", help="a genai build folder to measure instead of the fixtures"
    )
    parser.add_argument("--work", type=Path, help="write (and reuse) the variant folders here, not in a temporary one")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument(
        "--accuracy-level", type=int, default=0, choices=(0, 1, 2, 3, 4), help="the int4 MatMulNBits' (default 0)"
    )
    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu", help="the fixtures' builds for (cpu)")
    args = parser.parse_args(argv)
    providers: set[str] = set()
    rows = [
        "| build | variant | time to first token, ms | tokens/s | vs unfused (TTFT / tokens/s) | tokens = unfused |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="mambafuse-genai-bench-") as scratch:
        work = args.work or Path(scratch)
        if args.folder:
            sources = {folder.resolve().name: folder for folder in args.folder}
        else:
            builds = extract_builds(Path(scratch) / "builds")
            sources = {stem: builds / stem for stem in STEMS[args.target]}
        for stem, source in sources.items():
            if args.only and not re.search(args.only, stem):
                continue
            folders = _folders(source, work / stem, args.threads, args.accuracy_level)
            providers.add(_provider(folders["unfused"]))
            models = {variant: og.Model(str(folder)) for variant, folder in folders.items()}
            prompt = np.asarray(og.Tokenizer(models["unfused"]).encode(PROMPT), dtype=np.int32)[None, :]
            names = list(folders)
            ttft: dict[str, list[float]] = {v: [] for v in names}
            rate: dict[str, list[float]] = {v: [] for v in names}
            tokens: dict[str, list[int]] = {}
            for round_index in range(args.warmup + args.rounds):
                shift = round_index % len(names)
                order = names[shift:] + names[:shift]
                for variant in order:
                    generated, first, per_second = _generate(models[variant], prompt, args.new)
                    tokens[variant] = generated
                    if round_index >= args.warmup:
                        ttft[variant].append(first * 1e3)
                        rate[variant].append(per_second)
            for variant in names:
                base = "int4 unfused" if variant.startswith("int4") else "unfused"
                t, r = statistics.median(ttft[variant]), statistics.median(rate[variant])
                tb, rb = statistics.median(ttft[base]), statistics.median(rate[base])
                same = sum(a == b for a, b in zip(tokens[variant], tokens[base], strict=True))
                rows.append(
                    f"| {stem} | {variant} | {_spread(ttft[variant], t)} | {_spread(rate[variant], r)} | "
                    f"{'—' if variant == base else f'{tb / t:.2f}x / {r / rb:.2f}x'} | {same}/{args.new} |"
                )
                print(rows[-1], flush=True)
            del models
    environment = (
        f"onnxruntime-genai {og.__version__}, onnxruntime {ort.__version__}, "
        f"{platform.processor() or platform.machine()}, {_device(providers)}, {args.threads} intra-op thread"
        f"{'s' if args.threads > 1 else ''}; int4 at accuracy_level {args.accuracy_level}; prompt of "
        f"{prompt.shape[1]} tokens, {args.new} new; "
        f"median (min–max) of {args.rounds} rounds after {args.warmup}"
    )
    text = "\n".join(rows) + f"\n\n{environment}\n"
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
