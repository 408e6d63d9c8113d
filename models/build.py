"""Build small random-weight Nemotron-H and Zamba2 causal LMs from configs (no hub downloads).

Every model comes from one row of ``CONFIGS`` (family × size). Weights are drawn from a seeded
generator; the gated-norm weights, ``D`` and ``A_log`` are then perturbed per layer. Without that, the
freshly initialised norm weights are all ones in every layer, the exporters fold the identical
initializers into one tensor, and a fusion test would never see a layer-specific weight.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

FAMILIES = ("nemotron_h", "zamba2")
SIZES = ("tiny", "real")

#: One place for every config: family -> size -> kwargs of the transformers config class.
#: "tiny" is for tests and fixtures (hidden 32, 3–4 layers, two or more Mamba layers, 2–4 groups).
#: "real" keeps the published mixer widths (what the gated norm sees: C and group_size) with few
#: layers and a small vocabulary, for benchmarks.
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "nemotron_h": {
        "tiny": dict(
            vocab_size=64,
            # hidden 32: the gated norm's width C = heads x head_dim does not depend on it, and it halves
            # in_proj, which keeps ~60 fixtures within the fixture budget.
            hidden_size=32,
            # Mamba-2, attention, Mamba-2, MLP ("M*M-"): mixed types, two Mamba layers.
            layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            mamba_num_heads=4,
            mamba_head_dim=16,  # C = 64
            n_groups=4,  # group_size 16
            ssm_state_size=8,
            conv_kernel=4,
            chunk_size=16,
            layer_norm_epsilon=1e-5,
            max_position_embeddings=512,
            # Tied: one 128x64 table instead of two keeps every fixture a few KB smaller.
            tie_word_embeddings=True,
        ),
        # NVIDIA Nemotron-H-8B-Base-8K: hidden 4096, 128 Mamba heads x 64, 8 groups, d_state 128,
        # 32 q / 8 kv heads of 128, MLP 21504 relu2, eps 1e-5. Layers and vocab cut down; no MLP layer
        # (176 M parameters that the gated norm never sees): ~270 M parameters, 1.1 GB in fp32.
        "real": dict(
            vocab_size=1024,
            hidden_size=4096,
            layers_block_type=["linear_attention", "full_attention", "linear_attention"],
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=21504,
            mlp_hidden_act="relu2",
            mamba_num_heads=128,
            mamba_head_dim=64,  # C = 8192
            n_groups=8,  # group_size 1024
            ssm_state_size=128,
            conv_kernel=4,
            chunk_size=128,
            layer_norm_epsilon=1e-5,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
    },
    "zamba2": {
        "tiny": dict(
            vocab_size=64,
            # hidden 32, not 64: Zamba2's shared attention block is 2 x hidden wide whatever the head
            # count (4 x 128 x 128 weights at hidden 64, 2.5x the rest of the model), and ~30 fixtures
            # of it would not fit the fixture budget.
            hidden_size=32,
            # "hybrid" = the shared attention block followed by a Mamba-2 layer: three gated norms.
            num_hidden_layers=3,
            layers_block_type=["linear_attention", "hybrid", "linear_attention"],
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=32,
            n_mamba_heads=4,  # head_dim = 2*32/4 = 16, C = 64
            mamba_ngroups=2,  # group_size 32
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            chunk_size=16,
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            # The MLP's LoRA-style adapters exist even without attention adapters; rank 128 would
            # make them the largest tensors of the tiny model.
            adapter_rank=8,
            use_mem_rope=True,
            max_position_embeddings=512,
        ),
        # Zyphra Zamba2-2.7B: hidden 2560, expand 2 (C = 5120), 80 Mamba heads of 64, 1 group,
        # d_state 64, 32 attention heads, shared blocks with rank-128 adapters. Layers and vocab cut
        # down, and one shared block instead of two (one hybrid layer uses one): ~270 M parameters.
        "real": dict(
            vocab_size=1024,
            hidden_size=2560,
            num_hidden_layers=3,
            layers_block_type=["linear_attention", "hybrid", "linear_attention"],
            num_attention_heads=32,
            num_key_value_heads=32,
            n_mamba_heads=80,
            mamba_ngroups=1,  # group_size 5120
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
            chunk_size=256,
            num_mem_blocks=1,
            use_shared_attention_adapter=True,
            adapter_rank=128,
            use_mem_rope=True,
            max_position_embeddings=4096,
        ),
    },
}

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_config(family: str, size: str = "tiny") -> Any:
    """Return the transformers config object of ``CONFIGS[family][size]``."""
    from transformers import NemotronHConfig, Zamba2Config

    if family not in CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if size not in CONFIGS[family]:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    kwargs = copy.deepcopy(CONFIGS[family][size])
    config_class = NemotronHConfig if family == "nemotron_h" else Zamba2Config
    config = config_class(**kwargs)
    # The pure-PyTorch path is the one exporters trace; eager attention keeps SDPA's
    # version-specific lowering out of the graph.
    config._attn_implementation = "eager"
    return config


def mamba_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Return the Mamba-2 mixer modules of ``model`` in layer order (each ends with one gated norm)."""
    return [m for m in model.modules() if type(m).__name__ in ("NemotronHMamba2Mixer", "Zamba2MambaMixer")]


