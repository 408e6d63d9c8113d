"""Optimize a whole Mamba-2-family model for ONNX Runtime: every mambafuse fusion, onnxscript's ORT fusions, then
mambafuse's own passes.

Python::

    model, report = optimize_model(onnx_ir.load("model.onnx"))
    print(report.summary())

Command line: ``mambafuse optimize IN.onnx [OUT.onnx]`` (``python -m fusion.optimize``), with the options and
guarantees of ``mambafuse rewrite`` (atomic write, external data, ``--verify``, one-line errors).

The order is the one that fuses the most. mambafuse's fusions first, on the graph as exported, so that ``optimize``
fuses at least what ``rewrite`` fuses (onnxscript's rms_normalization takes the RMS of Falcon-H1's grouped norm,
and folds its weight into a (groups, group size) scale that the rules do not prove). Then onnxscript's
``optimize_for_ort`` fusions, one at a time: it folds constants and fuses the model's own RMSNorms (with the
residual Add before them: ``SkipSimplifiedLayerNormalization``), rotary embeddings and attention where its rules
match. Each step is checked and undone when it breaks the graph, and the result is loaded in ONNX Runtime (CPU,
and CUDA where available): when it does not load, the steps are replayed and each one that breaks loading is
undone and named. Then mambafuse's decode attention fusion (fusion/rules/attention.py): the half-precision
decode attentions without rotary that onnxscript's rules miss, onto ONNX Runtime's GroupQueryAttention
(``optimize`` only: that op has no model-local function, so ``mambafuse rewrite`` never writes it), and every
mambafuse fusion again for what those passes made provable. ``optimize_for_ort`` inlines every model-local
function, so run as a whole after the mambafuse fusions it would undo them; this command sets the functions
aside while onnxscript works, and ``mambafuse rewrite`` re-fuses an inlined model.

onnxscript's optimizer trusts the shapes a model declares for its graph inputs (as ONNX Runtime does, which
refuses inputs that contradict them); the mambafuse rules never do (docs/forms.md). ``--verify`` compares the
result with the original in ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import onnx
import onnx_ir as ir

from fusion import rewrite
from fusion.model_io import external_tensors, first_line
from fusion.rewrite import Report, rewrite_model
from fusion.rules._log import location

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
    #: Steps undone, each with the reason: they raised, left an invalid graph, or one ONNX Runtime does not load.
    undone: list[str] = dataclasses.field(default_factory=list)
    #: Chains the pass matched but did not fuse, each with where and why.
    refused: list[str] = dataclasses.field(default_factory=list)
    #: What the pass changed besides what it fused (constant folding, clean-up), so that the node counts add up.
    changes: list[str] = dataclasses.field(default_factory=list)
    #: What the pass could not check, and why.
    notes: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        """Return the pass's summary line, then one indented line per change besides its fusions, undone step,
        refusal and note."""
        if self.skipped is not None:
            return f"{self.name}: skipped ({self.skipped})"
        fused = ", ".join(f"{name} {count}" for name, count in self.fused.items()) or "nothing fused"
        line = f"{fused}; nodes {self.nodes_before} -> {self.nodes_after}"
        notes = [
            *self.changes,
            *(f"{self.name}: {reason}; undone" for reason in self.undone),
            *(f"refused: {why}" for why in self.refused),
            *self.notes,
        ]
        return "\n    ".join([f"{self.name}: {line}", *notes])


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
        """Return a few lines: the node counts over all passes, one line per pass (with its own node counts),
        then the mambafuse passes' summary (chains, refusals)."""
        lines = [f"nodes: {self.nodes_before} -> {self.nodes_after} (all passes)"]
        lines += [f"  {result.line()}" for result in self.passes]
        # The rewrite summary's own "nodes:" line would count from before the first mambafuse pass to after the
        # second, across the ORT fusions: a second, different total. The pass lines above give each pass's.
        lines += [line for line in self.rewrite.summary().splitlines() if not line.startswith("nodes: ")]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        return {
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "passes": [dataclasses.asdict(result) for result in self.passes],
            "rewrite": self.rewrite.to_dict(),
        }


