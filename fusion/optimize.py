"""Optimize a whole Mamba-2-family model for ONNX Runtime: onnxscript's ORT fusions, then every mambafuse fusion.

Python::

    model, report = optimize_model(onnx_ir.load("model.onnx"))
    print(report.summary())

Command line: ``mambafuse optimize IN.onnx [OUT.onnx]`` (``python -m fusion.optimize``), with the options and
guarantees of ``mambafuse rewrite`` (atomic write, external data, ``--verify``, one-line errors).

The order is the one that fuses the most. onnxscript's ``optimize_for_ort`` first: it folds constants and fuses
the model's own RMSNorms (with the residual Add before them: ``SkipSimplifiedLayerNormalization``), rotary
embeddings and attention where its rules match. Then mambafuse's fusions, which also see through what
``optimize_for_ort`` leaves (its constant folding only makes shape arithmetic simpler). Between the two, mambafuse's
decode attention fusion (fusion/rules/attention.py): the half-precision decode attentions without rotary that
onnxscript's rules miss, onto ONNX Runtime's GroupQueryAttention (``optimize`` only: that op has no model-local
function, so ``mambafuse rewrite`` never writes it). Run the other way round,
``optimize_for_ort`` inlines every model-local function, so it would undo the mambafuse nodes; this command never
does that, and ``mambafuse rewrite`` re-fuses an inlined model.

onnxscript's optimizer trusts the shapes a model declares for its graph inputs (as ONNX Runtime does, which
refuses inputs that contradict them); the mambafuse rules never do (docs/forms.md). ``--verify`` compares the
result with the original in ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import onnx
import onnx_ir as ir

from fusion import rewrite
from fusion.model_io import first_line
from fusion.rewrite import Report, rewrite_model

ModelT = TypeVar("ModelT", onnx.ModelProto, ir.Model)

__all__ = ["OptimizeReport", "PassResult", "optimize_model"]


@dataclasses.dataclass
class PassResult:
    """What one pass did: fusions by name (only those that fired), node counts around it, or why it was skipped."""

    name: str
    fused: dict[str, int] = dataclasses.field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    skipped: str | None = None
    #: Steps undone because they left a graph ONNX Runtime would refuse, each with the reason.
    undone: list[str] = dataclasses.field(default_factory=list)
    #: Chains the pass matched but did not fuse, each with where and why.
    refused: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        """Return the pass's summary line."""
        if self.skipped is not None:
            return f"{self.name}: skipped ({self.skipped})"
        fused = ", ".join(f"{name} {count}" for name, count in self.fused.items()) or "nothing fused"
        line = f"{self.name}: {fused}; nodes {self.nodes_before} -> {self.nodes_after}"
        notes = [*(f"undone: {reason}" for reason in self.undone), *(f"refused: {why}" for why in self.refused)]
        return "\n    ".join([line, *notes])


