"""The CUDA kernels of ai.mambafuse::MambaChunkScan against the op's float64 budget
(fusion/reference/mamba_chunk_scan.py, ``budget_report``) — not against the CPU kernel: both kernels (the chunked one
on tensor cores and the sequential one, picked with MAMBAFUSE_CHUNK_SCAN_CUDA), every type and optional input,
prompt lengths around the chunk size (64), groups and batch, dims that are not multiples of 16 and the real
widths, the time step's attributes, a prompt in four pieces against the prompt at once, a one-token prompt replayed
in ORT's CUDA graph, the one-token step kernel (a one-token prompt's default) in both state layouts, a NaN kept in
its head, and bad inputs named.

Needs onnxruntime with the CUDA execution provider, a GPU and the library built with -DMAMBAFUSE_CUDA=ON
($MAMBAFUSE_LIBRARY). Every session forbids CPU fallback, and the CPU prefill kernels are not registered in a
GPU-first session, so a library without the CUDA kernel fails here instead of running something else.
"""

from __future__ import annotations

import numpy as np
import pytest

from fusion.reference.mamba_chunk_scan import budget_report
from tests._cuda import cuda_problem, cuda_session, feeds_of
from tests._decode_step import BFLOAT16, DTYPE_IDS, DTYPES, FLOAT, FLOAT16, one_node_model
from tests.test_mamba_chunk_scan_kernel import NAMES, OUTPUTS, make_inputs

ort = pytest.importorskip("onnxruntime")
_problem = cuda_problem(ort)
pytestmark = pytest.mark.skipif(_problem is not None, reason=str(_problem))

OP = "MambaChunkScan"
PATH_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CUDA"
PATHS = ["chunked", "sequential"]
WARPS_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CUDA_WARPS"
WIDTHS_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CUDA_WIDTHS"
STATE_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CUDA_STATE"


def run_cuda(inputs: dict[str, np.ndarray | None], **attrs: object) -> list[np.ndarray]:
    sess = cuda_session(one_node_model(OP, [(n, inputs[n]) for n in NAMES], OUTPUTS, **attrs))
    return sess.run(None, feeds_of(inputs.items()))


def check(inputs: dict[str, np.ndarray | None], **attrs: object) -> list[np.ndarray]:
    out, state = run_cuda(inputs, **attrs)
    assert out.dtype == state.dtype == FLOAT
    ok, summary = budget_report(out, state, **inputs, **attrs)
    assert ok, summary
    return [out, state]


def check_graph_replays(rng: np.random.Generator, t: np.dtype, replays: int, **shape: int) -> None:
    """ORT's CUDA graph: captured at the first Run, replayed with new inputs of ``shape`` (make_inputs, drawn from
    ``rng`` one replay after another) written into the bound buffers; every replay's answer is within the budget (a
    stale or garbled replay is not)."""
    first = make_inputs(rng, t, **shape)
    sess = cuda_session(one_node_model(OP, [(n, first[n]) for n in NAMES], OUTPUTS), enable_cuda_graph="1")
    binding = sess.io_binding()
    bound = {}
    for name, value in feeds_of(first.items()).items():
        bound[name] = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        binding.bind_ortvalue_input(name, bound[name])
    out_value = ort.OrtValue.ortvalue_from_shape_and_type(first["x"].shape, np.float32, "cuda", 0)
    state_value = ort.OrtValue.ortvalue_from_shape_and_type(first["initial_state"].shape, np.float32, "cuda", 0)
    binding.bind_ortvalue_output("out", out_value)
    binding.bind_ortvalue_output("final_state", state_value)
    for step in range(replays):
        inputs = first if step == 0 else make_inputs(rng, t, **shape)
        for name, value in feeds_of(inputs.items()).items():
            bound[name].update_inplace(value)
        sess.run_with_iobinding(binding)
        ok, summary = budget_report(out_value.numpy(), state_value.numpy(), **inputs)
        assert ok, f"replay {step}: {summary}"


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(PATH_VARIABLE, request.param)
    return request.param


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("d_kind", ["D-f32", "D-T", "no-D"])
@pytest.mark.parametrize("state_kind", ["S-f32", "S-T", "no-state"])
@pytest.mark.parametrize("dt_bias", [True, False], ids=["bias", "no-bias"])
def test_types_and_optional_inputs(path: str, t: np.dtype, d_kind: str, state_kind: str, dt_bias: bool) -> None:
    """70 tokens: a full chunk and a short one; P = 8 and N = 16 (the chunked kernel pads P to 16)."""
    d_type = {"D-f32": FLOAT, "D-T": t, "no-D": None}[d_kind]
    state_type = {"S-f32": FLOAT, "S-T": t, "no-state": None}[state_kind]
    rng = np.random.default_rng(1)
    check(make_inputs(rng, t, dt_bias=dt_bias, d_type=d_type, state_type=state_type))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 127, 128, 129, 300])