def num_mamba_layers(family: str, size: str = "tiny") -> int:
    """Return how many Mamba-2 mixers (gated norms) a model of this family and size has."""
    types = CONFIGS[family][size]["layers_block_type"]
    return sum(t in ("linear_attention", "hybrid") for t in types)


@torch.no_grad()
def perturb_mixer_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give each Mamba layer its own gated-norm weight, ``D`` and ``A_log`` (in place).

    The defaults are ones / ``log(1..H)`` in every layer; identical initializers get merged by the
    exporters, so a layer's chain would then read a shared weight that no real checkpoint has.
    """
    for mixer in mamba_mixers(model):
        weight = mixer.norm.weight
        weight.copy_(1.0 + 0.25 * torch.randn(weight.shape, generator=generator))
        mixer.D.copy_(1.0 + 0.5 * torch.randn(mixer.D.shape, generator=generator))
        mixer.A_log.copy_(mixer.A_log + 0.1 * torch.randn(mixer.A_log.shape, generator=generator))
        mixer.dt_bias.copy_(0.5 * torch.randn(mixer.dt_bias.shape, generator=generator))


def build_model(family: str, size: str = "tiny", dtype: str = "fp32", seed: int = 0) -> torch.nn.Module:
    """Return a seeded random-weight Nemotron-H / Zamba2 causal LM in eval mode, cast to ``dtype``."""
    from transformers import NemotronHForCausalLM, Zamba2ForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    config = make_config(family, size)
    model_class = NemotronHForCausalLM if family == "nemotron_h" else Zamba2ForCausalLM
    # Initialise in fp32 under a fixed seed, then cast: the same seed gives the same weights
    # (up to rounding) in every dtype, so fp16 and fp32 exports can be compared.
    torch.manual_seed(seed)
    model = model_class(config)
    perturb_mixer_weights(model, torch.Generator().manual_seed(seed + 1))
    model = model.to(DTYPES[dtype]).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def sample_input_ids(config: Any, seq_len: int = 8, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """Return seeded token ids ``[batch, seq_len]`` that avoid the special tokens 0–2."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, seq_len), generator=generator, dtype=torch.int64)


def main(argv: list[str] | None = None) -> int:
    """Print a summary of one built model (parameters, Mamba layers, gated-norm widths)."""
    parser = argparse.ArgumentParser(prog="python -m models.build", description=main.__doc__)
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    model = build_model(args.family, args.size, args.dtype)
    mixers = mamba_mixers(model)
    params = sum(p.numel() for p in model.parameters())
    norm = mixers[0].norm
    print(
        f"{type(model).__name__} {args.size} {args.dtype}: {params / 1e6:.2f} M parameters, "
        f"{len(mixers)} Mamba layers, C={norm.weight.numel()} group_size={norm.group_size} "
        f"eps={norm.variance_epsilon}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
