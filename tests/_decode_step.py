"""Helpers shared by the decode-step kernel tests: a one-node model of an ai.mambafuse op, run in ORT."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort

import contrib_ops
from fusion.reference._bounds import SUPPORTED_TYPES, bfloat16

DOMAIN = "ai.mambafuse"
IR_VERSION = 10  # loads in every onnxruntime the library supports
_TYPE_OF = {dtype: elem for elem, dtype in SUPPORTED_TYPES.items()}
FLOAT, FLOAT16, BFLOAT16 = np.dtype(np.float32), np.dtype(np.float16), bfloat16
DTYPES = (FLOAT, FLOAT16, BFLOAT16)
DTYPE_IDS = {FLOAT: "f32", FLOAT16: "f16", BFLOAT16: "bf16"}


def one_node_model(
    op_type: str,
    inputs: Sequence[tuple[str, np.ndarray | None]],
    outputs: Sequence[tuple[str, np.dtype]],
    *,
    dynamic: bool = False,
    **attrs: object,
) -> onnx.ModelProto:
    """Return a model running one ``op_type`` node on ``inputs`` (None: an empty optional input).

    bfloat16 values enter as float32 through a Cast (exact for bf16-representable values) and leave through
    one, since numpy feeds have no bfloat16. ``dynamic`` declares every dim unknown.
    """
    nodes, graph_inputs, node_inputs = [], [], []
    for name, value in inputs:
        if value is None:
            node_inputs.append("")
            continue
        elem = _TYPE_OF[value.dtype]
        shape = [None] * value.ndim if dynamic else list(value.shape)
        if elem == onnx.TensorProto.BFLOAT16:
            graph_inputs.append(oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))
            nodes.append(oh.make_node("Cast", [name], [f"{name}_bf16"], to=elem))
            node_inputs.append(f"{name}_bf16")
        else:
            graph_inputs.append(oh.make_tensor_value_info(name, elem, shape))
            node_inputs.append(name)
    node_outputs, graph_outputs = [], []
    for name, dtype in outputs:
        elem = _TYPE_OF[np.dtype(dtype)]
        if elem == onnx.TensorProto.BFLOAT16:
            node_outputs.append(f"{name}_bf16")
            nodes.append(oh.make_node("Cast", [f"{name}_bf16"], [name], to=onnx.TensorProto.FLOAT))
            elem = onnx.TensorProto.FLOAT
        else:
            node_outputs.append(name)
        graph_outputs.append(oh.make_tensor_value_info(name, elem, None))
    nodes.insert(0, oh.make_node(op_type, node_inputs, node_outputs, domain=DOMAIN, **attrs))
    graph = oh.make_graph(nodes, op_type, graph_inputs, graph_outputs)
    return oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)], ir_version=IR_VERSION
    )


def session(model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return contrib_ops.session(model, session_options=options, use_library=True)


def run(
    op_type: str,
    inputs: Sequence[tuple[str, np.ndarray | None]],
    outputs: Sequence[tuple[str, np.dtype]],
    *,
    threads: int = 1,
    **attrs: object,
) -> list[np.ndarray]:
    """Return the op's outputs on ``inputs``, each in its declared dtype (bfloat16 converted back, exactly)."""
    sess = session(one_node_model(op_type, inputs, outputs, **attrs), threads)
    feeds = {name: (v.astype(np.float32) if v.dtype == bfloat16 else v) for name, v in inputs if v is not None}
    results = sess.run(None, feeds)
    return [r.astype(np.dtype(dtype)) for r, (_, dtype) in zip(results, outputs, strict=True)]
