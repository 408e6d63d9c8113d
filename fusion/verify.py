"""``--verify``: run the original and the fused model in ONNX Runtime on the same inputs and compare.

Two checks: every fused node against the float64 reference on its real inputs, at the op's accuracy
budget; and the model outputs, fused against original. Before anything is written, ``prepare_inputs``
validates ``--dim`` and ``--inputs`` against the original model and ``run_original`` runs it on the inputs
(so a model ONNX Runtime cannot run, or inputs it rejects, never leave an output behind); ``verify`` then
runs the fused model and compares.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from fusion.inputs import (
    InputError,
    RejectedRun,
    describe,
    first_run,
    holds_bfloat16,
    ignored_note,
    load_inputs,
    parse_dims,
    resolve_dims,
    split_provided,
)
from fusion.model_io import RewriteError, first_line
from fusion.reference import DOMAIN, OP_TYPE, budget_report


def prepare_inputs(
    original: Path, dim_items: list[str], inputs_file: str | None
) -> tuple[dict[str, int], dict[str, np.ndarray] | None, list[str]]:
    """Return the parsed ``--dim`` bindings and ``--inputs`` arrays, checked against ``original``, and notes
    for the user (the arrays ignored because they name no input of the model).

    Raises RewriteError naming the argument: a malformed ``--dim`` or one for a dim the model does not
    have (fusion/inputs.py), an unreadable or pickled ``.npz``, or an array whose rank or element type is not
    its input's.
    """
    model = onnx.load(str(original), load_external_data=False)
    try:
        dims = parse_dims(dim_items)
        arrays, ignored = split_provided(model, load_inputs(inputs_file) if inputs_file else None)
        resolve_dims(model, dims, arrays, strict=True)
    except InputError as error:
        raise RewriteError(str(error)) from None
    notes = [note] if (note := ignored_note(ignored, model)) else []
    if arrays is None:
        return dims, None, notes
    graph = model.graph
    declared = {v.name: v for v in graph.input}
    for name, array in arrays.items():
        value = declared[name]
        tensor_type = value.type.tensor_type
        if tensor_type.HasField("shape") and len(tensor_type.shape.dim) != array.ndim:
            raise RewriteError(
                f"--inputs: {name!r} has rank {array.ndim}; the model's input has rank {len(tensor_type.shape.dim)}"
            )
        if tensor_type.elem_type and tensor_type.elem_type != onnx.TensorProto.BFLOAT16:
            want = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
            # Floats are converted to the input's float type (fp16 inputs saved as fp32); other kinds are not.
            if (array.dtype.kind == "f") != (want.kind == "f"):
                raise RewriteError(f"--inputs: {name!r} is {array.dtype}; the model's input is {want}")
    return dims, arrays, notes


#: The op's attributes that name an element type (absent: the op's default).
_DTYPE_ATTRIBUTES = ("norm_dtype", "output_dtype", "gated_dtype")


def _holds_unfunctioned_fused_nodes(model: onnx.ModelProto) -> bool:
    """Return whether ``model`` has GatedGroupRMSNorm nodes but no function body for them."""
    has_nodes = any(n.domain == DOMAIN and n.op_type == OP_TYPE for n in model.graph.node)
    has_function = any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions)
    return has_nodes and not has_function


def _at_accuracy_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """``model`` (its external data still external) with accuracy_level ``level`` on every 4-bit weight product, as
    ``--int4-accuracy-level`` sets it (``fusion.int4.set_int4_accuracy_level``)."""
    import onnx_ir as ir

    from fusion.int4 import set_int4_accuracy_level

    leveled = ir.from_proto(model)
    set_int4_accuracy_level(leveled, level)
    return ir.to_proto(leveled)


def _external_data_options(original: Path) -> Any:
    """Quiet session options for a model given as bytes whose external data lie beside ``original``."""
    options = _quiet_options()
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(Path(original).resolve().parent)
    )
    return options


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
#: Half types whose presence makes a model "compute in half precision" (below).
_HALF_TYPES = {onnx.TensorProto.FLOAT16: np.dtype(np.float16), onnx.TensorProto.BFLOAT16: np.dtype(np.float16)}


def _compute_rtol(model_path: Path) -> float:
    """Return the END_TO_END_RTOL every output of the model at ``model_path`` gets at least.

    A model that computes in half precision (a half graph input, output or weight) gets float16's bound for its
    float32 outputs too (the recurrent states of fp16 exports): ONNX Runtime's CPU runs the graph's float16 ops
    in float32 and drops the roundings between them, which the fused kernels keep (they compute what the graph
    means, as a provider with float16 kernels does), so such an output carries one float16 rounding's
    difference (measured: a float32 state 1.45e-3 of its largest magnitude apart, one float16 ulp of dt * B * x).
    """
    proto = onnx.load(str(model_path), load_external_data=False)
    types = {tensor.data_type for tensor in proto.graph.initializer}
    types |= {value.type.tensor_type.elem_type for value in (*proto.graph.input, *proto.graph.output)}
    halves = [_HALF_TYPES[t] for t in types if t in _HALF_TYPES]
    return max((END_TO_END_RTOL[dtype] for dtype in halves), default=0.0)


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Return the element type of every value that ONNX shape inference can type in ``model``, or, where
    inference fails on the model (graphs saved by ONNX Runtime can hold value_info that its contrib ops'
    inference contradicts), every value the model declares a type for."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except onnx.shape_inference.InferenceError:
        inferred = model
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

    probe = onnx.load(str(fused), load_external_data=False)
    nodes = [n for n in probe.graph.node if n.domain == DOMAIN and n.op_type in _NODE_CHECKS]
    if not nodes:
        return []
    # The fused node's inputs are the original's values, or new ones (a broadcast guard's Expand).
    types = {**_value_types(probe), **_value_types(onnx.load(str(original), load_external_data=False))}
    results: list[dict[str, Any]] = []
    exposed: list[tuple[onnx.NodeProto, list[str]]] = []
    existing = {o.name for o in probe.graph.output}
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        names = [*node.input, *node.output]
        if node.op_type == OP_TYPE:
            names = [*node.input, node.output[0]]
            elem_types = [types.get(n) for n in node.input] + [attrs.get("output_dtype", types.get(node.input[0]))]
        else:
            elem_types = [types.get(n) if n else onnx.TensorProto.FLOAT for n in names]
        if None in elem_types or onnx.TensorProto.BFLOAT16 in elem_types:
            results.append({"node": node.name, "checked": False, "detail": "types unknown or bfloat16 (not on CPU)"})
            continue
        for name, elem_type in zip(names, elem_types, strict=True):
            if name and name not in existing:
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
        wanted = sorted({name for _, names in exposed for name in names if name})
        values = dict(zip(wanted, session.run(wanted, feeds), strict=True))
    finally:
        os.unlink(probe_path)
    for node, names in exposed:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        arrays = [np.asarray(values[name]) if name else None for name in names]
        within, message = _NODE_CHECKS[node.op_type](arrays, attrs)
        results.append({"node": node.name, "checked": True, "within_budget": within, "detail": message})
    return results


def _check_gated_norm(arrays: list[np.ndarray | None], attrs: dict[str, Any]) -> tuple[bool, str]:
    from fusion.reference import onnx_type_to_dtype, reference_for_budget

    y, z, w, out = arrays
    dtypes = {name: onnx_type_to_dtype(attrs[name]) if attrs.get(name) else None for name in _DTYPE_ATTRIBUTES}
    reference = reference_for_budget(
        y, z, w, epsilon=float(attrs["epsilon"]), group_size=int(attrs["group_size"]), **dtypes
    )
    return budget_report(out, **reference)


def _check_conv_update(arrays: list[np.ndarray | None], attrs: dict[str, Any]) -> tuple[bool, str]:
    reference = importlib.import_module("fusion.reference.causal_conv1d_update")
    *inputs, y, present = arrays
    x, conv_state, weight, bias = [*inputs, None, None, None, None][:4]
    activation = attrs.get("activation", b"silu")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    return reference.budget_report(y, present, x, conv_state, weight, bias, activation=activation)


def _check_state_update(arrays: list[np.ndarray | None], attrs: dict[str, Any]) -> tuple[bool, str]:
    reference = importlib.import_module("fusion.reference.selective_state_update")
    *inputs, out, present = arrays
    state, x, dt, dt_bias, A, B, C, D = [*inputs, *[None] * 8][:8]
    return reference.budget_report(
        out, present, state, x, dt, dt_bias, A, B, C, D, dt_softplus=int(attrs.get("dt_softplus", 1))
    )


def _check_chunk_scan(arrays: list[np.ndarray | None], attrs: dict[str, Any]) -> tuple[bool, str]:
    reference = importlib.import_module("fusion.reference.mamba_chunk_scan")
    *inputs, out, final_state = arrays
    x, dt, dt_bias, A, B, C, D, initial_state = [*inputs, *[None] * 8][:8]
    return reference.budget_report(
        out,
        final_state,
        x,
        dt,
        dt_bias,
        A,
        B,
        C,
        D,
        initial_state,
        dt_softplus=int(attrs.get("dt_softplus", 1)),
        dt_min=float(attrs.get("dt_min", 0.0)),
        dt_max=float(attrs.get("dt_max", float("inf"))),
        state_layout=int(attrs.get("state_layout", 0)),
    )


def _check_prompt_conv(arrays: list[np.ndarray | None], attrs: dict[str, Any]) -> tuple[bool, str]:
    reference = importlib.import_module("fusion.reference.causal_conv1d")
    *inputs, y, final_state = arrays
    x, weight, bias, initial_state = [*inputs, None, None, None, None][:4]
    activation = attrs.get("activation", b"silu")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    return reference.budget_report(
        y,
        final_state,
        x,
        weight,
        bias,
        initial_state,
        activation=activation,
        channels_last=int(attrs.get("channels_last", 1)),
        state_width=int(attrs["state_width"]),
        round_once=int(attrs.get("round_once", 0)),
    )


def _check_weight_product(arrays: list[np.ndarray | None], attrs: dict[str, Any]) -> tuple[bool, str]:
    reference = importlib.import_module("fusion.reference.decode_matmul")
    *inputs, y = arrays
    a, b = inputs[0], inputs[1]
    if len(inputs) > 2:  # DecodeMatMulNBits: the weight from its blocks, scales and zero points
        zero_points = inputs[3] if len(inputs) > 3 else None
        b = reference.dequantize(
            b, inputs[2], zero_points, k=int(attrs["K"]), n=int(attrs["N"]), block_size=int(attrs["block_size"])
        )
    outside, detail = reference.check_within_budget(y, a, b)
    return outside == 0, (f"{outside} outputs outside the budget; " if outside else "") + detail


def _check_squared_relu(arrays: list[np.ndarray | None], attrs: dict[str, Any]) -> tuple[bool, str]:
    reference = importlib.import_module("fusion.reference.squared_relu")
    x, y = arrays
    differ, detail = reference.count_differences(y, x)
    return differ == 0, (f"{differ} outputs differ from the once-rounded square; " if differ else "") + detail


#: Per fused op type: how verify checks one node's real inputs and outputs against the op's reference budget.
_NODE_CHECKS = {
    OP_TYPE: _check_gated_norm,
    "CausalConv1dUpdate": _check_conv_update,
    "SelectiveStateUpdate": _check_state_update,
    "MambaChunkScan": _check_chunk_scan,
    "CausalConv1d": _check_prompt_conv,
    "DecodeMatMul": _check_weight_product,
    "DecodeMatMulNBits": _check_weight_product,
    "SquaredRelu": _check_squared_relu,
}


@dataclass
class OriginalRun:
    """The original model's run that ``verify`` compares the fused model with (``run_original``)."""

    feeds: dict[str, np.ndarray]
    output_names: list[str]
    expected: list[np.ndarray]
    #: The symbolic dims the generated inputs were made with (``name: size``).
    dims: dict[str, int]
    use_library: bool
    backend: str
    #: How the sequence length of a prefill graph was chosen (``fusion.inputs.prefill_note``), or None.
    dims_note: str | None = None


