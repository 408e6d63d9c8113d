"""Rewrite an ONNX model: fuse every chain of every op in the registry (fusion/rules/registry.py) into its
``ai.mambafuse`` node — ``GatedGroupRMSNorm``, ``CausalConv1dUpdate``, ``SelectiveStateUpdate``.

Python::

    fused, report = rewrite_model(onnx.load("model.onnx"))
    print(report.summary())

Command line::

    python -m fusion.rewrite model.onnx [-o model.fused.onnx] [--no-function] [--verify] [--debug] [--json]

load → shape inference (so checks can find candidates; they prove what they fuse, docs/shapes.md) → each
registry entry's rules, in rounds → model-local functions → save.
The input file is never written; the output is written atomically next to its final name. Weights in
external data files stay there: they are not read into memory, and the output either points at the
same data file (output in the input's directory) or gets its own ``<output>.data`` copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from fusion import function as fused_function
from fusion._graph import value_info_preserved
from fusion.hints import CPU_INT4, Hint, topic_of
from fusion.inputs import HELP as INPUTS_HELP
from fusion.inputs import InputError
from fusion.int4 import (
    ACCURACY_LEVELS,
    INT8_ACTIVATIONS_LEVEL,
    float_activation_hint,
    set_int4_accuracy_level,
)
from fusion.model_io import (
    Interrupted,
    RewriteError,
    check_input,
    check_output,
    data_file_name,
    first_line,
    interruptible,
    load,
    save,
    writes_own_data,
)
from fusion.progress import ENV as PROGRESS_ENV
from fusion.progress import progress, stdout_closed
from fusion.reference import DOMAIN, OP_TYPE
from fusion.report import ReportError
from fusion.rules import registry
from fusion.rules._log import FusionLog, location
from fusion.rules.registry import Fusion, attach_functions
from fusion.shapes.symbolic import symbolic_shapes
from fusion.verify import prepare_inputs, run_original, verify

ModelT = TypeVar("ModelT", onnx.ModelProto, ir.Model)

#: Highest ONNX opset the installed onnx package knows (the checker and the function need it).
MAX_OPSET = onnx.defs.onnx_opset_version()


__all__ = ["Report", "RewriteError", "attach_function", "load", "main", "rewrite_model", "save", "verify"]


@dataclasses.dataclass
class Report:
    """What a rewrite found and did."""

    chains_found: dict[str, int] = dataclasses.field(default_factory=dict)
    fused: int = 0
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    function_attached: bool = False
    #: Per fused chain: location, form and the fused node's attributes.
    fused_chains: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: Filled by ``--verify``: backend used, per-output errors, pass/fail.
    verification: dict[str, Any] | None = None
    #: Every other op of the registry (fusion/rules/registry.py), per op type: what they count, chains found,
    #: fused, refused (location, reason) and the fused chains' attributes. Only ops with chains in the model are
    #: listed. (The key is the historical name: the decode-step ops were the first ops after the gated norm.)
    decode: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: What the model could gain outside the fusions, from what the rewrite saw (each a line of the summary; a
    #: fusion.hints.Hint where a caller may drop it by its topic).
    hints: list[str] = dataclasses.field(default_factory=list)
    #: ``int4_accuracy_level``: the level asked for and how many int4 weight products were set to it.
    accuracy_level: int | None = None
    accuracy_level_set: int = 0

    def refused_of(self, op_type: str) -> list[tuple[str, str]]:
        """Return the chains of ``op_type`` left unfused: (location, reason), in the graph's order."""
        if op_type == OP_TYPE:
            return self.refused
        return self.decode.get(op_type, {}).get("refused", [])

    @property
    def decode_fused(self) -> int:
        """How many decode-step chains were fused (all ops)."""
        return sum(op["fused"] for op in self.decode.values())

    def summary(self) -> str:
        """Return a few human-readable lines: chains per form, fused, refused with reasons, node counts."""
        total = sum(self.chains_found.values())
        forms = ", ".join(f"{form}: {count}" for form, count in sorted(self.chains_found.items())) or "none"
        lines = [
            f"gated group-RMSNorm chains found: {total} ({forms})",
            f"fused: {self.fused}, refused: {len(self.refused)}",
            f"nodes: {self.nodes_before} -> {self.nodes_after}",
        ]
        for op_type, op in self.decode.items():
            builder = ", ".join(f"{name} ({count})" for name, count in op.get("builder_fused", {}).items())
            if not op["found"]:
                lines.append(f"{op['counts']}: already fused by the builder as {builder}")
                continue
            lines.append(
                f"{op['counts']} found: {op['found']} (ai.mambafuse::{op_type}), fused: {op['fused']}, "
                f"refused: {len(op['refused'])}" + (f"; already fused by the builder as {builder}" if builder else "")
            )
            lines += [f"  refused {where}: {reason}" for where, reason in op["refused"]]
        if self.fused or self.decode_fused:
            lines.append(
                "model-local function: " + ("attached" if self.function_attached else "omitted (--no-function)")
            )
        lines += [f"  refused {where}: {reason}" for where, reason in self.refused]
        if self.verification is not None:
            lines.append(self.verification["summary"])
        if self.accuracy_level is not None:
            lines.append(
                f"int4 accuracy_level {self.accuracy_level} set on {self.accuracy_level_set} MatMulNBits"
                + (" (A rounded to int8 per block on the CPU)" if self.accuracy_level == INT8_ACTIVATIONS_LEVEL else "")
                + ("; verified against the original at the same level" if self.verification is not None else "")
            )
        lines += [f"hint: {hint}" for hint in self.hints]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        data = dataclasses.asdict(self)
        data["refused"] = [{"location": where, "reason": reason} for where, reason in self.refused]
        return data


