"""Build tiny Nemotron-H / Zamba2 / Mamba2 models with Microsoft's mobius builder, as test fixtures.

``python -m models.mobius`` regenerates ``tests/fixtures/mobius/``:

1. one random-weight Hugging Face checkpoint per row of ``CHECKPOINTS`` (transformers config classes, seeded
   weights, each Mamba layer's gated-norm weight / ``D`` / ``A_log`` / ``dt_bias`` perturbed), saved with
   ``save_pretrained`` in a temporary folder, with a small byte-level BPE tokenizer made in code;
2. ``mobius build --model <that folder> OUT --dtype ... --ep ... [--runtime ort-genai]`` for every row of
   ``build_jobs()``, each in its own subprocess (mobius reads ``MOBIUS_ORT_CUDA_GROUPED_RMSNORM_WORKAROUND``
   once per process), with the workarounds of ``_build_one``. The same wrapper is a command: ``python -m
   models.mobius mobius build --model DIR OUT ...`` is ``mobius build ...`` with those workarounds, for a
   Hugging Face checkpoint of your own: each applies only to a checkpoint mobius 0.1.0 would fail on or build
   another function for (transformers 5.x layer type names; Zamba2 without shared attention adapters;
   GraniteMoeHybrid's multipliers; a Nemotron-H with ``tie_word_embeddings`` and its own ``lm_head``), so
   the fixtures' checkpoints build byte for byte as plain ``mobius build`` writes them;
3. ``builds.tar.xz``: every build folder byte for byte as mobius wrote it (one solid xz archive: the
   ~45 folders are 7 MB unpacked, mostly the per-node metadata mobius writes and weights shared between
   builds; ``extract_builds`` / ``--extract DIR`` unpack them);
   ``manifest.json`` (per build: family, checkpoint, dtype, target, variant, the mobius command, files, Mamba
   layers, gated norms expected, the chains found by ``chain_forms``, ``model_same_as`` where model.onnx and
   its data are byte-identical to an earlier build's, the ORT CPU status, the RMSNormalization rounding
   measured in fp16 builds) and ``references.npz`` (a prompt step and one decode step: inputs and what ONNX
   Runtime CPU computed for the original model, where ORT CPU runs it).

No model hub is used.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from models.build import CONFIGS

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mobius"
WORKAROUND_ENV = "MOBIUS_ORT_CUDA_GROUPED_RMSNORM_WORKAROUND"
PROMPT_LEN = 8
INIT_RANGE = 0.06
VOCAB = 64


#: One random-weight checkpoint per row: family, transformers config kwargs. Widths are tiny (hidden 32,
#: C = 64) so that ~40 builds stay within the fixture budget; group counts 1 / 2 / 4, three epsilons and
#: three layer patterns. The first checkpoint of each family is the one built in every dtype / variant /
#: target; the others in fewer combinations (``build_jobs``).
def _checkpoint(family: str, base: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """Return a checkpoint row: ``base`` (a config) with ``overrides``."""
    return dict(family=family, config={**base, **overrides})


# The primary checkpoints are the project's tiny configs (models/build.py) with untied embeddings, plus what
# mobius 0.1.0 needs; the others change group count, epsilon and layer pattern.
_NEMOTRON_H = {**CONFIGS["nemotron_h"]["tiny"], "vocab_size": VOCAB, "tie_word_embeddings": False}
_ZAMBA2 = {
    **CONFIGS["zamba2"]["tiny"],
    "vocab_size": VOCAB,  # 2 groups of 32 in transformers; mobius normalizes over all 64 channels
    # mobius 0.1.0 always builds the adapters: without them its weight check fails
    # ("6 initializer(s) without weights").
    "use_shared_attention_adapter": True,
    "adapter_rank": 4,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
_MAMBA2 = {
    **CONFIGS["mamba2"]["tiny"],
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "expand": 2,  # C = expand x hidden = 64
    "n_groups": 4,  # transformers: group_size 16; mobius normalizes over all 64 channels
    "tie_word_embeddings": False,
}
_MAMBA2.pop("time_step_rank")  # the config class derives it from hidden_size

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "nemotron_h-g4": _checkpoint("nemotron_h", _NEMOTRON_H),  # M*M-, 4 groups of 16
    "nemotron_h-g2": _checkpoint(
        "nemotron_h",
        _NEMOTRON_H,
        layers_block_type=["linear_attention", "linear_attention", "full_attention"],  # MM*
        num_key_value_heads=2,
        mamba_num_heads=8,
        mamba_head_dim=8,  # C = 64
        n_groups=2,  # group_size 32
        layer_norm_epsilon=1e-6,
    ),
    "nemotron_h-g1": _checkpoint(
        "nemotron_h",
        _NEMOTRON_H,
        layers_block_type=["linear_attention", "mlp", "linear_attention"],  # M-M
        n_groups=1,  # group_size 64 = C: mobius writes the ungrouped form
        layer_norm_epsilon=1e-4,
    ),
    "zamba2-g2": _checkpoint("zamba2", _ZAMBA2),
    "zamba2-g1": _checkpoint(
        "zamba2",
        _ZAMBA2,
        num_hidden_layers=2,
        layers_block_type=["hybrid", "linear_attention"],
        n_mamba_heads=8,  # head_dim 8, C = 64
        mamba_ngroups=1,
        rms_norm_eps=1e-6,
    ),
    "mamba2-g4": _checkpoint("mamba2", _MAMBA2),
    "mamba2-g1": _checkpoint(
        "mamba2", _MAMBA2, num_hidden_layers=3, num_heads=8, head_dim=8, n_groups=1, layer_norm_epsilon=1e-6
    ),
}

FAMILIES = ("nemotron_h", "zamba2", "mamba2")
DTYPES = ("f32", "f16", "bf16")
VARIANTS = ("default", "workaround")
TARGETS = ("cpu", "cuda")
PRIMARY = {"nemotron_h": "nemotron_h-g4", "zamba2": "zamba2-g2", "mamba2": "mamba2-g4"}


def build_jobs() -> list[dict[str, Any]]:
    """Return every build of the fixture set: checkpoint, dtype, variant, target, runtime, stem.

    The primary checkpoint of each family in every dtype x variant x target (36 builds); the others in
    f32 / f16, default, cpu target (and Nemotron-H g2 also with the workaround, for a second group count
    of the decomposed form). ``--runtime ort-genai`` for the default builds genai can run: cpu target in
    f32 / f16 (genai's CPU package), cuda target in every dtype (``onnxruntime-genai-cuda``, the GPU tests).
    The flag adds ``genai_config.json`` and the tokenizer files; the graph and its data are the same bytes.
    """
    jobs = []
    for checkpoint, spec in CHECKPOINTS.items():
        primary = PRIMARY[spec["family"]] == checkpoint
        for dtype in DTYPES:
            for variant in VARIANTS:
                for target in TARGETS:
                    if not primary:
                        extra_variant = checkpoint == "nemotron_h-g2" and dtype == "f16"
                        if dtype == "bf16" or target != "cpu" or (variant != "default" and not extra_variant):
                            continue
                    # genai's CPU package runs f32 / f16; its CUDA package (the GPU tests) every dtype.
                    genai = variant == "default" and (target == "cuda" or dtype in ("f32", "f16"))
                    jobs.append(
                        dict(
                            checkpoint=checkpoint,
                            family=spec["family"],
                            dtype=dtype,
                            variant=variant,
                            target=target,
                            runtime="ort-genai" if genai else None,
                            stem=f"{checkpoint}-{dtype}-{variant}-{target}",
                        )
                    )
    return jobs


def num_mamba_layers(checkpoint: str) -> int:
    """Return how many Mamba-2 mixers (gated norms) the checkpoint's model has."""
    spec = CHECKPOINTS[checkpoint]
    config = spec["config"]
    if spec["family"] == "mamba2":
        return config["num_hidden_layers"]
    return sum(t in ("linear_attention", "hybrid") for t in config["layers_block_type"])


def gated_norm_geometry(checkpoint: str) -> dict[str, Any]:
    """Return C, the checkpoint's n_groups, the group size mobius normalizes over, and epsilon."""
    spec = CHECKPOINTS[checkpoint]
    config = spec["config"]
    if spec["family"] == "nemotron_h":
        channels = config["mamba_num_heads"] * config["mamba_head_dim"]
        groups, eps = config["n_groups"], config["layer_norm_epsilon"]
        mobius_group_size = channels // groups
    elif spec["family"] == "zamba2":
        channels = config["mamba_expand"] * config["hidden_size"]
        groups, eps = config["mamba_ngroups"], config["rms_norm_eps"]
        mobius_group_size = channels  # mobius 0.1.0 ignores mamba_ngroups in the gated norm
    else:
        channels = config["expand"] * config["hidden_size"]
        groups, eps = config["n_groups"], config["layer_norm_epsilon"]
        mobius_group_size = channels  # mobius 0.1.0 ignores n_groups in the gated norm
    return dict(channels=channels, n_groups=groups, group_size=mobius_group_size, epsilon=eps)


# --- 1. checkpoints --------------------------------------------------------------------------------


def _config_object(checkpoint: str) -> Any:
    import transformers

    spec = CHECKPOINTS[checkpoint]
    cls = {
        "nemotron_h": transformers.NemotronHConfig,
        "zamba2": transformers.Zamba2Config,
        "mamba2": transformers.Mamba2Config,
    }[spec["family"]]
    # initializer_range 0.06 (transformers: 0.02 / 0.1): with the defaults the scan output of these tiny
    # models is ~1e-5, inside float16's subnormal range, where one rounding of y moves a normalized value
    # by 5 % and every half-precision comparison measures subnormal rounding instead of the chain.
    kwargs = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=INIT_RANGE)
    return cls(**copy.deepcopy(spec["config"]), **kwargs)


