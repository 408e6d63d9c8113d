"""The CUDA kernel of ai.mambafuse::GatedGroupRMSNorm against fusion/reference/gated_group_rms_norm.py (docs/op.md, §3).

Needs onnxruntime with the CUDA execution provider, a GPU, and the library built with -DMAMBAFUSE_CUDA=ON
(point $MAMBAFUSE_LIBRARY at it). Every session here forbids CPU fallback, so a library without the CUDA
kernel fails instead of silently running the CPU one. Both kernels are run: MAMBAFUSE_CUDA_PATH forces one.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

import contrib_ops
from fusion.reference import SUPPORTED_TYPES, bfloat16, budget_report, gated_group_rms_norm
from tests._cuda import CUDA, cuda_problem, with_supported_ir
from tests._ops import (
    BFLOAT16,
    EDGE_GROUP_SIZE,
    EDGE_NONFINITE_GROUPS,
    EXPORTER_TYPE_MIXES,
    FLOAT,
    FLOAT16,
    GATED_TYPE_MIXES,
    GATED_TYPES,
    TIE_TYPE_MIXES,
    TYPE_NAMES,
    assert_one_consistent_evaluation,
    edge_value_inputs,
    gated_type_id,
    make_model,
    nonfinite_groups,
    one_node_model,
    random_inputs,
    tie_close_inputs,
)
from tests._ops import check_against_reference as shared_check
from tests.test_kernel_cpu import (
    GATED_ROUNDING_EPSILON,
    ISSUE_25_ROWS,
    TIE_SHAPES,
    assert_probes_rounded_exactly,
    gated_rounding_case,
)

ort = pytest.importorskip("onnxruntime")
if (_problem := cuda_problem(ort)) is not None:
    pytest.skip(_problem, allow_module_level=True)

TYPES = (FLOAT, FLOAT16, BFLOAT16)
PATHS = ("warp", "vector")


def cuda_session(model: onnx.ModelProto, provider_options: dict[str, str] | None = None, **options_kw: object):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for key, value in options_kw.items():
        setattr(options, key, value)
    return contrib_ops.session(
        with_supported_ir(model), providers=[(CUDA, provider_options or {})], session_options=options, use_library=True
    )


@pytest.fixture(autouse=True)
def _path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests parametrized with `path` force that kernel; the launcher reads the variable at every launch."""
    path = request.node.callspec.params.get("path") if hasattr(request.node, "callspec") else None
    if path is None or path == "auto":
        monkeypatch.delenv("MAMBAFUSE_CUDA_PATH", raising=False)
    else:
        monkeypatch.setenv("MAMBAFUSE_CUDA_PATH", path)


def check_against_reference(
    y, z, w, *, group_size: int, epsilon: float = 1e-5, norm_type=None, out_type=None, gated_type=None
) -> np.ndarray:
    return shared_check(
        cuda_session,
        y,
        z,
        w,
        group_size=group_size,
        epsilon=epsilon,
        norm_type=norm_type,
        out_type=out_type,
        gated_type=gated_type,
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"),
    list(itertools.product(TYPES, repeat=5)),
    ids=lambda t: TYPE_NAMES[t],  # y-z-w-norm-out
)
def test_every_type_combination(
    y_type: int, z_type: int, w_type: int, norm_type: int, out_type: int, path: str
) -> None:
    rng = np.random.default_rng([y_type, z_type, w_type, norm_type, out_type])
    # 14 400 elements, as in the CPU tests: with a half norm_dtype, enough n within the tie window (about
    # 0.2 % for float16) that every case meets some.
    y, z, w = random_inputs(rng, (30, 5, 96), y_type, z_type, w_type)
    check_against_reference(y, z, w, group_size=48, norm_type=norm_type, out_type=out_type)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gated_type", GATED_TYPES, ids=gated_type_id)
