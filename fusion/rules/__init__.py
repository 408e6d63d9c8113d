"""Fusion rules, one module per fused op (pattern / check / rewrite and its variants).

The public entry point for onnxscript users is ``rewrite_rules()``::

    import onnxscript.rewriter
    from fusion.rules import attach_function, rewrite_rules

    fused = onnxscript.rewriter.rewrite(model, pattern_rewrite_rules=rewrite_rules())
    attach_function(fused)     # the model-local function: stock ONNX Runtime runs the fused node

It works on an ``onnx.ModelProto`` or an ``onnx_ir.Model``, like every onnxscript rule set. To run it
next to onnxscript's own rules in one call, concatenate: ``[*rewrite_rules(), *other_rules]`` (see
``rewrite_rules`` for the one difference that makes).
"""

from __future__ import annotations

from typing import TypeVar

import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.rules.gated_group_rms_norm import (
    FusionLog,
    GatedGroupRMSNormFusion,
    fuse_gated_group_rms_norm,
    gated_group_rms_norm_rule_sets,
)

__all__ = [
    "AllRulesSet",
    "FusionLog",
    "GatedGroupRMSNormFusion",
    "GatedGroupRMSNormRuleSet",
    "all_rewrite_rules",
    "attach_function",
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


class AllRulesSet(pattern.RewriteRuleSet):
    """Every fusion's rules (fusion/fusions.py) as one onnxscript ``RewriteRuleSet``.

    Applying it runs each fusion's rule sets in ``rewrite_model``'s order, in rounds until one fuses nothing: a
    chain may be proven only through ops fused in an earlier round (transformers 5.25's decode step proves the
    next layer's batch, and the gated norm's y, through the fused conv and state updates). Iterating it gives
    the rules themselves, in that order, for a flat list with other rules (one onnxscript pass: what that pass
    can prove).
    """

    #: A bound on the rounds (each fuses at least one chain; a model's layers are proven one round apart at most).
    MAX_ROUNDS = 64

    def __init__(self) -> None:
        from fusion import fusions

        self._rule_sets = [rule_set for fusion in fusions.FUSIONS for rule_set in fusion.rules]
        super().__init__([rule for rule_set in self._rule_sets for rule in rule_set])
        self.remove_unused_nodes = False

    def apply_to_model(self, model: ir.Model, *, verbose: int | None = None, tracer=None) -> int:
        """Fuse every chain of ``model`` that the rounds prove, in place; return how many were fused."""
        total = 0
        for _ in range(self.MAX_ROUNDS):
            fused = sum(rule_set.apply_to_model(model, verbose=verbose, tracer=tracer) for rule_set in self._rule_sets)
            total += fused
            if not fused:
                break
        return total


def all_rewrite_rules() -> AllRulesSet:
    """Return the rules of every fusion (fusion/fusions.py) as one rule set, applied in rounds (``AllRulesSet``):
    the gated norm's (as ``rewrite_rules``), CausalConv1dUpdate's and SelectiveStateUpdate's.

    ``rewrite_rules()`` stays the gated norm's rule set; call ``attach_function`` after either.
    """
    return AllRulesSet()


def attach_function(model: ModelT) -> ModelT:
    """Add the op's model-local function to a fused ``model`` (ModelProto or ir.Model) in place; return it.

    With it, ONNX Runtime without the mambafuse library (and providers that cannot host custom ops)
    inlines the fused node's stock-op body. A model with no fused node is returned unchanged.
    """
    if isinstance(model, onnx.ModelProto):
        from fusion import function

        if any(node.domain == function.DOMAIN and node.op_type == function.OP_TYPE for node in model.graph.node):
            function.attach_function(model)
        function.attach_functions(model)  # the decode-step ops' functions, for the ops the model uses
        return model
    from fusion import rewrite

    if any(node.domain == rewrite.DOMAIN for node in ir.traversal.RecursiveGraphIterator(model.graph)):
        rewrite.attach_function(model)
    return model
