"""Run the Olive workflows of tests/test_olive.py in a process of their own: ``python tests/_olive_workflows.py OUT``.

Olive takes ~8 s to import and configures logging and telemetry globally, so the tests run it once, here,
with telemetry off and the Hugging Face hub offline, and check what it wrote to OUT:

- ``fixture/``: ``mambafuse olive`` (``python -m fusion.olive``) on a config (the committed tiny Nemotron-H
  prefill export → ``GraphSurgeries`` with our surgeon, ``min_fused`` 2 → Olive's latency evaluator on the
  fused model).
- ``mobius/``: a random-weight Hugging Face Mamba-2 directory → ``MobiusBuilder`` → ``GraphSurgeries``
  with our surgeon; ``mobius_only/``: the same without the surgeon (the unfused reference).
- ``olive_session_outputs.npz``: every output model run through Olive's own session factory
  (``olive.common.ort_inference.get_ort_inference_session``: no mambafuse library), and the feeds.
- ``int4-<pass>/``: a transformers 5.25 decode export through each of Olive's weight-only int4 passes
  (``INT4_PASSES``: RTN, k-quant, HQQ), for the tests to fuse.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "models" / "nemotron_h-dynamo-fp32-prefill.onnx"
SEED = 0
#: The decode export Olive's int4 passes quantize (models/fixtures: transformers 5.25, dynamo, float32).
INT4_SOURCE = ROOT / "tests" / "fixtures" / "models" / "transformers-5.25" / "nemotron_h-dynamo-fp32-decode.onnx"
#: Olive's weight-only quantization passes that write MatMulNBits, at block 32 (k-quant's default; RTN's and HQQ's
#: is 128, wider than the fixture's rows).
INT4_PASSES = {
    "rtn": {"type": "OnnxBlockWiseRtnQuantization", "block_size": 32},
    "kquant": {"type": "OnnxKQuantQuantization"},
    "hqq": {"type": "OnnxHqqQuantization", "block_size": 32},
}


def _shim_mobius_local_tokenizer() -> None:
    """Work around mobius-onnx 0.1.0 with a local model directory (no hub).

    Olive's MobiusBuilder passes the model's path as ``hf_model_id`` to mobius' genai-config writer,
    which asks ``hf_hub_download`` for the tokenizer files and only tolerates a missing file, not a path
    that is no repo id (HFValidationError). mobius has the local-directory copy; use it for directories.
    """
    from mobius.integrations.ort_genai import auto_export

    hub_copy = auto_export._copy_tokenizer_files

    def copy_tokenizer_files(model_id: str, output_dir: str) -> list[str]:
        if os.path.isdir(model_id):
            return auto_export._copy_tokenizer_files_from_local(model_id, output_dir)
        return hub_copy(model_id, output_dir)

    auto_export._copy_tokenizer_files = copy_tokenizer_files


def _tiny_mamba2(directory: Path) -> None:
    """Save a random-weight 2-layer Mamba-2 causal LM (C = 64) with a distinct gated-norm weight per layer."""
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(SEED)
    config = Mamba2Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=16,
        expand=2,
        n_groups=1,
        state_size=8,
        conv_kernel=4,
        chunk_size=16,
    )
    model = Mamba2ForCausalLM(config)
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for layer in model.backbone.layers:
            weight = layer.mixer.norm.weight
            weight.copy_(1 + 0.25 * torch.randn(weight.shape, generator=generator))
    model.save_pretrained(directory)


def _system() -> dict:
    return {
        "local": {
            "type": "LocalSystem",
            "accelerators": [{"device": "cpu", "execution_providers": ["CPUExecutionProvider"]}],
        }
    }


def _feeds(session) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    feeds = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else (1 if "batch" in str(d) else 5) for d in value.shape]
        if "int64" in value.type:
            feeds[value.name] = rng.integers(0, 64, size=shape, dtype=np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def main(out: Path) -> None:
    from olive.common.ort_inference import get_ort_inference_session
    from olive.workflows import run

    import fusion.cli
    import fusion.olive

    # 1. The fixture workflow through the command line entry point, config as a file.
    config = {
        "input_model": {"type": "ONNXModel", "model_path": str(FIXTURE)},
        "systems": _system(),
        "data_configs": [
            {
                "name": "tokens",
                "type": "DummyDataContainer",
                "load_dataset_config": {
                    "input_names": ["input_ids"],
                    "input_shapes": [[1, 8]],
                    "input_types": ["int64"],
                },
            }
        ],
        "evaluators": {
            "latency": {
                "type": "OnnxEvaluator",
                "metrics": [
                    {"name": "latency", "type": "latency", "sub_types": [{"name": "avg"}], "data_config": "tokens"}
                ],
            }
        },
        "evaluator": "latency",
        "passes": {
            "fuse": {"type": "GraphSurgeries", "surgeries": [{"surgeon": fusion.olive.SURGEON, "min_fused": 2}]}
        },
        "host": "local",
        "target": "local",
        "output_dir": str(out / "fixture"),
        "cache_dir": str(out / "cache"),
    }
    config_path = out / "fixture.json"
    config_path.write_text(json.dumps(config, indent=2))
    status = fusion.cli.main(["olive", str(config_path)])  # = mambafuse olive CONFIG = python -m fusion.olive
    if status != 0:
        raise SystemExit(f"mambafuse olive {config_path} exited with {status}")

    # 2. MobiusBuilder, then our surgeon; and MobiusBuilder alone for the unfused reference.
    _shim_mobius_local_tokenizer()
    hf_model = out / "hf_mamba2"
    _tiny_mamba2(hf_model)
    build = {"type": "MobiusBuilder", "precision": "fp32"}
    fuse = {"type": "GraphSurgeries", "surgeries": [{"surgeon": fusion.olive.SURGEON}]}
    for name, passes in (("mobius_only", {"build": build}), ("mobius", {"build": build, "fuse": fuse})):
        run(
            {
                "input_model": {"type": "HfModel", "model_path": str(hf_model)},
                "systems": _system(),
                "passes": passes,
                "host": "local",
                "target": "local",
                "output_dir": str(out / name),
                "cache_dir": str(out / "cache"),
            }
        )

    # 3. The surgeon's registration and its errors: bad arguments, and min_fused not reached.
    from olive.passes.onnx.graph_surgeries import Surgeon

    checks: dict[str, object] = {
        "registered": Surgeon.registry.get(fusion.olive.SURGEON.lower()) is fusion.olive.MambafuseGatedGroupRMSNorm
    }
    errors = []
    for kwargs in ({"function": "yes"}, {"min_fused": -1}, {"opt_in": ["nope"]}, {"opt_in": 3}):
        try:
            fusion.olive.MambafuseGatedGroupRMSNorm(**kwargs)
        except ValueError as error:
            errors.append(str(error))
    checks["argument_errors"] = errors
    # an opt-in fusion through the surgeon: the fixture's weight MatMuls as DecodeMatMul
    import onnx_ir as ir

    opted = fusion.olive.MambafuseGatedGroupRMSNorm(opt_in=["decode_matmul"]).call_ir(ir.load(FIXTURE))
    checks["opt_in_ops"] = sorted({node.op_type for node in opted.graph if node.domain == "ai.mambafuse"})
    strict = {k: v for k, v in config.items() if k not in ("evaluators", "evaluator", "data_configs")}
    strict["output_dir"] = str(out / "strict")
    strict["passes"] = {
        "fuse": {"type": "GraphSurgeries", "surgeries": [{"surgeon": fusion.olive.SURGEON, "min_fused": 3}]}
    }
    try:
        run(strict)
        checks["min_fused_error"] = None
    except Exception as error:
        checks["min_fused_error"] = str(error)
    (out / "checks.json").write_text(json.dumps(checks, indent=2))

    # 4b. Olive's int4 passes on a decode export (tests/test_olive.py fuses what they write).
    for name, quantization in INT4_PASSES.items():
        run(
            {
                "input_model": {"type": "ONNXModel", "model_path": str(INT4_SOURCE)},
                "systems": _system(),
                "passes": {"quantize": quantization},
                "output_dir": str(out / f"int4-{name}"),
                "cache_dir": str(out / "cache"),
            }
        )

    # 4. Olive's own sessions (no custom-op library) on every output model.
    arrays: dict[str, np.ndarray] = {}
    for name in ("fixture", "mobius", "mobius_only"):
        session = get_ort_inference_session(
            out / name / "model.onnx", "cpu", {"execution_provider": ["CPUExecutionProvider"]}
        )
        feeds = _feeds(session) if name != "fixture" else {"input_ids": np.arange(8, dtype=np.int64)[None] % 64}
        for key, value in feeds.items():
            arrays[f"{name}/input/{key}"] = value
        for output, value in zip(session.get_outputs(), session.run(None, feeds), strict=True):
            arrays[f"{name}/output/{output.name}"] = value
    np.savez(out / "olive_session_outputs.npz", **arrays)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