def test_prompt_lengths(path: str, t: np.dtype, length: int) -> None:
    check(make_inputs(np.random.default_rng(length), t, length=length, batch=1))


@pytest.mark.parametrize(("heads", "groups", "batch"), [(4, 1, 1), (6, 2, 3), (4, 4, 2), (3, 3, 1)])
def test_groups_and_batch(path: str, heads: int, groups: int, batch: int) -> None:
    check(make_inputs(np.random.default_rng(heads * 7 + groups), FLOAT16, heads=heads, groups=groups, batch=batch))


@pytest.mark.parametrize(
    ("head_dim", "state_size"),
    [(5, 7), (17, 33), (64, 128), (64, 64), (128, 128), (64, 256), (1, 1)],
    ids=["5x7", "17x33", "nemotron-64x128", "zamba2-64x64", "128x128", "64x256", "1x1"],
)
@pytest.mark.parametrize("t", [FLOAT, BFLOAT16], ids=DTYPE_IDS.get)
def test_dims(path: str, t: np.dtype, head_dim: int, state_size: int) -> None:
    """Dims not multiples of 16, the real widths, and sizes whose chunked shared memory does not fit (the kernel
    then runs the sequential path, whatever was asked)."""
    rng = np.random.default_rng(head_dim + state_size)
    check(make_inputs(rng, t, head_dim=head_dim, state_size=state_size, length=150, batch=1, heads=2, groups=1))


@pytest.mark.parametrize("t", [FLOAT, FLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    "attrs", [{"dt_min": 0.01, "dt_max": 0.2}, {"dt_softplus": 0}, {"dt_max": 0.05}], ids=["limits", "raw", "max"]
)
def test_time_step_attributes(path: str, t: np.dtype, attrs: dict[str, float]) -> None:
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, t)
    if attrs.get("dt_softplus") == 0:
        inputs["dt"] = np.abs(inputs["dt"])  # the budget is defined for a non-negative time step
    check(inputs, **attrs)


def test_time_steps_around_the_softplus_threshold(path: str) -> None:
    rng = np.random.default_rng(9)
    inputs = make_inputs(rng, FLOAT16, dt_bias=False)
    inputs["dt"] = rng.uniform(-12, 24, inputs["dt"].shape).astype(FLOAT16)
    check(inputs)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_a_prompt_in_pieces_equals_the_prompt_at_once(path: str, t: np.dtype) -> None:
    """2 × 130 tokens fed in four pieces (two inside one chunk, two across chunk ends), the state carried as float."""
    rng = np.random.default_rng(3)
    inputs = make_inputs(rng, t, length=260, state_type=FLOAT)
    whole_out, whole_state = check(inputs)
    state = inputs["initial_state"]
    outs = []
    for start, stop in [(0, 10), (10, 64), (64, 200), (200, 260)]:
        piece = dict(inputs)
        for name in ("x", "dt", "B", "C"):
            piece[name] = inputs[name][:, start:stop]
        piece["initial_state"] = state
        out, state = check(piece)
        outs.append(out)
    ok, summary = budget_report(np.concatenate(outs, axis=1), state, **inputs)
    assert ok, summary
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, whole_state, rtol=1e-4, atol=1e-4)


