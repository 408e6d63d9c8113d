"""The model-local function: valid ONNX, shape inference through it, docs/op.md numerics in stock ORT."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusion.function import MIN_OPSET, attach_function, make_function
from fusion.reference import (
    DOMAIN,
    OP_TYPE,
    budget_report,
    gated_group_rms_norm,
    onnx_type_to_dtype,
    reference_evaluator,
    reference_for_budget,
)
from tests._ops import GATED_TYPES, gated_type_id

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
# ORT CPU runs no bf16 arithmetic, so the numerics here cover float and float16 combinations.
RUNNABLE_TYPES = (FLOAT, FLOAT16)


def _model(
    y_type: int,
    w_type: int,
    norm_dtype: int,
    output_dtype: int,
    *,
    opset: int = 18,
    leading: tuple[int | str, ...] = ("batch", "seq"),
    channels: int = 96,
    group_size: int = 48,
    epsilon: float = 1e-5,
    declare_output_shape: bool = True,
    gated_dtype: int | None = None,
) -> onnx.ModelProto:
    optional = {} if gated_dtype is None else {"gated_dtype": gated_dtype}
    node = helper.make_node(
        OP_TYPE,
        ["y", "z", "w"],
        ["out"],
        domain=DOMAIN,
        epsilon=epsilon,
        group_size=group_size,
        norm_dtype=norm_dtype,
        output_dtype=output_dtype,
        **optional,
    )
    dims = [*leading, channels]
    out = helper.make_tensor_value_info("out", output_dtype, dims if declare_output_shape else None)
    graph = helper.make_graph(
        [node],
        "one_fused_node",
        [
            helper.make_tensor_value_info("y", y_type, dims),
            helper.make_tensor_value_info("z", y_type, dims),
            helper.make_tensor_value_info("w", w_type, [channels]),
        ],
        [out],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return attach_function(model)


def _feeds(y_type: int, w_type: int, shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    y_dtype, w_dtype = onnx_type_to_dtype(y_type), onnx_type_to_dtype(w_type)
    return {
        "y": (2 * rng.standard_normal(shape)).astype(y_dtype),
        # A wide gate range reaches where sigmoid is tiny: the function must stay exact there too.
        "z": (6 * rng.standard_normal(shape)).astype(y_dtype),
        "w": (1 + 0.5 * rng.standard_normal(shape[-1])).astype(w_dtype),
    }


@pytest.mark.parametrize("opset", [MIN_OPSET, 17, 18, 23])
def test_model_with_function_passes_full_check(opset: int) -> None:
    onnx.checker.check_model(_model(FLOAT16, FLOAT16, FLOAT16, FLOAT16, opset=opset), full_check=True)


def test_function_imports_the_models_onnx_opset() -> None:
    function = make_function(17)
    assert [(o.domain, o.version) for o in function.opset_import] == [("", 17)]
    assert list(function.attribute) == ["epsilon", "group_size", "norm_dtype", "output_dtype"]
    # gated_dtype is optional: a declared default (FLOAT, no rounding) keeps older call nodes' meaning.
    assert [(a.name, a.i) for a in function.attribute_proto] == [("gated_dtype", FLOAT)]
    # opset 17 takes ReduceMean axes as an attribute, 18 as an input.
    (mean17,) = [n for n in function.node if n.op_type == "ReduceMean"]
    (mean18,) = [n for n in make_function(18).node if n.op_type == "ReduceMean"]
    assert len(mean17.input) == 1 and len(mean18.input) == 2


def test_too_old_opset_is_an_error() -> None:
    with pytest.raises(ValueError, match="opset"):
        make_function(MIN_OPSET - 1)


@pytest.mark.parametrize("output_dtype", [FLOAT, FLOAT16, TensorProto.BFLOAT16])
def test_shape_inference_goes_through_the_function(output_dtype: int) -> None:
    model = _model(FLOAT, FLOAT, FLOAT, output_dtype, declare_output_shape=False)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    (out,) = inferred.graph.output
    assert out.type.tensor_type.elem_type == output_dtype


def test_attach_is_idempotent() -> None:
    model = _model(FLOAT, FLOAT, FLOAT, FLOAT)
    attach_function(model)
    assert len(model.functions) == 1
    assert [o.domain for o in model.opset_import].count(DOMAIN) == 1


COMBINATIONS = [
    (y, w, norm, out)
    for y, w, norm, out in itertools.product(RUNNABLE_TYPES, repeat=4)
    # ONNX's Mul needs the weight in the normalized value's type unless it is widened first; the
    # op itself takes any combination, and the function widens everything to f32 first.
]


def _assert_within_budget(got: np.ndarray, want: np.ndarray, norm_dtype: int) -> None:
    """budget_report, except where a half norm_dtype feeds a float32 output.

    There a value within a hair of a half rounding tie rounds either way in an fp32 computation, and
    the float32 output shows that 1-ulp flip of the half value (~6e-4 relative for float16), which the
    2e-6 float32 budget does not foresee (docs/op.md gap; the kernels have it too). Allowed: such
    flips on at most 0.1 % of elements, none larger than one half ulp.
    """
    ok, message = budget_report(got, want)
    if ok or not (got.dtype == np.float32 and norm_dtype != FLOAT):
        assert ok, message
        return
    rel = np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want.astype(np.float64)), 1e-30)
    flips = rel > 2e-6
    assert flips.sum() <= max(1, 0.001 * got.size), message
    assert rel.max() <= 2.0**-10, message


@pytest.mark.parametrize(("y_type", "w_type", "norm_dtype", "output_dtype"), COMBINATIONS)
@pytest.mark.parametrize("opset", [17, 18])
def test_stock_ort_runs_the_function_within_budget(
    y_type: int, w_type: int, norm_dtype: int, output_dtype: int, opset: int
) -> None:
    model = _model(y_type, w_type, norm_dtype, output_dtype, opset=opset)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for shape in ((1, 1, 96), (3, 5, 96)):
        feeds = _feeds(y_type, w_type, shape)
        (got,) = session.run(None, feeds)
        want = gated_group_rms_norm(
            feeds["y"],
            feeds["z"],
            feeds["w"],
            epsilon=1e-5,
            group_size=48,
            norm_dtype=onnx_type_to_dtype(norm_dtype),
            output_dtype=onnx_type_to_dtype(output_dtype),
            compute_dtype=np.float64,
        )
        _assert_within_budget(got, want, norm_dtype)


@pytest.mark.parametrize("leading", [(), (7,), (2, 3, 4)])
def test_any_number_of_leading_dims(leading: tuple[int, ...]) -> None:
    model = _model(FLOAT, FLOAT, FLOAT, FLOAT, leading=leading, channels=64, group_size=16)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _feeds(FLOAT, FLOAT, (*leading, 64))
    (got,) = session.run(None, feeds)
    want = gated_group_rms_norm(**feeds, epsilon=1e-5, group_size=16, compute_dtype=np.float64)
    ok, message = budget_report(got, want)
    assert ok, message


def test_edge_values_stay_in_their_group() -> None:
    """A NaN reaches its own group only; a group of zeros gives zeros."""
    model = _model(FLOAT, FLOAT, FLOAT, FLOAT, leading=(1,), channels=96, group_size=48)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _feeds(FLOAT, FLOAT, (1, 96))
    feeds["y"][0, :48] = 0.0
    feeds["y"][0, 50] = np.nan
    (got,) = session.run(None, feeds)
    assert np.all(got[0, :48] == 0)
    assert np.all(np.isnan(got[0, 48:]))


@pytest.mark.parametrize("gated_dtype", GATED_TYPES, ids=gated_type_id)
@pytest.mark.parametrize(
    ("y_type", "w_type", "norm_dtype", "output_dtype"),
    [(FLOAT, FLOAT, FLOAT, FLOAT), (FLOAT16, FLOAT16, FLOAT16, FLOAT16), (FLOAT, FLOAT, FLOAT, FLOAT16)],
)
def test_function_rounds_the_gated_product(
    y_type: int, w_type: int, norm_dtype: int, output_dtype: int, gated_dtype: int | None
) -> None:
    """The function's Cast to gated_dtype and back: stock ORT against the reference at the op's budget
    (with the tie-flip alternative of budget_report where h is rounded to a half type)."""
    model = _model(y_type, w_type, norm_dtype, output_dtype, gated_dtype=gated_dtype)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = _feeds(y_type, w_type, (30, 5, 96), seed=21)
    (got,) = session.run(None, feeds)
    reference = reference_for_budget(
        feeds["y"],
        feeds["z"],
        feeds["w"],
        epsilon=1e-5,
        group_size=48,
        norm_dtype=onnx_type_to_dtype(norm_dtype),
        output_dtype=onnx_type_to_dtype(output_dtype),
        gated_dtype=None if gated_dtype is None else onnx_type_to_dtype(gated_dtype),
    )
    ok, message = budget_report(got, **reference)
    assert ok, message


@pytest.mark.parametrize("gated_dtype", [FLOAT16, TensorProto.BFLOAT16])
def test_gated_dtype_changes_the_result(gated_dtype: int) -> None:
    """Rounding h to a half type is visible in a float32 output (the Cast is not a no-op), and the onnx
    reference evaluator's op reads the attribute as the function body does."""
    model = _model(FLOAT, FLOAT, FLOAT, FLOAT, gated_dtype=gated_dtype, leading=(4,))
    feeds = _feeds(FLOAT, FLOAT, (4, 96), seed=22)
    (got,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    unrounded = gated_group_rms_norm(**feeds, epsilon=1e-5, group_size=48)
    assert np.abs(got - unrounded).max() > 1e-5 * np.abs(unrounded).max(), "gated_dtype had no effect"
    del model.functions[:]  # the evaluator must run fusion.reference's op, not the function body
    evaluated = reference_evaluator(model).run(None, feeds)[0]
    ok, message = budget_report(
        evaluated.astype(np.float32),
        **reference_for_budget(
            feeds["y"], feeds["z"], feeds["w"], epsilon=1e-5, group_size=48, gated_dtype=onnx_type_to_dtype(gated_dtype)
        ),
    )
    assert ok, message
