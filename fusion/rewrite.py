"""Rewrite an ONNX model: fuse every gated group-RMSNorm chain into ``ai.mambafuse::GatedGroupRMSNorm``.

Python::

    fused, report = rewrite_model(onnx.load("model.onnx"))
    print(report.summary())

Command line::

    python -m fusion.rewrite model.onnx [-o model.fused.onnx] [--no-function] [--verify] [--debug] [--json]

load → shape inference (so checks can prove shapes) → fusion rules → model-local function → save.
The input file is never written; the output is written atomically next to its final name. Weights in
external data files stay there: they are not read into memory, and the output either points at the
same data file (output in the input's directory) or gets its own ``<output>.data`` copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from fusion import function as fused_function
from fusion.reference import DOMAIN, budget_report
from fusion.report import ReportError, load_inputs, parse_dims
from fusion.rules._graph import all_values, value_info_preserved
from fusion.rules.gated_group_rms_norm import (
    FusionLog,
    coarse_form,
    explain_unfused,
    find_chain_anchors,
    fuse_gated_group_rms_norm,
    location,
)

ModelT = TypeVar("ModelT", onnx.ModelProto, ir.Model)

#: Highest ONNX opset the installed onnx package knows (the checker and the function need it).
MAX_OPSET = onnx.defs.onnx_opset_version()


class RewriteError(Exception):
    """A model or argument the rewriter cannot work with; the message says what to do."""


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

    def summary(self) -> str:
        """Return a few human-readable lines: chains per form, fused, refused with reasons, node counts."""
        total = sum(self.chains_found.values())
        forms = ", ".join(f"{form}: {count}" for form, count in sorted(self.chains_found.items())) or "none"
        lines = [
            f"gated group-RMSNorm chains found: {total} ({forms})",
            f"fused: {self.fused}, refused: {len(self.refused)}",
            f"nodes: {self.nodes_before} -> {self.nodes_after}",
        ]
        if self.fused:
            lines.append(
                "model-local function: " + ("attached" if self.function_attached else "omitted (--no-function)")
            )
        lines += [f"  refused {where}: {reason}" for where, reason in self.refused]
        if self.verification is not None:
            lines.append(self.verification["summary"])
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


def rewrite_model(model: ModelT, *, function: bool = True) -> tuple[ModelT, Report]:
    """Return ``model`` with its gated group-RMSNorm chains fused, and a Report.

    A ModelProto is left untouched (a new one is returned). An ``ir.Model`` is rewritten in place and
    returned (copying it would load lazily-read external weights). With ``function``, fused models
    carry the op's model-local function so that stock ONNX Runtime runs them. Raises RewriteError for
    a model it cannot handle (unsupported opset).
    """
    if isinstance(model, onnx.ModelProto):
        ir_model = ir.from_proto(model)
        _, report = rewrite_model(ir_model, function=function)
        if report.fused == 0:
            unchanged = onnx.ModelProto()
            unchanged.CopyFrom(model)
            return unchanged, report
        return ir.to_proto(ir_model), report

    opset = _onnx_opset(model)
    report = Report(nodes_before=_node_count(model))
    if model.opset_imports.get(DOMAIN, fused_function.OPSET_VERSION) != fused_function.OPSET_VERSION:
        # A model saved by an ONNX Runtime session that had the library registered imports the domain at
        # the runtime's placeholder version (1000); the op has one version, 1.
        model.opset_imports[DOMAIN] = fused_function.OPSET_VERSION
    log = FusionLog()
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
        report.fused = fuse_gated_group_rms_norm(model, log)
        if any(not chain.fused for chain in log.chains.values()) and _symbolic_shapes(model):
            # ONNX's inference could not prove some chain's shapes (TorchScript exports lose dims through
            # their shape arithmetic); ONNX Runtime's symbolic inference often can. Second pass, same log.
            report.fused += fuse_gated_group_rms_norm(model, log)
        _explain_refusals(model, log, report)
    if report.fused and function:
        attach_function(model, opset)
        report.function_attached = True
    report.nodes_after = _node_count(model)
    return model, report


def _symbolic_shapes(model: ir.Model) -> int:
    """Fill unknown dims of ``model``'s values from ONNX Runtime's symbolic shape inference.

    Returns how many values got a more complete shape; 0 when the tool is missing or gives up on this
    graph (it raises on some ops it does not know). Weights stay where they are: the proto it reads
    keeps external tensors external.
    """
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:
        return 0
    tool_log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    previous_level = tool_log.level
    tool_log.setLevel(logging.ERROR)  # it warns about every guess it makes
    try:
        inferred = SymbolicShapeInference.infer_shapes(ir.to_proto(model), auto_merge=True)
    except Exception:
        return 0
    finally:
        tool_log.setLevel(previous_level)
    if inferred is None:
        return 0
    by_name = {value.name: value for value in all_values(model) if value.name}

    def informative(dims: list[Any]) -> int:
        # ints and real names count; None and ONNX's generated "unk__N" names do not
        return sum(1 for d in dims if isinstance(d, int) or (isinstance(d, str) and not d.startswith("unk__")))

    updated = 0
    for info in inferred.graph.value_info:
        value = by_name.get(info.name)
        tensor_type = info.type.tensor_type
        if value is None or not info.type.HasField("tensor_type") or not tensor_type.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]
        known = None if value.shape is None else [d if isinstance(d, int) else d.value for d in value.shape.dims]
        if known is not None and (len(known) != len(dims) or informative(known) >= informative(dims)):
            continue
        if value.dtype is None and tensor_type.elem_type:
            value.dtype = ir.DataType(tensor_type.elem_type)
        value.shape = ir.Shape(dims)
        updated += 1
    return updated


def _explain_refusals(model: ir.Model, log: FusionLog, report: Report) -> None:
    """Fill the report's per-form chain counts, fused chains and refusals (with reasons)."""
    for record in log.chains.values():
        if record.fused:
            report.chains_found[record.form] = report.chains_found.get(record.form, 0) + 1
            report.fused_chains.append({"location": record.location, "form": record.form, **record.attributes})
    for anchor in find_chain_anchors(model.graph):
        record = log.chains.get(anchor)
        form = record.form if record is not None else coarse_form(anchor)
        reason = record.reason if record is not None and record.reason else explain_unfused(model, anchor)
        report.chains_found[form] = report.chains_found.get(form, 0) + 1
        report.refused.append((record.location if record is not None else location(anchor), reason))


