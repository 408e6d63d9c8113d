"""``mambafuse optimize``'s graph-level passes on small graphs: the half-precision residual RMSNorm
(fusion/rules/residual_norm.py), Transposes of unit axes written as Reshapes (fusion/rules/unit_transpose.py) and
squares written as products (fusion/rules/square.py).

Each fused graph is run in ONNX Runtime against the graph it came from; every refusal is checked to keep the
graph as it was and to give its reason.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusion.rules.residual_norm import fuse_residual_norms
from fusion.rules.square import squares_to_products
from fusion.rules.unit_transpose import _target, transposes_to_reshapes

D = 256


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # run the graph as written
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _fused(model: onnx.ModelProto, run) -> tuple[onnx.ModelProto, object]:
    ir_model = ir.from_proto(model)
    result = run(ir_model)
    return ir.to_proto(ir_model), result


# --- residual norms -------------------------------------------------------------------------------------


def _norm_model(
    *,
    weight: np.ndarray,
    residual: bool = True,
    b_dims=("batch", 1, D),
    stash_type: int = 1,
    axis: int = -1,
    extra_reader: bool = False,
    y_is_output: bool = True,
) -> onnx.ModelProto:
    """y = Cast(SimplifiedLayerNormalization(a + b, weight), float16); the sum read again after the norm."""
    half = TensorProto.FLOAT16
    inputs = [helper.make_tensor_value_info("a", half, ["batch", 1, D])]
    nodes = []
    x = "a"
    if residual:
        inputs.append(helper.make_tensor_value_info("b", half, list(b_dims)))
        nodes.append(helper.make_node("Add", ["a", "b"], ["s"], name="residual"))
        x = "s"
    nodes.append(
        helper.make_node(
            "SimplifiedLayerNormalization",
            [x, "w"],
            ["y32"],
            name="norm",
            axis=axis,
            epsilon=1e-5,
            stash_type=stash_type,
        )
    )
    nodes.append(helper.make_node("Cast", ["y32"], ["y"], to=half, name="cast"))
    # The next layer: reads the norm's output and the residual sum.
    nodes.append(helper.make_node("Add", [x, "y"], ["next"], name="next_residual"))
    outputs = [helper.make_tensor_value_info("next", half, None)]
    if y_is_output:
        outputs.append(helper.make_tensor_value_info("y", half, None))
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("y32", TensorProto.FLOAT, None))
    w = onnx.numpy_helper.from_array(weight.astype(np.float32), "w")
    return _model(nodes, inputs, outputs, [w])


def _feeds(model: onnx.ModelProto, batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for value in model.graph.input:
        dims = [batch if d.dim_param else d.dim_value for d in value.type.tensor_type.shape.dim]
        out[value.name] = (rng.standard_normal(dims) * 2).astype(np.float16)
    return out


def _half_weight(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(D).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("residual", [True, False], ids=["skip", "no-residual"])
@pytest.mark.parametrize("batch", [1, 3])
def test_residual_norm_is_fused_and_computes_the_same(residual: bool, batch: int) -> None:
    original = _norm_model(weight=_half_weight(), residual=residual)
    fused, (counts, refused) = _fused(original, fuse_residual_norms)
    op = "SkipSimplifiedLayerNormalization" if residual else "SimplifiedLayerNormalization"
    assert (counts, refused) == ({op: 1}, [])
    ops = [(n.domain, n.op_type) for n in fused.graph.node]
    expected = (
        ("com.microsoft", "SkipSimplifiedLayerNormalization") if residual else ("", "SimplifiedLayerNormalization")
    )
    assert expected in ops and ("", "Cast") not in ops
    assert ops.count(("", "Add")) == 1, "only the next layer's Add is left"
    assert [o.name for o in fused.graph.output] == [o.name for o in original.graph.output]
    assert [t.name for t in fused.graph.initializer] == ["norm_weight_f16"], "the float32 weight is gone"
    for seed in range(3):
        _check_close(original, fused, _feeds(original, batch, seed))


def _ulp(values: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(values).astype(np.float16)).astype(np.float32)


def _check_close(
    original: onnx.ModelProto, fused: onnx.ModelProto, feeds: dict[str, np.ndarray], *, next_add: bool = True
) -> None:
    """The norm's y within one float16 ulp of the original's (ORT's kernel rounds its float32 product once, in
    its own order), and the next layer's Add exactly the float16 sum of the fused graph's s and y.

    (The original's own next Add is not the reference: ONNX Runtime's CPU provider may run it on the norm's
    float32 output, without the Cast's rounding; ``next_add=False`` skips the Add, for a broadcasting residual
    Add that stays in the graph, where ONNX Runtime's CPU float16 Add is not the numpy sum.)
    """
    (_, y_want), (next_got, y_got) = _session(original).run(None, feeds), _session(fused).run(None, feeds)
    assert y_got.dtype == y_want.dtype == np.float16 and y_got.shape == y_want.shape
    y_ulp = _ulp(np.maximum(np.abs(y_got), np.abs(y_want)))  # the larger binade's, where the two straddle one
    assert np.all(np.abs(y_got.astype(np.float32) - y_want.astype(np.float32)) <= y_ulp)
    if not next_add:
        return
    s = feeds["a"] + feeds["b"] if "b" in feeds else feeds["a"]
    np.testing.assert_array_equal(next_got, (s.astype(np.float32) + y_got.astype(np.float32)).astype(np.float16))


def test_the_sum_the_next_layer_reads_is_the_float16_add() -> None:
    original = _norm_model(weight=_half_weight(), y_is_output=False)
    fused, (counts, _) = _fused(original, fuse_residual_norms)
    assert counts == {"SkipSimplifiedLayerNormalization": 1}
    skip = next(n for n in fused.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
    # The next layer's Add reads the fused node's sum output under the name it read before.
    assert skip.output[3] == "s" and list(skip.input[:2]) == ["a", "b"]
    feeds = _feeds(original, 2, 7)
    # next = s + y: with y's one-ulp freedom removed, check the sum by the output alone.
    y_model = onnx.ModelProto()
    y_model.CopyFrom(fused)
    y_model.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT16, None))
    (_, s) = _session(y_model).run(None, feeds)
    np.testing.assert_array_equal(s, feeds["a"] + feeds["b"])


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"weight": np.full(D, 0.1, np.float32)}, "float32 weight has values float16 does not hold"),
        ({"weight": _half_weight(), "stash_type": 0}, "statistics are in"),
        ({"weight": _half_weight(), "axis": 1}, "not proven the last"),
        ({"weight": _half_weight()[None, :]}, "not a 1-D constant"),
        ({"weight": _half_weight(), "extra_reader": True}, "readers besides the Cast"),
    ],
    ids=["inexact-weight", "stash-type", "axis", "2-D-weight", "float32-reader"],
)
def test_residual_norm_refusals_keep_the_graph(kwargs, reason: str) -> None:
    original = _norm_model(**kwargs)
    fused, (counts, refused) = _fused(original, fuse_residual_norms)
    assert counts == {} and len(refused) == 1 and reason in refused[0], refused
    assert [n.op_type for n in fused.graph.node] == [n.op_type for n in original.graph.node]


def test_a_broadcasting_add_is_kept_and_only_the_cast_folded() -> None:
    # b of shape (1, 1, D) against a of (batch, 1, D): Add broadcasts, the fused node would not.
    original = _norm_model(weight=_half_weight(), b_dims=(1, 1, D))
    fused, (counts, _) = _fused(original, fuse_residual_norms)
    assert counts == {"SimplifiedLayerNormalization": 1}
    ops = [n.op_type for n in fused.graph.node]
    assert "SkipSimplifiedLayerNormalization" not in ops and ops.count("Add") == 2 and "Cast" not in ops
    _check_close(original, fused, _feeds(original, 3, 1), next_add=False)


def test_float32_models_are_left_to_onnxscript() -> None:
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("SimplifiedLayerNormalization", ["s", "w"], ["y32"], axis=-1, epsilon=1e-5, stash_type=1),
        helper.make_node("Cast", ["y32"], ["y"], to=TensorProto.FLOAT),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, D]) for n in "ab"]
    original = _model(
        nodes,
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(_half_weight(), "w")],
    )
    _, (counts, refused) = _fused(original, fuse_residual_norms)
    assert (counts, refused) == ({}, [])


# --- Transposes of unit axes ------------------------------------------------------------------------------


def _resolve(target: list[int], dims: tuple[int, ...]) -> tuple[int, ...]:
    """ONNX Reshape's reading of ``target`` (allowzero 0) for an input of ``dims``."""
    out = [dims[i] if t == 0 else t for i, t in enumerate(target)]
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1]))
        out[out.index(-1)] = int(np.prod(dims)) // known
    return tuple(out)


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_target_is_found_exactly_when_the_transpose_moves_no_element(rank: int) -> None:
    """Every dims in {1, 2, 3}^rank and every perm: a target exists iff the Transpose keeps the flat order,
    and Reshape to it gives the Transpose's result."""
    checked = 0
    for dims in itertools.product((1, 2, 3), repeat=rank):
        x = np.arange(int(np.prod(dims))).reshape(dims)
        for perm in itertools.permutations(range(rank)):
            moved = np.transpose(x, perm)
            target = _target(list(dims), list(perm))
            keeps_order = np.array_equal(moved.ravel(), x.ravel())
            assert (target is not None) == keeps_order, (dims, perm)
            if target is not None:
                np.testing.assert_array_equal(x.reshape(_resolve(target, dims)), moved)
                checked += 1
    assert checked > 0


