"""Fusion rules, one module per fused op (pattern / check / rewrite and its variants), and the registry of
fusions (``registry.py``: ``FUSIONS``, one entry per op).

The public entry points for onnxscript users are ``all_rewrite_rules()`` (every op) and ``rewrite_rules()``
(the gated group-RMSNorm alone)::

    import onnxscript.rewriter
    from fusion.rules import all_rewrite_rules, attach_function

    fused = onnxscript.rewriter.rewrite(model, pattern_rewrite_rules=all_rewrite_rules())
    attach_function(fused)     # the model-local functions: stock ONNX Runtime runs the fused nodes

It works on an ``onnx.ModelProto`` or an ``onnx_ir.Model``, like every onnxscript rule set. To run it
next to onnxscript's own rules in one call, concatenate: ``[*rewrite_rules(), *other_rules]`` (see
``rewrite_rules`` for the one difference that makes).
"""

from __future__ import annotations

from typing import TypeVar

import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.rules._log import FusionLog
from fusion.rules.gated_group_rms_norm import (
    GatedGroupRMSNormFusion,
    fuse_gated_group_rms_norm,
    gated_group_rms_norm_rule_sets,
)
from fusion.rules.registry import FUSIONS, AllRulesSet, Fusion, all_rewrite_rules, attach_functions

__all__ = [
    "FUSIONS",
    "AllRulesSet",
    "Fusion",
    "FusionLog",
    "GatedGroupRMSNormFusion",
    "GatedGroupRMSNormRuleSet",
    "all_rewrite_rules",
    "attach_function",
    "attach_functions",
    "fuse_gated_group_rms_norm",
    "gated_group_rms_norm_rule_sets",
    "rewrite_rules",
]

ModelT = TypeVar("ModelT", onnx.ModelProto, ir.Model)


class GatedGroupRMSNormRuleSet(pattern.RewriteRuleSet):
    """The gated group-RMSNorm rules as one onnxscript ``RewriteRuleSet``.

    Applying it (``apply_to_model``, which ``onnxscript.rewriter.rewrite`` and ``RewritePass`` call)
    runs the rules phase by phase (``gated_group_rms_norm_rule_sets``), exactly as ``python -m
    fusion.rewrite`` does: first the rules that absorb a Cast after the weight Mul into ``output_dtype``,
    then the rest. Iterating it gives the rules themselves in that order, for concatenation with other
    rule lists.
    """

    def __init__(self) -> None:
        rules = [rule for rule_set in gated_group_rms_norm_rule_sets for rule in rule_set]
        super().__init__(rules)
        # The rules remove exactly their chains' leftovers; no model-wide dead-code pass of ours.
        self.remove_unused_nodes = False
        #: Chains seen by the last ``apply_to_model``: form, fused attributes or refusal reason.
        self.log = FusionLog()

    def apply_to_model(self, model: ir.Model, *, verbose: int | None = None, tracer=None) -> int:
        """Fuse every chain of ``model`` in place; return how many were fused."""
        if verbose is None and tracer is None:
            self.log = FusionLog()
            return fuse_gated_group_rms_norm(model, self.log)
        # Debugging through onnxscript's own tracer / verbose output: phase by phase, no log.
        return sum(
            rule_set.apply_to_model(model, verbose=verbose, tracer=tracer)
            for rule_set in gated_group_rms_norm_rule_sets
        )


def rewrite_rules() -> GatedGroupRMSNormRuleSet:
    """Return the rule set that fuses gated group-RMSNorm chains into ``ai.mambafuse::GatedGroupRMSNorm``.

    Pass it to ``onnxscript.rewriter.rewrite(model, pattern_rewrite_rules=rewrite_rules())`` or
    ``onnxscript.rewriter.RewritePass(rewrite_rules())``. The fused model needs the op's model-local
    function to run on ONNX Runtime without the mambafuse library: call ``attach_function`` afterwards.

    The checks prove shapes from the model's value_info; exporters write it, and when a model has
    none, run ``onnx_ir.passes.common.ShapeInferencePass()`` first (``python -m fusion.rewrite`` does).

    Concatenated into one flat list with other rules (``[*rewrite_rules(), *others]``), onnxscript
    tries every rule at each node in graph order, so a chain is fused at its weight Mul before the
    Cast after it is reached: that Cast then stays as a separate node after a float32 fused node
    instead of becoming its ``output_dtype``. The values are the same (the kernel rounds its float32
    product once either way); only the node count differs.
    """
    return GatedGroupRMSNormRuleSet()


def attach_function(model: ModelT) -> ModelT:
    """Add the model-local function of every ``ai.mambafuse`` op a fused ``model`` (ModelProto or ir.Model) uses,
    in place; return it.

    With them, ONNX Runtime without the mambafuse library (and providers that cannot host custom ops) inlines
    each fused node's stock-op body. A model with no fused node is returned unchanged.
    """
    attach_functions(model)
    return model