def _nodes(model: ir.Model) -> Iterator[ir.Node]:
    """Yield the nodes of ``model``'s graph and of its subgraphs (what the report's node counts count)."""
    return iter(ir.traversal.RecursiveGraphIterator(model.graph))


def _node_count(model: ir.Model) -> int:
    return sum(1 for _ in _nodes(model))


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
#: The steps before and after the fusions, which fold and tidy rather than fuse: the report gives their node
#: changes apart from the fusions'.
CONSTANT_FOLDING, CLEAN_UP = "constant folding", "clean-up"
#: The domain of the intermediate ops onnxscript's fusions hand to later ones (SDPA, RotaryEmbedding). ONNX Runtime
#: knows none of them: a later fusion replaces them, or the clean-up inlines the function they carry (SDPA has
#: none, so a leftover SDPA leaves a model ONNX Runtime cannot load).
_INTERMEDIATE_DOMAIN = "ai.onnxruntime._fusion"
#: ONNX Runtime's session option for the folder of the external data of a model given as bytes.
_EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"

#: One step of onnxscript's fusions: its name in the report, and what runs it (returning how many it fused).
Step = tuple[str, Callable[[ir.Model], int]]


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


@dataclasses.dataclass
class _StepRecord:
    """What one step that stood did: how many it fused, the nodes it wrote (by name), its net node changes by op
    type, and the intermediate nodes it removed that no fusion took (the clean-up inlines them back)."""

    count: int
    created: set[str]
    delta: Counter[str]
    #: (name, op type) of each intermediate node the clean-up inlined back
    inlined: list[tuple[str, str]]


@dataclasses.dataclass
class _StepLog:
    """The steps of one run of onnxscript's fusions that stood, in order, and the ones undone with the reason."""

    steps: dict[str, _StepRecord] = dataclasses.field(default_factory=dict)
    undone: list[str] = dataclasses.field(default_factory=list)

    def creators(self) -> dict[str, str]:
        """Return, for each node a step that stood wrote, that step's name."""
        return {name: step for step, record in self.steps.items() for name in record.created}

    def fill(self, result: PassResult) -> None:
        """Fill ``result``: what each fusion fused and left in the graph, what folding and clean-up changed, and
        what was undone."""
        creators = self.creators()
        inlined: dict[str, Counter[str]] = {}
        for record in self.steps.values():
            for name, op_type in record.inlined:
                inlined.setdefault(creators.get(name, CLEAN_UP), Counter())[op_type] += 1
        for step, record in self.steps.items():
            if step in (CONSTANT_FOLDING, CLEAN_UP):
                if record.delta:
                    result.changes.append(f"{step} {_describe_delta(record.delta)}")
                continue
            taken_back = inlined.get(step, Counter())
            if record.count - taken_back.total() > 0:
                result.fused[step] = record.count - taken_back.total()
            if taken_back:
                ops = ", ".join(f"{count} {op_type}" for op_type, count in sorted(taken_back.items()))
                result.changes.append(f"{step}'s {ops} inlined back by the clean-up: no later fusion took them")
        result.undone = list(self.undone)


def _describe_delta(delta: Counter[str]) -> str:
    """Return net node changes in words: "removed 4 Reshape", "removed 3 Cast, 1 Neg and added 1 Mul"."""

    def listed(items: list[tuple[str, int]]) -> str:
        return ", ".join(f"{abs(count)} {op_type}" for op_type, count in items)

    ordered = sorted(delta.items(), key=lambda item: (-abs(item[1]), item[0]))
    removed = [item for item in ordered if item[1] < 0]
    added = [item for item in ordered if item[1] > 0]
    words = [f"removed {listed(removed)}"] if removed else []
    words += [f"added {listed(added)}"] if added else []
    return " and ".join(words)