def test_target_with_symbolic_dims() -> None:
    assert _target(["B", 1, 10240], [0, 2, 1]) == [0, 10240, 1]
    assert _target(["B", 1, "C"], [0, 2, 1]) == [0, -1, 1]
    assert _target([1, "B", "C"], [1, 2, 0]) is None  # two symbolic dims move: one -1 cannot say both
    assert _target(["B", "S", 8], [0, 2, 1]) is None  # S may be above 1: the data moves
    assert _target(["B", 0, 8], [0, 2, 1]) is None  # zero-size: left alone


def _transpose_model(dims: list, perm: list[int]) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=perm, name="t"),
        helper.make_node("Neg", ["t"], ["y"]),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, None),
        ],
    )


@pytest.mark.parametrize(
    ("dims", "perm", "count"),
    [
        (["batch", 1, 40], [0, 2, 1], 1),
        (["batch", 1, 4, 8], [0, 2, 1, 3], 1),
        (["batch", "seq", 40], [0, 2, 1], 0),
        ([2, 3], [1, 0], 0),
    ],
)
def test_transposes_to_reshapes_on_a_graph(dims: list, perm: list[int], count: int) -> None:
    original = _transpose_model(dims, perm)
    fused, done = _fused(original, transposes_to_reshapes)
    assert done == count
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("Transpose") == 1 - count and ops.count("Reshape") == count
    assert [o.name for o in fused.graph.output] == ["y", "t"]
    for batch in (1, 2, 3):
        shape = [batch if isinstance(d, str) else d for d in dims]
        if "seq" in dims:
            shape[1] = 5
        x = np.random.default_rng(batch).standard_normal(shape).astype(np.float32)
        for w, g in zip(_session(original).run(None, {"x": x}), _session(fused).run(None, {"x": x}), strict=True):
            np.testing.assert_array_equal(g, w)