# --- the rewrite ------------------------------------------------------------------------------------


def _onnx_opset(model: ir.Model) -> int:
    version = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if version is None:
        raise RewriteError("the model imports no ONNX opset")
    if not fused_function.MIN_OPSET <= version <= MAX_OPSET:
        raise RewriteError(
            f"ONNX opset {version} is not supported (supported: {fused_function.MIN_OPSET} to {MAX_OPSET})"
        )
    return version


def _node_count(model: ir.Model) -> int:
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


def rewrite_model(
    model: ModelT,
    *,
    function: bool = True,
    assume_equal_widths: bool = False,
    decode_steps: bool = True,
    opt_in: Sequence[str] = (),
    int4_accuracy_level: int | None = None,
) -> tuple[ModelT, Report]:
    """Return ``model`` with the chains of every registry op fused, and a Report.

    With ``decode_steps`` (the default) every op of the registry is fused (fusion/rules/registry.py: the gated
    norm, CausalConv1dUpdate and SelectiveStateUpdate, in rounds); ``decode_steps=False`` fuses the gated norm
    alone (where the graph proves its input's shape without the other ops: a transformers 5.25 decode export proves
    it only through the fused state update, so its norms stay unfused that way). ``opt_in`` names fusions of
    ``registry.OPT_IN_FUSIONS`` to run as well (``--opt-in``): right, but not faster everywhere the model runs (a
    ValueError names the choices for another name). ``int4_accuracy_level`` (``--int4-accuracy-level``) sets that
    ``accuracy_level`` on every 4-bit MatMulNBits (and DecodeMatMulNBits) after the fusions: 4 has ONNX Runtime's
    CPU kernel round A to int8 per block, 2-3x faster at a decode step and no longer the same numbers (the weights
    are not touched; docs/models.md).

    A ModelProto is left untouched (a new one is returned). An ``ir.Model`` is rewritten in place and
    returned (copying it would load lazily-read external weights). With ``function``, fused models
    carry the op's model-local function so that stock ONNX Runtime runs them. ``assume_equal_widths``
    (opt-in) fuses without the broadcast guard where the graph does not prove that y is as wide as the
    gate. Raises RewriteError for a model it cannot handle (unsupported opset), TypeError for a value
    that is not a model.
    """
    if not isinstance(model, (onnx.ModelProto, ir.Model)):
        hint = " (parse it first: onnx.load_from_string(data))" if isinstance(model, (bytes, bytearray)) else ""
        hint = " (wrap it: onnx.helper.make_model(graph))" if isinstance(model, onnx.GraphProto) else hint
        raise TypeError(f"rewrite_model takes an onnx.ModelProto or an onnx_ir.Model, not {type(model).__name__}{hint}")
    if isinstance(model, onnx.ModelProto):
        ir_model = ir.from_proto(model)
        _, report = rewrite_model(
            ir_model,
            function=function,
            assume_equal_widths=assume_equal_widths,
            decode_steps=decode_steps,
            opt_in=opt_in,
            int4_accuracy_level=int4_accuracy_level,
        )
        if report.fused == 0 and report.decode_fused == 0 and report.accuracy_level_set == 0:
            unchanged = onnx.ModelProto()
            unchanged.CopyFrom(model)
            return unchanged, report
        return ir.to_proto(ir_model), report

    opted = opt_in_fusions(opt_in)
    if int4_accuracy_level is not None and int4_accuracy_level not in ACCURACY_LEVELS:
        raise ValueError(f"int4_accuracy_level is {int4_accuracy_level}; MatMulNBits takes {list(ACCURACY_LEVELS)}")
    opset = _onnx_opset(model)
    report = Report(nodes_before=_node_count(model))
    if model.opset_imports.get(DOMAIN, fused_function.OPSET_VERSION) != fused_function.OPSET_VERSION:
        # A model saved by an ONNX Runtime session that had the library registered imports the domain at
        # the runtime's placeholder version (1000); the op has one version, 1.
        model.opset_imports[DOMAIN] = fused_function.OPSET_VERSION
    # The graph's interface as declared: the decode fusions write present states under the same names.
    declared_outputs = {v.name: (v.type, v.shape) for v in model.graph.outputs}
    # Shape inference lets the checks prove shapes; what it adds is rolled back at the end so that
    # the output differs from the input by the fusions only.
    with value_info_preserved(model):
        # ONNX's inference stops at ops it cannot type (bfloat16 Conv, Softplus at opset 18) and onnx-ir
        # then logs a traceback; the value_info the exporter wrote is still there, which is enough.
        inference_log = logging.getLogger("onnx_ir.passes.common.shape_inference")
        previous_level = inference_log.level
        inference_log.setLevel(logging.ERROR)
        try:
            ShapeInferencePass(strict_mode=False)(model)
        finally:
            inference_log.setLevel(previous_level)
        _check_existing_fused_nodes(model)
        fusions = registry.FUSIONS if decode_steps else tuple(f for f in registry.FUSIONS if f.op_type == OP_TYPE)
        fusions = (*fusions, *opted)
        logs, counts = _fuse_in_rounds(model, fusions, {"assume_equal_widths": assume_equal_widths})
        for fusion in fusions:
            _report_fusion(model, fusion, logs[fusion.name], counts[fusion.name], report)
    for output in model.graph.outputs:
        if output.name in declared_outputs:
            output.type, output.shape = declared_outputs[output.name]
    if int4_accuracy_level is not None:
        report.accuracy_level = int4_accuracy_level
        report.accuracy_level_set = set_int4_accuracy_level(model, int4_accuracy_level)
    if hint := float_activation_hint(model):
        report.hints.append(hint)
    report.hints += builder_op_hints(model, opted)
    if (report.fused or report.decode_fused) and function:
        attach_function(model, opset)
        report.function_attached = True
    report.nodes_after = _node_count(model)
    return model, report