@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"),
    list(GATED_TYPE_MIXES.values()),
    ids=list(GATED_TYPE_MIXES),
)
def test_gated_dtype(
    y_type: int, z_type: int, w_type: int, norm_type: int, out_type: int, gated_type: int | None, path: str
) -> None:
    """The third rounding point (h rounded to gated_dtype before the norm) on both kernels, every type mix it
    meets; 14 400 elements a case (the 0.1 % allowance must not hinge on the seed), and the decode width."""
    rng = np.random.default_rng([y_type, z_type, w_type, norm_type, out_type, gated_type or 0])
    y, z, w = random_inputs(rng, (30, 5, 96), y_type, z_type, w_type)
    check_against_reference(y, z, w, group_size=48, norm_type=norm_type, out_type=out_type, gated_type=gated_type)
    y, z, w = random_inputs(rng, (3, 7680), y_type, z_type, w_type)
    check_against_reference(y, z, w, group_size=960, norm_type=norm_type, out_type=out_type, gated_type=gated_type)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gated_type", [FLOAT16, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
def test_gated_rounding_is_exact(gated_type: int, path: str) -> None:
    """h rounded to gated_dtype bit for bit as numpy/ml_dtypes round (nearest even): the CPU tests' probes
    (ties, one float32 ulp either side, half-subnormal products, float16's overflow to Inf), each [probe,
    anchor] pair padded with zeros to a group of 8, so that the vector path (group_size % 8 == 0) takes it."""
    y2, z2, w2, h = gated_rounding_case(gated_type)
    pairs = y2.reshape(-1, 2)
    y = np.zeros((pairs.shape[0], 8), np.float32)
    y[:, :2] = pairs
    y = y.reshape(1, -1)
    z = np.full_like(y, 64.0)
    w = np.ones(y.shape[-1], np.float32)
    actual = check_against_reference(
        y, z, w, group_size=8, epsilon=GATED_ROUNDING_EPSILON, gated_type=gated_type
    ).reshape(-1, 8)[:, 0]
    assert_probes_rounded_exactly(actual, h, pairs[:, 1], group_size=8, gated_type=gated_type)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("shape", "group_size"), TIE_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("gated_type", [FLOAT16, BFLOAT16], ids=lambda t: TYPE_NAMES[t])
@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"), list(TIE_TYPE_MIXES.values()), ids=list(TIE_TYPE_MIXES)
)
def test_gated_products_at_ties(
    y_type: int,
    z_type: int,
    w_type: int,
    norm_type: int,
    out_type: int,
    gated_type: int,
    shape: tuple[int, ...],
    group_size: int,
    path: str,
) -> None:
    """The CPU tests' tie cases (tie_close_inputs: many h of each group at gated_dtype rounding ties, both
    signs) on both kernels: within the budget (every element within the tolerance of a consistent
    evaluation), and, where norm_dtype and the output are float32, exactly one consistent evaluation."""
    rng = np.random.default_rng([y_type, z_type, w_type, norm_type, out_type, gated_type, group_size])
    y, z, w = tie_close_inputs(rng, shape, group_size, y_type, z_type, w_type, gated_type)
    actual = check_against_reference(
        y, z, w, group_size=group_size, norm_type=norm_type, out_type=out_type, gated_type=gated_type
    )
    if norm_type == FLOAT and out_type == FLOAT:
        assert_one_consistent_evaluation(actual, y, z, w, group_size=group_size, gated_type=gated_type)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("shape", "group_size", "w_scale", "gated_type"), ISSUE_25_ROWS, ids=lambda v: str(v))
def test_random_rows_with_a_few_tie_close_products(
    shape: tuple[int, ...], group_size: int, w_scale: float, gated_type: int, path: str
) -> None:
    """Issue 25's float32 rows (a few tie-close h a group) on both kernels: within the budget, and one
    consistent evaluation."""
    rng = np.random.default_rng(0)
    y, z, w = random_inputs(rng, shape, FLOAT, FLOAT, FLOAT)
    w = (w * np.float32(w_scale)).astype(np.float32)
    actual = check_against_reference(y, z, w, group_size=group_size, gated_type=gated_type)
    assert_one_consistent_evaluation(actual, y, z, w, group_size=group_size, gated_type=gated_type)