def _fusion_steps() -> list[Step]:
    """Return ``optimize_for_ort``'s steps, one per fusion, between its constant folding and its clean-up.

    A fusion this onnxscript release does not have is left out.
    """
    import importlib

    import onnx_ir.passes.common as common_passes
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter.ort_fusions import ORT_PATTERN_REWRITE_RULES, shape_optimization

    def fold(model: ir.Model) -> int:
        common_passes.ShapeInferencePass()(model)
        optimizer.optimize(model)
        shape_optimization.rules.apply_to_model(model)
        optimizer.optimize(model)
        return 0

    steps: list[Step] = [(CONSTANT_FOLDING, fold)]
    for name, module_name, function_name, kwargs in _ORT_FUSIONS:
        try:
            fuse = getattr(importlib.import_module(f"onnxscript.rewriter.ort_fusions.{module_name}"), function_name)
        except (ImportError, AttributeError):
            continue
        steps.append((name, lambda model, fuse=fuse, kwargs=kwargs: fuse(model, **kwargs)))

    def clean_up(model: ir.Model) -> int:
        optimizer.optimize(model)  # inlines the intermediate ops no fusion took (those with a function)
        rewriter.rewrite(model, ORT_PATTERN_REWRITE_RULES)
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1)(model)
        common_passes.RemoveInitializersFromInputsPass()(model)
        common_passes.ShapeInferencePass()(model)
        return 0

    steps.append((CLEAN_UP, clean_up))
    return steps


def _apply(model: ir.Model, name: str, run: Callable[[ir.Model], int], log: _StepLog) -> tuple[ir.Model, _Checkpoint]:
    """Run one step on ``model``; undo it when it raises or leaves an invalid graph (``model_problem``).

    Returns the model (the one given, or its restored copy) and the checkpoint from before the step; the step's
    record, or why it was undone, goes to ``log``.
    """
    checkpoint = _Checkpoint(model)
    names = {node.name for node in _nodes(model)}
    op_types = Counter(node.op_type for node in _nodes(model))
    # The clean-up inlines the intermediate ops that no fusion took (those with a function): not fused after all.
    intermediates = [(node.name, node.op_type) for node in model.graph if node.domain == _INTERMEDIATE_DOMAIN]
    try:
        with _quiet_onnxscript():
            count = run(model)
    except Exception as error:  # onnxscript raises many types on graphs its rules do not expect
        log.undone.append(f"{name} failed ({first_line(error)})")
        return checkpoint.restore(), checkpoint
    problem = model_problem(model)
    if problem is not None:
        log.undone.append(f"{name} broke the graph ({problem})")
        return checkpoint.restore(), checkpoint
    after = {node.name for node in _nodes(model)}
    delta = Counter(node.op_type for node in _nodes(model))
    delta.subtract(op_types)
    log.steps[name] = _StepRecord(
        count=int(count or 0),
        created=after - names,
        delta=Counter({op_type: change for op_type, change in delta.items() if change}),
        inlined=[node for node in intermediates if node[0] not in after] if name == CLEAN_UP else [],
    )
    return model, checkpoint


def _ort_fusions(model: ir.Model, creators: dict[str, str] | None = None) -> tuple[ir.Model, PassResult]:
    """Run onnxscript's ORT fusions on ``model`` one at a time, undoing any that leaves a graph ONNX Runtime
    would refuse; return the model and the pass's report.

    onnxscript 0.7's fusions can write graphs ONNX Runtime refuses (measured on the bundled fixtures:
    ``SkipSimplifiedLayerNormalization`` with a float16 residual and a float32 input in fp16 models, rotary/attention
    rewrites that leave a node reading a value nothing produces; on a dynamo GPT-2 export, mha2 takes the Reshape
    before a Gemm, which then reads a rank-3 tensor). Each step is checked (``model_problem``, cheap) and undone
    when it breaks the graph; the result is then loaded in ONNX Runtime (``_load_error``), and when it does not
    load, the steps are replayed with a load after each (``_replay``). ``creators``, when given, gets the step that
    wrote each node (for the refusals of the mambafuse pass after this one).
    """
    result = PassResult("onnxscript ORT fusions", nodes_before=_node_count(model))
    # The model's own functions are set aside while onnxscript works: its optimizer inlines every model-local
    # function, and builders ship ORT's contrib ops with function bodies (mobius: CausalConvWithState,
    # LinearAttention, SkipSimplifiedLayerNormalization), which inlined would replace ORT's kernels by their
    # decomposition (measured on a mobius Nemotron-H build: 116 -> 162 kernels a Run, 1.5x slower).
    own_functions = dict(model.functions)
    model.functions.clear()
    try:
        model = _ort_fusion_steps(model, result, own_functions, creators if creators is not None else {})
    finally:
        for identifier, function in own_functions.items():
            model.functions.setdefault(identifier, function)
    result.nodes_after = _node_count(model)
    return model, result