def attach_function(model: ir.Model, onnx_opset: int | None = None) -> None:
    """Add the GatedGroupRMSNorm model-local function to ``model`` (replacing an older copy)."""
    opset = onnx_opset if onnx_opset is not None else _onnx_opset(model)
    function = ir.serde.deserialize_function(fused_function.make_function(opset))
    model.functions[function.identifier()] = function
    model.opset_imports.setdefault(DOMAIN, fused_function.OPSET_VERSION)


# --- files ------------------------------------------------------------------------------------------


def load(path: Path) -> ir.Model:
    """Return the model at ``path`` with its external weights left on disk; RewriteError if unusable."""
    if not path.exists():
        raise RewriteError(f"{path}: no such file")
    if path.is_dir():
        raise RewriteError(f"{path}: is a directory, not an ONNX model")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # protobuf raises several types for garbage and truncated files
        reason = _first_line(error)
        raise RewriteError(f"{path}: not a readable ONNX model (truncated or not ONNX): {reason}") from None
    if not proto.HasField("graph") or len(proto.graph.node) == 0:
        raise RewriteError(f"{path}: not an ONNX model with a graph (empty, truncated or not ONNX)")
    model = ir.serde.deserialize_model(proto)
    ir.external_data.set_base_dir(model.graph, path.resolve().parent)
    for tensor in _external_tensors(model):
        if not Path(tensor.path).is_file():
            raise RewriteError(f"{path}: external data file {tensor.location!r} is missing")
    try:
        # From the path, so that external data resolves beside the model (and > 2 GiB models work).
        onnx.checker.check_model(str(path))
    except Exception as error:
        raise RewriteError(f"{path}: invalid ONNX model: {_first_line(error)}") from None
    _onnx_opset(model)
    return model


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _external_tensors(model: ir.Model) -> list[ir.ExternalTensor]:
    return [
        value.const_value
        for graph in model.graphs()
        for value in graph.initializers.values()
        if isinstance(value.const_value, ir.ExternalTensor)
    ]


