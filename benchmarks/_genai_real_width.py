"""Build the real-width random-weight Nemotron-H as onnxruntime-genai folders, for ``bench_genai --folder``.

The model of ``bench_gpu_nemotron.py``'s ``export_mobius``: models/build.py's "real" Nemotron-H config (the 8B
model's widths, vocabulary 1024) with its first 8 layers (``LAYERS``: 4 Mamba-2, 3 MLP, 1 attention), random
weights, as a Hugging Face checkpoint (``WORK/checkpoint``, ~4 GB in fp32, written once), then one mobius build per
dtype and target (``WORK/nemotron_h-real8-<dtype>-<target>``), through models/mobius.py's wrapper exactly as the
fixtures' genai builds are made (``--ep <target> --runtime ort-genai``). For the CPU that is mobius' default graph;
for CUDA it is the graph its ``MOBIUS_ORT_CUDA_GROUPED_RMSNORM_WORKAROUND`` writes, because ONNX Runtime's CUDA
``RMSNormalization`` scales every group of a grouped norm by the first group's weights (benchmarks/RESULTS.md,
"the tiny builds and genai-cuda"), so the default graph's unfused tokens would be wrong there and not a baseline.

    python -m benchmarks._genai_real_width WORK [--dtype f32] [--dtype f16] [--target cpu|cuda]
    python -m benchmarks.bench_genai --folder WORK/nemotron_h-real8-f32-cpu --new 8 --rounds 5 --warmup 1

A CUDA folder is 2 GB of random weights in f16; ``benchmarks/_weightless.py`` packs it without them for a machine
that cannot build it, and fills them in again there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build(work: Path, dtypes: list[str], target: str = "cpu") -> list[Path]:
    """Write the checkpoint (unless there) and one genai build folder per dtype for ``target``; return the
    folders."""
    from benchmarks.bench_gpu_nemotron import REAL8_CHECKPOINT, write_real8_checkpoint
    from models import mobius

    checkpoint = work / "checkpoint"
    write_real8_checkpoint(checkpoint)
    folders = []
    for dtype in dtypes:
        out = work / f"{REAL8_CHECKPOINT}-{dtype}-{target}"
        job = dict(dtype=dtype, target=target, runtime="ort-genai")
        # A relative --model, as run_build passes it, keeps the work folder's path out of the graph's name.
        argv = mobius.mobius_argv(job, checkpoint.name, str(out.resolve()))
        env = {k: v for k, v in os.environ.items() if k != mobius.WORKAROUND_ENV}  # mobius' default graph
        if target == "cuda":
            env[mobius.WORKAROUND_ENV] = "1"  # a graph ORT's CUDA norm computes right (the docstring says why)
        env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "models.mobius", "mobius", *argv], cwd=work, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{dtype}: mobius build failed (exit {done.returncode})")
        print(f"{dtype}: {out} built in {time.perf_counter() - start:.0f} s", flush=True)
        folders.append(out)
    return folders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._genai_real_width", description=__doc__.split("\n")[0])
    parser.add_argument("work", type=Path, help="folder for the checkpoint and the builds (~4 GB each in fp32)")
    parser.add_argument("--dtype", action="append", choices=("f32", "f16"), help="default: f32")
    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu", help="mobius' --ep (default: cpu)")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    build(args.work, args.dtype or ["f32"], args.target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