#: The opt-in fusions of a builder's stateful ops, and what running them buys (benchmarks/RESULTS.md): a model that
#: still has such nodes after a rewrite without the opt-in gets a hint.
BUILDER_OP_GAINS = {
    "linear_attention_scan": "on CUDA a 2048-token prompt ~3x faster and a decode step ~5 % faster; on the CPU "
    "prompts and decode steps faster",
    "causal_conv_with_state": "on CUDA a 2048-token prompt ~10 % faster and a decode step ~1.5 % with the scan's; on "
    "the CPU prompts and decode steps faster",
}


def builder_op_hints(model: ir.Model, opted: Sequence[Fusion]) -> list[Hint]:
    """A hint for each opt-in fusion of ``BUILDER_OP_GAINS`` not in ``opted`` whose nodes are in ``model``."""
    hints = []
    for fusion in registry.OPT_IN_FUSIONS:
        gain = BUILDER_OP_GAINS.get(fusion.name)
        if gain is None or fusion in opted or not (left := len(fusion.find_anchors(model.graph))):
            continue
        providers = [name.upper() for name, names in registry.FOLDER_OPT_IN.items() if fusion.name in names]
        hints.append(
            Hint(
                f"{left} {fusion.counts} as the builder wrote them: --opt-in {fusion.name} runs them as "
                f"{DOMAIN}::{fusion.op_type} ({gain}; mambafuse genai does so on a folder for "
                f"{' or '.join(providers) or 'no provider'})",
                fusion.name,
            )
        )
    return hints


def _check_existing_fused_nodes(model: ir.Model) -> None:
    """Refuse fused nodes already in the model that break the op's type rule (docs/op.md: the all-float32 rule).

    When Y, Z and W are all float32 the output is float32 (holding values rounded to output_dtype); a
    graph that declares such a node's output half precision cannot load in ONNX Runtime with the library.
    """
    half = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN or node.op_type != OP_TYPE or len(node.inputs) < 3:
            continue
        output_dtype = node.attributes.get_int("output_dtype", 0)
        declared = node.outputs[0].dtype if node.outputs else None
        all_float = all(v is not None and v.dtype == ir.DataType.FLOAT for v in node.inputs[:3])
        if all_float and output_dtype in half and declared in half:
            raise RewriteError(
                f"fused node {location(node)!r}: Y, Z and W are float32, so its output is float32 (holding "
                f"values rounded to {ir.DataType(output_dtype).name.lower()}), but the graph declares it "
                f"{declared.name.lower()}; keep a Cast after the node (docs/op.md: the all-float32 output rule)"
            )