def save(model: ir.Model, output: Path) -> None:
    """Write ``model`` to ``output`` atomically, keeping external weights external.

    In the directory of the original data files the output refers to them (no copy); elsewhere it
    gets its own ``<output>.data``. Either way all files are written in a temporary directory beside
    ``output`` and moved into place, data before model.
    """
    output = output.resolve()
    external = _external_tensors(model)
    same_dir = all(Path(t.base_dir).resolve() == output.parent for t in external)
    data_name = output.name + ".data"
    if external and not same_dir:
        for tensor in external:
            if Path(tensor.path).resolve() == output.parent / data_name:
                raise RewriteError(f"{output}: its data file {data_name} is the input's weights; choose another -o")
    scratch = Path(tempfile.mkdtemp(prefix=".mambafuse-", dir=output.parent))
    try:
        if external and not same_dir:
            ir.save(model, scratch / output.name, external_data=data_name)
            os.replace(scratch / data_name, output.parent / data_name)
        else:
            ir.save(model, scratch / output.name)
        os.replace(scratch / output.name, output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --- verification -----------------------------------------------------------------------------------


def _quiet_options() -> Any:
    """Session options that keep ONNX Runtime's warnings (constant folding, fp16 casts) off the terminal."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # errors reach the user through the exception, once
    return options


#: --verify's tolerance on whole-model outputs, relative to each output's largest magnitude. The fused op
#: is checked against its own budget node by node (below); the model outputs only have to agree with the
#: original to this looser bound, because the unfused chain as ONNX Runtime runs it is not exact (its
#: Sigmoid, fp16 Casts it drops on the CPU) and the layers after a chain carry the difference on.
END_TO_END_RTOL = {np.dtype(np.float32): 1e-3, np.dtype(np.float16): 2e-2}


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Return the element type of every value that ONNX shape inference can type in ``model``."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    types.update({init.name: init.data_type for init in model.graph.initializer})
    return types


def _check_fused_nodes(
    original: Path, fused: Path, feeds: dict[str, np.ndarray], use_library: bool
) -> list[dict[str, Any]]:
    """Run every fused node on the model's real intermediate values; compare it with the float64 reference.

    The fused model is run once more with each fused node's inputs and output exposed as graph outputs
    (a probe copy written beside it, so relative external-data paths still resolve, then deleted).
    """
    import contrib_ops
    from fusion.reference import gated_group_rms_norm, onnx_type_to_dtype

    probe = onnx.load(str(fused), load_external_data=False)
    nodes = [n for n in probe.graph.node if n.domain == DOMAIN and n.op_type == "GatedGroupRMSNorm"]
    if not nodes:
        return []
    types = _value_types(onnx.load(str(original), load_external_data=False))
    results: list[dict[str, Any]] = []
    exposed: list[tuple[onnx.NodeProto, list[str]]] = []
    existing = {o.name for o in probe.graph.output}
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        y_type = types.get(node.input[0])
        names = [*node.input, node.output[0]]
        elem_types = [types.get(n) for n in node.input] + [attrs.get("output_dtype", y_type)]
        if None in elem_types or onnx.TensorProto.BFLOAT16 in elem_types:
            results.append({"node": node.name, "checked": False, "detail": "types unknown or bfloat16 (not on CPU)"})
            continue
        for name, elem_type in zip(names, elem_types, strict=True):
            if name not in existing:
                # A value listed both in value_info and as a graph output confuses ONNX Runtime's shape
                # inference: move an existing entry (type and shape) to the outputs instead.
                known = next((v for v in probe.graph.value_info if v.name == name), None)
                if known is not None:
                    probe.graph.value_info.remove(known)
                    probe.graph.output.append(known)
                else:
                    probe.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
                existing.add(name)
        exposed.append((node, names))
    if not exposed:
        return results
    handle, probe_path = tempfile.mkstemp(prefix=".verify-", suffix=".onnx", dir=fused.parent)
    os.close(handle)
    try:
        onnx.save(probe, probe_path)
        session = contrib_ops.session(probe_path, session_options=_quiet_options(), use_library=use_library)
        wanted = sorted({name for _, names in exposed for name in names})
        values = dict(zip(wanted, session.run(wanted, feeds), strict=True))
    finally:
        os.unlink(probe_path)
    for node, (y, z, w, out) in exposed:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        expected, normed = gated_group_rms_norm(
            values[y],
            values[z],
            values[w],
            epsilon=float(attrs["epsilon"]),
            group_size=int(attrs["group_size"]),
            norm_dtype=onnx_type_to_dtype(attrs["norm_dtype"]) if "norm_dtype" in attrs else None,
            output_dtype=onnx_type_to_dtype(attrs["output_dtype"]) if "output_dtype" in attrs else None,
            compute_dtype=np.float64,
            return_normed=True,
        )
        within, message = budget_report(np.asarray(values[out]), expected, normed=normed, weight=values[w])
        results.append({"node": node.name, "checked": True, "within_budget": within, "detail": message})
    return results


def verify(
    original: Path,
    fused: Path,
    dims: dict[str, int] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Run both models in ONNX Runtime (CPU) on the same inputs; return what agreed and what did not.

    Two checks: every fused node against the float64 reference on its real inputs, at the op's accuracy
    budget (DESIGN.md §1); and the model outputs, fused against original, within END_TO_END_RTOL of each
    output's largest magnitude (non-float outputs must be identical). Uses the mambafuse library when it
    is built, else the fused model's function (stock ORT). Inputs: ``inputs`` where given, the rest
    generated with symbolic dims bound by ``dims`` (fusion.report.make_inputs).
    """
    import contrib_ops
    from fusion.report import make_inputs

    try:
        contrib_ops.library_path()
        use_library, backend = True, "mambafuse library"
    except contrib_ops.LibraryNotFoundError:
        use_library, backend = False, "model-local function (library not built)"
    try:
        reference = contrib_ops.session(original, session_options=_quiet_options(), use_library=False)
    except Exception as error:
        message = _first_line(error)
        if "bfloat16" in message:
            raise RewriteError(
                "--verify: the original model does not load in ONNX Runtime's CPU provider, which has no "
                "bfloat16 kernels for some of its ops; verify bfloat16 models on CUDA"
            ) from None
        raise RewriteError(f"--verify: the original model does not load in ONNX Runtime: {message}") from None
    feeds = make_inputs(onnx.load(str(original), load_external_data=False), dims, provided=inputs)
    try:
        expected = reference.run(None, feeds)
    except Exception as error:
        raise RewriteError(
            f"--verify: the original model rejects its inputs ({_first_line(error)}); bind its "
            "symbolic dims with --dim NAME=SIZE or give real inputs with --inputs FILE.npz"
        ) from None
    try:
        candidate = contrib_ops.session(fused, session_options=_quiet_options(), use_library=use_library)
        actual = candidate.run(None, feeds)
        nodes = _check_fused_nodes(original, fused, feeds, use_library)
    except Exception as error:
        raise RewriteError(f"--verify: the fused model failed in ONNX Runtime: {_first_line(error)}") from None
    outputs = []
    ok = all(n.get("within_budget", True) for n in nodes)
    for meta, want, got in zip(reference.get_outputs(), expected, actual, strict=True):
        want, got = np.asarray(want), np.asarray(got)
        with np.errstate(invalid="ignore"):
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64)) if want.size else np.zeros(0)
        max_abs = float(np.nanmax(diff)) if diff.size else 0.0
        if want.dtype in END_TO_END_RTOL and want.shape == got.shape:
            scale = float(np.nanmax(np.abs(want.astype(np.float64)))) if want.size else 0.0
            limit = END_TO_END_RTOL[want.dtype] * max(scale, 1e-30)
            same_nan = np.array_equal(np.isnan(want), np.isnan(got))
            within = same_nan and max_abs <= limit
            message = f"limit {limit:.3g} ({END_TO_END_RTOL[want.dtype]:g} x max |original|)"
        else:
            within = want.shape == got.shape and np.array_equal(want, got)
            message = "identical" if within else "differs"
        outputs.append({"name": meta.name, "within_budget": within, "max_abs_error": max_abs, "detail": message})
        ok &= within
    checked = [n for n in nodes if n["checked"]]
    lines = [f"verify ({backend}): {'PASS' if ok else 'FAIL'}"]
    failing = [n for n in checked if not n["within_budget"]]
    unchecked = [n for n in nodes if not n["checked"]]
    lines.append(
        f"  fused nodes vs float64 reference on their real inputs: {len(checked) - len(failing)} of "
        f"{len(checked)} within the op's accuracy budget"
        + (f" ({len(unchecked)} not checkable: {unchecked[0]['detail']})" if unchecked else "")
    )
    lines += [f"    {n['node']}: {n['detail']}" for n in failing]
    lines += [f"  output {o['name']}: max abs error {o['max_abs_error']:.3g}; {o['detail']}" for o in outputs]
    return {"backend": backend, "ok": ok, "nodes": nodes, "outputs": outputs, "summary": "\n".join(lines)}