def run_original(
    original: Path,
    dims: dict[str, int] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    *,
    int4_accuracy_level: int | None = None,
) -> OriginalRun:
    """Run the original model in ONNX Runtime (CPU) on the verification inputs; return its outputs.
    ``int4_accuracy_level``: run it with that accuracy_level on its 4-bit MatMulNBits, as the command set it in the
    output (``--int4-accuracy-level``), so that the check measures the fusions and not the asked-for precision.

    Raises RewriteError when the check cannot run: a model ONNX Runtime does not load (bfloat16 on the
    CPU), inputs that cannot be made (too large, bfloat16), or inputs the model rejects (with the dims used).
    """
    import contrib_ops

    try:
        contrib_ops.library_path()
        use_library, backend = True, "mambafuse library"
    except contrib_ops.LibraryNotFoundError:
        use_library, backend = False, "model-local function (library not built)"
    original_proto = onnx.load(str(original), load_external_data=False)
    # A model saved by an ONNX Runtime session already holds fused nodes, without their function: only
    # the library runs those.
    original_needs_library = _holds_unfunctioned_fused_nodes(original_proto)
    if original_needs_library and not use_library:
        raise RewriteError(
            "--verify: the input already holds GatedGroupRMSNorm nodes without their function; build the "
            "mambafuse library (make build) to run it"
        )
    try:
        if int4_accuracy_level is None:
            reference = contrib_ops.session(
                original, session_options=_quiet_options(), use_library=original_needs_library
            )
        else:
            reference = contrib_ops.session(
                _at_accuracy_level(original_proto, int4_accuracy_level),
                session_options=_external_data_options(original),
                use_library=original_needs_library,
            )
    except Exception as error:
        message = first_line(error)
        if "bfloat16" in message or holds_bfloat16(original_proto):
            raise RewriteError(
                "--verify: the original model does not load in ONNX Runtime's CPU provider, which has no "
                f"bfloat16 kernels for some of its ops; verify bfloat16 models on CUDA (ONNX Runtime: {message})"
            ) from None
        raise RewriteError(f"--verify: the original model does not load in ONNX Runtime: {message}") from None
    try:
        inputs, _ = split_provided(original_proto, inputs)
    except InputError as error:
        raise RewriteError(f"--verify: {error}") from None
    # A prefill graph runs at several chunks by default, at one where the original rejects that (fusion/inputs.py).
    try:
        accepted = first_run(original_proto, dims, inputs, lambda feeds: reference.run(None, feeds))
    except InputError as error:
        raise RewriteError(f"--verify: {error}") from None
    except RejectedRun as rejected:
        raise RewriteError(
            f"--verify: the original model rejects its inputs ({first_line(rejected.error)}); dims used: "
            f"{describe(rejected.dims)}; bind its symbolic dims with --dim NAME=SIZE or give real inputs with --inputs "
            "FILE.npz"
        ) from None
    names = [meta.name for meta in reference.get_outputs()]
    expected = [np.asarray(e) for e in accepted.result]
    return OriginalRun(accepted.feeds, names, expected, accepted.dims, use_library, backend, accepted.note)


