"""The registry of fusions: one entry per ``ai.mambafuse`` op, in the order the rewriter tries them.

Everything that fuses, counts, explains or runs the ops iterates ``FUSIONS``: ``rewrite_model`` (fusion/rewrite.py)
and ``optimize`` fuse with each entry's ``fuse`` and explain what is left with its ``explain``; the report, the
command line's counts and ``--debug`` read the per-op results those fill; the Olive surgeon runs ``rewrite_model``;
``attach_functions`` adds each used op's model-local function (``make_function``); ``all_rewrite_rules`` hands
onnxscript every entry's rule sets. Adding an op is a rules module (with ``fuse``, ``find_anchors``), a function
module (``make_function``, ``MIN_OPSET``), a reference, a contract page, the kernels, and one entry below
(docs/adding-an-op.md).

This module sits below the orchestration: it imports the rule and function modules, never fusion/rewrite.py or
the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

from fusion.function import causal_conv1d as prompt_conv_function
from fusion.function import causal_conv1d_update as conv_function
from fusion.function import decode_matmul as weight_function
from fusion.function import gated_group_rms_norm as norm_function
from fusion.function import mamba_chunk_scan as scan_function
from fusion.function import selective_state_update as state_function
from fusion.function import squared_relu as squared_relu_function
from fusion.function._common import import_domain, model_onnx_opset, put_function
from fusion.reference._common import DOMAIN
from fusion.rules import causal_conv1d as prompt_conv_rules
from fusion.rules import causal_conv1d_update as conv_rules
from fusion.rules import causal_conv_with_state as conv_with_state_rules
from fusion.rules import decode_matmul as weight_rules
from fusion.rules import gated_group_rms_norm as norm_rules
from fusion.rules import linear_attention_scan as linear_attention_rules
from fusion.rules import mamba_chunk_scan as scan_rules
from fusion.rules import selective_state_update as state_rules
from fusion.rules import squared_relu as squared_relu_rules
from fusion.rules._log import FusionLog

#: The version of the ``ai.mambafuse`` domain a fused model imports (every op has one version, 1).
OPSET_VERSION = 1

ModelT = TypeVar("ModelT", onnx.ModelProto, ir.Model)


def _no_form(anchor: ir.Node) -> str:
    return ""


def _no_explanation(model: ir.Model, anchor: ir.Node) -> str:
    return "does not match the op's chain"


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One fused op: how to find, fuse, explain and run its chains."""

    #: the op's stem (fusion/rules/<name>.py, fusion/function/<name>.py, fusion/reference/<name>.py)
    name: str
    op_type: str
    #: what the report counts, e.g. "conv updates"
    counts: str
    #: the op's rule sets, in the order they are applied (a phase fuses what it can before the next starts)
    rules: tuple[pattern.RewriteRuleSet, ...]
    #: fuses every chain of a model it proves, in place, recording each chain in the log; returns how many fused
    fuse: Callable[..., int]
    #: the nodes where the op's chains start: after ``fuse``, the chains that are left (refused)
    find_anchors: Callable[[ir.Graph], list[ir.Node]]
    make_function: Callable[[int], onnx.FunctionProto]
    min_opset: int
    #: why a chain at this anchor was not fused, when no rule recorded a reason (it matched no rule's pattern)
    explain: Callable[[ir.Model, ir.Node], str] = _no_explanation
    #: the form (spelling) of a chain no rule matched, for the report's per-form counts; "" where the op has one form
    form_of: Callable[[ir.Node], str] = _no_form
    #: whether the rewriter tries the op again after ONNX Runtime's symbolic shape inference, where refused
    #: chains remain (TorchScript exports lose dims in their shape arithmetic that ORT's inference recovers)
    retry_with_symbolic_shapes: bool = False
    #: options of ``rewrite_model`` that ``fuse`` takes as keywords (the others are not passed)
    options: tuple[str, ...] = ()
    #: other opset domains the function body imports (name -> version)
    function_domains: tuple[tuple[str, int], ...] = ()
    #: The ops that builders already run the op's step as (mobius: ONNX Runtime's contrib op; ONNX's own since opset
    #: 27): each its domain, type and the attributes it must have. Such a layer has no chain to fuse; the report
    #: counts it apart.
    builder_ops: tuple[tuple[str, str, dict[str, object]], ...] = ()
    #: whether the fusion runs once after the others' rounds rather than in them: it replaces nodes (the weight
    #: MatMuls) that the other rules prove their chains' shapes through
    after_rounds: bool = False