def _ort_fusion_steps(
    model: ir.Model, result: PassResult, functions: dict[ir.OperatorIdentifier, ir.Function], creators: dict[str, str]
) -> ir.Model:
    """Run the steps of ``_ort_fusions`` on ``model`` (its own ``functions`` set aside); fill ``result``."""
    problem_before = model_problem(model)
    if problem_before is not None:
        result.skipped = f"the model is already inconsistent, so the fusions could not be checked: {problem_before}"
        return model
    steps = _fusion_steps()
    before = _Checkpoint(model)
    log = _StepLog()
    for name, run in steps:
        model, _ = _apply(model, name, run, log)
    # One session per provider when the result loads (the usual case); the replay only when it does not.
    providers = _check_providers()
    failing = {provider: error for provider in providers if (error := _load_error(model, functions, provider))}
    if failing:
        original = before.restore()
        checkable = [provider for provider in providers if provider not in failing]
        for provider in failing:
            error_before = _load_error(original, functions, provider)
            if error_before is None:
                checkable.append(provider)
            else:
                result.notes.append(
                    f"not checked on {_short(provider)}: ONNX Runtime's {_short(provider)} provider does not load "
                    f"the model before them either ({error_before})"
                )
        if any(provider in checkable for provider in failing):
            model, log = _replay(original, steps, lambda model: _first_load_error(model, functions, checkable))
    log.fill(result)
    creators.update(log.creators())
    return model


def _replay(
    original: ir.Model, steps: list[Step], load_error: Callable[[ir.Model], str | None]
) -> tuple[ir.Model, _StepLog]:
    """Run ``steps`` on ``original`` (a model ONNX Runtime loads) again, undoing each step after which the model
    does not load; return the result and the log.

    A state is loaded as the clean-up would leave it (on a copy), since the clean-up inlines the intermediate ops
    that no fusion took. A state holding an intermediate op without a function (SDPA) cannot load until a later
    fusion replaces it (mha, gqa, sdpa_via_mha), so it is loaded after that fusion, which, when the load fails, is
    the one undone; steps whose intermediate ops nothing replaced are undone at the end.
    """
    *before_clean_up, (clean_up_name, clean_up) = steps
    log = _StepLog()
    use_clean_up = True

    def cleaned_up(state: ir.Model) -> tuple[ir.Model, _StepLog, str | None]:
        copy = _Checkpoint(state).restore()
        clean_up_log = _StepLog()
        if use_clean_up:
            copy, _ = _apply(copy, clean_up_name, clean_up, clean_up_log)
        return copy, clean_up_log, load_error(copy)

    state = original
    good, good_clean_up, error = cleaned_up(state)
    if error is not None:  # the model before the fusions loads: the clean-up broke it
        log.undone.append(f"{clean_up_name} broke the graph ({error})")
        use_clean_up = False
        good, good_clean_up, _ = cleaned_up(state)
    pending: list[str] = []  # steps since ``good`` that fused, whose result could not be loaded yet
    since_good: list[str] = []  # every step that stood since ``good``
    for name, run in before_clean_up:
        signature = _signature(state)
        state, checkpoint = _apply(state, name, run, log)
        record = log.steps.get(name)
        if record is None:  # raised, or left an invalid graph: undone already
            continue
        since_good.append(name)
        if not record.count and _signature(state) == signature:
            continue  # fused nothing and moved no node (shape inference at most): loaded with the next step
        pending.append(name)
        if _unresolved_intermediates(state):
            continue
        candidate, candidate_clean_up, error = cleaned_up(state)
        if error is None:
            good, good_clean_up, pending, since_good = candidate, candidate_clean_up, [], []
            continue
        state = checkpoint.restore()
        log.steps.pop(name, None)
        pending.pop()
        since_good.pop()
        log.undone.append(f"{name} broke the graph ({error})")
    if pending:
        for name in pending:
            log.undone.append(
                f"{name} left intermediate ops ({_INTERMEDIATE_DOMAIN}) that no later fusion replaced and ONNX "
                "Runtime does not know"
            )
    elif since_good:
        candidate, candidate_clean_up, error = cleaned_up(state)
        if error is None:
            good, good_clean_up, since_good = candidate, candidate_clean_up, []
        else:
            log.undone.append(f"{', '.join(since_good)} broke the graph ({error})")
    for name in since_good:  # not in ``good``, the result
        log.steps.pop(name, None)
    log.steps.update(good_clean_up.steps)
    log.undone += good_clean_up.undone
    return good, log