def verify(
    original: Path,
    fused: Path,
    dims: dict[str, int] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    *,
    original_run: OriginalRun | None = None,
    role: str = "fused",
) -> dict[str, Any]:
    """Run both models in ONNX Runtime (CPU) on the same inputs; return what agreed and what did not.

    Two checks: every fused node against the float64 reference on its real inputs, at the op's accuracy
    budget (docs/op.md); and the model outputs, fused against original, within END_TO_END_RTOL of each
    output's largest magnitude (non-float outputs must be identical). Uses the mambafuse library when it
    is built, else the fused model's function (stock ORT). Inputs: ``inputs`` where given, the rest
    generated with symbolic dims bound by ``dims`` (fusion.inputs). ``original_run`` is the original's
    run from ``run_original`` when the caller made it already (before writing the fused model).
    Raises RewriteError when the fused model does not load or run; its message calls it "the {role} model"
    (``optimize`` passes "optimized": its model holds more than mambafuse's fusions).
    """
    import contrib_ops

    run = original_run if original_run is not None else run_original(original, dims, inputs)
    feeds, use_library, backend = run.feeds, run.use_library, run.backend
    try:
        candidate = contrib_ops.session(fused, session_options=_quiet_options(), use_library=use_library)
        actual = candidate.run(None, feeds)
        nodes = _check_fused_nodes(original, fused, feeds, use_library)
    except Exception as error:
        raise RewriteError(f"--verify: the {role} model failed in ONNX Runtime: {first_line(error)}") from None
    outputs = []
    ok = all(n.get("within_budget", True) for n in nodes)
    model_rtol = _compute_rtol(Path(original))
    for name, want, got in zip(run.output_names, run.expected, actual, strict=True):
        want, got = np.asarray(want), np.asarray(got)
        with np.errstate(invalid="ignore"):
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64)) if want.size else np.zeros(0)
        max_abs = float(np.nanmax(diff)) if diff.size else 0.0
        if want.dtype in END_TO_END_RTOL and want.shape == got.shape:
            scale = float(np.nanmax(np.abs(want.astype(np.float64)))) if want.size else 0.0
            rtol = max(END_TO_END_RTOL[want.dtype], model_rtol)
            limit = rtol * max(scale, 1e-30)
            same_nan = np.array_equal(np.isnan(want), np.isnan(got))
            within = same_nan and max_abs <= limit
            why = " (a half-precision model)" if rtol > END_TO_END_RTOL[want.dtype] else ""
            message = f"limit {limit:.3g} ({rtol:g} x max |original|{why})"
        else:
            within = want.shape == got.shape and np.array_equal(want, got)
            message = "identical" if within else "differs"
        outputs.append({"name": name, "within_budget": within, "max_abs_error": max_abs, "detail": message})
        ok &= within
    checked = [n for n in nodes if n["checked"]]
    lines = [f"verify ({backend}): {'PASS' if ok else 'FAIL'}"]
    given = sorted(set(inputs or {}) & set(feeds))
    if len(given) == len(feeds):
        lines.append(f"  inputs: all {len(feeds)} given")
    else:
        source = f"{len(given)} of {len(feeds)} given, the rest generated" if given else "generated"
        note = f" ({run.dims_note})" if run.dims_note else ""
        lines.append(f"  inputs: {source}; dims {describe(run.dims)}{note}")
    failing = [n for n in checked if not n["within_budget"]]
    unchecked = [n for n in nodes if not n["checked"]]
    lines.append(
        f"  fused nodes vs float64 reference on their real inputs: {len(checked) - len(failing)} of "
        f"{len(checked)} within their op's accuracy budget"
        + (f" ({len(unchecked)} not checkable: {unchecked[0]['detail']})" if unchecked else "")
    )
    lines += [f"    {n['node']}: {n['detail']}" for n in failing]
    lines += [f"  output {o['name']}: max abs error {o['max_abs_error']:.3g}; {o['detail']}" for o in outputs]
    return {
        "backend": backend,
        "ok": ok,
        "dims": dict(run.dims),
        "dims_note": run.dims_note,
        "nodes": nodes,
        "outputs": outputs,
        "summary": "\n".join(lines),
    }