GATED_GROUP_RMS_NORM = Fusion(
    name="gated_group_rms_norm",
    op_type="GatedGroupRMSNorm",
    counts="gated group-RMSNorm chains",
    rules=tuple(norm_rules.gated_group_rms_norm_rule_sets),
    fuse=norm_rules.fuse_gated_group_rms_norm,
    find_anchors=norm_rules.find_chain_anchors,
    make_function=norm_function.make_function,
    min_opset=norm_function.MIN_OPSET,
    explain=norm_rules.explain_unfused,
    form_of=norm_rules.coarse_form,
    retry_with_symbolic_shapes=True,
    options=("assume_equal_widths",),
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
    builder_ops=(("com.microsoft", "CausalConvWithState", {}), ("", "CausalConvWithState", {})),
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
    builder_ops=(
        ("com.microsoft", "LinearAttention", {"update_rule": "gated"}),
        ("", "LinearAttention", {"update_rule": "gated"}),
    ),
)

MAMBA_CHUNK_SCAN = Fusion(
    name="mamba_chunk_scan",
    op_type="MambaChunkScan",
    counts="chunk scans",
    rules=(scan_rules.mamba_chunk_scan_rules,),
    fuse=scan_rules.fuse_mamba_chunk_scan,
    find_anchors=scan_rules.find_anchors,
    make_function=scan_function.make_function,
    min_opset=scan_function.MIN_OPSET,
)

CAUSAL_CONV1D = Fusion(
    name="causal_conv1d",
    op_type="CausalConv1d",
    counts="prompt convs",
    rules=(prompt_conv_rules.causal_conv1d_rules,),
    fuse=prompt_conv_rules.fuse_causal_conv1d,
    find_anchors=prompt_conv_rules.find_anchors,
    make_function=prompt_conv_function.make_function,
    min_opset=prompt_conv_function.MIN_OPSET,
    function_domains=(("ai.onnx.ml", prompt_conv_function.ML_OPSET),),
)

#: Nemotron-H's MLP activation: not a Mamba-2 op, but after the mixers' fusions its two passes over the MLP's
#: activations are the largest elementwise kernels left in a prompt (docs/squared_relu.md).
SQUARED_RELU = Fusion(
    name="squared_relu",
    op_type="SquaredRelu",
    counts="squared ReLUs",
    rules=(squared_relu_rules.squared_relu_rules,),
    fuse=squared_relu_rules.fuse_squared_relu,
    find_anchors=squared_relu_rules.find_anchors,
    make_function=squared_relu_function.make_function,
    min_opset=squared_relu_function.MIN_OPSET,
    form_of=squared_relu_rules.form_of,
)

#: mobius' ``LinearAttention(update_rule="gated")`` run as MambaChunkScan on genai's state as it is (``state_layout``
#: 1): on the CPU faster on a prompt (1.3-2.2x) and on a decode step from the smallest published widths up; on CUDA
#: a 2048-token prompt ~3x faster and a decode step ~5 % faster at Nemotron-H-8B widths (benchmarks/RESULTS.md);
#: ``mambafuse genai`` runs it on a folder for the CPU or CUDA (``FOLDER_OPT_IN``), ``--opt-in
#: linear_attention_scan`` (``rewrite_model(..., opt_in=[...])``) elsewhere.
LINEAR_ATTENTION_SCAN = Fusion(
    name="linear_attention_scan",
    op_type="MambaChunkScan",
    counts="LinearAttention scans",
    rules=(linear_attention_rules.linear_attention_scan_rules,),
    fuse=linear_attention_rules.fuse_linear_attention_scan,
    find_anchors=linear_attention_rules.find_anchors,
    make_function=scan_function.make_function,
    min_opset=scan_function.MIN_OPSET,
)

#: mobius' ``CausalConvWithState`` run as CausalConv1d (channels-last where Transposes surround it): on the CPU
#: 3.9-9.2x faster on a prompt and 1.3-1.5x on a decode step; on CUDA, with the scan's rule, a 2048-token prompt of
#: the Nemotron-H-8B-shaped build ~10 % faster and its decode step ~1.5 % (benchmarks/RESULTS.md); ``mambafuse genai``
#: runs it on a folder for the CPU or CUDA (``FOLDER_OPT_IN``), ``--opt-in causal_conv_with_state`` elsewhere.
CAUSAL_CONV_WITH_STATE = Fusion(
    name="causal_conv_with_state",
    op_type="CausalConv1d",
    counts="CausalConvWithState convs",
    rules=(conv_with_state_rules.causal_conv_with_state_rules,),
    fuse=conv_with_state_rules.fuse_causal_conv_with_state,
    find_anchors=conv_with_state_rules.find_anchors,
    make_function=prompt_conv_function.make_function,
    min_opset=prompt_conv_function.MIN_OPSET,
    function_domains=(("ai.onnx.ml", prompt_conv_function.ML_OPSET),),
)