def _fuse_in_rounds(
    model: ir.Model, fusions: Sequence[Fusion], options: dict[str, Any]
) -> tuple[dict[str, FusionLog], dict[str, int]]:
    """Run ``fusions`` (registry order) in rounds until one fuses nothing or no chain is left; return each fusion's
    log and count, by its name.

    Rounds, because a chain may be proven only through ops fused after it in a round: a symbolic batch reaches the
    next layer through the previous layer's fused ops, and a transformers 5.25 decode export proves the gated
    norm's y only through the fused state update. An op that asks for it (``retry_with_symbolic_shapes``) is
    tried once more after ONNX Runtime's symbolic shape inference when it left chains refused (TorchScript
    exports lose dims through their shape arithmetic; ORT's inference often recovers them), once per rewrite.
    """
    logs = {fusion.name: FusionLog() for fusion in fusions}
    counts = dict.fromkeys(logs, 0)
    symbolic_tried = False

    def fuse(fusion: Fusion) -> int:
        return fusion.fuse(model, logs[fusion.name], **{name: options[name] for name in fusion.options})

    # Bounded like AllRulesSet: each round fuses at least one chain, and a model's layers are proven one round
    # apart at most; a rule that kept "fusing" a chain it left in place could not loop forever.
    in_rounds = [fusion for fusion in fusions if not fusion.after_rounds]
    for _ in range(registry.AllRulesSet.MAX_ROUNDS):
        progress = 0
        for fusion in in_rounds:
            fused = fuse(fusion)
            refused_left = any(not chain.fused for chain in logs[fusion.name].chains.values())
            if fusion.retry_with_symbolic_shapes and not symbolic_tried and refused_left:
                symbolic_tried = True
                if symbolic_shapes(model):
                    fused += fuse(fusion)
            counts[fusion.name] += fused
            progress += fused
        if not progress or not any(fusion.find_anchors(model.graph) for fusion in in_rounds):
            break
    # Once the rounds are done: a fusion that replaces nodes the others prove their chains' shapes through (the
    # weight MatMuls) runs last.
    for fusion in fusions:
        if fusion.after_rounds:
            counts[fusion.name] += fuse(fusion)
    return logs, counts


def _report_fusion(model: ir.Model, fusion: Fusion, log: FusionLog, fused: int, report: Report) -> None:
    """Fill ``report`` with what ``fusion`` did: its fused chains and, for every chain left, the reason.

    The gated norm's results are the report's top-level fields (per-form counts, fused, refused: its historical
    summary); every other op's go to ``report.decode[op_type]``, listed when the model has its chains (or layers a
    builder already runs as ORT's contrib op or ONNX's own, ``Fusion.builder_ops``: counted apart, not as found).
    """
    fused_chains = [{"location": r.location, "form": r.form, **r.attributes} for r in log.chains.values() if r.fused]
    refused, forms = [], [chain["form"] for chain in fused_chains]
    for anchor in fusion.find_anchors(model.graph):
        record = log.chains.get(anchor)
        reason = record.reason if record is not None and record.reason else fusion.explain(model, anchor)
        refused.append((record.location if record is not None else location(anchor), reason))
        forms.append(record.form if record is not None else fusion.form_of(anchor))
    if fusion.op_type == OP_TYPE:
        report.fused += fused
        report.fused_chains += fused_chains
        report.refused += refused
        for form in forms:
            report.chains_found[form] = report.chains_found.get(form, 0) + 1
        return
    builder = _builder_fused(model.graph, fusion)
    if not (fused or refused or builder):
        return
    entry = {
        "counts": fusion.counts,
        "found": fused + len(refused),
        "fused": fused,
        "refused": refused,
        "fused_chains": [{k: v for k, v in chain.items() if k != "form"} for chain in fused_chains],
        "builder_fused": builder,
    }
    earlier = report.decode.get(fusion.op_type)
    if earlier is not None:  # another fusion to the same op (an opt-in one): one entry for the op, both counted
        entry = {
            "counts": f"{earlier['counts']} and {fusion.counts}",
            "found": earlier["found"] + entry["found"],
            "fused": earlier["fused"] + fused,
            "refused": [*earlier["refused"], *refused],
            "fused_chains": [*earlier["fused_chains"], *entry["fused_chains"]],
            "builder_fused": {**earlier["builder_fused"], **builder},
        }
    report.decode[fusion.op_type] = entry


def opt_in_fusions(names: Sequence[str]) -> tuple[Fusion, ...]:
    """Return the fusions of ``registry.OPT_IN_FUSIONS`` that ``names`` names (each once, in the registry's
    order); a ValueError names the choices for any other name."""
    known = {fusion.name: fusion for fusion in registry.OPT_IN_FUSIONS}
    if isinstance(names, str):
        names = [names]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"no opt-in fusion named {', '.join(map(repr, unknown))} (choices: {', '.join(known)})")
    return tuple(fusion for fusion in registry.OPT_IN_FUSIONS if fusion.name in names)


def smallest_scan_state(model: ir.Model) -> int | None:
    """The fewest state elements (H·N·P, the past state's dims after the batch) of the model's LinearAttention nodes,
    from the declared shapes (a speed choice, not a proof); None where there is none or a dim is not a number."""
    sizes = []
    for node in model.graph.all_nodes():
        if node.op_type != "LinearAttention" or len(node.inputs) < 4 or node.inputs[3] is None:
            continue
        state = node.inputs[3]
        while state.shape is None and state.producer() is not None and state.producer().op_type == "Cast":
            state = state.producer().inputs[0]  # a 16-bit build widens genai's past state first
        shape = state.shape
        dims = list(shape)[1:] if shape is not None and len(shape) == 4 else []
        if len(dims) != 3 or not all(isinstance(d, int) for d in dims):
            return None
        sizes.append(dims[0] * dims[1] * dims[2])
    return min(sizes) if sizes else None


