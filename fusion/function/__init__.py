"""Model-local functions of the ``ai.mambafuse`` ops (their stock-op bodies), one module per op.

- ``gated_group_rms_norm``: ``GatedGroupRMSNorm``. Its names are re-exported here, so
  ``from fusion.function import make_function, attach_function`` keeps working.
- ``causal_conv1d_update``: ``CausalConv1dUpdate``; ``selective_state_update``: ``SelectiveStateUpdate``.
  ``attach_functions`` adds the function of every ``ai.mambafuse`` op a model uses.

A fused model carries the function of every op it uses, so it runs on ONNX Runtime without the mambafuse
library (which, when registered, shadows the functions with its kernels).
"""

from __future__ import annotations

import onnx

from fusion.function._common import OPSET_VERSION, import_domain, model_onnx_opset, put_function
from fusion.function.gated_group_rms_norm import (
    ATTRIBUTES,
    MIN_OPSET,
    OPTIONAL_ATTRIBUTES,
    attach_function,
    make_function,
)
from fusion.reference.gated_group_rms_norm import DOMAIN, OP_TYPE


def attach_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add (or replace) the function of every ``ai.mambafuse`` op ``model`` uses, in place; return it."""
    from fusion import fusions

    used = {node.op_type for node in model.graph.node if node.domain == DOMAIN}
    if not used:
        return model
    onnx_opset = model_onnx_opset(model)
    for fusion in fusions.FUSIONS:
        if fusion.op_type not in used:
            continue
        put_function(model, fusion.make_function(onnx_opset))
        for domain, version in fusion.function_domains:
            import_domain(model, domain, version)
    import_domain(model, DOMAIN, OPSET_VERSION)
    return model


__all__ = [
    "ATTRIBUTES",
    "DOMAIN",
    "MIN_OPSET",
    "OPSET_VERSION",
    "OPTIONAL_ATTRIBUTES",
    "OP_TYPE",
    "attach_function",
    "attach_functions",
    "make_function",
]