#: A weight MatMul (a constant (K, N) B) as DecodeMatMul, and a 4-bit MatMulNBits as DecodeMatMulNBits: the same
#: products, which the library's CUDA kernels run as a GEMV at up to 8 rows (a decode step) and with cuBLAS above.
#: Opt-in (``--opt-in decode_matmul``, ``--opt-in decode_matmul_nbits``) until measured faster where they run.
DECODE_MATMUL = Fusion(
    name="decode_matmul",
    op_type="DecodeMatMul",
    counts="weight MatMuls",
    rules=(weight_rules.decode_matmul_rules,),
    fuse=weight_rules.fuse_decode_matmul,
    find_anchors=weight_rules.find_anchors,
    make_function=weight_function.make_function,
    min_opset=weight_function.MIN_OPSET,
    after_rounds=True,
)
DECODE_MATMUL_NBITS = Fusion(
    name="decode_matmul_nbits",
    op_type="DecodeMatMulNBits",
    counts="4-bit MatMulNBits",
    rules=(weight_rules.decode_matmul_nbits_rules,),
    fuse=weight_rules.fuse_decode_matmul_nbits,
    find_anchors=weight_rules.find_nbits_anchors,
    make_function=weight_function.make_nbits_function,
    min_opset=weight_function.MIN_OPSET,
    function_domains=((weight_function.CONTRIB_DOMAIN, weight_function.CONTRIB_OPSET),),
    after_rounds=True,
)

#: Every fusion, in the order the rewriter tries them in each round (the decode conv before the prompt conv: a decode
#: step's conv is the update's).
FUSIONS: tuple[Fusion, ...] = (
    GATED_GROUP_RMS_NORM,
    CAUSAL_CONV1D_UPDATE,
    SELECTIVE_STATE_UPDATE,
    MAMBA_CHUNK_SCAN,
    CAUSAL_CONV1D,
    SQUARED_RELU,
)

#: Fusions that are right but not faster everywhere the fused model runs: never applied by default.
OPT_IN_FUSIONS: tuple[Fusion, ...] = (LINEAR_ATTENTION_SCAN, CAUSAL_CONV_WITH_STATE, DECODE_MATMUL, DECODE_MATMUL_NBITS)
#: The opt-in fusions ``mambafuse genai`` runs on a folder without ``--opt-in``, by the execution provider its config
#: names ("cpu" where it names none): those measured as fast or faster there on the calls a genai folder makes (its
#: prompt and its decode steps; benchmarks/RESULTS.md). A folder for another provider gets none.
FOLDER_OPT_IN: dict[str, tuple[str, ...]] = {
    "cpu": ("linear_attention_scan", "causal_conv_with_state"),
    "cuda": ("linear_attention_scan", "causal_conv_with_state"),
}
#: A folder's default scans run as MambaChunkScan where each layer's state has at least this many elements (H·N·P):
#: on the CPU the kernel is faster than LinearAttention from the smallest published Mamba-2 (mamba2-130m: 24·128·64 =
#: 196608) up, while on toy widths (the test fixtures' 512) a call's fixed cost outweighs its work; CUDA was measured
#: at real widths only, so the same bound holds there (benchmarks/RESULTS.md).
SCAN_MIN_STATE = 65536


def _by_op_type() -> dict[str, Fusion]:
    """Return one fusion per op type, default ones first: the op's function and its imports are the same for
    every fusion to it."""
    ops: dict[str, Fusion] = {}
    for fusion in (*FUSIONS, *OPT_IN_FUSIONS):
        ops.setdefault(fusion.op_type, fusion)
    return ops


def fusion_of(op_type: str) -> Fusion | None:
    """Return the fusion whose op is ``op_type`` (a default one before an opt-in one), else None."""
    return _by_op_type().get(op_type)