def _signature(model: ir.Model) -> int:
    """Return a hash of ``model``'s graph structure: each node's op and the names it reads and writes."""
    return hash(
        tuple(
            (node.domain, node.op_type, *(value.name if value is not None else "" for value in node.inputs), "->")
            + tuple(value.name for value in node.outputs)
            for node in model.graph
        )
    )


def _unresolved_intermediates(model: ir.Model) -> bool:
    """Return whether ``model`` holds an intermediate op of onnxscript's fusions that carries no function."""
    return any(
        node.domain == _INTERMEDIATE_DOMAIN and node.op_identifier() not in model.functions for node in model.graph
    )


# --- loading in ONNX Runtime ---------------------------------------------------------------------------------


def _check_providers() -> list[str]:
    """Return the providers a result is loaded on: CPU, and CUDA where this ONNX Runtime has it."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [provider for provider in ("CPUExecutionProvider", "CUDAExecutionProvider") if provider in available]


def _short(provider: str) -> str:
    return provider.removesuffix("ExecutionProvider")


def _first_load_error(
    model: ir.Model, functions: dict[ir.OperatorIdentifier, ir.Function], providers: Sequence[str]
) -> str | None:
    """Return why ONNX Runtime does not load ``model`` on the first of ``providers`` that refuses it, naming the
    provider; None when every one loads it."""
    for provider in providers:
        error = _load_error(model, functions, provider)
        if error is not None:
            return f"ONNX Runtime's {_short(provider)} provider cannot load the result: {error}"
    return None


_ORT_ERROR_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")


def _load_error(model: ir.Model, functions: dict[ir.OperatorIdentifier, ir.Function], provider: str) -> str | None:
    """Return why ONNX Runtime cannot create a session for ``model`` (with ``functions`` added) on ``provider``,
    in one line (ONNX Runtime's first, without its error-code prefix); None when it can.

    The session resolves the graph (types, shapes), runs ONNX Runtime's graph optimizations at the level a user's
    session has by default (its transformer fusions re-infer shapes: a dynamo GPT-2 export after onnxscript's mha2
    loads with them off and fails with them on) and creates a kernel for every node. Weights are not prepacked
    (that copies them and checks nothing about the graph); external weights are read where they are
    (memory-mapped by ONNX Runtime where aligned), never copied. The model's ``ai.mambafuse`` nodes run through
    their functions (added where the model omits them, ``--no-function``), so the mambafuse library is not needed.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # the error reaches the report, once
    options.add_session_config_entry("session.disable_prepacking", "1")
    try:
        proto = _session_proto(model, functions)
        folder = _external_data_folder(model, proto)
        if folder is not None:
            options.add_session_config_entry(_EXTERNAL_DATA_FOLDER, folder)
        ort.InferenceSession(proto.SerializeToString(), options, providers=[provider])
    except Exception as error:
        return _ORT_ERROR_PREFIX.sub("", first_line(error))
    return None


def _session_proto(model: ir.Model, functions: dict[ir.OperatorIdentifier, ir.Function]) -> onnx.ModelProto:
    """Return ``model`` as the proto a session loads: with ``functions`` (set aside by ``_ort_fusions``) and the
    function of every ``ai.mambafuse`` op it uses and does not define."""
    from fusion.rules.registry import attach_functions

    proto = ir.to_proto(model)
    present = {(function.domain, function.name, function.overload) for function in proto.functions}
    for identifier, function in functions.items():
        if identifier not in present:
            proto.functions.append(ir.serde.serialize_function(function))
    if any(opset.domain in ("", "ai.onnx") for opset in proto.opset_import):
        attach_functions(proto, only_missing=True)
    return proto


def _external_data_folder(model: ir.Model, proto: onnx.ModelProto) -> str | None:
    """Return the folder ONNX Runtime reads ``proto``'s external data from; None when it has none.

    Weights read from one folder (every model ``load`` reads) are found there as they are; from several (a model
    put together in Python), the locations in ``proto`` are rewritten relative to their common folder.
    """
    tensors = [tensor for tensor in external_tensors(model) if tensor.base_dir]
    folders = {str(Path(tensor.base_dir).resolve()) for tensor in tensors}
    if len(folders) <= 1:
        return folders.pop() if folders else None
    common = os.path.commonpath(folders)
    relative = {
        tensor.name: os.path.relpath(Path(tensor.base_dir).resolve() / tensor.location, common) for tensor in tensors
    }
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.name in relative:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = relative[tensor.name]
    return common


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
    from fusion.rules._log import FusionLog
    from fusion.rules.attention import FORM, fuse_group_query_attention

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


def _squares(model: ir.Model) -> tuple[dict[str, int], list[str]]:
    """Write ``Pow(x, 2)`` as ``Mul(x, x)`` (square.py)."""
    from fusion.rules.square import squares_to_products

    return {"Pow as Mul": squares_to_products(model)}, []


def _conv_parts(model: ir.Model) -> tuple[dict[str, int], list[str]]:
    """Run each prompt conv whose output is split as one conv per part, cut by the projection's Split
    (conv_parts.py)."""
    from fusion.rules.conv_parts import split_conv_parts

    return split_conv_parts(model)


def optimize_model(
    model: ModelT,
    *,
    ort_fusions: bool = True,
    function: bool = True,
    assume_equal_widths: bool = False,
    opt_in: Sequence[str] = (),
    int4_accuracy_level: int | None = None,
) -> tuple[ModelT, OptimizeReport]:
    """Return ``model`` optimized for ONNX Runtime, and an OptimizeReport.

    Passes, in order: every mambafuse fusion (``rewrite_model``, with ``function``, ``assume_equal_widths`` and
    ``opt_in`` as there), on the graph as given; onnxscript's ORT fusions (``optimize_for_ort``'s, one at a time,
    each undone with its reason when it leaves a graph ONNX Runtime would refuse or cannot load; skipped with
    ``ort_fusions=False``); mambafuse's decode attention fusion (GroupQueryAttention, with the chains it refused
    and why); every mambafuse fusion again, for chains the passes before made provable (and ``int4_accuracy_level``
    as ``rewrite_model`` sets it); the float16 residual norms (after the mambafuse fusions, whose nodes carry a
    symbolic batch to the residual Adds), the unit-axis Transposes, the squares (``Pow(x, 2)`` as ``Mul(x, x)``)
    and the prompt convs by part (a split conv output cut by the in-projection's Split instead).
    A ModelProto is left untouched (a new one is returned); an ``ir.Model`` is optimized in place and returned.
    """
    if not isinstance(model, (onnx.ModelProto, ir.Model)):
        raise TypeError(f"optimize_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}")
    if isinstance(model, onnx.ModelProto):
        # onnxscript's optimizer edits protos that an ir.Model read from them still shares (seen: Constant
        # nodes of the caller's ModelProto removed): work on a copy, so the caller's model stays as it was.
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        ir_model, report = optimize_model(
            ir.from_proto(copy),
            ort_fusions=ort_fusions,
            function=function,
            assume_equal_widths=assume_equal_widths,
            opt_in=opt_in,
            int4_accuracy_level=int4_accuracy_level,
        )
        return ir.to_proto(ir_model), report
    report = OptimizeReport()
    # mambafuse's fusions first, on the graph as exported (what ``rewrite`` fuses, so ``optimize`` fuses at least
    # that): onnxscript's fusions below set the model's functions aside and leave the fused nodes alone, but they
    # rewrite some chains into spellings the rules do not prove (Falcon-H1's grouped norm, whose RMS their
    # rms_normalization takes). A chain fusable only after them is fused in a second mambafuse pass.
    opt_in = [opt_in] if isinstance(opt_in, str) else list(opt_in)
    # The weight products run last (Fusion.after_rounds): onnxscript's fusions and the attention pass match MatMuls.
    early_opt_in = [fusion.name for fusion in rewrite.opt_in_fusions(opt_in) if not fusion.after_rounds]
    before = _node_count(model)
    model, first = rewrite_model(model, function=function, assume_equal_widths=assume_equal_widths, opt_in=early_opt_in)
    report.passes.append(
        PassResult("mambafuse", fused=_fused_ops(first), nodes_before=before, nodes_after=_node_count(model))
    )
    first_refused = _refused_chains(model, first)
    creators: dict[str, str] = {}
    if ort_fusions:
        model, result = _ort_fusions(model, creators)
    else:
        count = _node_count(model)
        result = PassResult("onnxscript ORT fusions", nodes_before=count, nodes_after=count, skipped="--no-ort-fusions")
    report.passes.append(result)
    report.passes.append(_own_pass("mambafuse attention", model, _attention))
    before = _node_count(model)
    model, second = rewrite_model(
        model,
        function=function,
        assume_equal_widths=assume_equal_widths,
        opt_in=opt_in,
        int4_accuracy_level=int4_accuracy_level,
    )
    if second.fused or second.decode_fused:
        report.passes.append(
            PassResult(
                "mambafuse, after the ORT fusions",
                fused=_fused_ops(second),
                nodes_before=before,
                nodes_after=_node_count(model),
            )
        )
    _explain_left_refusals(model, second, first_refused, creators)
    report.rewrite = _merged(first, second)
    # After the mambafuse fusions: their nodes prove the residual Adds' dims under a symbolic batch.
    report.passes.append(_own_pass("mambafuse residual norms", model, _residual_norms))
    report.passes.append(_own_pass("mambafuse layout", model, _unit_transposes))
    report.passes.append(_own_pass("mambafuse squares", model, _squares))
    report.passes.append(_own_pass("mambafuse conv parts", model, _conv_parts))
    return model, report


def _fused_ops(rewrite: Report) -> dict[str, int]:
    """Return a rewrite's fused chains per op type (ops with none left out)."""
    fused = {"GatedGroupRMSNorm": rewrite.fused}
    fused.update({op_type: op["fused"] for op_type, op in rewrite.decode.items()})
    return {op_type: count for op_type, count in fused.items() if count}


#: A chain a rewrite refused: its anchor node, and the rewrite's (where, why).
RefusedChain = tuple[ir.Node, tuple[str, str]]


def _refused_chains(model: ir.Model, report: Report) -> dict[str, list[RefusedChain] | None]:
    """Return, per op type, the chains ``report`` (of a rewrite of ``model`` just run) refused, in its order.

    The report lists them in the order its op's anchors are in the graph (``rewrite._report_fusion`` finds them
    so); None for an op whose anchors do not line up with its refusals.
    """
    from fusion.rules.registry import FUSIONS

    refused: dict[str, list[RefusedChain] | None] = {}
    listed = [(fusion.op_type, fusion.find_anchors, report.refused_of(fusion.op_type)) for fusion in FUSIONS]
    for op_type, find_anchors, reasons in listed:
        if not reasons:
            continue
        anchors = find_anchors(model.graph)
        refused[op_type] = list(zip(anchors, reasons, strict=True)) if len(anchors) == len(reasons) else None
    return refused


def _chain_key(anchor: ir.Node) -> str:
    """Return what names ``anchor``'s chain across onnxscript's passes: its output's name (the passes keep value
    names where they rename nodes: a TorchScript export's ``/mixer/norm/Reshape`` comes back as
    ``node_Reshape_60``)."""
    return anchor.outputs[0].name if anchor.outputs and anchor.outputs[0].name else location(anchor)


def _explain_left_refusals(
    model: ir.Model, second: Report, first: dict[str, list[RefusedChain] | None], creators: dict[str, str]
) -> None:
    """Reword, in ``second`` (the mambafuse pass after onnxscript's), the refusals of the chains left unfused.

    A chain the first pass refused too keeps that pass's words (where and why on the graph as given: what
    ``rewrite`` says). A chain only the second pass saw gets, when one of onnxscript's steps wrote nodes of it
    (``creators``), which one: the rules' "does not match any chain form" on a chain onnxscript rewrote is about
    its spelling, not about the model.
    """
    before = {
        (op_type, _chain_key(anchor)): refusal for op_type, chains in first.items() for anchor, refusal in chains or []
    }
    for op_type, chains in _refused_chains(model, second).items():
        if chains is None:
            continue
        explained = []
        for anchor, (where, reason) in chains:
            refusal = before.get((op_type, _chain_key(anchor)))
            if refusal is None:
                rewriters = _rewriters(anchor, creators)
                suffix = f" (onnxscript's ORT fusions rewrote this chain first: {rewriters})" if rewriters else ""
                refusal = (where, reason + suffix)
            explained.append(refusal)
        if op_type == "GatedGroupRMSNorm":
            second.refused = explained
        else:
            second.decode[op_type]["refused"] = explained


def _rewriters(anchor: ir.Node, creators: dict[str, str], depth: int = 10) -> str:
    """Return which of onnxscript's steps wrote nodes around ``anchor`` (the nodes it reads from, and those up to
    ``depth`` readers on: a chain's extent), each with one node it wrote; empty when none did."""
    around = [anchor, *(value.producer() for value in anchor.inputs if value is not None and value.producer())]
    frontier, seen = [(anchor, depth)], set(around)
    while frontier:
        node, left = frontier.pop(0)
        for output in node.outputs:
            for user, _ in output.uses():
                if user not in seen and left > 0:
                    seen.add(user)
                    around.append(user)
                    frontier.append((user, left - 1))
    found: dict[str, str] = {}
    for node in around:
        step = creators.get(node.name) if node is not None else None
        if step is not None:
            found.setdefault(step, node.name)
    return ", ".join(f"{step} wrote {name}" for step, name in found.items())


def _merged(first: Report, second: Report) -> Report:
    """Return one rewrite Report for ``optimize``'s two mambafuse passes: what both fused, what is left refused
    after the second (the chains still in the model), the node counts from before the first to after the
    second (across onnxscript's passes: the OptimizeReport's pass lines give each pass's)."""
    merged = Report(
        fused=first.fused + second.fused,
        refused=list(second.refused),
        nodes_before=first.nodes_before,
        nodes_after=second.nodes_after,
        function_attached=first.function_attached or second.function_attached,
        fused_chains=[*first.fused_chains, *second.fused_chains],
        hints=list(second.hints),  # about the model as written
        accuracy_level=second.accuracy_level,
        accuracy_level_set=second.accuracy_level_set,
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
        opt_in=args.opt_in,
        int4_accuracy_level=args.int4_accuracy_level,
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
