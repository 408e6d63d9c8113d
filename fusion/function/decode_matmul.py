"""The model-local functions of ``ai.mambafuse::DecodeMatMul`` and ``DecodeMatMulNBits``: the node each replaced.

``DecodeMatMul(A, B)`` is ``MatMul(A, B)``; ``DecodeMatMulNBits(A, B, scales, zero_points)`` is ONNX Runtime's
``com.microsoft::MatMulNBits`` with the same inputs and attributes. The ops change how a product runs (the
library's CUDA kernels pick a GEMV for a decode step's few rows, a GEMM for a prompt's), never what it computes,
so without the library, or on an execution provider it has no kernel for, ONNX Runtime inlines the body and runs
the very node the model had, with its own optimizations (MLAS' prepacked weights, ORT's MatMulNBits kernels).

``zero_points`` is optional in both: a node without it leaves the body's fourth input empty, as MatMulNBits takes
it. MatMulNBits needs ONNX Runtime's ``com.microsoft`` domain, which the model already imported where it had
the node.
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import node_with_refs, op_function, require_opset
from fusion.reference.decode_matmul import NBITS_OP_TYPE, OP_TYPE

#: Lowest ONNX opset of the bodies (MatMul on bfloat16: opset 13).
MIN_OPSET = 13
#: ONNX Runtime's contrib domain and version, which DecodeMatMulNBits' body imports.
CONTRIB_DOMAIN = "com.microsoft"
CONTRIB_OPSET = 1

INPUTS = ("A", "B")
NBITS_INPUTS = ("A", "B", "scales", "zero_points")
OUTPUTS = ("Y",)
#: DecodeMatMulNBits' attributes every node sets (MatMulNBits' required ones) ...
NBITS_ATTRIBUTES = ("K", "N", "bits", "block_size")
#: ... and the optional one, with MatMulNBits' default.
NBITS_OPTIONAL_ATTRIBUTES = {"accuracy_level": 0}


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of DecodeMatMul for a model whose ONNX opset is ``onnx_opset``."""
    require_opset(OP_TYPE, onnx_opset, MIN_OPSET)
    return op_function(
        OP_TYPE,
        inputs=INPUTS,
        outputs=OUTPUTS,
        nodes=[helper.make_node("MatMul", list(INPUTS), list(OUTPUTS))],
        opset_imports={"": onnx_opset},
        optional_attributes={},
        contract="docs/decode_matmul.md",
    )


def make_nbits_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of DecodeMatMulNBits for a model whose ONNX opset is ``onnx_opset``."""
    require_opset(NBITS_OP_TYPE, onnx_opset, MIN_OPSET)
    attribute = onnx.AttributeProto
    refs = {name: (name, attribute.INT) for name in (*NBITS_ATTRIBUTES, *NBITS_OPTIONAL_ATTRIBUTES)}
    body = node_with_refs("MatMulNBits", list(NBITS_INPUTS), list(OUTPUTS), refs)
    body.domain = CONTRIB_DOMAIN
    return op_function(
        NBITS_OP_TYPE,
        inputs=NBITS_INPUTS,
        outputs=OUTPUTS,
        nodes=[body],
        opset_imports={"": onnx_opset, CONTRIB_DOMAIN: CONTRIB_OPSET},
        attributes=NBITS_ATTRIBUTES,
        optional_attributes=NBITS_OPTIONAL_ATTRIBUTES,
        contract="docs/decode_matmul.md",
    )


__all__ = ["CONTRIB_DOMAIN", "CONTRIB_OPSET", "MIN_OPSET", "make_function", "make_nbits_function"]