def attach_functions(model: ModelT, onnx_opset: int | None = None, *, only_missing: bool = False) -> list[str]:
    """Add the model-local function of every ``ai.mambafuse`` op ``model`` uses (an ``ir.Model`` or a
    ``ModelProto``, in place), replacing an older copy, or with ``only_missing`` adding only those it lacks.

    Returns the op types whose functions were added. A function whose body needs a newer ONNX opset than the
    model's is skipped (the rules do not fuse there).
    """
    if isinstance(model, onnx.ModelProto):
        opset = model_onnx_opset(model) if onnx_opset is None else onnx_opset
        used = {node.op_type for node in model.graph.node if node.domain == DOMAIN}
        defined = {function.name for function in model.functions if function.domain == DOMAIN}

        def add(function: onnx.FunctionProto) -> None:
            put_function(model, function)

        def import_opset(domain: str, version: int) -> None:
            import_domain(model, domain, version)
    else:
        opset = (
            onnx_opset if onnx_opset is not None else model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        )
        if opset is None:
            raise ValueError("the model imports no ONNX opset")
        used = {node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph) if node.domain == DOMAIN}
        defined = {identifier[1] for identifier in model.functions if identifier[0] == DOMAIN}

        def add(function: onnx.FunctionProto) -> None:
            deserialized = ir.serde.deserialize_function(function)
            model.functions[deserialized.identifier()] = deserialized

        def import_opset(domain: str, version: int) -> None:
            model.opset_imports.setdefault(domain, version)

    attached = []
    for fusion in _by_op_type().values():
        if fusion.op_type not in used or opset < fusion.min_opset or (only_missing and fusion.op_type in defined):
            continue
        add(fusion.make_function(opset))
        for domain, version in fusion.function_domains:
            import_opset(domain, version)
        attached.append(fusion.op_type)
    if attached:
        import_opset(DOMAIN, OPSET_VERSION)
    return attached


class AllRulesSet(pattern.RewriteRuleSet):
    """Every fusion's rules (``FUSIONS``) as one onnxscript ``RewriteRuleSet``.

    Applying it runs each fusion's rule sets in the registry's order, in rounds until one fuses nothing: a chain
    may be proven only through ops fused in an earlier round (transformers 5.25's decode step proves the next
    layer's batch, and the gated norm's y, through the fused conv and state updates). Iterating it gives the
    rules themselves, in that order, for a flat list with other rules (one onnxscript pass: what that pass can
    prove).
    """

    #: A bound on the rounds (each fuses at least one chain; a model's layers are proven one round apart at most).
    MAX_ROUNDS = 64

    def __init__(self) -> None:
        self._rule_sets = [rule_set for fusion in FUSIONS if not fusion.after_rounds for rule_set in fusion.rules]
        self._final_sets = [rule_set for fusion in FUSIONS if fusion.after_rounds for rule_set in fusion.rules]
        every = [*self._rule_sets, *self._final_sets]
        super().__init__([rule for rule_set in every for rule in rule_set])
        self.remove_unused_nodes = False

    def apply_to_model(self, model: ir.Model, *, verbose: int | None = None, tracer=None) -> int:
        """Fuse every chain of ``model`` that the rounds prove, in place; return how many were fused."""
        total = 0
        for _ in range(self.MAX_ROUNDS):
            fused = sum(rule_set.apply_to_model(model, verbose=verbose, tracer=tracer) for rule_set in self._rule_sets)
            total += fused
            if not fused:
                break
        # then, once, the fusions that replace nodes the others prove their shapes through (Fusion.after_rounds)
        total += sum(rule_set.apply_to_model(model, verbose=verbose, tracer=tracer) for rule_set in self._final_sets)
        return total


def all_rewrite_rules() -> AllRulesSet:
    """Return the rules of every fusion as one rule set, applied in rounds (``AllRulesSet``): the gated norm's (as
    ``fusion.rules.rewrite_rules``), CausalConv1dUpdate's and SelectiveStateUpdate's.

    Call ``fusion.rules.attach_function`` on the result for the fused ops' model-local functions.
    """
    return AllRulesSet()


__all__ = [
    "CAUSAL_CONV1D",
    "CAUSAL_CONV1D_UPDATE",
    "CAUSAL_CONV_WITH_STATE",
    "DOMAIN",
    "FOLDER_OPT_IN",
    "FUSIONS",
    "GATED_GROUP_RMS_NORM",
    "LINEAR_ATTENTION_SCAN",
    "MAMBA_CHUNK_SCAN",
    "OPSET_VERSION",
    "OPT_IN_FUSIONS",
    "SCAN_MIN_STATE",
    "SELECTIVE_STATE_UPDATE",
    "SQUARED_RELU",
    "AllRulesSet",
    "Fusion",
    "FusionLog",
    "all_rewrite_rules",
    "attach_functions",
    "fusion_of",
]
