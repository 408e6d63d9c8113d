"""Write a Transpose that only moves axes of size 1 as the Reshape it is.

Used by ``mambafuse optimize``. A Transpose whose axes of other sizes keep their order moves no element: the
row-major order of the data is the same before and after, so ``Reshape`` to the permuted dims computes the same
tensor. ONNX Runtime's CUDA provider runs such a Transpose as a device copy (one more launch and gap a decode
step); its Reshape is no launch at all. Decode exports have them around every conv update, where torch's
``(B, 1, C) -> (B, C, 1)`` moves the one-token axis (8 copies a step in the Nemotron-H-8B-shaped benchmark).

What is proven from the graph: the Transpose's input dims (from the graph inputs' declared dims through every op,
never an intermediate value's declared shape, as the other rules prove theirs), every moved axis of size 1, and
the Reshape's target: the proven ints, ``0`` (copy the input's dim) for a symbolic dim that stays at its axis,
and at most one ``-1`` for a symbolic dim that moves. A zero-size dim is left alone (Reshape's 0 would copy).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fusion._graph import NameSource
from fusion.rules._decode import DecodeShapes, rewrite_each
from fusion.shapes.dims import Dim


def _target(dims: list[Dim], perm: list[int]) -> list[int] | None:
    """The Reshape target equal to Transpose(perm) of a tensor of ``dims``, or None when it is not a Reshape."""
    if sorted(perm) != list(range(len(dims))):
        return None
    if any(isinstance(dim, int) and dim <= 0 for dim in dims):
        return None
    kept = [axis for axis in perm if dims[axis] != 1]
    if kept != sorted(kept):
        return None  # an axis of another size moves past another: the data moves
    target: list[int] = []
    for position, axis in enumerate(perm):
        dim = dims[axis]
        if isinstance(dim, int):
            target.append(dim)
        elif axis == position:
            target.append(0)
        elif -1 in target:
            return None
        else:
            target.append(-1)
    return target


def _reshape(node: ir.Node, shapes: DecodeShapes, fresh: NameSource) -> ir.Node | None:
    """The Reshape a Transpose is, else None."""
    dims = shapes(node.inputs[0])
    perm_attribute = node.attributes.get("perm")
    if dims is None or perm_attribute is None:
        return None
    target = _target(dims, list(perm_attribute.as_ints()))
    if target is None:
        return None
    name = fresh(f"{node.name or 'transpose'}_as_reshape")
    shape = ir.Value(name=name, const_value=ir.tensor(np.array(target, dtype=np.int64), name=name))
    node.graph.register_initializer(shape)
    return ir.Node("", "Reshape", [node.inputs[0], shape], num_outputs=1, name=name)


def transposes_to_reshapes(model: ir.Model) -> int:
    """Replace every Transpose of ``model``'s main graph that moves only axes of size 1; return how many."""
    return rewrite_each(model, "Transpose", _reshape, "_transposed")


__all__ = ["transposes_to_reshapes"]