@dataclasses.dataclass
class OptimizeReport:
    """The passes in the order they ran, and the mambafuse pass's full rewrite Report."""

    passes: list[PassResult] = dataclasses.field(default_factory=list)
    rewrite: Report = dataclasses.field(default_factory=Report)

    @property
    def verification(self) -> dict[str, Any] | None:
        """``--verify``'s result (kept on the rewrite Report, whose summary prints it)."""
        return self.rewrite.verification

    @verification.setter
    def verification(self, value: dict[str, Any] | None) -> None:
        self.rewrite.verification = value

    @property
    def nodes_before(self) -> int:
        return self.passes[0].nodes_before if self.passes else 0

    @property
    def nodes_after(self) -> int:
        return self.passes[-1].nodes_after if self.passes else 0

    def pass_named(self, name: str) -> PassResult:
        """Return the pass of that name (e.g. "onnxscript ORT fusions")."""
        return next(result for result in self.passes if result.name == name)

    def summary(self) -> str:
        """Return a few lines: one per pass, then the mambafuse pass's own summary (chains, refusals)."""
        lines = [f"nodes: {self.nodes_before} -> {self.nodes_after}"]
        lines += [f"  {result.line()}" for result in self.passes]
        lines.append(self.rewrite.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        return {
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "passes": [dataclasses.asdict(result) for result in self.passes],
            "rewrite": self.rewrite.to_dict(),
        }


def _node_count(model: ir.Model) -> int:
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


@contextlib.contextmanager
def _quiet_onnxscript() -> Iterator[None]:
    """Silence the tracebacks onnx-ir logs when ONNX's shape inference gives up on a graph (it then goes on)."""
    loggers = [logging.getLogger(name) for name in ("onnx_ir.passes.common.shape_inference", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


#: onnxscript's ORT fusions in the order ``optimize_for_ort`` applies them (onnxscript 0.5-0.7), as
#: (name in the report, module under onnxscript.rewriter.ort_fusions, function, keyword arguments).
_ORT_FUSIONS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("erf_gelu", "erfgelu", "fuse_erfgelu", {}),
    ("rms_normalization", "rms_normalization", "fuse_rms_normalization", {}),
    ("skip_layer_normalization", "skip_normalization", "fuse_skip_layer_normalization", {}),
    ("skip_rms_normalization", "skip_normalization", "fuse_skip_rms_normalization", {}),
    ("rotary_embedding", "rotary_embedding", "fuse_rotary_embedding", {}),
    ("cos_sin_cache", "cos_sin_cache", "fuse_cos_sin_cache", {}),
    ("partial_rotary_embedding", "rotary_embedding", "fuse_partial_rotary_embedding", {}),
    ("sdpa", "sdpa", "fuse_sdpa", {"apply_shape_inference": True}),
    ("gqa", "gqa", "fuse_gqa", {}),
    ("packed_qkv_for_gqa", "gqa_packed_qkv", "fuse_qkv_gqa", {}),
    ("mha1", "mha", "fuse_mha1", {}),
    ("mha2", "mha", "fuse_mha2", {}),
    ("mha_scale", "mha_scale", "fuse_mha_scale", {}),
    ("mha_bias", "mha_bias", "fuse_mha_bias", {}),
    ("attention", "attention", "fuse_attention", {}),
    ("gelu", "gelu", "fuse_gelu", {}),
    ("bias_gelu", "bias_gelu", "fuse_bias_gelu", {}),
    ("sdpa_via_mha", "sdpa_via_mha", "replace_sdpa_by_mha", {}),
)


class _Checkpoint:
    """A copy of a model's graph to return to when an onnxscript step leaves it invalid.

    External weights stay references to their files (only the graph is copied); the restored model's
    external tensors get back the directories the originals were read from.
    """

    def __init__(self, model: ir.Model) -> None:
        self.proto = ir.to_proto(model)
        self.directories = {
            value.name: value.const_value.base_dir
            for value in model.graph.initializers.values()
            if isinstance(value.const_value, ir.ExternalTensor)
        }

    def restore(self) -> ir.Model:
        model = ir.serde.deserialize_model(self.proto)
        for value in model.graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor) and value.name in self.directories:
                value.const_value.base_dir = self.directories[value.name]
        return model


def _ort_fusions(model: ir.Model) -> tuple[ir.Model, PassResult]:
    """Run onnxscript's ORT fusions on ``model`` one at a time, undoing any that leaves an invalid graph.

    onnxscript 0.7's fusions can write graphs ONNX Runtime refuses on these exports (measured on the bundled
    fixtures: ``SkipSimplifiedLayerNormalization`` with a float16 residual and a float32 input in fp16 models,
    rotary/attention rewrites that leave a node reading a value nothing produces). Each step is checked
    (``model_problem``) and undone when it breaks the graph; the report names it with the reason.
    """
    result = PassResult("onnxscript ORT fusions", nodes_before=_node_count(model))
    # The model's own functions are set aside while onnxscript works: its optimizer inlines every model-local
    # function, and builders ship ORT's contrib ops with function bodies (mobius: CausalConvWithState,
    # LinearAttention, SkipSimplifiedLayerNormalization), which inlined would replace ORT's kernels by their
    # decomposition (measured on a mobius Nemotron-H build: 116 -> 162 kernels a Run, 1.5x slower).
    own_functions = dict(model.functions)
    model.functions.clear()
    try:
        model = _ort_fusion_steps(model, result)
    finally:
        for identifier, function in own_functions.items():
            model.functions.setdefault(identifier, function)
    result.nodes_after = _node_count(model)
    return model, result


def _ort_fusion_steps(model: ir.Model, result: PassResult) -> ir.Model:
    """Run the steps of ``_ort_fusions`` on ``model`` (its own functions set aside); fill ``result``."""
    import importlib

    import onnx_ir.passes.common as common_passes
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter.ort_fusions import ORT_PATTERN_REWRITE_RULES, shape_optimization

    problem_before = model_problem(model)
    if problem_before is not None:
        result.skipped = f"the model is already inconsistent, so the fusions could not be checked: {problem_before}"
        return model
    undone: list[str] = []

    def step(name: str, run) -> None:
        nonlocal model
        checkpoint = _Checkpoint(model)
        try:
            with _quiet_onnxscript():
                count = run(model)
        except Exception as error:  # onnxscript raises many types on graphs its rules do not expect
            model = checkpoint.restore()
            undone.append(f"{name} ({first_line(error)})")
            return
        problem = model_problem(model)
        if problem is not None:
            model = checkpoint.restore()
            undone.append(f"{name} (left an invalid graph: {problem})")
        elif count:
            result.fused[name] = result.fused.get(name, 0) + int(count)

    def prepare(model: ir.Model) -> int:
        common_passes.ShapeInferencePass()(model)
        optimizer.optimize(model)
        shape_optimization.rules.apply_to_model(model)
        optimizer.optimize(model)
        return 0

    step("constant folding", prepare)
    for name, module_name, function_name, kwargs in _ORT_FUSIONS:
        try:
            fuse = getattr(importlib.import_module(f"onnxscript.rewriter.ort_fusions.{module_name}"), function_name)
        except (ImportError, AttributeError):
            continue  # an onnxscript release without this fusion
        step(name, lambda model, fuse=fuse, kwargs=kwargs: fuse(model, **kwargs))

    def finish(model: ir.Model) -> int:
        optimizer.optimize(model)  # inlines what the attention fusions left as functions
        rewriter.rewrite(model, ORT_PATTERN_REWRITE_RULES)
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1)(model)
        common_passes.RemoveInitializersFromInputsPass()(model)
        common_passes.ShapeInferencePass()(model)
        return 0

    step("clean-up", finish)
    result.undone = undone
    return model