SHAPES = [
    ((1, 7680), 960),  # Nemotron-H decode row, 8 groups
    ((3, 5, 96), 48),
    ((4, 120), 40),
    ((2, 3, 64), 64),  # one group
    ((64, 8192), 1024),  # prefill-sized
    ((512, 7680), 960),
    ((5, 24), 1),  # group of one
    ((2, 1, 100), 25),  # group size not a multiple of the vector width: warp path only
    ((3, 8192), 8192),  # the vector path's largest group
    ((2, 16384), 16384),  # beyond it: warp path
]


@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize(("shape", "group_size"), SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("elem_type", TYPES, ids=lambda t: TYPE_NAMES[t])
def test_shapes(shape: tuple[int, ...], group_size: int, elem_type: int, path: str) -> None:
    rng = np.random.default_rng([len(shape), *shape, group_size, elem_type])
    y, z, w = random_inputs(rng, shape, elem_type, elem_type, elem_type)
    check_against_reference(y, z, w, group_size=group_size)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("y_type", "z_type", "w_type", "norm_type", "out_type"),
    list(EXPORTER_TYPE_MIXES.values()),
    ids=list(EXPORTER_TYPE_MIXES),
)
def test_exporter_type_mixes(y_type: int, z_type: int, w_type: int, norm_type: int, out_type: int, path: str) -> None:
    rng = np.random.default_rng(7)
    for rows in (1, 33):
        y, z, w = random_inputs(rng, (rows, 7680), y_type, z_type, w_type)
        check_against_reference(y, z, w, group_size=960, norm_type=norm_type, out_type=out_type)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("elem_type", TYPES, ids=lambda t: TYPE_NAMES[t])
def test_edge_values(elem_type: int, path: str) -> None:
    """Zero groups give zeros; NaN/Inf stay in their own group; eps-dominated and saturated groups."""
    y, z, w = edge_value_inputs(elem_type)
    actual = check_against_reference(y, z, w, group_size=EDGE_GROUP_SIZE)
    assert nonfinite_groups(actual) == EDGE_NONFINITE_GROUPS
    assert np.all(actual[0, :EDGE_GROUP_SIZE].astype(np.float32) == 0.0)


def test_empty_leading_axis_gives_empty_output() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", 96], group_size=48)
    y = np.zeros((0, 96), np.float32)
    out = cuda_session(model).run(None, {"y": y, "z": y, "w": np.ones(96, np.float32)})[0]
    assert out.shape == (0, 96)


def test_run_time_error_names_the_problem() -> None:
    model = one_node_model(FLOAT, FLOAT, FLOAT, shape=["n", "c"], w_shape=["wc"], group_size=8)
    y = np.ones((2, 16), np.float32)
    with pytest.raises(Exception, match=r"W must have shape \[C\] = \[16\], got \[15\]"):  # noqa: PT011
        cuda_session(model).run(None, {"y": y, "z": y, "w": np.ones(15, np.float32)})


# --- device buffers through IO binding: misaligned views, bf16 without Casts ---------------------------

torch = pytest.importorskip("torch")
TORCH_DTYPES = {FLOAT: torch.float32, FLOAT16: torch.float16, BFLOAT16: torch.bfloat16}


def direct_model(
    y_type: int, z_type: int, w_type: int, out_type: int, rows: int, channels: int, group_size: int
) -> onnx.ModelProto:
    """The op alone, inputs and output in the op's own types (bf16 included): fed through IO binding."""
    node = oh.make_node(
        "GatedGroupRMSNorm",
        ["y", "z", "w"],
        ["out"],
        domain="ai.mambafuse",
        epsilon=1e-5,
        group_size=group_size,
        output_dtype=out_type,
    )
    graph = oh.make_graph(
        [node],
        "direct",
        [
            oh.make_tensor_value_info("y", y_type, [rows, channels]),
            oh.make_tensor_value_info("z", z_type, [rows, channels]),
            oh.make_tensor_value_info("w", w_type, [channels]),
        ],
        [oh.make_tensor_value_info("out", out_type, [rows, channels])],
    )
    return make_model(graph)