def provider_opt_in(model: ir.Model, provider: str, named: Sequence[str] = ()) -> tuple[tuple[str, ...], list[str]]:
    """Return the opt-in fusions measured faster on ``provider`` ("cpu", "cuda": ``registry.FOLDER_OPT_IN``'s; none
    for another) that ``model`` gets, and a note for each left out: the scan's where a layer's state has fewer than
    ``registry.SCAN_MIN_STATE`` elements, unless ``named`` (the ``--opt-in`` names) names it."""
    chosen = registry.FOLDER_OPT_IN.get(provider, ())
    notes = []
    if "linear_attention_scan" in chosen and "linear_attention_scan" not in named:
        smallest = smallest_scan_state(model)
        if smallest is not None and smallest < registry.SCAN_MIN_STATE:
            chosen = tuple(name for name in chosen if name != "linear_attention_scan")
            notes.append(
                f"LinearAttention kept: a layer's state has {smallest} elements, under the {registry.SCAN_MIN_STATE} "
                "from which MambaChunkScan is measured the faster (--opt-in linear_attention_scan runs it anyway)"
            )
    return chosen, notes


def drop_settled_hints(report: Report, provider: str, defaults: bool = True) -> None:
    """Drop the hints that running on ``provider`` settles: with ``defaults`` (its default opt-in fusions ran) their
    builder-op hints (taken, or kept with a note saying why), and off the CPU the int4 accuracy-level hint (the
    level is about the CPU's kernel; CUDA's ignores it)."""
    settled = set(registry.FOLDER_OPT_IN.get(provider, ()) if defaults else ())
    settled |= {CPU_INT4} if provider != "cpu" else set()
    report.hints = [hint for hint in report.hints if topic_of(hint) not in settled]


def attach_function(model: ir.Model, onnx_opset: int | None = None) -> None:
    """Add the model-local function of every ``ai.mambafuse`` op whose nodes ``model`` has, replacing older copies
    (the registry's ``attach_functions``)."""
    attach_functions(model, onnx_opset if onnx_opset is not None else _onnx_opset(model))


def _builder_fused(graph: ir.Graph, fusion: Fusion) -> dict[str, int]:
    """Return ``{"domain::type": count}`` of the builder's nodes that do ``fusion``'s step (``Fusion.builder_ops``;
    ONNX's own ops as ``ai.onnx::type``)."""
    counts: dict[str, int] = {}
    for domain, op_type, attributes in fusion.builder_ops:
        count = sum(
            1
            for node in ir.traversal.RecursiveGraphIterator(graph)
            if node.domain == domain
            and node.op_type == op_type
            and all(
                node.attributes.get(name) is not None and node.attributes[name].value == value
                for name, value in attributes.items()
            )
        )
        if count:
            counts[f"{domain or 'ai.onnx'}::{op_type}"] = count
    return counts


# --- command line -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
    """One command line built on this module's: its name, what it does to the model, and its output's suffix.

    ``transform(model, args)`` returns the model and a report with ``summary()``, ``to_dict()`` and a settable
    ``verification`` (``rewrite`` and ``fusion.optimize``'s ``optimize``).
    """

    name: str
    description: str
    suffix: str
    transform: Any
    add_arguments: Any = None


def _rewrite_transform(model: ir.Model, args: argparse.Namespace) -> tuple[ir.Model, Report]:
    return rewrite_model(
        model,
        function=not args.no_function,
        assume_equal_widths=args.assume_equal_widths,
        opt_in=args.opt_in,
        int4_accuracy_level=args.int4_accuracy_level,
    )


