"""What every op's reference shares: the ops' domain and their ``onnx.reference`` implementations."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from onnx.reference.op_run import OpRun

DOMAIN = "ai.mambafuse"


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
