"""Model-local functions of the ``ai.mambafuse`` ops (their stock-op bodies), one module per op.

- ``gated_group_rms_norm``: ``GatedGroupRMSNorm``. Its names are re-exported here, so
  ``from fusion.function import make_function, attach_function`` keeps working.
- ``causal_conv1d_update``: ``CausalConv1dUpdate``; ``selective_state_update``: ``SelectiveStateUpdate``.
- ``mamba_chunk_scan``: ``MambaChunkScan`` (draft: no rule writes it yet, docs/mamba_chunk_scan.md).

``fusion.rules.attach_functions`` (the registry) adds the function of every ``ai.mambafuse`` op a model uses.

A fused model carries the function of every op it uses, so it runs on ONNX Runtime without the mambafuse
library (which, when registered, shadows the functions with its kernels).
"""

from __future__ import annotations

from fusion.function._common import OPSET_VERSION
from fusion.function.gated_group_rms_norm import (
    ATTRIBUTES,
    MIN_OPSET,
    OPTIONAL_ATTRIBUTES,
    attach_function,
    make_function,
)
from fusion.reference.gated_group_rms_norm import DOMAIN, OP_TYPE

__all__ = [
    "ATTRIBUTES",
    "DOMAIN",
    "MIN_OPSET",
    "OPSET_VERSION",
    "OPTIONAL_ATTRIBUTES",
    "OP_TYPE",
    "attach_function",
    "make_function",
]