def test_the_two_kernels_agree_at_real_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nemotron-H-8B's head and state widths (P 64, N 128, 16 heads a group), 300 tokens in float16: both kernels
    within the budget, and within 1e-4 of each other plus a millionth of the largest output (the slowly decaying
    head's outputs reach ~260 here, where the two kernels' float32 sums part by ~1e-4 in the host emulation)."""
    rng = np.random.default_rng(11)
    inputs = make_inputs(rng, FLOAT16, batch=1, length=300, heads=16, head_dim=64, groups=1, state_size=128)
    results = {}
    for name in PATHS:
        monkeypatch.setenv(PATH_VARIABLE, name)
        results[name] = check(inputs)
    for a, b in zip(results["chunked"], results["sequential"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 + 1e-6 * float(np.abs(b).max()))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("length", [1, 64, 129])
def test_the_chunked_kernel_with_eight_warps(monkeypatch: pytest.MonkeyPatch, t: np.dtype, length: int) -> None:
    """The chunked kernel's 8-warp build (a benchmark's comparison), at real widths: staged loads for float16 and
    bfloat16, plain ones for float."""
    monkeypatch.setenv(PATH_VARIABLE, "chunked")
    monkeypatch.setenv(WARPS_VARIABLE, "8")
    rng = np.random.default_rng(length)
    check(make_inputs(rng, t, batch=2, length=length, heads=4, head_dim=64, groups=2, state_size=128))


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_size", [128, 64])
@pytest.mark.parametrize("length", [1, 63, 65, 129])
@pytest.mark.parametrize("initial", [True, False], ids=["state", "no-state"])
def test_the_half_path_and_the_kernel_for_any_widths_agree(
    monkeypatch: pytest.MonkeyPatch, t: np.dtype, state_size: int, length: int, initial: bool
) -> None:
    """float16 and bfloat16 at P = 64 and N = 128 or 64 (the models' widths) take the chunked kernel's half path (C
    from the staging buffer, C·Bᵀ on 16-bit tensor cores); MAMBAFUSE_CHUNK_SCAN_CUDA_WIDTHS=any runs the kernel for
    any widths on the same inputs. Both within the budget, and within 1e-4 of each other."""
    monkeypatch.setenv(PATH_VARIABLE, "chunked")
    rng = np.random.default_rng(length + state_size)
    inputs = make_inputs(
        rng, t, batch=2, length=length, heads=4, head_dim=64, groups=2, state_size=state_size,
        state_type=FLOAT if initial else None,
    )  # fmt: skip
    half = check(inputs)
    monkeypatch.setenv(WIDTHS_VARIABLE, "any")
    for a, b in zip(half, check(inputs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_size", [128, 64])
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 129, 300])
@pytest.mark.parametrize(("d_kind", "state_kind"), [("D-f32", "S-f32"), ("D-T", "S-T"), ("no-D", "no-state")])
def test_the_register_state_kernel(
    monkeypatch: pytest.MonkeyPatch, t: np.dtype, state_size: int, length: int, d_kind: str, state_kind: str
) -> None:
    """RegisterStateScan (the state in registers; the default at the models' widths) within the budget, and within
    1e-4 of the half path's other kernel (MAMBAFUSE_CHUNK_SCAN_CUDA_STATE=shared) on the same inputs, over
    prompt lengths around the chunk of 64 and 300 tokens (the three staging slots go round), D and the initial state
    as float, as T, or absent."""
    monkeypatch.setenv(PATH_VARIABLE, "chunked")
    rng = np.random.default_rng(length + state_size)
    kind = {"D-f32": FLOAT, "S-f32": FLOAT, "D-T": t, "S-T": t, "no-D": None, "no-state": None}
    inputs = make_inputs(
        rng, t, batch=2, length=length, heads=4, head_dim=64, groups=2, state_size=state_size,
        d_type=kind[d_kind], state_type=kind[state_kind],
    )  # fmt: skip
    monkeypatch.setenv(STATE_VARIABLE, "shared")
    shared = check(inputs)
    monkeypatch.setenv(STATE_VARIABLE, "registers")
    registers = check(inputs)
    for a, b in zip(registers, shared, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _float_time_step(rng: np.random.Generator, inputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    """``inputs`` with dt and dt_bias float32 values that are not values of x's 16-bit type."""
    inputs["dt"] = (rng.standard_normal(inputs["dt"].shape) - 1).astype(FLOAT)
    inputs["dt_bias"] = rng.standard_normal(inputs["dt_bias"].shape).astype(FLOAT)
    return inputs


def _widened(inputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    return {n: v if v is None or n in ("dt", "dt_bias") else v.astype(FLOAT) for n, v in inputs.items()}


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("length", [1, 70, 300])
def test_a_float_time_step_with_16_bit_x_b_and_c(path: str, t: np.dtype, length: int) -> None:
    """dt and dt_bias float with 16-bit x, B and C (a mobius build's scan): the time step is not rounded to T, within
    the budget, and within 1e-4 of the kernel on x, B and C widened to float."""
    rng = np.random.default_rng(length)
    inputs = _float_time_step(rng, make_inputs(rng, t, length=length, d_type=FLOAT, state_type=t))
    attrs = {"dt_min": 0.001, "dt_max": 7.3}
    for a, b in zip(check(inputs, **attrs), check(_widened(inputs), **attrs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_size", [128, 64])
@pytest.mark.parametrize("state", ["registers", "shared"])
@pytest.mark.parametrize("softplus", [1, 0])
def test_a_float_time_step_on_the_half_path(
    monkeypatch: pytest.MonkeyPatch, t: np.dtype, state_size: int, state: str, softplus: int
) -> None:
    """The half path's kernels (the models' widths) with a float time step and 16-bit x, B, C and state: within the
    budget and within 1e-4 of the kernel for float inputs on the same values widened."""
    monkeypatch.setenv(PATH_VARIABLE, "chunked")
    monkeypatch.setenv(STATE_VARIABLE, state)
    rng = np.random.default_rng(state_size + softplus)
    inputs = make_inputs(
        rng, t, batch=2, length=200, heads=4, head_dim=64, groups=2, state_size=state_size, d_type=FLOAT, state_type=t
    )
    inputs = _float_time_step(rng, inputs)
    for a, b in zip(check(inputs, dt_softplus=softplus), check(_widened(inputs), dt_softplus=softplus), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
def test_the_register_state_kernel_in_pieces_and_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch, t: np.dtype) -> None:
    """RegisterStateScan over 4 × 130 tokens with the state carried equals the prompt at once (within 1e-4), and a
    one-token prompt replayed in ORT's CUDA graph at Nemotron-H-8B's head widths stays within the budget."""
    monkeypatch.setenv(PATH_VARIABLE, "chunked")
    monkeypatch.setenv(STATE_VARIABLE, "registers")
    rng = np.random.default_rng(21)
    inputs = make_inputs(rng, t, batch=1, length=520, heads=2, head_dim=64, groups=1, state_size=128)
    whole_out, whole_state = check(inputs)
    state, outs = inputs["initial_state"], []
    for start in range(0, 520, 130):
        piece = dict(inputs, initial_state=state)
        for name in ("x", "dt", "B", "C"):
            piece[name] = inputs[name][:, start : start + 130]
        out, state = check(piece)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state, whole_state, rtol=1e-4, atol=1e-4)
    check_graph_replays(rng, t, 3, batch=1, length=1, heads=16, head_dim=64, groups=2, state_size=128)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("head_dim", "state_size"), [(64, 128), (64, 64), (40, 24)], ids=["N128", "N64", "odd"])
@pytest.mark.parametrize("state", ["registers", "shared"])
@pytest.mark.parametrize("length", [1, 130])
def test_the_state_in_n_p_layout(
    path: str, monkeypatch: pytest.MonkeyPatch, t: np.dtype, head_dim: int, state_size: int, state: str, length: int
) -> None:
    """state_layout 1 ((B, H, N, P) states, a mobius build's) on every kernel, with a float time step as mobius
    passes it: within the budget, and the same bits as layout 0 on the transposed state (only where the state is
    read and written differs)."""
    monkeypatch.setenv(STATE_VARIABLE, state)
    rng = np.random.default_rng(length + head_dim + state_size)
    inputs = make_inputs(
        rng, t, batch=2, length=length, heads=4, head_dim=head_dim, groups=2, state_size=state_size, state_type=t
    )
    if t != FLOAT:
        inputs = _float_time_step(rng, inputs)
    laid = dict(inputs, initial_state=np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2)))
    out, final = check(laid, state_layout=1)
    plain_out, plain_final = check(inputs)
    np.testing.assert_array_equal(out, plain_out)
    np.testing.assert_array_equal(final, plain_final.transpose(0, 1, 3, 2))


def test_misaligned_tensors_take_the_plain_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """P = 12 float16 values (24 bytes a row) are not whole 16-byte copies: the kernel loads them one by one."""
    monkeypatch.setenv(PATH_VARIABLE, "chunked")
    check(make_inputs(np.random.default_rng(13), FLOAT16, head_dim=12, state_size=40, length=90))


def test_a_nan_stays_in_its_head(path: str) -> None:
    rng = np.random.default_rng(4)
    inputs = make_inputs(rng, FLOAT, batch=1, length=100, heads=4, groups=2)
    inputs["dt"][0, 70, 1] = np.nan
    out, state = run_cuda(inputs)
    assert np.isnan(out[0, 70:, 1]).all() and np.isnan(state[0, 1]).all()
    assert not np.isnan(out[0, :64, 1]).any(), "tokens of earlier chunks stay finite"
    others = [0, 2, 3]
    assert np.isfinite(out[:, :, others]).all() and np.isfinite(state[:, others]).all()
    clean = dict(inputs, dt=inputs["dt"].copy())
    clean["dt"][0, 70, 1] = 0
    ref_out, ref_state = run_cuda(clean)
    np.testing.assert_array_equal(out[:, :, others], ref_out[:, :, others])
    np.testing.assert_array_equal(state[:, others], ref_state[:, others])


def test_a_one_token_prompt_in_a_cuda_graph(path: str) -> None:
    """A one-token prompt in ORT's CUDA graph, replayed three times with new values (check_graph_replays)."""
    rng = np.random.default_rng(6)
    check_graph_replays(rng, FLOAT16, 4, batch=2, length=1, heads=8, head_dim=16, groups=4, state_size=64)


STEP_WIDTHS = {"N128": (64, 128), "N64": (64, 64), "vectors": (40, 24), "scalars": (6, 10), "P12": (12, 40)}


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("widths", STEP_WIDTHS.values(), ids=STEP_WIDTHS.keys())
@pytest.mark.parametrize("state_layout", [0, 1])
@pytest.mark.parametrize("state_kind", ["S-f32", "S-T", "no-state"])
def test_the_one_token_step(t: np.dtype, widths: tuple[int, int], state_layout: int, state_kind: str) -> None:
    """A one-token prompt takes the step kernel by default (a decode step): within the budget in both state layouts,
    at the models' widths and others (4-element vectors and not), with a state of either type or none, D in T;
    with a float time step for 16-bit inputs (a mobius build's)."""
    head_dim, state_size = widths
    rng = np.random.default_rng(head_dim + state_size + state_layout)
    state_type = {"S-f32": FLOAT, "S-T": t, "no-state": None}[state_kind]
    inputs = make_inputs(
        rng,
        t,
        batch=2,
        length=1,
        heads=4,
        head_dim=head_dim,
        groups=2,
        state_size=state_size,
        d_type=t,
        state_type=state_type,
    )
    if t != FLOAT:
        inputs = _float_time_step(rng, inputs)
    if state_layout == 1 and state_type is not None:
        inputs["initial_state"] = np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2))
    check(inputs, state_layout=state_layout)


