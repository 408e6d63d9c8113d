"""Regenerate the tiny exported models under ``tests/fixtures/models/`` with their manifest and references.

``python -m models.fixtures`` exports every combination of ``FIXTURE_MATRIX`` (family × exporter × dtype
× mode) in a subprocess each (an exporter crash or leak stays in its own process; two run at a time),
then writes, atomically:

- ``<family>-<exporter>-<dtype>-<mode>.onnx``  one self-contained model each (exporter stack traces
  stripped, weights inline);
- ``manifest.json``  per file: family, exporter, dtype, mode, opset, number of Mamba layers, input and
  output names, cache map of decode graphs, repairs, package versions, the chains found
  (``models.inspect_chains``: count, DESIGN §2 forms, op sequences); plus every combination that
  failed, with the exporter's exact error, and the probes of documented exporter failures;
- ``references.npz``  what the torch model computed on the fixture's sample inputs (bf16 tensors as f32,
  exactly; prefill: inputs
  and logits; decode: the step's inputs incl. the cache that ``generate()`` built from the prompt, its
  logits, and the 16 tokens torch's greedy loop produces from that cache).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "models"
GREEDY_TOKENS = 16

FAMILY_LIST = ("nemotron_h", "zamba2")
DTYPE_LIST = ("fp32", "fp16", "bf16")

#: (exporter, opset or None for the exporter's default, modes, dtypes); every entry for both families.
#: Opset 23 only for fp32 prefill: its chains are opset 18's (same op sequence; ReduceMean axes are an
#: input from opset 18 on) and more copies would only add bytes.
FIXTURE_MATRIX: list[tuple[str, int | None, tuple[str, ...], tuple[str, ...]]] = [
    ("dynamo", 18, ("prefill", "decode"), DTYPE_LIST),
    ("dynamo", 23, ("prefill",), ("fp32",)),
    # bf16 of these two exporters is their fp16 graph with bf16 element types (same forms D / F, same
    # node counts, checked when the matrix was first generated); bf16 does not run on CPU, and the
    # ~1.2 MB it would add is what keeps the set within its budget.
    ("dynamo-noopt", 18, ("prefill", "decode"), ("fp32", "fp16")),
    ("torchscript", 17, ("prefill",), DTYPE_LIST),
    ("transformers", None, ("prefill", "decode"), DTYPE_LIST),
    ("transformers-ort", None, ("prefill", "decode"), ("fp32", "fp16")),
]


def fixture_stem(family: str, exporter: str, opset: int | None, dtype: str, mode: str) -> str:
    """Return the file stem of one fixture (the opset is named only where it is not the default)."""
    tag = exporter if opset in (None, 18, 17) else f"{exporter}-opset{opset}"
    return f"{family}-{tag}-{dtype}-{mode}"


def fixture_jobs() -> list[dict[str, Any]]:
    """Return every fixture combination as a job dict (stem, family, exporter, opset, dtype, mode)."""
    jobs = []
    for family in FAMILY_LIST:
        for exporter, opset, modes, dtypes in FIXTURE_MATRIX:
            for mode in modes:
                for dtype in dtypes:
                    stem = fixture_stem(family, exporter, opset, dtype, mode)
                    jobs.append(dict(stem=stem, family=family, exporter=exporter, opset=opset, dtype=dtype, mode=mode))
    return jobs


def _to_numpy(tensor: Any) -> np.ndarray:
    """Return a numpy copy of a torch tensor; bf16 becomes f32 (exact; numpy and npz have no bf16)."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.numpy()


def _references(job: dict[str, Any], record: Any) -> dict[str, np.ndarray]:
    """Return the torch model's reference tensors of one fixture (``input/<name>``, ``output/<name>``)."""
    import copy

    import torch

    from models import export
    from models.build import build_model, mamba_mixers

    model = build_model(job["family"], "tiny", job["dtype"])
    refs: dict[str, np.ndarray] = {}
    input_names = [i["name"] for i in record.inputs]
    with torch.no_grad():
        if record.scope == "mixer":
            mixer = mamba_mixers(model)[0]
            dtype = next(mixer.parameters()).dtype
            hidden = torch.randn(
                1, export.PROMPT_LEN, model.config.hidden_size, generator=torch.Generator().manual_seed(0)
            ).to(dtype)
            refs["input/hidden_states"] = _to_numpy(hidden)
            refs["output/mixer_out"] = _to_numpy(mixer(hidden))
        elif job["mode"] == "prefill":
            ids = export.prefill_inputs(model)["input_ids"]
            refs["input/input_ids"] = ids.numpy()
            if "position_ids" in input_names:
                refs["input/position_ids"] = torch.arange(ids.shape[1])[None].numpy()
            refs["output/logits"] = _to_numpy(model(input_ids=ids, use_cache=False).logits)
        else:
            inputs = export.decode_inputs(model)
            leaves, _ = torch.utils._pytree.tree_flatten(inputs["cache"])
            cache_names = [n for n in input_names if n not in ("input_ids", "position_ids")]
            if len(cache_names) != len(leaves):
                raise RuntimeError(f"{len(cache_names)} cache inputs in the graph, {len(leaves)} cache tensors")
            refs["input/input_ids"] = inputs["input_ids"].numpy()
            refs["input/position_ids"] = inputs["position_ids"].numpy()
            for name, leaf in zip(cache_names, leaves, strict=True):
                refs[f"input/{name}"] = _to_numpy(leaf)
            cache = copy.deepcopy(inputs["cache"])
            out = model(
                input_ids=inputs["input_ids"],
                position_ids=inputs["position_ids"],
                cache=cache,
                use_cache=True,
            )
            refs["output/logits"] = _to_numpy(out.logits)
            # Greedy continuation from the same cache: the token sequence a decode loop must reproduce.
            cache = copy.deepcopy(inputs["cache"])
            token, position = inputs["input_ids"], inputs["position_ids"]
            tokens = []
            for _ in range(GREEDY_TOKENS):
                out = model(input_ids=token, position_ids=position, cache=cache, use_cache=True)
                cache = out.cache
                token = out.logits[:, -1:].float().argmax(-1)
                position = position + 1
                tokens.append(int(token))
            refs["greedy_tokens"] = np.array(tokens, dtype=np.int64)
    return refs