# --- command line -----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, no usage block: bad arguments are reported like every other error.
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m fusion.rewrite",
        description="Fuse the gated group-RMSNorm chains of a Mamba-2 model into ai.mambafuse::GatedGroupRMSNorm.",
    )
    parser.add_argument("input", type=Path, help="the ONNX model to rewrite (never modified)")
    parser.add_argument("-o", "--output", type=Path, help="where to write (default: IN.fused.onnx beside IN)")
    parser.add_argument("--no-function", action="store_true", help="omit the model-local function")
    parser.add_argument("--verify", action="store_true", help="run both models in ONNX Runtime and compare")
    parser.add_argument("--debug", action="store_true", help="explain every chain that was not fused")
    parser.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="bind a symbolic dimension of the generated inputs (--verify, --report)",
    )
    parser.add_argument(
        "--inputs", metavar="FILE.npz", help="real model inputs for --verify and --report (arrays named by input)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    # Hook for fusion/report.py (dispatch and latency before/after): it adds its flag here.
    _add_report_arguments(parser)
    return parser


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--report`` and its options (the measurement is fusion/report.py's)."""
    group = parser.add_argument_group("before/after report (fusion.report)")
    group.add_argument(
        "--report", action="store_true", help="measure dispatches, latency and output error before vs after"
    )
    group.add_argument("--providers", default="CPUExecutionProvider", help="comma-separated providers to measure")
    group.add_argument("--runs", type=int, default=200, help="timed runs per model (default 200)")
    group.add_argument("--report-json", metavar="OUT.json", help="also write the report as JSON")
    group.add_argument("--report-plot", metavar="OUT.png", help="also write a PNG (needs matplotlib)")


def _inputs(args: argparse.Namespace) -> dict[str, np.ndarray] | None:
    """Return the arrays of ``--inputs``, if given."""
    return load_inputs(args.inputs) if args.inputs else None


def _run_report(args: argparse.Namespace, original: Path, fused: Path) -> None:
    """Measure and print the before/after report when ``--report`` asks for it."""
    if not (args.report or args.report_json or args.report_plot):
        return
    from fusion import report as before_after

    options = argparse.Namespace(
        providers=args.providers,
        runs=args.runs,
        warmup=20,
        threads=1,
        dim=args.dim,
        optimization_level="all",
        json_path=args.report_json,
        plot=args.report_plot,
        quiet=args.json,
        inputs=args.inputs,
    )
    try:
        before_after.run_from_args(original, fused, options, print_fn=print)
    except before_after.ReportError as error:
        raise RewriteError(f"report: {error}") from None


def default_output(input_path: Path) -> Path:
    """Return IN.fused.onnx beside IN (``model.onnx`` -> ``model.fused.onnx``)."""
    stem = input_path.name[: -len(".onnx")] if input_path.name.endswith(".onnx") else input_path.name
    return input_path.with_name(f"{stem}.fused.onnx")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 1 verification failed, 2 error)."""
    args = _parser().parse_args(argv)
    prog = "python -m fusion.rewrite"
    try:
        output = args.output if args.output is not None else default_output(args.input)
        if output.exists() and args.input.exists() and output.resolve() == args.input.resolve():
            raise RewriteError(f"{output}: refusing to overwrite the input model; choose another -o")
        if not output.parent.is_dir():
            raise RewriteError(f"{output.parent}: output directory does not exist")
        model = load(args.input)
        fused_model, report = rewrite_model(model, function=not args.no_function)
        save(fused_model, output)
        if args.verify:
            report.verification = verify(args.input, output, parse_dims(args.dim), _inputs(args))
    except Exception as error:
        return _report_error(prog, error, args.debug)
    if args.json:
        print(json.dumps({"output": str(output), **report.to_dict()}, indent=2))
    else:
        print(report.summary())
        print(f"wrote {output}")
    if args.debug:
        print(_debug_text(report), file=sys.stderr)
    if report.verification is not None and not report.verification["ok"]:
        return 1
    try:
        sys.stdout.flush()
        _run_report(args, args.input, output)
    except Exception as error:
        return _report_error(prog, error, args.debug)
    return 0


def _report_error(prog: str, error: Exception, debug: bool) -> int:
    """Print one line for ``error`` (a traceback only with --debug, for unexpected errors); return 2."""
    if isinstance(error, (RewriteError, ReportError)):
        print(f"{prog}: error: {error}", file=sys.stderr)
    elif isinstance(error, (OSError, MemoryError)):
        print(f"{prog}: error: {_first_line(error)}", file=sys.stderr)
    elif debug:
        raise error
    else:
        print(f"{prog}: internal error (rerun with --debug for details): {_first_line(error)}", file=sys.stderr)
    return 2


def _debug_text(report: Report) -> str:
    lines = ["debug: chains not fused and why:"]
    lines += [f"  {where}: {reason}" for where, reason in report.refused] or ["  (none)"]
    lines.append("debug: fused chains:")
    lines += [
        "  {location} [form {form}]: epsilon={epsilon:g} group_size={group_size} "
        "norm_dtype={norm_dtype} output_dtype={output_dtype}".format(**chain)
        for chain in report.fused_chains
    ] or ["  (none)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