REWRITE = Command(
    name="rewrite",
    description="Fuse the Mamba-2 chains of a model (gated group-RMSNorm, conv and state updates) into "
    "ai.mambafuse ops.",
    suffix="fused",
    transform=_rewrite_transform,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, no usage block: bad arguments are reported like every other error.
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


_EPILOG = f"""\
inputs of --verify and --report:
{INPUTS_HELP}

exit status:
  0    fused and written (and, with --verify, verified)
  1    --verify ran and failed: the output is not kept (rerun without --verify to keep it)
  2    bad argument, bad model, or a check that cannot run (ONNX Runtime cannot load or feed
       the original); every argument is checked and the original run before anything is written
  130, 143   interrupted (SIGINT, SIGTERM): the output is complete or absent
  141  stdout closed by its reader (| head)

environment:
  {PROGRESS_ENV}=0 never draws the progress line on stderr, =1 always does (default: on a terminal)
"""


def _parser(prog: str = "python -m fusion.rewrite", command: Command = REWRITE) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description=command.description,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", type=Path, help="the ONNX model (never modified)")
    parser.add_argument(
        "output_path", type=Path, nargs="?", metavar="OUT", help=f"where to write (default: IN.{command.suffix}.onnx)"
    )
    parser.add_argument("-o", "--output", type=Path, help="where to write (the same as OUT)")
    if command.add_arguments is not None:
        command.add_arguments(parser)
    parser.add_argument("--no-function", action="store_true", help="omit the model-local function")
    parser.add_argument(
        "--assume-equal-widths",
        action="store_true",
        help="where the graph does not prove y's width equals the gate's (dynamo prefill exports), assume it: "
        "no broadcast guard (faster); a width-1 y is then rejected at run time instead of broadcast",
    )
    add_opt_in_argument(parser)
    add_provider_argument(parser)
    add_accuracy_level_argument(parser)
    parser.add_argument("--verify", action="store_true", help="run both models in ONNX Runtime and compare")
    parser.add_argument("--debug", action="store_true", help="explain every chain that was not fused")
    parser.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="bind a symbolic dimension of the generated inputs of --verify and --report (an error without one "
        "of them, or for a name that is no symbolic dim of the model); repeatable; defaults below",
    )
    parser.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="real model inputs for --verify and --report (arrays named by input; others are ignored, with a note)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    # Hook for fusion/report.py (dispatch and latency before/after): it adds its flag here.
    _add_report_arguments(parser)
    return parser


def add_opt_in_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--opt-in NAME`` (repeatable): fusions of ``registry.OPT_IN_FUSIONS`` to run too."""
    parser.add_argument(
        "--opt-in",
        action="append",
        default=[],
        metavar="NAME",
        choices=[fusion.name for fusion in registry.OPT_IN_FUSIONS],
        help="also run this fusion, which is right but not faster everywhere (repeatable; choices: %(choices)s). "
        "For mobius builds: linear_attention_scan runs LinearAttention as MambaChunkScan (on the CPU faster "
        "prompts and decode steps; on CUDA 3x faster prompts); causal_conv_with_state runs "
        "CausalConvWithState as CausalConv1d (faster prompts and decode steps). `mambafuse genai` "
        "runs both on a folder for the CPU or CUDA. decode_matmul / "
        "decode_matmul_nbits run weight MatMuls / 4-bit MatMulNBits as DecodeMatMul(NBits) (CUDA kernels; at "
        "batch 1 still slower than ONNX Runtime's own, docs/decode_matmul.md). docs/cli.md",
    )


def add_provider_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--provider NAME``: also run the opt-in fusions measured faster on that execution provider."""
    parser.add_argument(
        "--provider",
        type=str.lower,
        choices=sorted(registry.FOLDER_OPT_IN),
        metavar="NAME",
        help="the execution provider the model will run on (choices: %(choices)s): also run the opt-in fusions "
        "measured faster there, as mambafuse genai does for a folder: for both, linear_attention_scan (where a "
        f"layer's state has at least {registry.SCAN_MIN_STATE} elements) and causal_conv_with_state. docs/cli.md",
    )


