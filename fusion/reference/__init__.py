"""Numpy references of the ``ai.mambafuse`` ops, one module per op: the executable form of each op's doc.

- ``gated_group_rms_norm``: ``GatedGroupRMSNorm`` (docs/op.md). Its names are re-exported here, so
  ``from fusion.reference import gated_group_rms_norm, budget_report`` keeps working.

Each module holds the op's reference (``compute_dtype=np.float64`` gives the evaluation its accuracy budget
is measured against), its budget check and an ``OpRun`` for onnx's ReferenceEvaluator.
"""

from __future__ import annotations

from fusion.reference.gated_group_rms_norm import (
    DOMAIN,
    GATED_TIE_WINDOW,
    OP_TYPE,
    SUPPORTED_TYPES,
    GatedGroupRMSNorm,
    bfloat16,
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
