"""Numpy references of the ``ai.mambafuse`` ops, one module per op: the executable form of each op's doc.

- ``gated_group_rms_norm``: ``GatedGroupRMSNorm`` (docs/op.md). Its names are re-exported here, so
  ``from fusion.reference import gated_group_rms_norm, budget_report`` keeps working.
- ``causal_conv1d_update``: ``CausalConv1dUpdate``; ``selective_state_update``: ``SelectiveStateUpdate``.
- ``mamba_chunk_scan``: ``MambaChunkScan`` (the prefill scan; draft: no rule writes it yet).
- ``_common``: what every op shares (``DOMAIN``, ``SUPPORTED_TYPES``, ``bfloat16``, the sigmoid, the OpRun
  factory); ``_bounds``: the exact roundings and intervals of the decode-step ops' budgets.

Each module holds the op's reference (``compute_dtype=np.float64`` gives the evaluation its accuracy budget
is measured against), its budget check and an ``OpRun`` for onnx's ReferenceEvaluator.
"""

from __future__ import annotations

from fusion.reference._common import DOMAIN, SUPPORTED_TYPES, bfloat16
from fusion.reference.gated_group_rms_norm import (
    GATED_TIE_WINDOW,
    OP_TYPE,
    GatedGroupRMSNorm,
    budget_report,
    dtype_to_onnx_type,
    gated_group_rms_norm,
    onnx_type_to_dtype,
    reference_evaluator,
    reference_for_budget,
    ulp_distance,
    ulp_of,
)

__all__ = [
    "DOMAIN",
    "GATED_TIE_WINDOW",
    "OP_TYPE",
    "SUPPORTED_TYPES",
    "GatedGroupRMSNorm",
    "bfloat16",
    "budget_report",
    "dtype_to_onnx_type",
    "gated_group_rms_norm",
    "onnx_type_to_dtype",
    "reference_evaluator",
    "reference_for_budget",
    "ulp_distance",
    "ulp_of",
]