# --- squares --------------------------------------------------------------------------------------------


def _pow_model(x_type: int, exponent: onnx.TensorProto | None, x_dims=("n",), constant_node: bool = False):
    """y = Pow(x, e), e an initializer (or a Constant node's value), x's dims as given."""
    nodes = []
    initializers = []
    if constant_node:
        nodes.append(helper.make_node("Constant", [], ["e"], value=exponent))
    else:
        initializers.append(exponent)
    nodes.append(helper.make_node("Pow", ["x", "e"], ["y"], name="pow"))
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", x_type, list(x_dims) if x_dims is not None else None)],
        [helper.make_tensor_value_info("y", x_type, None)],
        initializers,
    )


def _every_float16() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16)


def _some_float32() -> np.ndarray:
    rng = np.random.default_rng(0)
    values = rng.standard_normal(1 << 20).astype(np.float32) * np.float32(1e4)
    values[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -2.0]
    return values


@pytest.mark.parametrize(
    ("x_type", "values"),
    [(TensorProto.FLOAT16, _every_float16()), (TensorProto.FLOAT, _some_float32())],
    ids=["float16-every-value", "float32"],
)
def test_squares_are_the_bits_of_pow_and_of_the_rounded_square(x_type: int, values: np.ndarray) -> None:
    """Mul(x, x) after the pass gives the bits ORT's Pow(x, 2) gave, which are x² rounded once to the type."""
    numpy_type = values.dtype
    original = _pow_model(x_type, helper.make_tensor("e", x_type, [], [2.0]))
    fused, done = _fused(original, squares_to_products)
    assert done == 1 and [n.op_type for n in fused.graph.node] == ["Mul"]
    (want,) = _session(original).run(None, {"x": values})
    (got,) = _session(fused).run(None, {"x": values})
    bits = np.uint16 if numpy_type == np.float16 else np.uint32
    np.testing.assert_array_equal(got.view(bits), want.view(bits))
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = (values.astype(np.float64) ** 2).astype(numpy_type)  # exact in float64, then one rounding
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(got[finite].view(bits), rounded[finite].view(bits))
    assert np.isnan(got[~finite]).all()