def test_the_step_is_the_default_for_one_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """MAMBAFUSE_CHUNK_SCAN_CUDA unset and "step" run the same kernel (the same bits) at real width; the chunked
    kernel on the same token is within the budget too, and sums in another order (so the default is seen to be the
    step, not the chunk)."""
    rng = np.random.default_rng(12)
    inputs = make_inputs(rng, FLOAT16, batch=1, length=1, heads=16, head_dim=64, groups=1, state_size=128)
    monkeypatch.delenv(PATH_VARIABLE, raising=False)
    default = check(inputs)
    monkeypatch.setenv(PATH_VARIABLE, "step")
    step = check(inputs)
    monkeypatch.setenv(PATH_VARIABLE, "chunked")
    chunked = check(inputs)
    for a, b in zip(default, step, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(default[0], chunked[0])


def test_the_step_in_a_cuda_graph_and_a_longer_prompt_asked_for_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step kernel replayed in ORT's CUDA graph at real width; MAMBAFUSE_CHUNK_SCAN_CUDA=step with a longer
    prompt runs what the default runs for it."""
    monkeypatch.setenv(PATH_VARIABLE, "step")
    rng = np.random.default_rng(14)
    check_graph_replays(rng, FLOAT16, 4, batch=2, length=1, heads=16, head_dim=64, groups=2, state_size=128)
    check(make_inputs(rng, FLOAT16, batch=1, length=70, heads=2, head_dim=64, groups=1, state_size=128))


def test_a_nan_in_the_step_stays_in_its_head() -> None:
    rng = np.random.default_rng(15)
    inputs = make_inputs(rng, FLOAT16, batch=1, length=1, heads=4, head_dim=64, groups=2, state_size=128)
    clean_out, clean_state = run_cuda(inputs)
    inputs["dt"][0, 0, 1] = np.nan
    out, state = run_cuda(inputs)
    assert np.isnan(out[0, 0, 1]).all() and np.isnan(state[0, 1]).all()
    others = [0, 2, 3]
    np.testing.assert_array_equal(out[:, :, others], clean_out[:, :, others])
    np.testing.assert_array_equal(state[:, others], clean_state[:, others])


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_an_empty_batch_no_state_or_no_head_channels(path: str, t: np.dtype) -> None:
    """B = 0 and P = 0: empty outputs; N = 0: the output is the skip D·x alone (one float32 product: exact)."""
    rng = np.random.default_rng(8)
    out, state = run_cuda(make_inputs(rng, t, batch=0))
    assert out.shape == (0, 70, 4, 8) and state.shape == (0, 4, 8, 16)
    inputs = make_inputs(rng, t, state_size=0)
    out, state = run_cuda(inputs)
    assert state.shape == (2, 4, 8, 0)
    skip = inputs["D"].astype(FLOAT)[None, None, :, None] * inputs["x"].astype(FLOAT)
    np.testing.assert_array_equal(out, skip)
    out, state = run_cuda(make_inputs(rng, t, head_dim=0))
    assert out.shape == (2, 70, 4, 0) and state.shape == (2, 4, 0, 16)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.update(B=i["B"][:, :5]), "B must have shape"),
        (lambda i: i.update(C=i["C"][:, :, :1]), "B and C must have the same shape"),
        (lambda i: i.update(A=i["A"].astype(np.float16)), "A must be float"),
        (lambda i: i.update(dt=i["dt"][:, :, :2]), "dt must have shape"),
        (lambda i: i.update(initial_state=i["initial_state"][:, :, :3]), "initial_state must have shape"),
    ],
    ids=["B-length", "C-shape", "A-type", "dt-shape", "state-shape"],
)
def test_bad_inputs_name_the_input(change, message: str) -> None:
    inputs = make_inputs(np.random.default_rng(2), FLOAT16)
    change(inputs)
    with pytest.raises(Exception, match=message):
        run_cuda(inputs)


def test_a_bad_kernel_choice_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATH_VARIABLE, "tensor")
    with pytest.raises(Exception, match=PATH_VARIABLE):
        run_cuda(make_inputs(np.random.default_rng(2), FLOAT16))