def write_checkpoint(checkpoint: str, folder: Path, seed: int = 0) -> None:
    """Save a seeded random-weight checkpoint (safetensors, config, tokenizer) into ``folder``."""
    import torch
    import transformers

    config = _config_object(checkpoint)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        mixers = [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "norm")]
        if len(mixers) != num_mamba_layers(checkpoint):
            raise RuntimeError(f"{checkpoint}: {len(mixers)} Mamba mixers, expected {num_mamba_layers(checkpoint)}")
        for mixer in mixers:
            # Defaults are ones / log(1..H) in every layer; identical initializers would be merged.
            mixer.norm.weight.copy_(1.0 + 0.25 * torch.randn(mixer.norm.weight.shape, generator=generator))
            mixer.D.copy_(1.0 + 0.5 * torch.randn(mixer.D.shape, generator=generator))
            mixer.A_log.copy_(mixer.A_log + 0.1 * torch.randn(mixer.A_log.shape, generator=generator))
            mixer.dt_bias.copy_(0.5 * torch.randn(mixer.dt_bias.shape, generator=generator))
    model.save_pretrained(folder)
    write_tokenizer(folder)


def write_tokenizer(folder: Path) -> None:
    """Write a tiny byte-level BPE tokenizer (``VOCAB`` tokens, ids 0-2 special) made in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    # Byte-level symbols: "Ġ" is the space byte; letters and a little punctuation map to themselves.
    symbols = ["Ġ", *"abcdefghijklmnopqrstuvwxyz", *".,!?'", *"0123456789"]
    merges = [("Ġ", "t"), ("t", "h"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n")]
    merges += [("Ġ", "a"), ("Ġ", "s"), ("r", "e"), ("e", "d"), ("o", "r"), ("Ġ", "w")]
    vocab = {token: i for i, token in enumerate(specials + symbols)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab = {token: i for token, i in vocab.items() if i < VOCAB}
    merges = [(a, b) for a, b in merges if a + b in vocab]
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>")
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)


# --- 2. one mobius build (runs in its own process) ---------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


#: transformers 5.x layer type names (and the 4.x ones) -> mobius 0.1.0's, for the hybrids whose layer types mobius
#: reads from ``layers_block_type`` knowing only the 4.x names (Bamba, GraniteMoeHybrid: it reads "full_attention"
#: as a Mamba layer, then finds no weights for it: "8 initializer(s) without weights: 'model.layers.1.mamba.A_log'").
HYBRID_LAYER_TYPES = {
    "linear_attention": "mamba2",
    "mamba": "mamba2",
    "full_attention": "full_attention",
    "attention": "full_attention",
}


def mobius_layer_types(hf_config: Any, layer_types: list[str] | None) -> list[str] | None:
    """Return the layer types mobius 0.1.0 should build for ``hf_config`` where the ones it derived
    (``layer_types``) are wrong, else None.

    - Nemotron-H: transformers 5.x names its Mamba layers ``linear_attention``, which mobius builds as a DeltaNet
      layer ("Linear-attention cache inputs requested but the following config fields are unset: ..."); mobius'
      own name for them is ``mamba2``.
    - Bamba, GraniteMoeHybrid: mobius maps only the 4.x name ``attention`` to ``full_attention`` and takes every
      other layer for a Mamba layer, so the 5.x ``full_attention`` layers become Mamba layers without weights.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "nemotron_h" and layer_types:
        fixed = ["mamba2" if t == "linear_attention" else t for t in layer_types]
        return fixed if fixed != layer_types else None
    if model_type in ("bamba", "granitemoehybrid"):
        hf_types = list(getattr(hf_config, "layers_block_type", None) or [])
        if layer_types and len(hf_types) == len(layer_types):
            fixed = [HYBRID_LAYER_TYPES.get(t, t) for t in hf_types]
            return fixed if fixed != layer_types else None
    return None


