"""The fusions ``rewrite_model`` runs, in order: one entry per fused op (name, rule set, what it counts).

The gated group-RMSNorm runs first (its report lines are the historical summary); the decode-step ops
follow. Each entry knows how to fuse a model (``fuse``), where its chains are (``find_anchors``, for the
report's found/refused counts) and its op's model-local function (``make_function``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.function import causal_conv1d_update as conv_function
from fusion.function import gated_group_rms_norm as norm_function
from fusion.function import selective_state_update as state_function
from fusion.rules import causal_conv1d_update as conv_rules
from fusion.rules import gated_group_rms_norm as norm_rules
from fusion.rules import selective_state_update as state_rules
from fusion.rules.gated_group_rms_norm import FusionLog

DOMAIN = "ai.mambafuse"


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One fused op: how to find, fuse and run its chains."""

    #: the op's stem (fusion/rules/<name>.py, fusion/function/<name>.py)
    name: str
    op_type: str
    #: what the report counts, e.g. "conv updates"
    counts: str
    rules: tuple[pattern.RewriteRuleSet, ...]
    fuse: Callable[[ir.Model, FusionLog], int]
    find_anchors: Callable[[ir.Graph], list[ir.Node]]
    make_function: Callable[[int], onnx.FunctionProto]
    min_opset: int
    #: other opset domains the function body imports (name -> version)
    function_domains: tuple[tuple[str, int], ...] = ()


GATED_GROUP_RMS_NORM = Fusion(
    name="gated_group_rms_norm",
    op_type="GatedGroupRMSNorm",
    counts="gated group-RMSNorm chains",
    rules=tuple(norm_rules.gated_group_rms_norm_rule_sets),
    fuse=norm_rules.fuse_gated_group_rms_norm,
    find_anchors=norm_rules.find_chain_anchors,
    make_function=norm_function.make_function,
    min_opset=norm_function.MIN_OPSET,
)
CAUSAL_CONV1D_UPDATE = Fusion(
    name="causal_conv1d_update",
    op_type="CausalConv1dUpdate",
    counts="conv updates",
    rules=(conv_rules.causal_conv1d_update_rules,),
    fuse=conv_rules.fuse_causal_conv1d_update,
    find_anchors=conv_rules.find_anchors,
    make_function=conv_function.make_function,
    min_opset=conv_function.MIN_OPSET,
    function_domains=(("ai.onnx.ml", conv_function.ML_OPSET),),
)
SELECTIVE_STATE_UPDATE = Fusion(
    name="selective_state_update",
    op_type="SelectiveStateUpdate",
    counts="state updates",
    rules=(state_rules.selective_state_update_rules,),
    fuse=state_rules.fuse_selective_state_update,
    find_anchors=state_rules.find_anchors,
    make_function=state_function.make_function,
    min_opset=state_function.MIN_OPSET,
)

#: Every fusion, in the order ``rewrite_model`` runs them.
FUSIONS: tuple[Fusion, ...] = (GATED_GROUP_RMS_NORM, CAUSAL_CONV1D_UPDATE, SELECTIVE_STATE_UPDATE)
#: The decode-step fusions (after the gated norm).
DECODE_FUSIONS: tuple[Fusion, ...] = FUSIONS[1:]


def fusion_of(op_type: str) -> Fusion | None:
    """Return the fusion whose op is ``op_type``, else None."""
    return next((f for f in FUSIONS if f.op_type == op_type), None)


def attach_functions(model: ir.Model, onnx_opset: int) -> list[str]:
    """Add the model-local function of every ``ai.mambafuse`` op that ``model`` uses; return their op types.

    A function whose body needs a newer opset than the model's is skipped (the rules do not fuse there).
    """
    used = {node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph) if node.domain == DOMAIN}
    attached = []
    for fusion in FUSIONS:
        if fusion.op_type not in used or onnx_opset < fusion.min_opset:
            continue
        function = ir.serde.deserialize_function(fusion.make_function(onnx_opset))
        model.functions[function.identifier()] = function
        for domain, version in fusion.function_domains:
            model.opset_imports.setdefault(domain, version)
        attached.append(fusion.op_type)
    if attached:
        model.opset_imports.setdefault(DOMAIN, 1)
    return attached