def chain_summary(path: Path) -> dict[str, Any]:
    """Return the gated-norm chains of one exported file: count, forms, distinct op sequences."""
    from models.inspect_chains import inspect_model

    report = inspect_model(path)
    sequences = sorted(
        {" -> ".join(c.ops) + (f"  [inputs: {'; '.join(c.inputs)}]" if c.inputs else "") for c in report.chains}
    )
    return {
        "count": len(report.chains),
        "forms": report.forms(),
        "nodes_per_chain": sorted({c.num_nodes for c in report.chains}),
        "sequences": sequences,
    }


def _run_one(job: dict[str, Any], workdir: Path) -> None:
    """Export one job into ``workdir`` (``<stem>.onnx`` / ``.json`` / ``.npz``), or record its failure."""
    from models import export

    stem = job["stem"]
    result: dict[str, Any] = {"job": job}
    try:
        record = export.export_model(
            job["family"],
            job["exporter"],
            job["dtype"],
            job["mode"],
            job["opset"],
            "tiny",
            workdir / f"{stem}.onnx",
            strip_metadata=True,
        )
        refs = _references(job, record)
        np.savez(workdir / f"{stem}.npz", **refs)
        entry = record.to_json()
        entry["file"] = f"{stem}.onnx"
        del entry["path"]
        result["record"] = entry
    except Exception as e:
        result["error"] = _exact_error(e)
        result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
    (workdir / f"{stem}.json").write_text(json.dumps(result, indent=1))


def _exact_error(e: BaseException) -> str:
    """Return ``Type: message`` of the innermost cause (exporters wrap the real error), trimmed."""
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = f"{type(inner).__name__}: {inner}".strip()
    outer = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    if inner is not e:
        text = f"{outer} <- {text}"
    return text[:1500]


#: Documented exporter failures: each probe returns the exact error it hits (or None if it now works).
def probe_torchscript_full_model() -> str | None:
    """Return the error of a TorchScript (dynamo=False, opset 17) export of the whole causal LM.

    The model is wrapped to take token ids and return logits only (no cache object crosses the
    boundary), the fairest chance TorchScript gets.
    """
    import io

    import torch

    from models.build import build_model, sample_input_ids
    from models.export import _prefill_wrapper

    model = build_model("nemotron_h")
    ids = sample_input_ids(model.config)
    try:
        with torch.no_grad():
            torch.onnx.export(_prefill_wrapper(model), (ids,), io.BytesIO(), dynamo=False, opset_version=17)
    except Exception as e:
        return _exact_error(e)
    return None


def probe_dynamo_dynamic_batch() -> str | None:
    """Return the error of a dynamo prefill export with dynamic batch and sequence axes."""
    import torch

    from models.build import build_model, sample_input_ids
    from models.export import _prefill_wrapper

    model = build_model("nemotron_h")
    ids = sample_input_ids(model.config)
    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    try:
        with torch.no_grad():
            torch.onnx.export(
                _prefill_wrapper(model), (ids,), dynamo=True, dynamic_shapes={"input_ids": dims}, verbose=False
            )
    except Exception as e:
        return _exact_error(e)
    return None


PROBES = {
    "torchscript full model (NemotronHForCausalLM, opset 17)": probe_torchscript_full_model,
    "dynamo prefill with dynamic batch and sequence axes": probe_dynamo_dynamic_batch,
}


def _run_probes(workdir: Path) -> None:
    results = {}
    for name, probe in PROBES.items():
        error = probe()
        results[name] = error if error is not None else "no error: this export now works"
    (workdir / "_probes.json").write_text(json.dumps(results, indent=1))


def _spawn(args: list[str], log: Path) -> int:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    with open(log, "w") as f:
        return subprocess.call(
            [sys.executable, "-m", "models.fixtures", *args], stdout=f, stderr=subprocess.STDOUT, env=env
        )