@functools.cache
def _schemas() -> dict[tuple[str, str], list[Any]]:
    """Return ONNX Runtime's operator schemas (ONNX and its contrib domains) by (domain, op type), newest first."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    schemas: dict[tuple[str, str], list[Any]] = {}
    for schema in ort_state.get_all_operator_schema():
        domain = "" if schema.domain in ("", "ai.onnx") else schema.domain
        schemas.setdefault((domain, schema.name), []).append(schema)
    for versions in schemas.values():
        versions.sort(key=lambda schema: -schema.since_version)
    return schemas


def _schema(node: ir.Node, opsets: dict[str, int]) -> Any | None:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    version = opsets.get(domain, opsets.get("ai.onnx" if domain == "" else domain))
    for schema in _schemas().get((domain, node.op_type), []):
        if version is None or schema.since_version <= version:
            return schema
    return None


def model_problem(model: ir.Model) -> str | None:
    """Return why ONNX Runtime would refuse ``model``'s main graph, or None.

    Checks what onnxscript's fusions have been seen to break: a node reading a value that no node, input or
    initializer produces (or that is produced after it), and a node whose inputs and outputs bind one type
    parameter of its ONNX Runtime schema to two element types. Cheap: no session, no weights read.
    """
    graph = model.graph
    available = {*graph.inputs, *graph.initializers.values()}
    opsets = dict(model.opset_imports)
    for node in graph:
        for value in node.inputs:
            if value is not None and value not in available:
                return f"node {node.name!r} ({node.op_type}) reads {value.name!r}, which nothing before it produces"
        available.update(node.outputs)
        schema = _schema(node, opsets)
        if schema is None:
            continue
        constraints = {constraint.type_param_str for constraint in schema.type_constraints}
        bound: dict[str, set[ir.DataType]] = {}
        for values, formals in ((node.inputs, schema.inputs), (node.outputs, schema.outputs)):
            for index, value in enumerate(values):
                if value is None or value.dtype is None or not formals:
                    continue
                type_param = formals[min(index, len(formals) - 1)].typeStr
                if type_param in constraints:
                    bound.setdefault(type_param, set()).add(value.dtype)
        for type_param, dtypes in bound.items():
            if len(dtypes) > 1:
                names = " and ".join(sorted(dtype.name.lower() for dtype in dtypes))
                return f"node {node.name!r} ({node.op_type}) binds its type {type_param} to {names}"
    missing = [value.name for value in graph.outputs if value not in available]
    if missing:
        return f"graph output {missing[0]!r} is produced by no node"
    return None


def _own_pass(name: str, model: ir.Model, run: Callable[[ir.Model], tuple[dict[str, int], list[str]]]) -> PassResult:
    """Run one of ``optimize``'s own passes on ``model``: what it fused (by op), where and why it refused, and
    the node counts around it."""
    result = PassResult(name, nodes_before=_node_count(model))
    fused, result.refused = run(model)
    result.fused = {op_type: count for op_type, count in fused.items() if count}
    result.nodes_after = _node_count(model)
    return result


def _attention(model: ir.Model) -> tuple[dict[str, int], list[str]]:
    """Fuse the decode attentions onnxscript's rules miss into GroupQueryAttention (fusion/rules/attention.py)."""
    from fusion.rules.attention import FORM, fuse_group_query_attention
    from fusion.rules.gated_group_rms_norm import FusionLog

    log = FusionLog()
    count = fuse_group_query_attention(model, log)
    refused = [
        f"{record.location}: {record.reason}"
        for record in log.chains.values()
        if record.form == FORM and not record.fused
    ]
    return {"GroupQueryAttention": count}, refused


