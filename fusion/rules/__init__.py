"""Fusion rules, one module per fused op (pattern / check / rewrite and its variants)."""

from __future__ import annotations

from fusion.rules.gated_group_rms_norm import (
    FusionLog,
    GatedGroupRMSNormFusion,
    fuse_gated_group_rms_norm,
    gated_group_rms_norm_rule_sets,
)

__all__ = [
    "FusionLog",
    "GatedGroupRMSNormFusion",
    "fuse_gated_group_rms_norm",
    "gated_group_rms_norm_rule_sets",
]