def add_accuracy_level_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--int4-accuracy-level N``: set MatMulNBits' accuracy_level on every 4-bit weight product."""
    parser.add_argument(
        "--int4-accuracy-level",
        type=int,
        choices=ACCURACY_LEVELS,
        default=None,
        metavar="N",
        help="set accuracy_level N on every 4-bit MatMulNBits (weights untouched). 4 runs them on the CPU with A "
        "rounded to int8 per block: 2-3x faster at a decode step, not the same numbers (docs/models.md); "
        "CUDA ignores it",
    )


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--report`` and its options (the measurement is fusion/report.py's)."""
    group = parser.add_argument_group("before/after report (fusion.report)")
    group.add_argument(
        "--report", action="store_true", help="measure dispatches, latency and output error before vs after"
    )
    group.add_argument("--providers", help="comma-separated providers to measure (default CPUExecutionProvider)")
    group.add_argument("--runs", type=int, help="timed runs per model (default 200)")
    group.add_argument(
        "--report-no-library",
        action="store_true",
        help="measure without mambafuse's library: the fused nodes run through their model-local function",
    )
    group.add_argument("--report-json", metavar="OUT.json", help="also write the report as JSON")
    group.add_argument("--report-plot", metavar="OUT.png", help="also write a PNG (needs matplotlib)")


def _wants_report(args: argparse.Namespace) -> bool:
    return bool(args.report or args.report_json or args.report_plot)


def _check_option_use(args: argparse.Namespace) -> None:
    """Refuse options that would do nothing: ``--dim`` / ``--inputs`` without ``--verify`` or ``--report``, the
    report's options without ``--report``, ``--report-no-library`` with ``--no-function``."""
    wants_report = _wants_report(args)
    for option, given in (("--dim", args.dim), ("--inputs", args.inputs)):
        if given and not (args.verify or wants_report):
            raise RewriteError(
                f"{option} sets the inputs of --verify and --report, and neither is given: add one, or drop {option}"
            )
    for option, given in (
        ("--providers", args.providers is not None),
        ("--runs", args.runs is not None),
        ("--report-no-library", args.report_no_library),
    ):
        if given and not wants_report:
            raise RewriteError(f"{option} is an option of --report, which is not given: add --report, or drop {option}")
    if args.report_no_library and args.no_function:
        raise RewriteError(
            "--report-no-library with --no-function: without the function only the library runs the fused nodes"
        )


def _report_options(args: argparse.Namespace) -> argparse.Namespace:
    """Return the report's options (fusion.report's names) from the rewrite command line."""
    return argparse.Namespace(
        providers=args.providers or "CPUExecutionProvider",
        runs=200 if args.runs is None else args.runs,
        no_library=args.report_no_library,
        warmup=20,
        threads=1,
        dim=args.dim,
        optimization_level="all",
        json_path=args.report_json,
        plot=args.report_plot,
        quiet=args.json,
        inputs=args.inputs,
    )


def _check_report(args: argparse.Namespace) -> None:
    """Check the report's arguments against the input model (providers, dims, inputs) before any write."""
    if not _wants_report(args):
        return
    from fusion import report as before_after

    try:
        before_after.check_arguments(args.input, _report_options(args))
    except (ReportError, InputError) as error:
        raise RewriteError(f"--report: {error}") from None


def _run_report(args: argparse.Namespace, original: Path, fused: Path) -> None:
    """Measure and print the before/after report when ``--report`` asks for it."""
    if not _wants_report(args):
        return
    from fusion import report as before_after

    try:
        # The --inputs note was printed when the arguments were checked.
        before_after.run_from_args(original, fused, _report_options(args), print_fn=print, note_fn=lambda _: None)
    except (ReportError, InputError) as error:
        raise RewriteError(f"report: {error}") from None


def default_output(input_path: Path, suffix: str = "fused") -> Path:
    """Return IN.<suffix>.onnx beside IN (``model.onnx`` -> ``model.fused.onnx``)."""
    stem = input_path.name[: -len(".onnx")] if input_path.name.endswith(".onnx") else input_path.name
    return input_path.with_name(f"{stem}.{suffix}.onnx")


def main(
    argv: Sequence[str] | None = None, *, prog: str = "python -m fusion.rewrite", command: Command = REWRITE
) -> int:
    """Run the command line; return the exit status (0 ok, 1 verification failed, 2 error, 130/143 signal,
    141 stdout closed by its reader).

    ``prog`` is how errors name the command (``mambafuse rewrite`` from the console command).
    """
    args = _parser(prog, command).parse_args(argv)
    args.prog = prog
    try:
        with interruptible():
            return _run(args, command)
    except BrokenPipeError:  # `mambafuse rewrite … | head`: the reader left; the output is complete
        return stdout_closed()
    except Interrupted as interrupted:
        print(f"{prog}: interrupted ({interrupted}); no output was written or it is complete", file=sys.stderr)
        return 128 + interrupted.signal_number
    except Exception as error:
        return _report_error(prog, error, args.debug)


def _output_argument(args: argparse.Namespace) -> tuple[str, str]:
    """Return how the user named the output (``-o``, ``OUT``, or not at all) and what to change to name another."""
    if args.output is not None:
        return "-o", "choose another -o"
    if args.output_path is not None:
        return "OUT", "choose another OUT (the second argument)"
    return "the default output", "name another output (OUT or -o)"


def _run(args: argparse.Namespace, command: Command = REWRITE) -> int:
    if args.output is not None and args.output_path is not None and args.output != args.output_path:
        raise RewriteError(f"two outputs given ({args.output_path} and -o {args.output}): name one")
    # Before the default output is derived from it: "." or a folder has no model name to derive one from.
    check_input(args.input)
    _check_option_use(args)
    output = args.output or args.output_path or default_output(args.input, command.suffix)
    named_by, choose = _output_argument(args)
    if not output.parent.is_dir():
        raise RewriteError(f"{output.parent}: output directory does not exist")
    if output.is_dir():
        example = output / default_output(args.input, command.suffix).name
        raise RewriteError(f"{output}: is a directory; {named_by} names the output file (e.g. {example})")
    prog = getattr(args, "prog", f"mambafuse {command.name}")
    # One status line on a terminal (nothing in a log) while loading, fusing, writing and verifying.
    with progress(f"mambafuse {command.name}") as bar:
        bar.step("loading and checking the model")
        model = load(args.input)
        check_output(args.input, model, output, choose=choose)
        # Every argument is checked, and the original run for --verify, before anything is written.
        dims, inputs, notes = ({}, None, [])
        if args.verify or _wants_report(args):
            dims, inputs, notes = prepare_inputs(args.input, args.dim, args.inputs)
        for note in notes:
            bar.close()  # erase the status line: the note stays on its own line
            print(f"{prog}: note: {note}", file=sys.stderr)
        _check_report_paths(args)
        _check_report(args)
        original_run = None
        if args.verify:
            bar.step("verifying: running the original model")
            original_run = run_original(
                args.input, dims, inputs, int4_accuracy_level=getattr(args, "int4_accuracy_level", None)
            )
        if args.provider is not None:
            chosen, provider_notes = provider_opt_in(model, args.provider, args.opt_in)
            args.opt_in = list(dict.fromkeys((*chosen, *args.opt_in)))
            bar.close()
            print(
                f"{prog}: note: --provider {args.provider}: opted in "
                + (", ".join(chosen) if chosen else "none of the provider's fusions"),
                file=sys.stderr,
            )
            for note in provider_notes:
                print(f"{prog}: note: {note}", file=sys.stderr)
        bar.step("fusing" if command is REWRITE else f"{command.name}: running its passes")
        fused_model, report = command.transform(model, args)
        if args.provider is not None:
            drop_settled_hints(getattr(report, "rewrite", report), args.provider)
        written = [output]
        if writes_own_data(fused_model, output):
            written.append(output.parent / data_file_name(output))
        bar.step(f"writing {output.name}")
        stale = save(fused_model, output)
        if args.verify:
            bar.step("verifying: running the fused model")
            try:
                report.verification = verify(
                    args.input, output, inputs=inputs, original_run=original_run, role=command.suffix
                )
            except RewriteError as error:
                raise RewriteError(f"{error}; {_remove(written)}") from None
            except BaseException:  # interrupted, or an internal error: an unverified output is not kept
                _remove(written)
                raise
    kept = report.verification is None or report.verification["ok"]
    last_line = f"wrote {output}" if kept else f"verification failed: {_remove(written)}"
    if args.json:
        removed = {} if kept else {"removed": [str(path) for path in written]}  # not kept: not verified
        if stale:
            removed["removed_stale_data"] = [str(output.with_name(path.name)) for path in stale]
        print(json.dumps({"output": str(output) if kept else None, **removed, **report.to_dict()}, indent=2))
    else:
        print(report.summary())
        for path in stale:
            stale_name = output.with_name(path.name)
            print(f"removed {stale_name}: the replaced output's data file, which {output.name} does not use")
        print(last_line)
    if args.debug:
        print(_debug_text(getattr(report, "rewrite", report)), file=sys.stderr)
    if not kept:
        return 1
    sys.stdout.flush()
    _run_report(args, args.input, output)
    return 0


def _remove(paths: list[Path]) -> str:
    """Delete the files a rewrite wrote (the output was not verified); return what was done, for the user."""
    for path in paths:
        path.unlink(missing_ok=True)
    names = " and ".join(str(path) for path in paths)
    return f"removed {names} (not kept unless verified; rerun without --verify to keep an unverified output)"


def _check_report_paths(args: argparse.Namespace) -> None:
    """Refuse --report-json / --report-plot paths whose directory is missing, before any work."""
    for option, value in (("--report-json", args.report_json), ("--report-plot", args.report_plot)):
        if value and not Path(value).resolve().parent.is_dir():
            raise RewriteError(f"{option}: directory {str(Path(value).parent)!r} does not exist")


def _report_error(prog: str, error: Exception, debug: bool) -> int:
    """Print one line for ``error`` (a traceback only with --debug, for unexpected errors); return 2."""
    if isinstance(error, (RewriteError, ReportError, InputError)):
        print(f"{prog}: error: {error}", file=sys.stderr)
    elif isinstance(error, (OSError, MemoryError)):
        print(f"{prog}: error: {first_line(error)}", file=sys.stderr)
    elif debug:
        raise error
    else:
        print(f"{prog}: internal error (rerun with --debug for details): {first_line(error)}", file=sys.stderr)
    return 2


def _debug_text(report: Report) -> str:
    """Return --debug's lines: every chain not fused with its reason, and every fused chain's attributes (the
    gated norm's, then each decode-step op's)."""
    refused = [f"  {where}: {reason}" for where, reason in report.refused]
    fused = [
        "  {location} [form {form}]: epsilon={epsilon:g} group_size={group_size} "
        "norm_dtype={norm_dtype} output_dtype={output_dtype} gated_dtype={gated_dtype}".format(**chain)
        for chain in report.fused_chains
    ]
    for op_type, op in report.decode.items():
        refused += [f"  {where} [{op_type}]: {reason}" for where, reason in op["refused"]]
        for chain in op["fused_chains"]:
            attributes = " ".join(f"{name}={value}" for name, value in chain.items() if name != "location")
            fused.append(f"  {chain['location']} [{op_type}]: {attributes}".rstrip())
    lines = ["debug: chains not fused and why:", *(refused or ["  (none)"])]
    lines += ["debug: fused chains:", *(fused or ["  (none)"])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