def _residual_norms(model: ir.Model) -> tuple[dict[str, int], list[str]]:
    """Fold float16 RMSNorms with float32 weights, and their residual Adds, into ORT's norms (residual_norm.py)."""
    from fusion.rules.residual_norm import fuse_residual_norms

    return fuse_residual_norms(model)


def _unit_transposes(model: ir.Model) -> tuple[dict[str, int], list[str]]:
    """Write the Transposes that move only axes of size 1 as Reshapes (unit_transpose.py)."""
    from fusion.rules.unit_transpose import transposes_to_reshapes

    return {"Transpose as Reshape": transposes_to_reshapes(model)}, []


def optimize_model(
    model: ModelT, *, ort_fusions: bool = True, function: bool = True, assume_equal_widths: bool = False
) -> tuple[ModelT, OptimizeReport]:
    """Return ``model`` optimized for ONNX Runtime, and an OptimizeReport.

    Passes, in order: onnxscript's ORT fusions (``optimize_for_ort``'s, one at a time, each undone with its
    reason when it leaves a graph ONNX Runtime would refuse; skipped with ``ort_fusions=False``), mambafuse's
    decode attention fusion (GroupQueryAttention, with the chains it refused and why), every mambafuse fusion
    (``rewrite_model``, with ``function`` and ``assume_equal_widths`` as there), the float16 residual norms
    (after the mambafuse fusions, whose nodes carry a symbolic batch to the residual Adds) and the unit-axis
    Transposes. A ModelProto is left untouched (a new one is returned); an ``ir.Model`` is optimized in place and
    returned.
    """
    if not isinstance(model, (onnx.ModelProto, ir.Model)):
        raise TypeError(f"optimize_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")
    if isinstance(model, onnx.ModelProto):
        # onnxscript's optimizer edits protos that an ir.Model read from them still shares (seen: Constant
        # nodes of the caller's ModelProto removed): work on a copy, so the caller's model stays as it was.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        ir_model, report = optimize_model(
            ir.from_proto(copy), ort_fusions=ort_fusions, function=function, assume_equal_widths=assume_equal_widths
        )
        return ir.to_proto(ir_model), report
    report = OptimizeReport()
    # mambafuse's fusions first, on the graph as exported (what ``rewrite`` fuses, so ``optimize`` fuses at least
    # that): onnxscript's fusions below set the model's functions aside and leave the fused nodes alone, but they
    # rewrite some chains into spellings the rules do not prove (Falcon-H1's grouped norm, whose RMS their
    # rms_normalization takes). A chain fusable only after them is fused in a second mambafuse pass.
    before = _node_count(model)
    model, first = rewrite_model(model, function=function, assume_equal_widths=assume_equal_widths)
    report.passes.append(
        PassResult("mambafuse", fused=_fused_ops(first), nodes_before=before, nodes_after=_node_count(model))
    )
    if ort_fusions:
        model, result = _ort_fusions(model)
    else:
        count = _node_count(model)
        result = PassResult("onnxscript ORT fusions", nodes_before=count, nodes_after=count, skipped="--no-ort-fusions")
    report.passes.append(result)
    report.passes.append(_own_pass("mambafuse attention", model, _attention))
    before = _node_count(model)
    model, second = rewrite_model(model, function=function, assume_equal_widths=assume_equal_widths)
    if second.fused or second.decode_fused:
        report.passes.append(
            PassResult(
                "mambafuse, after the ORT fusions",
                fused=_fused_ops(second),
                nodes_before=before,
                nodes_after=_node_count(model),
            )
        )
    report.rewrite = _merged(first, second)
    # After the mambafuse fusions: their nodes prove the residual Adds' dims under a symbolic batch.
    report.passes.append(_own_pass("mambafuse residual norms", model, _residual_norms))
    report.passes.append(_own_pass("mambafuse layout", model, _unit_transposes))
    return model, report


