"""Shape proofs: what an ONNX graph proves about the dims of its values, the numbers in its shape tensors, and
the integer arithmetic an exporter does on a sequence length.

Every fusion rule leans on this package: a rule fuses only what is proven from the graph (constants, and the
arithmetic these modules follow), never what a declared shape claims. Its answers are exact or "not proven"
(None), never a guess; docs/shapes.md says what it can and cannot prove.

- ``dims``: ``Dim`` (an int, a named symbol, an opaque token equal only to itself, a quasi-affine expression of
  one symbol, or None); ``constant_array`` / ``constant_scalar`` (constants through element-preserving ops);
  ``resolve_shape_tensor`` (the dims a shape tensor holds, through Shape/Gather/Concat/arithmetic);
  ``ForwardShapes`` (each value's dims, inferred forward from the graph's inputs op by op, with the symbols a
  Concat or a fused op fixes); ``dims_equal``, ``format_dims``.
- ``arith``: ``QuasiAffine``, integer arithmetic over one symbol (``+``, ``-``, ``*`` by constants, ``//`` and
  ``Mod`` by positive constants, Min/Max where one side is below the other), compared exactly for every size >= 1.
- ``symbolic``: ONNX Runtime's symbolic shape inference, run to fill value_info hints where ONNX's own
  inference left dims unknown (hints: the rules still prove what they fuse).
"""

from fusion.shapes.arith import QuasiAffine
from fusion.shapes.dims import (
    Dim,
    ForwardShapes,
    constant_array,
    constant_scalar,
    dims_equal,
    format_dims,
    forward_dims,
    resolve_shape_tensor,
    value_dims,
)

__all__ = [
    "Dim",
    "ForwardShapes",
    "QuasiAffine",
    "constant_array",
    "constant_scalar",
    "dims_equal",
    "format_dims",
    "forward_dims",
    "resolve_shape_tensor",
    "value_dims",
]
