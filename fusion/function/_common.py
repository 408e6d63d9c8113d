"""What every op's model-local function shares: the constants and attribute references of their bodies,
the FunctionProto around a body, and putting a function into a model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx
from onnx import helper

from fusion.reference._common import DOMAIN

#: The ``ai.mambafuse`` domain's opset version, which a model using any of its ops imports.
OPSET_VERSION = 1


def int64s(name: str, values: list[int]) -> onnx.NodeProto:
    """Return a Constant node whose output ``name`` is the 1-D int64 tensor ``values``."""
    value = helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
    return helper.make_node("Constant", [], [name], value=value)


def int64_scalar(name: str, value: int) -> onnx.NodeProto:
    """Return a Constant node whose output ``name`` is the int64 scalar ``value``."""
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [], [value]))


def node_with_refs(
    op_type: str, inputs: list[str], outputs: list[str], refs: Mapping[str, tuple[str, int]]
) -> onnx.NodeProto:
    """Return a node whose attributes refer to the function's: ``refs`` maps the node's attribute name to
    (the function attribute's name, its AttributeProto type), e.g. ``{"to": ("norm_dtype", INT)}``."""
    node = helper.make_node(op_type, inputs, outputs)
    for name, (function_attribute, attr_type) in refs.items():
        attr = onnx.AttributeProto()
        attr.name, attr.ref_attr_name, attr.type = name, function_attribute, attr_type
        node.attribute.append(attr)
    return node


def require_opset(op_type: str, onnx_opset: int, min_opset: int) -> None:
    """Raise ValueError if a body written for ONNX opset ``min_opset`` and later cannot serve ``onnx_opset``."""
    if onnx_opset < min_opset:
        raise ValueError(f"{op_type}'s function needs ONNX opset >= {min_opset}, got {onnx_opset}")


def op_function(
    op_type: str,
    *,
    inputs: Sequence[str],
    outputs: Sequence[str],
    nodes: list[onnx.NodeProto],
    opset_imports: Mapping[str, int],
    attributes: Sequence[str] = (),
    optional_attributes: Mapping[str, object],
    contract: str | None = None,
) -> onnx.FunctionProto:
    """Return the FunctionProto of ``ai.mambafuse::op_type`` with this body.

    ``attributes`` are those every call node sets; ``optional_attributes`` those the function declares with
    their defaults. ``opset_imports`` maps each domain the body uses to its version. ``contract`` (a doc's
    path) goes into the function's doc string.
    """
    described = f"{op_type} ({contract})" if contract else op_type
    return helper.make_function(
        DOMAIN,
        op_type,
        inputs=list(inputs),
        outputs=list(outputs),
        nodes=nodes,
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in opset_imports.items()],
        attributes=list(attributes),
        attribute_protos=[helper.make_attribute(name, value) for name, value in optional_attributes.items()],
        doc_string=f"{described} in stock ONNX ops; ONNX Runtime inlines it when the mambafuse library is not "
        "registered.",
    )


def model_onnx_opset(model: onnx.ModelProto) -> int:
    """Return the ONNX opset version ``model`` imports, or raise ValueError."""
    onnx_opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if onnx_opset is None:
        raise ValueError("the model imports no ONNX opset")
    return onnx_opset


def put_function(model: onnx.ModelProto, function: onnx.FunctionProto) -> None:
    """Add ``function`` to ``model`` in place, replacing a function of the same domain and name."""
    kept = [f for f in model.functions if (f.domain, f.name) != (function.domain, function.name)]
    del model.functions[:]
    model.functions.extend([*kept, function])


def import_domain(model: onnx.ModelProto, domain: str, version: int) -> None:
    """Make ``model`` import ``domain`` (at ``version``) if it does not import it yet."""
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))


def _layout_branch(name: str, source: str, output: str, perm: Sequence[int] | None) -> onnx.GraphProto:
    """Return an If branch whose one output ``output`` is ``source`` (an outer value), transposed by ``perm`` or (None)
    as it is; its type is left to inference (the branch serves every type)."""
    if perm is not None:
        body = helper.make_node("Transpose", [source], [output], perm=list(perm))
    else:
        body = helper.make_node("Identity", [source], [output])
    return helper.make_graph([body], name, [], [helper.make_value_info(output, onnx.TypeProto())])


def in_layout(source: str, output: str, condition: str, perm: Sequence[int] = (0, 2, 1)) -> onnx.NodeProto:
    """Return an If node: ``output`` is ``source`` transposed by ``perm`` where ``condition``, else ``source``."""
    return helper.make_node(
        "If",
        [condition],
        [output],
        then_branch=_layout_branch(f"{output}_transposed", source, f"{output}_then", perm),
        else_branch=_layout_branch(f"{output}_as_is", source, f"{output}_else", None),
    )
