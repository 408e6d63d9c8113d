"""Regenerate the tiny exported models under ``tests/fixtures/models/`` with their manifest and references.

Five fixture sets, each a directory with its own ``manifest.json`` and ``references.npz``:

- ``models`` (``tests/fixtures/models/``): Nemotron-H and Zamba2, ``FIXTURE_MATRIX`` (family × exporter ×
  dtype × mode, every combination);
- ``families`` (``tests/fixtures/models/families/``): Mamba2, Bamba, GraniteMoeHybrid and Falcon-H1 in both
  norm orders, ``FAMILY_FIXTURES`` (a representative subset per family, not every combination). Its
  records also say how many chains must be fused (``expected_fused``) and why the others must be
  refused (``expected_refusal``), and its probes record the whole-model TorchScript export of each family;
- ``padded`` (``tests/fixtures/models/padded/``): whole-model dynamo prefill exports of every gate-before-norm
  family at other SSD chunk sizes, traced at a multiple of the chunk size (torch then writes the group count
  from the padded length, ``(G * c * ceil(L / c)) // L``, and the export runs only at multiples of c) and at
  a length past one chunk that is not a multiple (``PADDED_FIXTURES``); references at two chunks;
- ``batch`` (``tests/fixtures/models/batch/``): decode steps with a symbolic batch axis, traced at
  ``TRACED_BATCH`` rows (``BATCH_FIXTURES``); references at that batch;
- ``transformers-5.25`` (``tests/fixtures/models/transformers-5.25/``): every family exported with transformers
  5.25, whose decode step is written differently (``TF525_FIXTURES``); the sets above are 5.24's.

``python -m models.fixtures [--set models|families|padded|batch|transformers-5.25]`` exports every combination
of the set in a subprocess each (an exporter crash or leak stays in its own process; two run at a time),
then writes, atomically:

- ``<family>-<exporter>-<dtype>-<mode>.onnx``  one self-contained model each (exporter stack traces
  stripped, weights inline);
- ``manifest.json``  per file: family, exporter, dtype, mode, opset, number of Mamba layers, input and
  output names, cache map of decode graphs, repairs, package versions, the chains found
  (``models.inspect_chains``: count, docs/forms.md forms, op sequences); plus every combination that
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
FAMILY_FIXTURE_DIR = FIXTURE_DIR / "families"
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


#: The families set: per family, the (exporter, opset or None, mode, dtype) combinations exported — a
#: representative subset, not every combination (the Nemotron-H / Zamba2 set has those). Every family gets
#: dynamo (optimize) fp32 prefill and fp16 prefill and decode, dynamo without optimize, transformers'
#: exporter and TorchScript; Falcon-H1 (gate-before-norm: the weight inside the grouped view, a spelling
#: of its own) gets every dtype × mode of dynamo and both dtypes of dynamo-noopt and the TorchScript
#: mixer; its norm-before-gate twin one export per exporter.
_COMMON: list[tuple[str, int | None, str, str]] = [
    ("dynamo", 18, "prefill", "fp32"),
    ("dynamo", 18, "prefill", "fp16"),
    ("dynamo", 18, "decode", "fp16"),
    ("dynamo-noopt", 18, "decode", "fp32"),
    ("transformers", None, "decode", "fp16"),
]
#: Whole-model TorchScript: Mamba2's exports (no mixer fixture needed); Bamba's and Falcon-H1's stop at
#: aten::diff (recorded in the manifest's failures) and get the mixer exported alone, as Nemotron-H and
#: Zamba2 do. GraniteMoeHybrid's whole model exports too, but its graph is ~0.5 MB (every expert and
#: shape computation as nodes): its fixture is the mixer.
_TS_MODEL = ("torchscript-model", 17, "prefill", "fp32")
_TS_MIXER = ("torchscript", 17, "prefill", "fp32")
FAMILY_FIXTURES: dict[str, list[tuple[str, int | None, str, str]]] = {
    "mamba2": [*_COMMON, _TS_MODEL],
    "bamba": [*_COMMON, _TS_MODEL, _TS_MIXER],
    "granitemoehybrid": [*_COMMON, _TS_MIXER],
    "falcon_h1": [
        _TS_MODEL,
        ("dynamo", 18, "prefill", "fp32"),
        ("dynamo", 18, "prefill", "fp16"),
        ("dynamo", 18, "decode", "fp32"),
        ("dynamo", 18, "decode", "fp16"),
        ("dynamo-noopt", 18, "prefill", "fp32"),
        ("dynamo-noopt", 18, "decode", "fp16"),
        ("torchscript", 17, "prefill", "fp32"),
        ("torchscript", 17, "prefill", "fp16"),
        ("transformers", None, "decode", "fp16"),
    ],
    "falcon_h1_nbg": [
        ("dynamo", 18, "prefill", "fp32"),
        ("dynamo", 18, "decode", "fp16"),
        ("torchscript", 17, "prefill", "fp32"),
        ("transformers", None, "decode", "fp32"),
    ],
}

#: The padded set: (family, exporter, opset, dtype, SSD chunk size c, traced length L). Traced at a multiple of
#: c, the chunked scan's ``if pad_size > 0`` branch is not taken: torch drops the ``[:, :L]`` slice, writes the
#: norm's group count from the padded length, ``(G * c * ceil(L / c)) // L``, and the export runs only at
#: multiples of c. Traced past one chunk at a length that is not a multiple, the slice stays (``Min(L, padded)``,
#: which the arithmetic follows) and the export runs at every length. Every gate-before-norm family traced at
#: two chunks; Nemotron-H and Zamba2 also at chunk 4 and in fp16 (Nemotron-H without optimize), and once at a
#: non-multiple.
PADDED_FIXTURE_DIR = FIXTURE_DIR / "padded"
PADDED_FIXTURES: list[tuple[str, str, int, str, int, int]] = [
    ("nemotron_h", "dynamo", 18, "fp32", 4, 8),
    ("nemotron_h", "dynamo", 18, "fp32", 8, 16),
    ("nemotron_h", "dynamo-noopt", 18, "fp16", 8, 16),
    ("nemotron_h", "dynamo", 18, "fp32", 8, 12),
    ("zamba2", "dynamo", 18, "fp32", 4, 8),
    ("zamba2", "dynamo", 18, "fp16", 8, 16),
    ("zamba2", "dynamo", 18, "fp32", 4, 6),
    ("mamba2", "dynamo", 18, "fp32", 8, 16),
    ("bamba", "dynamo", 18, "fp32", 8, 16),
    ("granitemoehybrid", "dynamo", 18, "fp32", 8, 16),
    ("falcon_h1", "dynamo", 18, "fp32", 8, 16),
]
#: The batch set: decode steps exported with a symbolic batch axis (dynamo: ``Dim("batch")`` on the token
#: ids, which torch.export carries to every cache tensor), traced at ``TRACED_BATCH`` rows: (family,
#: exporter, opset or None, dtype). Nemotron-H and Zamba2 (a Mamba-2 layer after an attention layer, whose
#: dims reach it only through the fused ops before it) and Mamba2 (Mamba-2 layers only), dynamo in fp32 and
#: fp16; Bamba, GraniteMoeHybrid and Falcon-H1 dynamo fp16; transformers' exporter, whose dynamic axes make
#: the batch symbolic too, once.
BATCH_FIXTURE_DIR = FIXTURE_DIR / "batch"
TRACED_BATCH = 2
BATCH_FIXTURES: list[tuple[str, str, int | None, str]] = [
    ("nemotron_h", "dynamo", 18, "fp32"),
    ("nemotron_h", "dynamo", 18, "fp16"),
    ("zamba2", "dynamo", 18, "fp32"),
    ("zamba2", "dynamo", 18, "fp16"),
    ("mamba2", "dynamo", 18, "fp32"),
    ("mamba2", "dynamo", 18, "fp16"),
    ("bamba", "dynamo", 18, "fp16"),
    ("granitemoehybrid", "dynamo", 18, "fp16"),
    ("falcon_h1", "dynamo", 18, "fp16"),
    ("nemotron_h", "transformers", None, "fp32"),
]
#: The transformers-5.25 set (``tests/fixtures/models/transformers-5.25/``): the same families exported with
#: transformers 5.25, whose decode step runs through the kernel-hub fallback functions (``causal_conv1d_update``,
#: ``mamba2_selective_state_update``) with the batch read from the cache, and adds a ``cumulative_length_linear``
#: cache tensor per Mamba layer. Beside the sets above (exported with 5.24), so that the tests keep both
#: versions' graphs: every family's dynamo decode (fp32, fp16) and prefill (fp32), dynamo without optimize,
#: transformers' exporter; Nemotron-H and Zamba2 also bf16 decode, opset 23 prefill, TorchScript and
#: transformers' exporter with ORT's fusions; and a symbolic-batch decode step each of Nemotron-H and Mamba2.
#: ``python -m models.fixtures --set transformers-5.25`` regenerates it with the installed transformers (the
#: manifest records the version; the tests check it is 5.25).
TF525_FIXTURE_DIR = FIXTURE_DIR / "transformers-5.25"
TF525_VERSION = "5.25"
TF525_FIXTURES: list[tuple[str, str, int | None, str, str, int]] = [
    *(
        (family, exporter, opset, mode, dtype, 1)
        for family in ("nemotron_h", "zamba2", "mamba2", "bamba", "granitemoehybrid", "falcon_h1", "falcon_h1_nbg")
        for exporter, opset, mode, dtype in (
            ("dynamo", 18, "decode", "fp32"),
            ("dynamo", 18, "decode", "fp16"),
            ("dynamo", 18, "prefill", "fp32"),
            ("dynamo-noopt", 18, "decode", "fp32"),
            ("transformers", None, "decode", "fp32"),
            ("transformers", None, "prefill", "fp16"),
        )
    ),
    *(
        (family, exporter, opset, mode, dtype, 1)
        for family in ("nemotron_h", "zamba2")
        for exporter, opset, mode, dtype in (
            ("dynamo", 18, "decode", "bf16"),
            ("dynamo", 23, "prefill", "fp32"),
            ("torchscript", 17, "prefill", "fp32"),
            ("transformers-ort", None, "decode", "fp32"),
        )
    ),
    ("nemotron_h", "dynamo", 18, "decode", "fp32", TRACED_BATCH),
    ("mamba2", "dynamo", 18, "decode", "fp16", TRACED_BATCH),
]
FIXTURE_SETS = ("models", "families", "padded", "batch", "transformers-5.25")
#: The sets of the families table (the batch set repeats families and exporters that the others cover).
_TABLE_SETS = ("models", "families", "padded")


def family_fixture_jobs() -> list[dict[str, Any]]:
    """Return every combination of the families set as a job dict (stem, family, exporter, opset, dtype, mode)."""
    jobs = []
    for family, combos in FAMILY_FIXTURES.items():
        for exporter, opset, mode, dtype in combos:
            stem = fixture_stem(family, exporter, opset, dtype, mode)
            jobs.append(dict(stem=stem, family=family, exporter=exporter, opset=opset, dtype=dtype, mode=mode))
    return jobs


def padded_fixture_jobs() -> list[dict[str, Any]]:
    """Return every combination of the padded set as a job dict (with chunk_size, prompt_len, reference_len)."""
    jobs = []
    for family, exporter, opset, dtype, chunk, traced in PADDED_FIXTURES:
        tag = f"-chunk{chunk}-len{traced}-prefill"
        stem = fixture_stem(family, exporter, opset, dtype, "prefill").replace("-prefill", tag)
        jobs.append(
            dict(
                stem=stem,
                family=family,
                exporter=exporter,
                opset=opset,
                dtype=dtype,
                mode="prefill",
                chunk_size=chunk,
                prompt_len=traced,
                reference_len=2 * chunk,
            )
        )
    return jobs


def batch_fixture_jobs() -> list[dict[str, Any]]:
    """Return every combination of the batch set as a job dict (with batch, the traced rows)."""
    jobs = []
    for family, exporter, opset, dtype in BATCH_FIXTURES:
        stem = fixture_stem(family, exporter, opset, dtype, "decode").replace("-decode", "-batch-decode")
        jobs.append(
            dict(
                stem=stem, family=family, exporter=exporter, opset=opset, dtype=dtype, mode="decode", batch=TRACED_BATCH
            )
        )
    return jobs


def tf525_fixture_jobs() -> list[dict[str, Any]]:
    """Return every combination of the transformers-5.25 set as a job dict (with batch where above 1)."""
    jobs = []
    for family, exporter, opset, mode, dtype, batch in TF525_FIXTURES:
        stem = fixture_stem(family, exporter, opset, dtype, mode)
        job = dict(stem=stem, family=family, exporter=exporter, opset=opset, dtype=dtype, mode=mode)
        if batch > 1:
            job.update(stem=stem.replace("-decode", "-batch-decode"), batch=batch)
        jobs.append(job)
    return jobs


def set_jobs(fixture_set: str) -> list[dict[str, Any]]:
    """Return every job of a fixture set ("models", "families", "padded" or "batch")."""
    return {
        "models": fixture_jobs,
        "families": family_fixture_jobs,
        "padded": padded_fixture_jobs,
        "batch": batch_fixture_jobs,
        "transformers-5.25": tf525_fixture_jobs,
    }[fixture_set]()


def set_dir(fixture_set: str) -> Path:
    """Return the directory of a fixture set."""
    return {
        "models": FIXTURE_DIR,
        "families": FAMILY_FIXTURE_DIR,
        "padded": PADDED_FIXTURE_DIR,
        "batch": BATCH_FIXTURE_DIR,
        "transformers-5.25": TF525_FIXTURE_DIR,
    }[fixture_set]


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

    model = build_model(job["family"], "tiny", job["dtype"], chunk_size=job.get("chunk_size"))
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
            ids = export.prefill_inputs(model, job.get("reference_len", export.PROMPT_LEN))["input_ids"]
            refs["input/input_ids"] = ids.numpy()
            if "position_ids" in input_names:
                refs["input/position_ids"] = torch.arange(ids.shape[1])[None].numpy()
            for name in input_names:  # transformers 5.25's per-layer token counts, of an empty cache
                if name.endswith("cumulative_length_linear"):
                    refs[f"input/{name}"] = np.array(0, dtype=np.int64)
            refs["output/logits"] = _to_numpy(model(input_ids=ids, use_cache=False).logits)
        else:
            batch = job.get("batch", 1)
            inputs = export.decode_inputs(model, batch=batch)
            leaves, _ = torch.utils._pytree.tree_flatten(inputs["cache"])
            cache_names = [n for n in input_names if n not in ("input_ids", "position_ids")]
            if len(cache_names) != len(leaves):
                raise RuntimeError(f"{len(cache_names)} cache inputs in the graph, {len(leaves)} cache tensors")
            refs["input/input_ids"] = inputs["input_ids"].numpy()
            # Mamba2ForCausalLM's decode step has no position ids.
            has_positions = "position_ids" in inputs
            if has_positions:
                refs["input/position_ids"] = inputs["position_ids"].numpy()
            for name, leaf in zip(cache_names, leaves, strict=True):
                refs[f"input/{name}"] = _to_numpy(leaf)
            cache = copy.deepcopy(inputs["cache"])
            step = {"position_ids": inputs["position_ids"]} if has_positions else {}
            out = model(input_ids=inputs["input_ids"], cache=cache, use_cache=True, **step)
            refs["output/logits"] = _to_numpy(out.logits)
            # Greedy continuation from the same cache: the token sequence a decode loop must reproduce.
            cache = copy.deepcopy(inputs["cache"])
            token = inputs["input_ids"]
            tokens = []
            for _ in range(GREEDY_TOKENS):
                out = model(input_ids=token, cache=cache, use_cache=True, **step)
                cache = out.cache
                token = out.logits[:, -1:].float().argmax(-1)
                if has_positions:
                    step = {"position_ids": step["position_ids"] + 1}
                tokens.append(token.reshape(-1).tolist() if batch > 1 else int(token))
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
            chunk_size=job.get("chunk_size"),
            prompt_len=job.get("prompt_len", export.PROMPT_LEN),
            batch=job.get("batch", 1),
        )
        refs = _references(job, record)
        if job["dtype"] != "bf16":  # no bf16 CPU kernels, and numpy has no bf16 to feed
            _check_runs(workdir / f"{stem}.onnx", record, refs)
        np.savez(workdir / f"{stem}.npz", **refs)
        entry = record.to_json()
        entry["file"] = f"{stem}.onnx"
        del entry["path"]
        if "reference_len" in job:
            entry["reference_len"] = job["reference_len"]
        if "batch" in job:
            entry["batch"] = job["batch"]
        result["record"] = entry
    except Exception as e:
        result["error"] = _exact_error(e)
        result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
    (workdir / f"{stem}.json").write_text(json.dumps(result, indent=1))


def _check_runs(path: Path, record: Any, refs: dict[str, np.ndarray]) -> None:
    """Raise when ONNX Runtime (CPU) cannot run the exported model on its reference inputs: an export that
    does not run is recorded as a failure of its exporter, not kept as a fixture."""
    import onnxruntime as ort

    from models.runtime import feeds

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds({"inputs": record.inputs}, refs))
    except Exception as error:
        raise RuntimeError(f"the export does not run in ONNX Runtime {ort.__version__}: {error}") from error


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


def generate(
    out_dir: Path = FIXTURE_DIR,
    jobs: list[dict[str, Any]] | None = None,
    workers: int = 2,
    fixture_set: str = "models",
) -> dict:
    """Export all fixtures of a set into ``out_dir`` (replacing what is there); return the manifest written.

    ``jobs`` a subset of the set's jobs: the other fixtures of the set are kept as they are.
    """
    from models.export import save_atomic  # noqa: F401  (fail early if the package is broken)

    all_jobs = set_jobs(fixture_set)
    jobs = all_jobs if jobs is None else jobs
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mambafuse-fixtures-") as tmp:
        workdir = Path(tmp)
        start = time.time()
        stems = {job["stem"] for job in jobs}
        partial = stems != {job["stem"] for job in all_jobs}
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {
                pool.submit(_spawn, ["--one", json.dumps(job), "--workdir", tmp], workdir / f"{job['stem']}.log"): job
                for job in jobs
            }
            if fixture_set == "models":  # the families set records its exporter failures per combination
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
            keep = {job["stem"] for job in all_jobs} - stems
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


#: The norm-before-gate gated norms of families not exported as whole models: each norm module alone,
#: exported with dynamo (``python -m models.fixtures --norm-modules``), under ``NORM_MODULE_DIR``.
NORM_MODULES = {
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated"),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNormGated"),
    "kimi_linear": ("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearRMSNormGated"),
}
NORM_MODULE_DIR = FAMILY_FIXTURE_DIR / "norms"


def export_norm_modules(out_dir: Path = NORM_MODULE_DIR) -> None:
    """Export each ``NORM_MODULES`` norm alone (per-head: x, gate ``[1, 8, 4, 16]`` -> out), fp32, dynamo
    opset 18, with its torch output on seeded inputs in ``references.npz`` (``<name>/x``, ``/gate``, ``/out``)."""
    import importlib

    import torch

    from models.onnx_utils import check, save_atomic, strip_debug_metadata

    out_dir.mkdir(parents=True, exist_ok=True)
    references = {}
    for name, (module_path, class_name) in NORM_MODULES.items():
        norm = getattr(importlib.import_module(module_path), class_name)(16, eps=1e-6).eval()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            norm.weight.copy_(1.0 + 0.25 * torch.randn(16, generator=generator))
            x, gate = torch.randn(2, 1, 8, 4, 16, generator=generator)
            program = torch.onnx.export(
                norm, (x, gate), dynamo=True, opset_version=18, input_names=["x", "gate"], output_names=["out"]
            )
            references |= {f"{name}/x": x.numpy(), f"{name}/gate": gate.numpy(), f"{name}/out": norm(x, gate).numpy()}
        proto = program.model_proto
        strip_debug_metadata(proto)
        if check(proto) != "ok":
            raise RuntimeError(f"{name}: onnx.checker: {check(proto)}")
        save_atomic(proto, out_dir / f"{name}.onnx")
    np.savez_compressed(out_dir / "references.npz", **references)


#: Families the fixtures do not export: gated norms that are deliberately not fused, and why. One row each
#: in the families table (family, transformers class, variant, why).
NOT_EXPORTED = [
    (
        "Qwen3-Next / Qwen3.5",
        "`Qwen3NextRMSNormGated` / `Qwen3_5RMSNormGated`",
        "per-head norm, then `* silu(gate)`",
        "norm before gate, a different op (the norm alone, `families/norms/`: no group Reshape, no chain found)",
    ),
    (
        "Kimi Linear",
        "`KimiLinearRMSNormGated`",
        "per-head norm, then `* sigmoid(gate)`",
        "norm before gate with a sigmoid gate, a different op (the norm alone: no chain found)",
    ),
    (
        "TII Falcon-H1, `mamba_rms_norm=False`",
        "`FalconH1ForCausalLM` (the mixer's `norm` is `nn.Identity`)",
        "no gated norm (the config class default)",
        "nothing to fuse",
    ),
]

_FAMILY_LABELS = {
    "nemotron_h": "NVIDIA Nemotron-H",
    "zamba2": "Zyphra Zamba2",
    "mamba2": "Mistral Codestral Mamba, Mamba2",
    "bamba": "IBM Bamba",
    "granitemoehybrid": "IBM Granite 4.0-H",
    "falcon_h1": "TII Falcon-H1, gate before norm",
    "falcon_h1_nbg": "TII Falcon-H1, norm before gate",
}
_EXPORTER_LABELS = {
    "dynamo": "dynamo",
    "dynamo-noopt": "dynamo-noopt",
    "torchscript": "TorchScript (mixer)",
    "torchscript-model": "TorchScript (model)",
    "transformers": "transformers",
    "transformers-ort": "transformers-ort",
}


def families_table(manifests: list[dict[str, Any]] | None = None) -> str:
    """Return the families table (markdown): family → transformers class → variant → fused? → exporters tested.

    Built from the fixture manifests (what was exported, how many chains each export must fuse, which
    exporters failed) and ``models.build.FAMILY_SPECS``; ``tests/test_families.py`` checks that
    ``models/README.md`` holds exactly this table, and the fusion tests that every count in it holds.
    """
    from models.build import FAMILY_SPECS

    if manifests is None:
        manifests = [json.loads((set_dir(name) / "manifest.json").read_text()) for name in _TABLE_SETS]
    records = [r for m in manifests for r in m["fixtures"].values()]
    failures = [f for m in manifests for f in m["failures"].values()]
    lines = [
        "| family | transformers class (model / gated norm) | variant | fused? | exporters tested (fixtures) |",
        "|---|---|---|---|---|",
    ]
    for family, spec in FAMILY_SPECS.items():
        mine = [r for r in records if r["family"] == family]
        if not mine:
            continue
        exporters = sorted({r["exporter"] for r in mine}, key=list(_EXPORTER_LABELS).index)
        tested = ", ".join(_EXPORTER_LABELS[e] for e in exporters)
        failed = sorted({_EXPORTER_LABELS[f["exporter"]] for f in failures if f["family"] == family})
        if failed:
            tested += "; export fails: " + ", ".join(failed)
        chains = sum(r["num_mamba_layers"] for r in mine)
        expected = sum(r.get("expected_fused", r["num_mamba_layers"]) for r in mine)
        if expected == chains:
            fused = f"yes: all {chains} chains of {len(mine)} exports"
        elif expected == 0:
            fused = f"no, deliberately: norm before gate, refused ({chains} chains of {len(mine)} exports)"
        else:
            fused = f"{expected} of {chains} chains"
        lines.append(
            f"| {_FAMILY_LABELS[family]} (`{family}`) | `{spec.model_class}` / `{spec.norm_class}` | "
            f"{spec.variant} | {fused} | {tested} |"
        )
    for family, classes, variant, why in NOT_EXPORTED:
        tested = "dynamo (the norm module alone)" if "no chain found" in why else "not exported"
        lines.append(f"| {family} | {classes} | {variant} | no, deliberately: {why} | {tested} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Regenerate the fixtures (or, internally, run one export job / the probes)."""
    parser = argparse.ArgumentParser(prog="python -m models.fixtures", description=main.__doc__)
    parser.add_argument("--set", dest="fixture_set", choices=FIXTURE_SETS, default="models")
    parser.add_argument("-o", "--out-dir", type=Path, default=None, help="default: the set's directory")
    parser.add_argument("-j", "--workers", type=int, default=2)
    parser.add_argument("--families-table", action="store_true", help="print the families table and exit")
    parser.add_argument("--norm-modules", action="store_true", help="export NORM_MODULES into NORM_MODULE_DIR")
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
    if args.families_table:
        print(families_table(), end="")
        return 0
    if args.norm_modules:
        export_norm_modules()
        return 0
    out_dir = args.out_dir or set_dir(args.fixture_set)
    jobs = set_jobs(args.fixture_set)
    if args.only:
        jobs = [j for j in jobs if re.search(args.only, j["stem"])]
    if args.retry_failed:
        failed = set(json.loads((out_dir / "manifest.json").read_text())["failures"])
        jobs = [j for j in jobs if j["stem"] in failed]
    manifest = generate(out_dir, jobs, args.workers, args.fixture_set)
    total = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    print(
        f"{len(manifest['fixtures'])} fixtures, {len(manifest['failures'])} failed combinations, "
        f"{total / 1e6:.2f} MB in {out_dir}"
    )
    for stem, failure in manifest["failures"].items():
        print(f"  FAILED {stem}: {failure['error'][:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