def _fused_ops(rewrite: Report) -> dict[str, int]:
    """Return a rewrite's fused chains per op type (ops with none left out)."""
    fused = {"GatedGroupRMSNorm": rewrite.fused}
    fused.update({op_type: op["fused"] for op_type, op in rewrite.decode.items()})
    return {op_type: count for op_type, count in fused.items() if count}


def _merged(first: Report, second: Report) -> Report:
    """Return one rewrite Report for ``optimize``'s two mambafuse passes: what both fused, what is left refused
    after the second (the chains still in the model), the node counts from before the first to after the
    second."""
    merged = Report(
        fused=first.fused + second.fused,
        refused=list(second.refused),
        nodes_before=first.nodes_before,
        nodes_after=second.nodes_after,
        function_attached=first.function_attached or second.function_attached,
        fused_chains=[*first.fused_chains, *second.fused_chains],
    )
    # the second pass counts the chains still in the model (fused then or refused); the first's fused are gone
    merged.chains_found = dict(second.chains_found)
    for chain in first.fused_chains:
        merged.chains_found[chain["form"]] = merged.chains_found.get(chain["form"], 0) + 1
    for op_type in dict.fromkeys([*first.decode, *second.decode]):
        a = first.decode.get(op_type, {})
        b = second.decode.get(op_type, {})
        fused = a.get("fused", 0) + b.get("fused", 0)
        refused = list(b.get("refused", []))
        merged.decode[op_type] = {
            "counts": (b or a)["counts"],
            "found": fused + len(refused),
            "fused": fused,
            "refused": refused,
            "fused_chains": [*a.get("fused_chains", []), *b.get("fused_chains", [])],
            "builder_fused": b.get("builder_fused", a.get("builder_fused", {})),
        }
    return merged


# --- command line -----------------------------------------------------------------------------------


def _add_arguments(parser) -> None:
    parser.add_argument(
        "--no-ort-fusions", action="store_true", help="skip onnxscript's ORT fusions: only mambafuse's fusions run"
    )


def _transform(model: ir.Model, args) -> tuple[ir.Model, OptimizeReport]:
    return optimize_model(
        model,
        ort_fusions=not args.no_ort_fusions,
        function=not args.no_function,
        assume_equal_widths=args.assume_equal_widths,
    )


OPTIMIZE = rewrite.Command(
    name="optimize",
    description="Optimize a Mamba-2-family model for ONNX Runtime: onnxscript's ORT fusions (RMSNorm, "
    "residual + RMSNorm, rotary embedding, attention where its rules match), each checked and undone if it "
    "breaks the graph, then mambafuse's decode attention fusion (float16/bfloat16 attention without rotary "
    "onto ONNX Runtime's GroupQueryAttention) and every mambafuse fusion (gated group-RMSNorm, conv and state "
    "updates).",
    suffix="optimized",
    transform=_transform,
    add_arguments=_add_arguments,
)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m fusion.optimize") -> int:
    """Run the command line (``mambafuse optimize``); exit statuses as ``mambafuse rewrite``'s."""
    return rewrite.main(argv, prog=prog, command=OPTIMIZE)


if __name__ == "__main__":
    sys.exit(main())
