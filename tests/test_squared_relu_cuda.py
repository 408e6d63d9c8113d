"""The CUDA kernel of ai.mambafuse::SquaredRelu against fusion/reference/squared_relu.py (docs/squared_relu.md), bit
for bit: every float16 and bfloat16 value, float32 values over the whole exponent range (squares that overflow,
are subnormal, underflow), the special values, lengths around the 16-byte vectors and their tail, any rank, the
scalar path (pointers off 16-byte alignment, bound through IO binding), a captured CUDA graph, the provider that
runs the node, and bad inputs.

Needs onnxruntime with the CUDA execution provider, a GPU, and the library built with -DMAMBAFUSE_CUDA=ON
($MAMBAFUSE_LIBRARY). Every session forbids CPU fallback, so a library without the CUDA kernel fails instead of
running something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from fusion.reference.squared_relu import count_differences
from tests._cuda import CUDA, cuda_problem, cuda_session, feeds_of
from tests._decode_step import DOMAIN, DTYPE_IDS, DTYPES, FLOAT, FLOAT16, IR_VERSION, one_node_model
from tests.test_squared_relu_kernel import SPECIALS, assert_exact, every_16_bit_value, float32_sweep

ort = pytest.importorskip("onnxruntime")
_problem = cuda_problem(ort)
pytestmark = pytest.mark.skipif(_problem is not None, reason=_problem or "")

OP = "SquaredRelu"


def squared(x: np.ndarray, **provider_options: str) -> np.ndarray:
    model = one_node_model(OP, [("x", x)], [("y", x.dtype)])
    y = cuda_session(model, **provider_options).run(None, feeds_of([("x", x)]))[0]
    return y.astype(x.dtype)


@pytest.mark.parametrize("t", [FLOAT16, DTYPES[2]], ids=["f16", "bf16"])
def test_every_16_bit_value(t: np.dtype) -> None:
    x = every_16_bit_value(t)
    assert_exact(squared(x), x)


def test_float32_over_the_exponent_range() -> None:
    x = float32_sweep(np.random.default_rng(3), 1 << 20)
    y = squared(x)
    assert_exact(y, x)
    assert np.count_nonzero((y > 0) & (y < np.finfo(np.float32).tiny)), "no subnormal square was checked"


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_special_values(t: np.dtype) -> None:
    x = np.array(SPECIALS, dtype=np.float32).astype(t)
    y = squared(x).astype(np.float64)
    assert np.isnan(y[:2]).all(), f"NaN must stay NaN, got {y[:2]}"
    assert list(y[2:]) == [np.inf, 0.0, 0.0, 0.0, 1.0, 0.0, 9.0, 0.0]
    assert not np.signbit(y[2:]).any()


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 2047, 65536 * 3 + 5, 2048 * 21504 + 3])
def test_lengths_around_the_vectors_and_their_tail(t: np.dtype, length: int) -> None:
    x = (4 * np.random.default_rng(length % 1000).standard_normal(length)).astype(t)
    assert_exact(squared(x), x)


@pytest.mark.parametrize("shape", [(), (1,), (2, 3, 5), (1, 4, 2, 9)], ids=str)
def test_any_rank(shape: tuple[int, ...]) -> None:
    x = np.asarray(np.random.default_rng(5).standard_normal(shape).astype(np.float16))
    y = squared(x)
    assert y.shape == shape
    assert_exact(y, x)


def test_empty_tensor() -> None:
    y = squared(np.zeros((3, 0, 2), dtype=np.float16))
    assert y.shape == (3, 0, 2)


@pytest.mark.parametrize("t", [FLOAT, FLOAT16], ids=["f32", "f16"])
@pytest.mark.parametrize(("x_offset", "y_offset"), [(1, 0), (0, 1), (3, 5)])
def test_pointers_off_the_vector_alignment_take_the_scalar_path(t: np.dtype, x_offset: int, y_offset: int) -> None:
    """IO binding hands the kernel device pointers a few elements into buffers ORT allocated (aligned): the launcher
    must see they are not 16-byte aligned and run one element a thread."""
    length = 1000
    x = (4 * np.random.default_rng(x_offset).standard_normal(length)).astype(t)
    model = one_node_model(OP, [("x", x)], [("y", t)])
    sess = cuda_session(model)
    x_buffer = ort.OrtValue.ortvalue_from_numpy(np.concatenate([np.zeros(x_offset, t), x]), "cuda", 0)
    y_buffer = ort.OrtValue.ortvalue_from_numpy(np.full(length + y_offset, -1, t), "cuda", 0)
    binding = sess.io_binding()
    size = np.dtype(t).itemsize
    binding.bind_input("x", "cuda", 0, t, [length], x_buffer.data_ptr() + x_offset * size)
    binding.bind_output("y", "cuda", 0, t, [length], y_buffer.data_ptr() + y_offset * size)
    sess.run_with_iobinding(binding)
    out = y_buffer.numpy()
    assert (out[:y_offset] == -1).all(), "the kernel wrote before y"
    assert_exact(out[y_offset:], x)


def test_replays_in_a_cuda_graph() -> None:
    """ORT's CUDA graph: the node is captured at the first run and replayed on new values in the bound buffers."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 3000)).astype(np.float16)
    sess = cuda_session(one_node_model(OP, [("x", x)], [("y", FLOAT16)]), enable_cuda_graph="1")
    binding = sess.io_binding()
    x_value = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    y_value = ort.OrtValue.ortvalue_from_shape_and_type(x.shape, np.float16, "cuda", 0)
    binding.bind_ortvalue_input("x", x_value)
    binding.bind_ortvalue_output("y", y_value)
    for step in range(3):
        x = x if step == 0 else (step * rng.standard_normal(x.shape)).astype(np.float16)
        x_value.update_inplace(x)
        sess.run_with_iobinding(binding)
        differ, detail = count_differences(y_value.numpy(), x)
        assert differ == 0, f"step {step}: {detail}"


def test_the_node_runs_on_the_cuda_provider(tmp_path: Path) -> None:
    x = np.ones(64, dtype=np.float16)
    sess = cuda_session(one_node_model(OP, [("x", x)], [("y", FLOAT16)]), profile_prefix=str(tmp_path / "profile"))
    sess.run(None, {"x": x})
    events = json.loads(Path(sess.end_profiling()).read_text())
    providers = {
        e["args"].get("provider") for e in events if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == OP
    }
    assert providers == {CUDA}, providers


def test_a_double_input_is_refused_by_name() -> None:
    graph = oh.make_graph(
        [oh.make_node(OP, ["x"], ["y"], domain=DOMAIN)],
        "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, [4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid(DOMAIN, 1)], ir_version=IR_VERSION
    )
    with pytest.raises(Exception, match="X has element type double"):
        cuda_session(model).run(None, {"x": np.ones(4)})
