"""Build small random-weight Mamba-2-family causal LMs from transformers configs (no hub downloads).

Families: Nemotron-H, Zamba2, Mamba2 (Codestral Mamba), Bamba, GraniteMoeHybrid (Granite 4.0-H) and
Falcon-H1 (two entries: ``falcon_h1``, its gated norm gate-before-norm, and ``falcon_h1_nbg``, the same
model with ``mamba_norm_before_gate=True``). ``FAMILY_SPECS`` says which transformers classes build each
one and which norm order its gated norm has. Every model comes from one row of ``CONFIGS`` (family × size).
Weights are drawn from a seeded
generator; the gated-norm weights, ``D`` and ``A_log`` are then perturbed per layer. Without that, the
freshly initialised norm weights are all ones in every layer, the exporters fold the identical
initializers into one tensor, and a fusion test would never see a layer-specific weight.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Any

import torch

FAMILIES = ("nemotron_h", "zamba2", "mamba2", "bamba", "granitemoehybrid", "falcon_h1", "falcon_h1_nbg")
SIZES = ("tiny", "real", "real-large")


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """Which transformers classes build a family, and what its gated norm is."""

    config_class: str
    model_class: str
    mixer_class: str  # the Mamba-2 mixer module (ends with one gated norm)
    norm_class: str  # the gated norm module inside the mixer
    #: "gate_before_norm": ``norm(y * silu(z)) * W`` (the op); "norm_before_gate": ``norm(y) * W * silu(z)``
    #: (a different function, refused by the rewriter with that reason)
    norm_order: str
    variant: str  # one line for the families table


FAMILY_SPECS: dict[str, FamilySpec] = {
    "nemotron_h": FamilySpec(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        "NemotronHMamba2Mixer",
        "NemotronHRMSNormGated",
        "gate_before_norm",
        "grouped, `norm_before_gate=False`",
    ),
    "zamba2": FamilySpec(
        "Zamba2Config",
        "Zamba2ForCausalLM",
        "Zamba2MambaMixer",
        "Zamba2RMSNormGated",
        "gate_before_norm",
        "grouped, `norm_before_gate=False`",
    ),
    "mamba2": FamilySpec(
        "Mamba2Config",
        "Mamba2ForCausalLM",
        "Mamba2Mixer",
        "MambaRMSNormGated",
        "gate_before_norm",
        "grouped (`n_groups` > 1)",
    ),
    "bamba": FamilySpec(
        "BambaConfig",
        "BambaForCausalLM",
        "BambaMixer",
        "BambaRMSNormGated",
        "gate_before_norm",
        "one group (`mamba_n_groups=1`, as published)",
    ),
    "granitemoehybrid": FamilySpec(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridMambaLayer",
        "GraniteMoeHybridRMSNormGated",
        "gate_before_norm",
        "grouped, MoE experts `batched_mm`",
    ),
    "falcon_h1": FamilySpec(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        "FalconH1Mixer",
        "FalconH1RMSNormGated",
        "gate_before_norm",
        "`mamba_rms_norm=True`, `mamba_norm_before_gate=False`: weight inside the grouped view",
    ),
    "falcon_h1_nbg": FamilySpec(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        "FalconH1Mixer",
        "FalconH1RMSNormGated",
        "norm_before_gate",
        "`mamba_rms_norm=True`, `mamba_norm_before_gate=True`",
    ),
}

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
    # The tiny configs of the families below are hidden 16 (C = 64 all the same: expand 4, or Falcon-H1's
    # explicit d_ssm): the families fixture set stays within its 4 MB.
    "mamba2": {
        # Every layer is a Mamba-2 mixer; n_groups 2 > 1 (the published model has 8).
        "tiny": dict(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            expand=4,  # C = 4 x 16
            num_heads=4,
            head_dim=16,  # C = 64
            n_groups=2,  # group_size 32
            state_size=8,
            conv_kernel=4,
            chunk_size=16,
            time_step_rank=8,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
        ),
        # Mistral Codestral Mamba 7B (mistralai/Mamba-Codestral-7B-v0.1): the Mamba2Config defaults are its
        # widths — hidden 4096, expand 2, 128 heads x 64 (C = 8192), 8 groups, d_state 128, vocab 32768,
        # 64 layers. Layers and vocab cut down: ~230 M parameters.
        "real": dict(
            vocab_size=1024,
            hidden_size=4096,
            num_hidden_layers=2,
            expand=2,
            num_heads=128,
            head_dim=64,  # C = 8192
            n_groups=8,  # group_size 1024
            state_size=128,
            conv_kernel=4,
            chunk_size=256,
            time_step_rank=256,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=False,
        ),
    },
    "bamba": {
        # Mamba, attention, Mamba; one group, as the published model.
        "tiny": dict(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=32,
            mamba_n_heads=4,
            mamba_d_head=16,  # C = 64
            mamba_n_groups=1,  # group_size 64
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=4,  # C = 4 x 16
            mamba_chunk_size=16,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
        # IBM Bamba-9B (ibm-ai-platform/Bamba-9B): the BambaConfig defaults are its widths — hidden 4096,
        # 128 Mamba heads x 64 (C = 8192), 1 group, d_state 256, 32 q / 8 kv heads, MLP 14336, eps 1e-5.
        # Three layers (Mamba, attention, Mamba), vocab cut down, MLP cut to 1024 (the chain never sees
        # it; 14336 would triple the weights): ~295 M parameters.
        "real": dict(
            vocab_size=1024,
            hidden_size=4096,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=1024,
            mamba_n_heads=128,
            mamba_d_head=64,  # C = 8192
            mamba_n_groups=1,  # group_size 8192
            mamba_d_state=256,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    },
    "granitemoehybrid": {
        # Mamba, attention, Mamba, every layer with a 4-expert top-2 MoE and a shared expert. Two groups
        # (the published models have one) so that a grouped GraniteMoeHybrid chain is tested too.
        "tiny": dict(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=16,
            shared_intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=16,  # C = 64
            mamba_n_groups=2,  # group_size 32
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=4,  # C = 4 x 16
            mamba_chunk_size=16,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
        # IBM Granite-4.0-H-Tiny (ibm-granite/granite-4.0-h-tiny config.json): hidden 1536, 48 Mamba heads
        # x 64 (C = 3072), 1 group, d_state 128, 12 q / 4 kv heads, 64 experts of 512 (top 6), shared
        # expert 1024, vocab 100352, 40 layers. Three layers, vocab cut down, 8 experts instead of 64
        # (the chain never sees them): ~110 M parameters.
        "real": dict(
            vocab_size=1024,
            hidden_size=1536,
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=512,
            shared_intermediate_size=1024,
            num_local_experts=8,
            num_experts_per_tok=6,
            mamba_n_heads=48,
            mamba_d_head=64,  # C = 3072
            mamba_n_groups=1,  # group_size 3072
            mamba_d_state=128,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
    },
    "falcon_h1": {
        # Every Falcon-H1 layer runs attention and a Mamba-2 mixer in parallel: two layers, two chains.
        # mamba_rms_norm=True (the config class default is False: no gated norm at all) with the gate
        # applied before the norm; two groups so the weight's [G, gs] view is not trivial.
        "tiny": dict(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=32,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_ssm=64,  # C = 64
            mamba_n_groups=2,  # group_size 32
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=4,  # C = 4 x 16
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        ),
        # TII Falcon-H1-1.5B (transformers' FalconH1 model doc, architecture table): 24 layers, hidden 2048,
        # 8 q / 2 kv heads of 128, 48 Mamba heads x 64 (d_ssm = C = 3072), d_state 256. The table gives no
        # group count or MLP width: 1 group (the config class default) and MLP 4608 (the chain never sees
        # it). Three layers, vocab cut down: ~165 M parameters.
        "real": dict(
            vocab_size=1024,
            hidden_size=2048,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            intermediate_size=4608,
            mamba_n_heads=48,
            mamba_d_head=64,
            mamba_d_ssm=3072,  # C = 3072
            mamba_n_groups=1,
            mamba_d_state=256,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    },
}
# IBM Granite-4.0-H-Small (ibm-granite/granite-4.0-h-small config.json): hidden 4096, expand 2
# (C = 8192: 128 heads x 64), 1 group, d_state 128, 32 q / 8 kv heads, 72 experts of 768 (top 10),
# shared expert 1536, vocab 100352, 40 layers. Three layers, vocab cut down, 10 experts: ~590 M
# parameters (2.4 GB in fp32: exports go to a .data sidecar).
# Its "real" config with these changed:
CONFIGS["granitemoehybrid"]["real-large"] = {
    **CONFIGS["granitemoehybrid"]["real"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 768,
    "shared_intermediate_size": 1536,
    "num_local_experts": 10,
    "num_experts_per_tok": 10,
    "mamba_n_heads": 128,  # C = 8192
}
# TII Falcon-H1-7B (same table): 44 layers, hidden 3072, 12 q / 2 kv heads of 128, 24 Mamba heads x
# 128 (C = 3072), d_state 256. 1 group, MLP 4608 as above. Three layers: ~255 M parameters.
CONFIGS["falcon_h1"]["real-large"] = {
    **CONFIGS["falcon_h1"]["real"],
    "hidden_size": 3072,
    "num_attention_heads": 12,
    "mamba_n_heads": 24,
    "mamba_d_head": 128,  # C = 3072
}
# Falcon-H1 with the norm applied before the gate: the same model with one flag flipped (refused, a
# different op).
CONFIGS["falcon_h1_nbg"] = {
    size: {**kwargs, "mamba_norm_before_gate": True} for size, kwargs in CONFIGS["falcon_h1"].items()
}

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def sizes(family: str) -> tuple[str, ...]:
    """Return the sizes ``CONFIGS`` has for ``family`` ("tiny", "real", and for some "real-large")."""
    return tuple(CONFIGS[family])


def chunk_size_key(family: str) -> str:
    """Return the name of the SSD chunk size in ``family``'s config (``chunk_size`` or ``mamba_chunk_size``)."""
    kwargs = CONFIGS[family]["tiny"]
    return "chunk_size" if "chunk_size" in kwargs else "mamba_chunk_size"


