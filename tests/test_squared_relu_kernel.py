"""The CPU kernel of ai.mambafuse::SquaredRelu against fusion/reference/squared_relu.py (docs/squared_relu.md):
every float16 and bfloat16 value, float32 values over the whole exponent range (squares that overflow, that are
subnormal and that underflow to 0), the special values, lengths around the vector widths and the thread split, any
rank, and bad inputs. The budget is exact, so every check is bit for bit (NaN matching NaN)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from fusion.reference.squared_relu import count_differences, squared_relu
from tests._decode_step import BFLOAT16, DOMAIN, DTYPE_IDS, DTYPES, FLOAT, FLOAT16, IR_VERSION, run, session

OP = "SquaredRelu"


def squared(x: np.ndarray, threads: int = 1) -> np.ndarray:
    return run(OP, [("x", x)], [("y", x.dtype)], threads=threads)[0]


def assert_exact(y: np.ndarray, x: np.ndarray) -> None:
    differ, detail = count_differences(y, x)
    assert differ == 0, f"{differ} of {x.size} outputs differ from the once-rounded square; {detail}"


def every_16_bit_value(t: np.dtype) -> np.ndarray:
    bits = np.arange(1 << 16, dtype=np.uint16)
    if t == BFLOAT16:
        with np.errstate(invalid="ignore"):  # the NaNs convert as NaNs
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(BFLOAT16)
    return bits.view(np.float16)


def float32_sweep(rng: np.random.Generator, count: int) -> np.ndarray:
    """float32 values of both signs from 2^-149 to 2^127: their squares overflow, land on normals, on
    subnormals, and underflow to 0."""
    mantissa = rng.uniform(1.0, 2.0, count)
    exponent = rng.integers(-149, 128, count)
    sign = rng.choice([-1.0, 1.0], count)
    return (sign * mantissa * np.exp2(exponent.astype(np.float64))).astype(np.float32)


SPECIALS = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 3.0, -3.0]


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
def test_every_16_bit_value(t: np.dtype) -> None:
    x = every_16_bit_value(t)
    assert_exact(squared(x), x)


def test_float32_over_the_exponent_range() -> None:
    x = float32_sweep(np.random.default_rng(3), 1 << 18)
    y = squared(x)
    assert_exact(y, x)
    wide = np.square(np.maximum(x.astype(np.float64), 0))
    # the sweep reaches every regime of the rounding (the test would not see a kernel that flushes subnormals)
    assert np.count_nonzero(np.isinf(y)) and np.count_nonzero((y > 0) & (y < np.finfo(np.float32).tiny))
    assert np.count_nonzero((wide > 0) & (y == 0))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_special_values(t: np.dtype) -> None:
    x = np.array(SPECIALS, dtype=np.float32).astype(t)
    y = squared(x).astype(np.float64)
    assert np.isnan(y[:2]).all(), f"NaN must stay NaN, got {y[:2]}"
    assert list(y[2:]) == [np.inf, 0.0, 0.0, 0.0, 1.0, 0.0, 9.0, 0.0]
    assert not np.signbit(y[2:]).any(), "every square is +0 or positive (a negative input's too)"


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("length", [1, 3, 4, 7, 8, 15, 16, 17, 33, 65535, 65536 * 3 + 5])
def test_lengths_around_the_vector_widths_and_chunks(t: np.dtype, length: int) -> None:
    rng = np.random.default_rng(length)
    x = (4 * rng.standard_normal(length)).astype(t)
    assert_exact(squared(x, threads=2), x)


@pytest.mark.parametrize("shape", [(), (1,), (2, 3, 5), (1, 4, 2, 9)], ids=str)
def test_any_rank(shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    y = squared(np.asarray(x))
    assert y.shape == shape
    assert_exact(y, np.asarray(x))


def test_empty_tensor() -> None:
    x = np.zeros((3, 0, 2), dtype=np.float16)
    y = squared(x)
    assert y.shape == (3, 0, 2) and y.dtype == np.float16


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_the_thread_split_changes_nothing(t: np.dtype) -> None:
    x = (8 * np.random.default_rng(7).standard_normal(65536 * 5 + 3)).astype(t)
    one, four = squared(x, threads=1), squared(x, threads=4)
    assert one.astype(np.float32).tobytes() == four.astype(np.float32).tobytes()


def test_the_check_rejects_a_relu_without_its_square_and_a_double_rounding() -> None:
    x = np.linspace(-3, 3, 101).astype(np.float16)
    assert count_differences(np.maximum(x, 0), x)[0] > 0
    # rounding the ReLU to bfloat16 first, then squaring: the kind of extra rounding the contract forbids
    x = np.random.default_rng(9).uniform(1, 2, 1000).astype(np.float32)
    twice = np.square(x.astype(BFLOAT16).astype(np.float32))
    assert count_differences(twice, x)[0] > 0
    assert count_differences(squared_relu(x), x)[0] == 0


@pytest.mark.parametrize(
    ("elem", "values"),
    [(onnx.TensorProto.DOUBLE, np.ones(4)), (onnx.TensorProto.INT32, np.ones(4, dtype=np.int32))],
    ids=["double", "int32"],
)
def test_an_unsupported_type_is_refused_by_name(elem: int, values: np.ndarray) -> None:
    node = oh.make_node(OP, ["x"], ["y"], domain=DOMAIN)
    graph = oh.make_graph(
        [node], "g", [oh.make_tensor_value_info("x", elem, [4])], [oh.make_tensor_value_info("y", elem, None)]
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)], ir_version=IR_VERSION
    )
    with pytest.raises(
        (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidArgument)
    ) as error:
        session(model).run(None, {"x": values})
    assert "SquaredRelu" in str(error.value) and "X has element type" in str(error.value)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_shape_inference_gives_y_the_shape_of_x(t: np.dtype) -> None:
    elem = {FLOAT: onnx.TensorProto.FLOAT, FLOAT16: onnx.TensorProto.FLOAT16, BFLOAT16: onnx.TensorProto.BFLOAT16}[t]
    model = oh.make_model(
        oh.make_graph(
            [oh.make_node(OP, ["x"], ["y"], domain=DOMAIN)],
            "g",
            [oh.make_tensor_value_info("x", elem, ["batch", 7])],
            [oh.make_tensor_value_info("y", elem, None)],
        ),
        opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)],
        ir_version=IR_VERSION,
    )
    # y is declared without a shape: the one ORT reports is the op's inference
    assert session(model).get_outputs()[0].shape == ["batch", 7]