def to_torch(arr: np.ndarray, elem_type: int, offset: int) -> torch.Tensor:
    """A CUDA tensor holding `arr`, `offset` elements into a larger buffer (offset 1: not 16-byte aligned)."""
    values = torch.from_numpy(arr.astype(np.float32)).to(TORCH_DTYPES[elem_type])
    buffer = torch.zeros(arr.size + offset + 8, dtype=TORCH_DTYPES[elem_type], device="cuda")
    view = buffer[offset : offset + arr.size].view(arr.shape)
    view.copy_(values.cuda())
    return view


def ort_value(tensor: torch.Tensor):
    from onnxruntime.capi import _pybind_state as C

    return ort.OrtValue(C.OrtValue.from_dlpack(torch.utils.dlpack.to_dlpack(tensor), False))


def run_bound(session, feeds: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    binding = session.io_binding()
    for name, tensor in feeds.items():
        binding.bind_ortvalue_input(name, ort_value(tensor))
    binding.bind_ortvalue_output("out", ort_value(out))
    session.run_with_iobinding(binding)
    torch.cuda.synchronize()


@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize("misaligned", ["none", "gate", "all"])
@pytest.mark.parametrize("elem_type", TYPES, ids=lambda t: TYPE_NAMES[t])
def test_device_buffers_aligned_and_misaligned(elem_type: int, misaligned: str, path: str) -> None:
    """A gate that is a slice of a larger buffer (one element in) cannot take 16-byte loads: the launcher
    must fall back to the warp path even when the vector path is asked for, and give the same values."""
    rows, channels, group_size = 17, 7680, 960
    rng = np.random.default_rng([elem_type, len(misaligned)])
    y, z, w = random_inputs(rng, (rows, channels), elem_type, elem_type, elem_type)
    off = {"none": (0, 0, 0, 0), "gate": (0, 1, 0, 0), "all": (1, 1, 1, 1)}[misaligned]
    feeds = {
        "y": to_torch(y, elem_type, off[0]),
        "z": to_torch(z, elem_type, off[1]),
        "w": to_torch(w, elem_type, off[2]),
    }
    out = to_torch(np.full((rows, channels), np.nan, np.float32), elem_type, off[3])
    if off[1]:
        assert feeds["z"].data_ptr() % 16 != 0
    session = cuda_session(direct_model(elem_type, elem_type, elem_type, elem_type, rows, channels, group_size))
    run_bound(session, feeds, out)
    actual = out.float().cpu().numpy().astype(SUPPORTED_TYPES[elem_type])
    expected = gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=group_size, compute_dtype=np.float64)
    ok, message = budget_report(actual, expected)
    assert ok, message


@pytest.mark.parametrize("path", PATHS)
def test_bf16_mixed_types_through_dlpack(path: str) -> None:
    rows, channels, group_size = 9, 8192, 1024
    rng = np.random.default_rng(21)
    y, z, w = random_inputs(rng, (rows, channels), BFLOAT16, BFLOAT16, FLOAT)
    session = cuda_session(direct_model(BFLOAT16, BFLOAT16, FLOAT, BFLOAT16, rows, channels, group_size))
    out = to_torch(np.zeros((rows, channels), np.float32), BFLOAT16, 0)
    run_bound(
        session,
        {"y": to_torch(y, BFLOAT16, 0), "z": to_torch(z, BFLOAT16, 0), "w": to_torch(w, FLOAT, 0)},
        out,
    )
    actual = out.float().cpu().numpy().astype(bfloat16)
    ok, message = budget_report(
        actual, gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=group_size, compute_dtype=np.float64)
    )
    assert ok, message


# --- placement, profiling, CUDA graphs -----------------------------------------------------------------