def _no_attention_adapters(zamba2: Any) -> None:
    """Make mobius 0.1.0 build Zamba2 without the shared attention block's Q/K/V adapters.

    mobius always builds them; a checkpoint with ``use_shared_attention_adapter=False`` has no weights for them
    ("Component 'model' has 6 initializer(s) without weights: 'model.qkv_adapters.0.q_adapter.down.weight'").
    transformers adds nothing to Q, K and V then (its ``Zamba2Attention`` applies the adapters only when the
    flag is set), and mobius' attention adds an adapter's output only when it is given one: returning none
    builds the checkpoint's function. The MLP adapters exist either way (transformers always has them).
    """
    from onnxscript import nn

    class NoQKVAdapters(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()

        def forward(self, op: Any, attn_input: Any) -> tuple[None, None, None]:
            return None, None, None

    zamba2._Zamba2QKVAdapters = NoQKVAdapters


def _granite_multipliers(granite: Any) -> None:
    """Make mobius 0.1.0's GraniteMoeHybrid apply the checkpoint's embedding, attention and logits multipliers.

    transformers' ``GraniteMoeHybridForCausalLM`` multiplies the embeddings by ``embedding_multiplier``, scales
    attention scores by ``attention_multiplier`` (instead of 1/sqrt(head_dim)) and divides the logits by
    ``logits_scaling``; mobius 0.1.0 applies only ``residual_multiplier``, so a checkpoint whose other multipliers
    are not 1 (and 1/sqrt(head_dim)) builds another function. Each is added where it is not the identity, as
    transformers computes it.
    """
    from mobius.components import Embedding, Linear

    class ScaledEmbedding(Embedding):
        multiplier = 1.0

        def forward(self, op: Any, input_ids: Any) -> Any:
            hidden = super().forward(op, input_ids)
            return op.Mul(hidden, op.CastLike(op.Constant(value_float=self.multiplier), hidden))

    class ScaledLogits(Linear):
        divisor = 1.0

        def forward(self, op: Any, x: Any) -> Any:
            logits = super().forward(op, x)
            return op.Div(logits, op.CastLike(op.Constant(value_float=self.divisor), logits))

    text_init = granite._GraniteMoeHybridTextModel.__init__
    attention_init = granite._GraniteMoeHybridAttentionDecoderLayer.__init__
    model_init = granite.GraniteMoeHybridCausalLMModel.__init__

    def text_model(self: Any, config: Any) -> None:
        text_init(self, config)
        if config.embedding_multiplier != 1.0:
            self.embed_tokens.__class__ = ScaledEmbedding  # same weight, same name
            self.embed_tokens.multiplier = float(config.embedding_multiplier)

    def attention_layer(self: Any, config: Any) -> None:
        attention_init(self, config)
        if config.attention_multiplier is not None:
            self.self_attn.scaling = float(config.attention_multiplier)

    def causal_lm(self: Any, config: Any) -> None:
        model_init(self, config)
        if config.logits_scaling != 1.0:
            self.lm_head.__class__ = ScaledLogits
            self.lm_head.divisor = float(config.logits_scaling)

    granite._GraniteMoeHybridTextModel.__init__ = text_model
    granite._GraniteMoeHybridAttentionDecoderLayer.__init__ = attention_layer
    granite.GraniteMoeHybridCausalLMModel.__init__ = causal_lm


def _stores_own_lm_head(model_dir: Path) -> bool:
    """Return whether the safetensors checkpoint in ``model_dir`` stores an ``lm_head.weight`` of its own."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return "lm_head.weight" in json.loads(index.read_text()).get("weight_map", {})
    single = model_dir / "model.safetensors"
    if not single.is_file():
        return False
    from safetensors import safe_open

    with safe_open(str(single), "np") as tensors:
        return "lm_head.weight" in tensors.keys()  # noqa: SIM118 - safe_open has keys(), no __contains__


def _build_one(argv: list[str]) -> int:
    """Run ``mobius build`` in this process with the mobius 0.1.0 workarounds.

    - Layer types: transformers 5.x names Nemotron-H's, Bamba's and GraniteMoeHybrid's layers
      ``linear_attention`` / ``full_attention``, which mobius misreads (``mobius_layer_types``: Nemotron-H fails
      with "Linear-attention cache inputs requested", Bamba and GraniteMoeHybrid with "initializer(s) without
      weights"); its config gets the layer types in its own names.
    - Zamba2 without shared attention adapters (``use_shared_attention_adapter=False``, transformers' default):
      mobius builds them anyway and fails for want of their weights; they are left out
      (``_no_attention_adapters``).
    - GraniteMoeHybrid: mobius ignores ``embedding_multiplier``, ``attention_multiplier`` and ``logits_scaling``
      and builds another function for a checkpoint that sets them (Granite checkpoints do: an embedding multiplier of
      12, for one): they
      are applied as transformers applies them (``_granite_multipliers``).
    - Nemotron-H with ``tie_word_embeddings=True`` and its own ``lm_head.weight`` in the checkpoint: mobius ties
      the head to the embedding, transformers' ``NemotronHForCausalLM`` never does (it has no tied weights), so
      the logits would be silently wrong; the head is untied where the local checkpoint stores one.
    - With a local ``--model`` folder and ``--runtime ort-genai``, mobius asks the hub for the tokenizer
      files (``HFValidationError: Repo id must be in the form 'repo_name' ...``): copy them from the folder.
    - With a local ``--model`` folder the hub is not needed, and without network its client retries for
      ~20 s before giving up: ``HF_HUB_OFFLINE=1`` unless the caller set it (read when the hub client is
      imported, so set before mobius is).

    Each workaround applies only to a config that needs it: a build mobius gets right is left as it is.
    """
    model_dir = _local_model(argv)
    if model_dir is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import mobius.__main__ as cli
    import mobius._config_resolver as resolver
    import mobius.integrations.ort_genai.auto_export as auto_export
    import mobius.models.granitemoehybrid as granite
    import mobius.models.zamba2 as zamba2

    original = resolver._config_from_hf

    def config_from_hf(hf_config: Any, parent_config: Any = None, module_class: Any = None) -> Any:
        config = original(hf_config, parent_config=parent_config, module_class=module_class)
        layer_types = mobius_layer_types(hf_config, getattr(config, "layer_types", None))
        if layer_types is not None:
            config = dataclasses.replace(config, layer_types=layer_types)
        model_type = getattr(hf_config, "model_type", None)
        if model_type == "zamba2" and not getattr(hf_config, "use_shared_attention_adapter", True):
            _no_attention_adapters(zamba2)
        if model_type == "granitemoehybrid":
            _granite_multipliers(granite)
        if model_type == "nemotron_h" and config.tie_word_embeddings and model_dir and _stores_own_lm_head(model_dir):
            config = dataclasses.replace(config, tie_word_embeddings=False)
        return config

    def copy_tokenizer_files(model_id: str, output_dir: str) -> list[str]:
        copied = []
        for name in TOKENIZER_FILES:
            if (Path(model_id) / name).is_file():
                shutil.copy2(Path(model_id) / name, Path(output_dir) / name)
                copied.append(name)
        return copied

    resolver._config_from_hf = config_from_hf
    auto_export._copy_tokenizer_files = copy_tokenizer_files
    sys.argv = ["mobius", *argv]
    return cli.main() or 0


def _local_model(argv: list[str]) -> Path | None:
    """Return the local folder a mobius command line's ``--model`` names, or None (a hub id, or no --model)."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--model" and i + 1 < len(argv) else arg.partition("=")[2]
        if arg == "--model" or arg.startswith("--model="):
            return Path(value) if Path(value).is_dir() else None
    return None


def mobius_argv(job: dict[str, Any], checkpoint_dir: str, out_dir: str) -> list[str]:
    """Return the ``mobius`` command line of one build."""
    argv = ["build", "--model", checkpoint_dir, out_dir, "--dtype", job["dtype"], "--ep", job["target"]]
    if job["runtime"]:
        argv += ["--runtime", job["runtime"]]
    return argv


def run_build(job: dict[str, Any], workdir: Path, out_dir: Path) -> dict[str, Any]:
    """Build one job in a subprocess (cwd = ``workdir``, where the checkpoints are); return its record."""
    env = dict(os.environ)
    env.pop(WORKAROUND_ENV, None)
    if job["variant"] == "workaround":
        env[WORKAROUND_ENV] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    # A relative --model keeps the temporary folder's name out of the graph name mobius writes.
    argv = mobius_argv(job, job["checkpoint"], str(out_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "models.mobius", "mobius", *argv],
        cwd=workdir,
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    record = dict(job, mobius=" ".join(["mobius", *argv]).replace(str(out_dir), job["stem"]))
    if job["variant"] == "workaround":
        record["mobius"] = f"{WORKAROUND_ENV}=1 " + record["mobius"]
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        record["error"] = lines[-1] if lines else f"exit status {proc.returncode}"
    return record


# --- 3. chains and references ---------------------------------------------------------------------


def _model_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in ("model.onnx", "model.onnx.data"):
        if (folder / name).is_file():
            digest.update(name.encode())
            digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def _dims(value_info: Any) -> list[Any]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def sample_feeds(model_path: Path, checkpoint: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """Return the prompt step's feeds (``PROMPT_LEN`` seeded tokens, empty cache) and the cache input names."""
    import ml_dtypes
    import onnx

    model = onnx.load(model_path, load_external_data=False)
    np_types = {
        onnx.TensorProto.FLOAT: np.float32,
        onnx.TensorProto.FLOAT16: np.float16,
        onnx.TensorProto.BFLOAT16: ml_dtypes.bfloat16,
    }
    seed = int(hashlib.sha256(checkpoint.encode()).hexdigest()[:8], 16)
    token_ids = np.random.default_rng(seed).integers(3, VOCAB, (1, PROMPT_LEN)).astype(np.int64)
    feeds: dict[str, np.ndarray] = {}
    cache = []
    for value in model.graph.input:
        if value.name == "input_ids":
            feeds[value.name] = token_ids
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((1, PROMPT_LEN), np.int64)
        else:
            elem = value.type.tensor_type.elem_type
            if elem not in np_types:
                raise TypeError(f"input {value.name}: element type {onnx.TensorProto.DataType.Name(elem)}")
            shape = [1 if d == "batch" else (0 if isinstance(d, str) else d) for d in _dims(value)]
            feeds[value.name] = np.zeros(shape, np_types[elem])
            cache.append(value.name)
    return feeds, cache


def present_name(past: str) -> str:
    """Return the output that feeds cache input ``past`` on the next step.

    mobius names them ``past_key_values.<i>.<name>`` (Mamba2: ``past_states.<i>.<name>``) → ``present.<i>.<name>``.
    """
    return "present." + past.split(".", 1)[1]


def next_step_inputs(feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return the next decode step's own inputs after a step fed ``feeds`` gave ``outputs``: the greedy
    token, and the attention mask one longer (its cache is ``outputs``' presents, see ``present_name``)."""
    token = int(outputs["logits"][0, -1].astype(np.float32).argmax())
    step = {"input_ids": np.array([[token]], np.int64)}
    if "attention_mask" in feeds:
        step["attention_mask"] = np.ones((1, feeds["attention_mask"].shape[1] + 1), np.int64)
    return step


def run_steps(session: Any, feeds: dict[str, np.ndarray], cache: list[str]) -> list[tuple[dict, dict]]:
    """Return [(inputs, outputs)] of the prompt step and of one decode step (greedy token, cache fed back).

    The decode step's inputs are only its token (and mask): its cache is the prompt step's outputs.
    """
    names = [o.name for o in session.get_outputs()]
    prompt_out = dict(zip(names, session.run(None, feeds), strict=True))
    step = next_step_inputs(feeds, prompt_out)
    full = step | {name: prompt_out[present_name(name)] for name in cache}
    decode_out = dict(zip(names, session.run(None, full), strict=True))
    return [(feeds, prompt_out), (step, decode_out)]


def decode_steps(
    session: Any, feeds: dict[str, np.ndarray], cache: list[str], steps: int, tokens: list[int] | None = None
) -> list[dict[str, np.ndarray]]:
    """Return the outputs of the prompt step and of ``steps`` decode steps, each fed the one before's presents and
    the token ``tokens`` gives (None: the greedy one)."""
    names = [o.name for o in session.get_outputs()]
    outputs = [dict(zip(names, session.run(None, feeds), strict=True))]
    step_feeds = feeds
    for index in range(steps):
        step = next_step_inputs(step_feeds, outputs[-1])
        if tokens is not None:
            step["input_ids"] = np.array([[tokens[index]]], np.int64)
        step_feeds = step | {name: outputs[-1][present_name(name)] for name in cache}
        outputs.append(dict(zip(names, session.run(None, step_feeds), strict=True)))
    return outputs


def cpu_session(model_path: Path, library: bool = False) -> Any:
    """Return a one-thread ORT CPU session (with the mambafuse custom-op library when ``library``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if library:
        import contrib_ops

        options = contrib_ops.register(options)
    return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])


def references(model_path: Path, checkpoint: str) -> dict[str, np.ndarray]:
    """Return ``{prefill|decode/input|output/<name>: array}`` computed by ORT CPU on the original model."""
    session = cpu_session(model_path)
    feeds, cache = sample_feeds(model_path, checkpoint)
    result = {}
    for phase, (inputs, outputs) in zip(("prefill", "decode"), run_steps(session, feeds, cache), strict=True):
        result |= {f"{phase}/input/{k}": v for k, v in inputs.items()}
        result |= {f"{phase}/output/{k}": v for k, v in outputs.items()}
    return result


def rms_rounding(model_path: Path, checkpoint: str, chains: list[dict[str, Any]]) -> dict[str, Any]:
    """Return which rounding ORT CPU's fp16 RMSNormalization computes in a model's gated norms.

    For each gated norm's RMSNormalization (input x and scale s in T): ORT's output against
    ``one``: round(T, f32(s) * (f32(x) * nf)) and ``two``: round(T, f32(s) * f32(round(T, f32(x) * nf))),
    nf = 1 / sqrt(mean(f32(x)^2) + eps) in f32, on the prompt step's inputs; element counts.
    """
    import onnx
    from onnx import helper

    model = onnx.load(model_path)
    values = [c["rms_values"] for c in chains if "rms_values" in c]
    epsilons = [c["rms_attributes"]["epsilon"] for c in chains if "rms_values" in c]
    known = {o.name for o in model.graph.output}
    for name in {n for triple in values for n in triple} - known:
        model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT16, None))
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds, _ = sample_feeds(model_path, checkpoint)
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    counts = dict(elements=0, equal_one_rounding=0, equal_round_before_scale=0, candidates_differ=0)
    for (x_name, s_name, y_name), eps in zip(values, epsilons, strict=True):
        x, s, got = out[x_name].astype(np.float32), out[s_name].astype(np.float32), out[y_name].view(np.uint16)
        nf = np.float32(1) / np.sqrt((x * x).mean(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
        normed = x * nf
        one = (s * normed).astype(np.float16).view(np.uint16)
        two = (s * normed.astype(np.float16).astype(np.float32)).astype(np.float16).view(np.uint16)
        counts["elements"] += got.size
        counts["equal_one_rounding"] += int((got == one).sum())
        counts["equal_round_before_scale"] += int((got == two).sum())
        counts["candidates_differ"] += int((one != two).sum())
    return counts


def chain_forms(model_path: Path) -> list[dict[str, Any]]:
    """Return one entry per gated norm (``Sigmoid → Mul → Mul`` and what follows) of a mobius model.

    The chain is every node reachable from the gate's Sigmoid before the out-projection (``MatMul``), in
    graph order. Each entry: ``form`` (S1 grouped RMSNormalization, S2 decomposed, S3 ungrouped
    RMSNormalization, else ``unknown``), ``ops`` (the chain's op sequence, Shape included), ``feeds`` (what
    feeds the chain from outside, per node input: initializer, Constant value, or producing op), the
    RMSNormalization attributes, the Reshape targets, the element types of y, z, the norm input and output.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(model_path, load_external_data=False)
    graph = model.graph
    all_nodes = list(graph.node)  # one Python object per node: identity below is by index
    producer = {out: node for node in all_nodes for out in node.output}
    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(all_nodes):
        for name in node.input:
            consumers.setdefault(name, []).append(index)
    initializers = {t.name: t for t in graph.initializer}
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types |= {t.name: t.data_type for t in graph.initializer}

    def type_name(name: str) -> str:
        elem = types.get(name)
        return onnx.TensorProto.DataType.Name(elem) if elem else "?"

    def const_value(name: str) -> np.ndarray | None:
        if name in initializers and not initializers[name].external_data:
            return numpy_helper.to_array(initializers[name])
        node = producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
                if attr.name == "value_ints":
                    return np.array(list(attr.ints), np.int64)
                if attr.name == "value_float":
                    return np.array(attr.f, np.float32)
        return None

    def describe(name: str) -> str:
        value = const_value(name)
        if value is not None and value.size <= 8:
            kind = "initializer" if name in initializers else "Constant"
            return f"{kind} {value.tolist()} ({type_name(name)})"
        if name in initializers:
            dims = list(initializers[name].dims)
            return f"initializer {name} {dims} ({type_name(name)})"
        node = producer.get(name)
        if node is None:
            return f"graph input {name}"
        if node.op_type == "Cast":
            to = next(a.i for a in node.attribute if a.name == "to")
            return f"Cast(to {onnx.TensorProto.DataType.Name(to)}) of {describe(node.input[0])}"
        if node.op_type == "Reshape":
            return f"Reshape({describe(node.input[0])}, {describe(node.input[1])})"
        return f"{node.op_type} output ({type_name(name)})"

    def attributes(node: Any) -> str:
        parts = []
        for attr in node.attribute:
            value = onnx.helper.get_attribute_value(attr)
            if attr.name == "to":
                value = onnx.TensorProto.DataType.Name(value)
            elif isinstance(value, float):
                value = float(np.float32(value))
            parts.append(f"{attr.name}={value}")
        return "{" + ", ".join(parts) + "}" if parts else ""

    entries = []
    for start, sigmoid in enumerate(all_nodes):
        if sigmoid.op_type != "Sigmoid":
            continue
        users = consumers.get(sigmoid.output[0], [])
        if len(users) != 1 or all_nodes[users[0]].op_type != "Mul":
            continue
        silu = all_nodes[users[0]]
        users = consumers.get(silu.output[0], [])
        if len(users) != 1 or all_nodes[users[0]].op_type != "Mul":
            continue
        gated = all_nodes[users[0]]
        chain: set[int] = set()
        frontier = [start]
        while frontier:
            index = frontier.pop()
            if index in chain or all_nodes[index].op_type in ("MatMul", "Gemm") or len(chain) > 40:
                continue
            chain.add(index)
            for out in all_nodes[index].output:
                frontier.extend(consumers.get(out, []))
        nodes = [all_nodes[i] for i in sorted(chain)]
        ops = [n.op_type for n in nodes]
        y = next(i for i in gated.input if i != silu.output[0])
        entry: dict[str, Any] = dict(
            ops=ops,
            nodes=len(nodes),
            y=describe(y),
            z=describe(sigmoid.input[0]),
            output_type=type_name(nodes[-1].output[0]),
            output=nodes[-1].output[0],
        )
        position = {out: k for k, n in enumerate(nodes) for out in n.output}
        steps = []
        for k, n in enumerate(nodes):
            args = [f"#{position[i]}" if i in position else ("y" if i == y else describe(i)) for i in n.input]
            if n is sigmoid:
                args = ["z"]
            steps.append(f"#{k} {n.op_type}({', '.join(args)}){attributes(n)} -> {type_name(n.output[0])}")
        entry["steps"] = steps
        norms = [n for n in nodes if n.op_type == "RMSNormalization"]
        if norms:
            norm = norms[0]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in norm.attribute}
            entry["rms_attributes"] = {k: (float(v) if isinstance(v, float) else v) for k, v in attrs.items()}
            entry["rms_io_types"] = [type_name(norm.input[0]), type_name(norm.input[1]), type_name(norm.output[0])]
            entry["rms_values"] = [norm.input[0], norm.input[1], norm.output[0]]
            before = ops[: ops.index("RMSNormalization")]
            entry["form"] = "S1" if "Reshape" in before else "S3"
        elif "ReduceMean" in ops and "Sqrt" in ops:
            entry["form"] = "S2"
        else:
            entry["form"] = "unknown"
        entries.append(entry)
    return entries


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ("mobius-onnx", "onnxruntime", "onnxruntime-genai", "onnx", "onnxscript", "torch", "transformers")
    return {name: version(name) for name in names}


def _write_archive(builds: Path, names: list[str], archive: Path) -> None:
    """Write ``builds/<name>/*`` into a reproducible tar.xz (sorted, no owners, mtime 0)."""
    import tarfile

    def normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        info.mode = 0o755 if info.isdir() else 0o644
        return info

    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for name in sorted(names):
            tar.add(builds / name, arcname=name, recursive=False, filter=normalized)
            for path in sorted((builds / name).iterdir()):
                tar.add(path, arcname=f"{name}/{path.name}", filter=normalized)


def generate(out_dir: Path = FIXTURE_DIR, only: str | None = None, workers: int = 2) -> dict[str, Any]:
    """Build every job, then write ``out_dir`` (replaced atomically): archive, manifest, references."""
    import re

    jobs = [j for j in build_jobs() if only is None or re.search(only, j["stem"])]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".mobius-", dir=out_dir.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="mobius-ckpt-") as work:
            workdir = Path(work)
            for checkpoint in sorted({j["checkpoint"] for j in jobs}):
                write_checkpoint(checkpoint, workdir / checkpoint)
            builds = workdir / "builds"
            builds.mkdir()
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                records = list(pool.map(lambda j: run_build(j, workdir, builds / j["stem"]), jobs))
            manifest = _describe(records, builds, staging)
            _write_archive(builds, [r["stem"] for r in records if "error" not in r], staging / ARCHIVE_NAME)
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp makes it private
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(staging, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _describe(records: list[dict[str, Any]], builds: Path, staging: Path) -> dict[str, Any]:
    """Return the manifest of the builds and write ``references.npz`` into ``staging``."""
    manifest: dict[str, Any] = dict(versions=_versions(), checkpoints={}, builds=[])
    for checkpoint in sorted({r["checkpoint"] for r in records}):
        manifest["checkpoints"][checkpoint] = dict(
            family=CHECKPOINTS[checkpoint]["family"],
            mamba_layers=num_mamba_layers(checkpoint),
            config=CHECKPOINTS[checkpoint]["config"],
            **gated_norm_geometry(checkpoint),
        )
    refs: dict[str, np.ndarray] = {}
    first_with_model: dict[str, str] = {}
    for record in records:
        record["mamba_layers"] = num_mamba_layers(record["checkpoint"])
        record["expected_chains"] = record["mamba_layers"]
        manifest["builds"].append(record)
        if "error" in record:
            continue
        folder = builds / record["stem"]
        record["files"] = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
        digest = _model_digest(folder)
        if digest in first_with_model:
            # Byte-identical model.onnx / model.onnx.data: same chains, same references.
            record["model_same_as"] = first_with_model[digest]
        first_with_model.setdefault(digest, record["stem"])
        chains = chain_forms(folder / "model.onnx")
        record["chains"] = dict(count=len(chains), forms=sorted({c["form"] for c in chains}), details=chains)
        if record["dtype"] == "bf16":
            record["ort_cpu"] = "not run: ONNX Runtime CPU has no bf16 MatMul"
            continue
        record["references"] = record.get("model_same_as", record["stem"])
        try:
            if "model_same_as" not in record:
                for key, value in references(folder / "model.onnx", record["checkpoint"]).items():
                    refs[f"{record['stem']}/{key}"] = value
            record["ort_cpu"] = "ok"
            if record["dtype"] == "f16" and any("rms_values" in c for c in chains):
                record["ort_rms_rounding"] = rms_rounding(folder / "model.onnx", record["checkpoint"], chains)
        except Exception as e:  # noqa: BLE001 - recorded in the manifest, exactly
            record["ort_cpu"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            record.pop("references")
    np.savez_compressed(staging / "references.npz", **refs)
    return manifest


# --- fixture access (tests, fusion.genai tests) -----------------------------------------------------

ARCHIVE_NAME = "builds.tar.xz"


def load_manifest(fixture_dir: Path = FIXTURE_DIR) -> dict[str, Any]:
    """Return the parsed ``manifest.json`` of the mobius fixtures."""
    return json.loads((Path(fixture_dir) / "manifest.json").read_text())


def extract_builds(dest: Path, fixture_dir: Path = FIXTURE_DIR) -> Path:
    """Unpack every build folder (exactly as mobius wrote it) into ``dest``; return ``dest``."""
    import tarfile

    with tarfile.open(Path(fixture_dir) / ARCHIVE_NAME, "r:xz") as tar:
        tar.extractall(dest, filter="data")
    return Path(dest)


def load_references(stem: str, fixture_dir: Path = FIXTURE_DIR) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """Return ``{phase: {"input"|"output": {name: array}}}`` of one build (its ``references`` stem)."""
    result: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    with np.load(Path(fixture_dir) / "references.npz") as refs:
        for key in refs.files:
            if key.startswith(stem + "/"):
                phase, kind, name = key[len(stem) + 1 :].split("/", 2)
                result.setdefault(phase, {}).setdefault(kind, {})[name] = refs[key]
    return result


def reference_feeds(refs: dict[str, dict[str, dict[str, np.ndarray]]], phase: str) -> dict[str, np.ndarray]:
    """Return the full feeds of a stored step (a decode step's cache = the prompt step's outputs)."""
    if phase == "prefill":
        return dict(refs["prefill"]["input"])
    prompt = refs["prefill"]["output"]
    cache = [name for name in refs["prefill"]["input"] if name not in refs["decode"]["input"]]
    return refs["decode"]["input"] | {past: prompt[present_name(past)] for past in cache}


def one_node_rms_rounding(rows: int = 256, seed: int = 0) -> list[dict[str, Any]]:
    """Return ORT CPU's opset-24 RMSNormalization in fp16 / bf16 on one-node models vs the two roundings.

    Shapes as mobius writes them: ``[rows, G, gs]`` with a ``[G, gs]`` scale (S1) and ``[rows, C]`` with a
    ``[C]`` scale (S3); x ~ N(0, 1), scale 1 + 0.25 N(0, 1), eps 1e-5.
    """
    import ml_dtypes
    import onnx
    import onnxruntime as ort
    from onnx import helper

    results = []
    for elem, np_type in ((onnx.TensorProto.FLOAT16, np.float16), (onnx.TensorProto.BFLOAT16, ml_dtypes.bfloat16)):
        for x_shape, s_shape in (((rows, 4, 16), (4, 16)), ((rows, 64), (64,)), ((rows, 8, 1024), (8, 1024))):
            eps = 1e-5
            rng = np.random.default_rng(seed)
            x = rng.standard_normal(x_shape).astype(np.float32).astype(np_type)
            s = (1 + 0.25 * rng.standard_normal(s_shape)).astype(np.float32).astype(np_type)
            graph = helper.make_graph(
                [helper.make_node("RMSNormalization", ["x", "s"], ["y"], epsilon=eps, axis=-1)],
                "rms",
                [helper.make_tensor_value_info("x", elem, x_shape), helper.make_tensor_value_info("s", elem, s_shape)],
                [helper.make_tensor_value_info("y", elem, x_shape)],
            )
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=11)
            entry: dict[str, Any] = dict(dtype=np.dtype(np_type).name, x=list(x_shape), scale=list(s_shape))
            try:
                session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                got = np.asarray(session.run(None, {"x": x, "s": s})[0]).view(np.uint16)
            except Exception as e:  # noqa: BLE001 - reported
                entry["ort_cpu"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                results.append(entry)
                continue
            xf, sf = x.astype(np.float32), s.astype(np.float32)
            nf = np.float32(1) / np.sqrt((xf * xf).mean(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
            one = (sf * (xf * nf)).astype(np_type).view(np.uint16)
            two = (sf * (xf * nf).astype(np_type).astype(np.float32)).astype(np_type).view(np.uint16)
            entry |= dict(
                elements=int(got.size),
                equal_one_rounding=int((got == one).sum()),
                equal_round_before_scale=int((got == two).sum()),
                candidates_differ=int((one != two).sum()),
            )
            results.append(entry)
    return results


def main(argv: list[str] | None = None) -> int:
    """Regenerate ``tests/fixtures/mobius/`` and print one line per build."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mobius"]:
        return _build_one(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m models.mobius",
        description=main.__doc__,
        epilog="python -m models.mobius mobius build --model DIR OUT [mobius options]: mobius' own command with "
        "the mobius 0.1.0 workarounds (transformers 5.x layer types of Nemotron-H, Bamba and GraniteMoeHybrid; "
        "Zamba2 without attention adapters; GraniteMoeHybrid's multipliers; Nemotron-H's untied lm_head; the "
        "tokenizer of a local folder; offline for a local folder)",
    )
    parser.add_argument("-o", "--output", type=Path, default=FIXTURE_DIR)
    parser.add_argument("--only", help="regex on the build stem (writes only those into --output)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--extract", type=Path, metavar="DIR", help="unpack the committed builds into DIR and exit")
    parser.add_argument(
        "--rounding", action="store_true", help="measure ORT CPU's fp16/bf16 RMSNormalization rounding and exit"
    )
    args = parser.parse_args(argv)
    if args.extract:
        print(extract_builds(args.extract))
        return 0
    if args.rounding:
        for entry in one_node_rms_rounding():
            print(json.dumps(entry))
        return 0
    manifest = generate(args.output, args.only, args.workers)
    for record in manifest["builds"]:
        if "error" in record:
            print(f"{record['stem']}: mobius failed: {record['error']}")
            continue
        chains = record["chains"]
        size = sum(record["files"].values())
        same = f" (model = {record['model_same_as']})" if "model_same_as" in record else ""
        rounding = record.get("ort_rms_rounding")
        note = (
            f", RMSNormalization fp16: ORT = one rounding {rounding['equal_one_rounding']}/{rounding['elements']}"
            if rounding
            else ""
        )
        print(
            f"{record['stem']}: {size / 1024:.0f} KiB{same}, chains {chains['count']}/{record['mamba_layers']} "
            f"{','.join(chains['forms'])}, ORT CPU {record['ort_cpu']}{note}"
        )
    total = sum(p.stat().st_size for p in args.output.rglob("*") if p.is_file())
    print(f"{args.output}: {total / 1024 / 1024:.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
