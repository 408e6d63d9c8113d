"""Shapes from ONNX Runtime's symbolic shape inference, where ONNX's own inference left dims unknown.

TorchScript exports lose dims through their shape arithmetic; ORT's tool (onnxruntime.tools.symbolic_shape_infer)
often recovers them. Its results are declared shapes, as good as an exporter's value_info: the rules read them
as hints and prove what they fuse from the graph (fusion/shapes/dims.py).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from typing import Any

import onnx
import onnx_ir as ir

from fusion._graph import all_values


def symbolic_shapes(model: ir.Model) -> int:
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
        proto = ir.to_proto(model)
        constants_as_tensors(proto.graph)
        # Where it cannot infer every shape it saves the model (weights as external data) into the working
        # directory before it raises (onnxruntime 1.32's tools/symbolic_shape_infer.py): run it in a scratch one.
        with tempfile.TemporaryDirectory(prefix="mambafuse-shapes-") as scratch, contextlib.chdir(scratch):
            inferred = SymbolicShapeInference.infer_shapes(proto, auto_merge=True)
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


_CONSTANT_LISTS = {
    "value_int": (onnx.TensorProto.INT64, False),
    "value_ints": (onnx.TensorProto.INT64, True),
    "value_float": (onnx.TensorProto.FLOAT, False),
    "value_floats": (onnx.TensorProto.FLOAT, True),
}


def constants_as_tensors(graph: onnx.GraphProto) -> None:
    """Rewrite, in place, each Constant of ``graph`` (and its subgraphs) that holds ``value_int``,
    ``value_float`` or their lists as the same value in a ``value`` tensor.

    ONNX Runtime's symbolic shape inference reads only ``value`` and raises on the others (onnxruntime 1.32's
    tools/symbolic_shape_infer.py; reported upstream as microsoft/onnxruntime#22422, closed unfixed), which an
    inlined mambafuse function leaves behind (its group size and epsilon come from the node's attributes):
    without this, a model whose functions someone inlined got no symbolic shapes and its gated norms could not
    be fused again. Only the copy handed to the tool is changed.
    """
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
            attribute = node.attribute[0]
            if attribute.name in _CONSTANT_LISTS:
                elem_type, is_list = _CONSTANT_LISTS[attribute.name]
                value = onnx.helper.get_attribute_value(attribute)
                tensor = onnx.helper.make_tensor(
                    "value", elem_type, [len(value)] if is_list else [], value if is_list else [value]
                )
                del node.attribute[:]
                node.attribute.append(onnx.helper.make_attribute("value", tensor))
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs):
                constants_as_tensors(subgraph)