def make_config(family: str, size: str = "tiny", chunk_size: int | None = None) -> Any:
    """Return the transformers config object of ``CONFIGS[family][size]`` (with another SSD chunk size)."""
    import transformers

    if family not in CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if size not in CONFIGS[family]:
        raise ValueError(f"unknown size {size!r} for {family}; choose one of {', '.join(sizes(family))}")
    kwargs = copy.deepcopy(CONFIGS[family][size])
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk size {chunk_size} is not positive")
        kwargs[chunk_size_key(family)] = chunk_size
    config = getattr(transformers, FAMILY_SPECS[family].config_class)(**kwargs)
    # The pure-PyTorch path is the one exporters trace; eager attention keeps SDPA's
    # version-specific lowering out of the graph.
    config._attn_implementation = "eager"
    if family == "granitemoehybrid":
        # The default experts implementation (a Python loop over the routed experts, data-dependent)
        # does not export with dynamo; "batched_mm" gathers every token's experts and does.
        config._experts_implementation = "batched_mm"
    return config


def mamba_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Return the Mamba-2 mixer modules of ``model`` in layer order (each ends with one gated norm)."""
    names = {spec.mixer_class for spec in FAMILY_SPECS.values()}
    return [m for m in model.modules() if type(m).__name__ in names]


def num_mamba_layers(family: str, size: str = "tiny") -> int:
    """Return how many Mamba-2 mixers (gated norms) a model of this family and size has."""
    kwargs = CONFIGS[family][size]
    if family in ("nemotron_h", "zamba2"):
        return sum(t in ("linear_attention", "hybrid") for t in kwargs["layers_block_type"])
    if family == "bamba":
        return kwargs["num_hidden_layers"] - len(kwargs.get("attn_layer_indices") or [])
    if family == "granitemoehybrid":
        return sum(t in ("mamba", "linear_attention") for t in kwargs["layer_types"])
    # Mamba2: every layer is a mixer; Falcon-H1: every layer has a mixer beside its attention.
    return kwargs["num_hidden_layers"]


def expected_fused(family: str, scope_layers: int) -> int:
    """Return how many chains of an export with ``scope_layers`` mixers the rewriter must fuse.

    Gate-before-norm families: every chain. Norm-before-gate (``falcon_h1_nbg``): none — it is a
    different function, refused with that reason.
    """
    return scope_layers if FAMILY_SPECS[family].norm_order == "gate_before_norm" else 0


@torch.no_grad()
def perturb_mixer_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give each Mamba layer its own gated-norm weight, ``D``, ``A_log`` and ``dt_bias`` (in place).

    The defaults are ones / ``log(1..H)`` in every layer; identical initializers get merged by the
    exporters, so a layer's chain would then read a shared weight that no real checkpoint has.
    """
    for mixer in mamba_mixers(model):
        weight = getattr(mixer.norm, "weight", None)  # Falcon-H1 with mamba_rms_norm=False: Identity
        if weight is not None:
            weight.copy_(1.0 + 0.25 * torch.randn(weight.shape, generator=generator))
        mixer.D.copy_(1.0 + 0.5 * torch.randn(mixer.D.shape, generator=generator))
        mixer.A_log.copy_(mixer.A_log + 0.1 * torch.randn(mixer.A_log.shape, generator=generator))
        mixer.dt_bias.copy_(0.5 * torch.randn(mixer.dt_bias.shape, generator=generator))


def build_model(
    family: str, size: str = "tiny", dtype: str = "fp32", seed: int = 0, chunk_size: int | None = None
) -> torch.nn.Module:
    """Return a seeded random-weight causal LM of ``family`` in eval mode, cast to ``dtype``.

    ``chunk_size`` replaces the config's SSD chunk size (the weights do not depend on it).
    """
    import transformers

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    config = make_config(family, size, chunk_size)
    model_class = getattr(transformers, FAMILY_SPECS[family].model_class)
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
    if args.size not in CONFIGS[args.family]:
        parser.error(f"{args.family} has sizes {', '.join(sizes(args.family))}")
    model = build_model(args.family, args.size, args.dtype)
    mixers = mamba_mixers(model)
    params = sum(p.numel() for p in model.parameters())
    norm = mixers[0].norm
    width = norm.weight.numel()
    group_size = getattr(norm, "group_size", None) or width // norm.n_groups
    print(
        f"{type(model).__name__} {args.size} {args.dtype}: {params / 1e6:.2f} M parameters, "
        f"{len(mixers)} Mamba layers, C={width} group_size={group_size} eps={norm.variance_epsilon} "
        f"({FAMILY_SPECS[args.family].norm_order})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