def projected_model(
    rows: int, channels: int, group_size: int, hidden: int, rng: np.random.Generator
) -> onnx.ModelProto:
    """in_proj MatMul -> GatedGroupRMSNorm -> out_proj MatMul, fp16: the fused node between two GEMMs."""
    proj_in = (rng.standard_normal((hidden, 2 * channels)) * 0.05).astype(np.float16)
    proj_out = (rng.standard_normal((channels, hidden)) * 0.05).astype(np.float16)
    weight = (1.0 + 0.5 * rng.standard_normal(channels)).astype(np.float16)
    nodes = [
        oh.make_node("MatMul", ["x", "proj_in"], ["yz"]),
        oh.make_node("Split", ["yz"], ["y", "z"], axis=-1, num_outputs=2),
        oh.make_node(
            "GatedGroupRMSNorm",
            ["y", "z", "w"],
            ["normed"],
            domain="ai.mambafuse",
            epsilon=1e-5,
            group_size=group_size,
        ),
        oh.make_node("MatMul", ["normed", "proj_out"], ["out"]),
    ]
    graph = oh.make_graph(
        nodes,
        "projected",
        [oh.make_tensor_value_info("x", FLOAT16, [rows, hidden])],
        [oh.make_tensor_value_info("out", FLOAT16, [rows, hidden])],
        initializer=[
            onnx.numpy_helper.from_array(a, n) for a, n in ((proj_in, "proj_in"), (proj_out, "proj_out"), (weight, "w"))
        ],
    )
    return make_model(graph)


def test_profile_shows_the_node_on_the_cuda_provider(tmp_path: Path) -> None:
    model = projected_model(4, 7680, 960, 256, np.random.default_rng(3))
    session = cuda_session(model, enable_profiling=True, profile_file_prefix=str(tmp_path / "profile"))
    x = (np.random.default_rng(4).standard_normal((4, 256)) * 0.5).astype(np.float16)
    for _ in range(3):
        session.run(None, {"x": x})
    events = json.loads(Path(session.end_profiling()).read_text())
    ours = [
        e
        for e in events
        if e.get("cat") == "Node"
        and e.get("args", {}).get("op_name") == "GatedGroupRMSNorm"
        and e["name"].endswith("_kernel_time")
    ]
    assert ours, "no GatedGroupRMSNorm kernel event in the profile"
    providers = {e["args"]["provider"] for e in ours}
    assert providers == {CUDA}, f"GatedGroupRMSNorm ran on {providers}"


@pytest.mark.parametrize("elem_type", [FLOAT16, FLOAT], ids=lambda t: TYPE_NAMES[t])
def test_cuda_graph_capture_and_replay(elem_type: int) -> None:
    """ORT captures the node into a CUDA graph at the first Run and replays it afterwards: the launch must be
    capture-safe (no sync, no allocation) and replays must read the inputs' current contents."""
    rows, channels, group_size = 2, 7680, 960
    session = cuda_session(
        direct_model(elem_type, elem_type, elem_type, elem_type, rows, channels, group_size),
        {"enable_cuda_graph": "1"},
    )
    rng = np.random.default_rng(8)
    y, z, w = random_inputs(rng, (rows, channels), elem_type, elem_type, elem_type)
    values = {n: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for n, a in (("y", y), ("z", z), ("w", w))}
    out = ort.OrtValue.ortvalue_from_shape_and_type([rows, channels], SUPPORTED_TYPES[elem_type], "cuda", 0)
    binding = session.io_binding()
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_ortvalue_output("out", out)
    for step in range(4):  # step 0 warms up, 1 captures, the rest replay
        y, z, _ = random_inputs(rng, (rows, channels), elem_type, elem_type, elem_type)
        values["y"].update_inplace(y)
        values["z"].update_inplace(z)
        session.run_with_iobinding(binding)
        actual = out.numpy()
        ok, message = budget_report(
            actual,
            gated_group_rms_norm(y, z, w, epsilon=1e-5, group_size=group_size, compute_dtype=np.float64),
        )
        assert ok, f"run {step}: {message}"
