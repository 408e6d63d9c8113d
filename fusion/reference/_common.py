"""What every op's reference shares: the ops' domain and types, the sigmoid they compute, and their
``onnx.reference`` implementations."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx.reference.op_run import OpRun

DOMAIN = "ai.mambafuse"

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: ONNX TensorProto element types the ops accept, and their numpy dtypes.
SUPPORTED_TYPES: dict[int, np.dtype] = {
    onnx.TensorProto.FLOAT: np.dtype(np.float32),
    onnx.TensorProto.FLOAT16: np.dtype(np.float16),
    onnx.TensorProto.BFLOAT16: bfloat16,
}
#: Stored mantissa bits and the smallest normal exponent of each supported type: its ulp at any magnitude.
MANTISSA_BITS = {np.dtype(np.float32): 23, np.dtype(np.float16): 10, bfloat16: 7}
MIN_EXPONENT = {np.dtype(np.float32): -126, np.dtype(np.float16): -14, bfloat16: -126}


def sigmoid(v: np.ndarray) -> np.ndarray:
    """Return 1 / (1 + exp(-v)) in v's dtype, as 1 / (1 + e) or e / (1 + e) with e = exp(-|v|), which never
    overflows."""
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1 / (1 + e), e / (1 + e)).astype(v.dtype)


def as_arrays(*values: Any) -> tuple[Any, ...]:
    """Return ``values`` as numpy arrays, keeping None (an absent optional input) as None."""
    return tuple(None if v is None else np.asarray(v) for v in values)


def reference_op(domain: str, op_type: str, evaluate: Callable[..., tuple[Any, ...]]) -> type[OpRun]:
    """Return the ``onnx.reference`` OpRun class of ``domain::op_type``, so ``ReferenceEvaluator`` runs fused
    models: its ``_run`` returns ``evaluate(*inputs, **attributes)``.

    ReferenceEvaluator passes a node's inputs positionally and only the attributes the node sets, by name
    (a custom op has no schema to fill in defaults), so ``evaluate`` gives every attribute a default.
    ``_run`` does not use ``self``: it can be called unbound, ``Op._run(None, *inputs, **attributes)``. Its
    signature is ``evaluate``'s after ``self``, so ``inspect`` lists the op's inputs and attributes.
    """

    def _run(self: OpRun | None, *inputs: Any, **attributes: Any) -> tuple[Any, ...]:
        return evaluate(*inputs, **attributes)

    signature = inspect.signature(evaluate)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    _run.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])  # type: ignore[attr-defined]

    return type(
        op_type,
        (OpRun,),
        {
            "__doc__": f"``onnx.reference`` implementation of ``{domain}::{op_type}``.",
            "__module__": evaluate.__module__,
            "__qualname__": op_type,
            "op_domain": domain,
            "_run": _run,
        },
    )