@pytest.mark.parametrize(
    ("x_type", "exponent", "x_dims", "constant_node", "count"),
    [
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.FLOAT, [], [2.0]), ("n",), False, 1),
        (TensorProto.FLOAT16, helper.make_tensor("e", TensorProto.FLOAT16, [], [2.0]), ("n",), True, 1),
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.INT64, [], [2]), ("n",), False, 1),
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.FLOAT, [1], [2.0]), (2, "n"), False, 1),
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.FLOAT, [1, 1], [2.0]), ("n",), False, 0),
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.FLOAT, [1], [2.0]), None, False, 0),
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.FLOAT, [], [3.0]), ("n",), False, 0),
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.FLOAT, [], [2.0000002]), ("n",), False, 0),
        (TensorProto.FLOAT, helper.make_tensor("e", TensorProto.FLOAT, [2], [2.0, 2.0]), (2,), False, 0),
        (TensorProto.INT32, helper.make_tensor("e", TensorProto.INT32, [], [2]), ("n",), False, 0),
    ],
    ids=[
        "scalar",
        "float16-constant-node",
        "integer-exponent",
        "rank-1-exponent-under-rank-2-x",
        "exponent-of-higher-rank",
        "x-of-unknown-rank",
        "cube",
        "not-exactly-two",
        "two-exponents",
        "integer-x",
    ],
)
def test_squares_to_products_fuses_only_a_proven_square(
    x_type: int, exponent: onnx.TensorProto, x_dims, constant_node: bool, count: int
) -> None:
    original = _pow_model(x_type, exponent, x_dims, constant_node)
    fused, done = _fused(original, squares_to_products)
    assert done == count
    ops = [n.op_type for n in fused.graph.node if n.op_type != "Constant"]
    assert ops == (["Mul"] if count else ["Pow"])
    assert [o.name for o in fused.graph.output] == ["y"]
    shape = [d if isinstance(d, int) else 5 for d in x_dims] if x_dims is not None else [5]
    numpy_type = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.INT32: np.int32}
    x = (np.arange(np.prod(shape)) - 4).reshape(shape).astype(numpy_type[x_type])
    for want, got in zip(_session(original).run(None, {"x": x}), _session(fused).run(None, {"x": x}), strict=True):
        assert want.shape == got.shape and want.dtype == got.dtype
        np.testing.assert_array_equal(got, want)
