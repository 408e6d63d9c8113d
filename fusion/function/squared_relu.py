"""The model-local function of ``ai.mambafuse::SquaredRelu``: ``Mul(Relu(X), Relu(X))``.

The stock ops give the op's value (docs/squared_relu.md): ONNX's ``Mul`` of two T values rounds their exact product
once, and ``Relu`` is exact. So without the library, or on an execution provider it has no kernel for, ONNX Runtime
inlines the body and computes what the model's own ``Relu`` and square did (ONNX Runtime's ``Relu`` keeps NaN on the
CPU and CUDA providers, as the op does).
"""

from __future__ import annotations

import onnx
from onnx import helper

from fusion.function._common import op_function, require_opset
from fusion.reference.squared_relu import OP_TYPE

#: Lowest ONNX opset of the body (Relu on bfloat16: opset 14).
MIN_OPSET = 14

INPUTS = ("X",)
OUTPUTS = ("Y",)


def make_function(onnx_opset: int) -> onnx.FunctionProto:
    """Return the FunctionProto of SquaredRelu for a model whose ONNX opset is ``onnx_opset``."""
    require_opset(OP_TYPE, onnx_opset, MIN_OPSET)
    return op_function(
        OP_TYPE,
        inputs=INPUTS,
        outputs=OUTPUTS,
        nodes=[helper.make_node("Relu", ["X"], ["R"]), helper.make_node("Mul", ["R", "R"], ["Y"])],
        opset_imports={"": onnx_opset},
        optional_attributes={},
        contract="docs/squared_relu.md",
    )


__all__ = ["MIN_OPSET", "make_function"]