def generate(out_dir: Path = FIXTURE_DIR, jobs: list[dict[str, Any]] | None = None, workers: int = 2) -> dict:
    """Export all fixtures into ``out_dir`` (replacing what is there); return the manifest written."""
    from models.export import save_atomic  # noqa: F401  (fail early if the package is broken)

    jobs = fixture_jobs() if jobs is None else jobs
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mambafuse-fixtures-") as tmp:
        workdir = Path(tmp)
        start = time.time()
        stems = {job["stem"] for job in jobs}
        partial = stems != {job["stem"] for job in fixture_jobs()}
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {
                pool.submit(_spawn, ["--one", json.dumps(job), "--workdir", tmp], workdir / f"{job['stem']}.log"): job
                for job in jobs
            }
            futures[pool.submit(_spawn, ["--probes", "--workdir", tmp], workdir / "_probes.log")] = None
            for future in concurrent.futures.as_completed(futures):
                job = futures[future]
                name = job["stem"] if job else "probes"
                print(f"[{time.time() - start:6.0f} s] {name}: exit {future.result()}", flush=True)

        manifest: dict[str, Any] = {"fixtures": {}, "failures": {}, "probes": {}}
        references: dict[str, np.ndarray] = {}
        if partial and (out_dir / "manifest.json").exists():
            # A partial run (--only) keeps the other fixtures as they are.
            # Combinations no longer in the matrix are dropped.
            old = json.loads((out_dir / "manifest.json").read_text())
            keep = {job["stem"] for job in fixture_jobs()} - stems
            for key in ("fixtures", "failures"):
                manifest[key] = {k: v for k, v in old[key].items() if k in keep}
            with np.load(out_dir / "references.npz") as refs:
                references = {k: refs[k] for k in refs.files if k.split("/", 1)[0] in manifest["fixtures"]}
        for job in jobs:
            stem = job["stem"]
            result_path = workdir / f"{stem}.json"
            if not result_path.exists():
                log = (workdir / f"{stem}.log").read_text()[-1500:]
                manifest["failures"][stem] = {**job, "error": f"worker died: {log}"}
                continue
            result = json.loads(result_path.read_text())
            if "error" in result:
                manifest["failures"][stem] = {**job, "error": result["error"]}
                continue
            manifest["fixtures"][stem] = result["record"] | {"chains": chain_summary(workdir / f"{stem}.onnx")}
            with np.load(workdir / f"{stem}.npz") as refs:
                for key in refs.files:
                    references[f"{stem}/{key}"] = refs[key]
        probes_path = workdir / "_probes.json"
        if probes_path.exists():
            manifest["probes"] = json.loads(probes_path.read_text())
        elif partial and (out_dir / "manifest.json").exists():
            manifest["probes"] = json.loads((out_dir / "manifest.json").read_text()).get("probes", {})

        # Replace the old fixture set: stale files of combinations that no longer export must go too.
        for old_file in out_dir.glob("*.onnx"):
            if not partial or old_file.stem in stems or old_file.stem not in manifest["fixtures"]:
                old_file.unlink()
        for stem in manifest["fixtures"]:
            if stem not in stems:
                continue  # kept from the previous run (partial regeneration)
            os.replace(workdir / f"{stem}.onnx", out_dir / f"{stem}.onnx")
            os.chmod(out_dir / f"{stem}.onnx", 0o644)
        refs_tmp = workdir / "references.npz"
        np.savez_compressed(refs_tmp, **references)
        os.replace(refs_tmp, out_dir / "references.npz")
        os.chmod(out_dir / "references.npz", 0o644)
        manifest_tmp = workdir / "manifest.json"
        manifest_tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.replace(manifest_tmp, out_dir / "manifest.json")
        os.chmod(out_dir / "manifest.json", 0o644)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Regenerate the fixtures (or, internally, run one export job / the probes)."""
    parser = argparse.ArgumentParser(prog="python -m models.fixtures", description=main.__doc__)
    parser.add_argument("-o", "--out-dir", type=Path, default=FIXTURE_DIR)
    parser.add_argument("-j", "--workers", type=int, default=2)
    parser.add_argument("--only", default=None, help="regenerate only stems matching this regex (others kept)")
    parser.add_argument("--retry-failed", action="store_true", help="re-run only the combinations that failed")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--probes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _run_one(json.loads(args.one), args.workdir)
        return 0
    if args.probes:
        _run_probes(args.workdir)
        return 0
    jobs = fixture_jobs()
    if args.only:
        jobs = [j for j in jobs if re.search(args.only, j["stem"])]
    if args.retry_failed:
        failed = set(json.loads((args.out_dir / "manifest.json").read_text())["failures"])
        jobs = [j for j in jobs if j["stem"] in failed]
    manifest = generate(args.out_dir, jobs, args.workers)
    total = sum(f.stat().st_size for f in args.out_dir.iterdir())
    print(
        f"{len(manifest['fixtures'])} fixtures, {len(manifest['failures'])} failed combinations, "
        f"{total / 1e6:.2f} MB in {args.out_dir}"
    )
    for stem, failure in manifest["failures"].items():
        print(f"  FAILED {stem}: {failure['error'][:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
