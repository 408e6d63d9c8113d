"""The prefill CUDA kernels' logic without a GPU: MambaChunkScan's and CausalConv1d's kernels built for the host
emulation (contrib_ops/cuda/tools/emulate_prefill.sh: g++ and the CUDA headers, no nvcc run; one std::thread per CUDA
thread, the warp-wide instructions — mma.sync, ldmatrix, shuffles — computed from every lane's operands by their
fragment layouts), checked against the ops' float64 budgets as the GPU tests check the real kernels.

What this catches: fragment and lane mappings, shared-memory layouts and strides, a read of shared memory the block
did not write (it is refilled with NaN before each block), the order of the staging copies against their readers
(once with every copy held until its thread's wait, once with every copy landing at once: a copy into a buffer that
is still being read shows), chunk boundaries and the launch logic. What it cannot: timing, the memory model, bank
conflicts, CUDA's math library — tests/test_mamba_chunk_scan_cuda.py and tests/test_causal_conv1d_cuda.py run the
real kernels on a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fusion.reference.causal_conv1d import budget_report as conv_budget_report
from fusion.reference.mamba_chunk_scan import budget_report as scan_budget_report
from tests._cuda import ONNX_TYPE, emulated_library, host_pointer
from tests._decode_step import BFLOAT16, DTYPE_IDS, DTYPES, FLOAT, FLOAT16
from tests.test_causal_conv1d_kernel import make_inputs as conv_inputs
from tests.test_mamba_chunk_scan_kernel import make_inputs as scan_inputs

COPY_MODES = ["deferred", "immediate"]
# The half path's two kernels: the state in registers (RegisterStateScan, the default) and in shared memory
# (ChunkedScan, MAMBAFUSE_CHUNK_SCAN_CUDA_STATE=shared).
STATE_KERNELS = ["shared", "registers"]
STATE_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CUDA_STATE"


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (the prefill launch entry points, tools/cuda_prefill_bench_launch.cc) with their argument types."""
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.mambafuse_chunk_scan_launch.argtypes = [p] * 10 + [i] * 3 + [i64] * 6 + [i, f, f, i, p]
    lib.mambafuse_chunk_scan_launch_dt.argtypes = [p] * 10 + [i] * 4 + [i64] * 6 + [i, f, f, i, p]
    lib.mambafuse_chunk_scan_launch_layout.argtypes = [p] * 10 + [i] * 4 + [i64] * 6 + [i, f, f, i, i, p]
    lib.mambafuse_chunk_scan_resolve.argtypes = [i64] * 3 + [i]
    lib.mambafuse_causal_conv1d_launch.argtypes = [p] * 6 + [i] + [i64] * 5 + [i, i, p]
    lib.mambafuse_causal_conv1d_launch_rounding.argtypes = [p] * 6 + [i] + [i64] * 5 + [i, i, i, p]
    lib.mambafuse_causal_conv1d_path.argtypes = [i64, i64, i]
    return lib


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("prefill_emulated")
    return declare(emulated_library("emulate_prefill.sh", "libmambafuse_prefill_emulated.so", out))


@pytest.fixture(params=COPY_MODES)
def copy_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MAMBAFUSE_EMU_COPY", request.param)
    return request.param


@pytest.fixture(params=STATE_KERNELS)
def state_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(STATE_VARIABLE, request.param)
    return request.param


def run_scan(
    emulated: ctypes.CDLL, inputs: dict[str, np.ndarray | None], path: int = 1, state_layout: int = 0
) -> tuple[np.ndarray, ...]:
    """The emulated MambaChunkScan (path 0 auto, 1 chunked, 2 sequential, 3 step) on ``inputs``, the states in
    ``state_layout``'s layout; out and final state start NaN."""
    batch, length, heads, head_dim = inputs["x"].shape
    groups, state_size = inputs["B"].shape[2:]
    out = np.full((batch, length, heads, head_dim), np.nan, np.float32)
    state_dims = (state_size, head_dim) if state_layout == 1 else (head_dim, state_size)
    final = np.full((batch, heads, *state_dims), np.nan, np.float32)
    d, state = inputs["D"], inputs["initial_state"]
    rc = emulated.mambafuse_chunk_scan_launch_layout(
        *(host_pointer(inputs[n]) for n in ("x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state")),
        host_pointer(out),
        host_pointer(final),
        ONNX_TYPE[inputs["x"].dtype],
        ONNX_TYPE[inputs["dt"].dtype],
        ONNX_TYPE[d.dtype if d is not None else FLOAT],
        ONNX_TYPE[state.dtype if state is not None else FLOAT],
        batch,
        length,
        heads,
        head_dim,
        groups,
        state_size,
        1,
        0.0,
        float("inf"),
        state_layout,
        path,
        None,
    )
    assert rc == 0
    return out, final


def check_scan(
    emulated: ctypes.CDLL, inputs: dict[str, np.ndarray | None], path: int = 1, state_layout: int = 0
) -> tuple[np.ndarray, ...]:
    """Run the emulated kernel, assert its outputs are within the budget (the inputs' head 0 decays slowly, so the
    state counts in every row of a chunk: tests/test_mamba_chunk_scan_kernel.make_inputs) and return them."""
    out, final = run_scan(emulated, inputs, path, state_layout)
    ok, summary = scan_budget_report(out, final, **inputs, state_layout=state_layout)
    assert ok, summary
    return out, final


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_size", [128, 64])
@pytest.mark.parametrize(("length", "initial"), [(1, True), (65, True), (130, False)], ids=["1", "65", "130-no-state"])
def test_the_half_path(
    emulated: ctypes.CDLL, copy_mode: str, state_kernel: str, t: np.dtype, state_size: int, length: int, initial: bool
) -> None:
    """The build for the models' widths (P = 64, N = 128 or 64, float16 / bfloat16): one token (asked for: by default
    one token takes the step kernel), a chunk and one more, two chunks and a short one; with D and a state, and
    without both."""
    rng = np.random.default_rng(length + state_size)
    kind = FLOAT if initial else None
    inputs = scan_inputs(
        rng,
        t,
        batch=1,
        length=length,
        heads=2,
        head_dim=64,
        groups=1,
        state_size=state_size,
        d_type=kind,
        state_type=kind,
    )
    check_scan(emulated, inputs, path=1)


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_size", [128, 64])
def test_the_half_path_over_many_chunks(
    emulated: ctypes.CDLL, copy_mode: str, state_kernel: str, t: np.dtype, state_size: int
) -> None:
    """Four chunks and a short fifth (the staging buffers go round more than once), two batch rows, four heads in
    two groups, a state of the input type."""
    rng = np.random.default_rng(state_size + 7)
    inputs = scan_inputs(
        rng, t, batch=2, length=300, heads=4, head_dim=64, groups=2, state_size=state_size, d_type=t, state_type=t
    )
    check_scan(emulated, inputs)


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
def test_the_half_path_with_a_float_time_step(emulated: ctypes.CDLL, state_kernel: str, t: np.dtype) -> None:
    """dt and dt_bias float with 16-bit x, B, C and state (a mobius build's scan): the time steps the helper warps
    compute are not rounded to T (the budget is the float time step's), over three chunks."""
    rng = np.random.default_rng(11)
    inputs = scan_inputs(
        rng, t, batch=1, length=150, heads=2, head_dim=64, groups=1, state_size=128, d_type=FLOAT, state_type=t
    )
    inputs["dt"] = (rng.standard_normal(inputs["dt"].shape) - 1).astype(FLOAT)
    inputs["dt_bias"] = rng.standard_normal(inputs["dt_bias"].shape).astype(FLOAT)
    check_scan(emulated, inputs)


@pytest.mark.parametrize(
    ("t", "head_dim", "state_size", "path"),
    [(FLOAT16, 64, 128, 1), (BFLOAT16, 64, 64, 1), (FLOAT, 40, 24, 1), (FLOAT16, 8, 16, 2)],
    ids=["half-N128", "half-N64", "float-odd", "sequential"],
)
def test_the_state_in_n_p_layout(
    emulated: ctypes.CDLL, state_kernel: str, t: np.dtype, head_dim: int, state_size: int, path: int
) -> None:
    """state_layout 1 ((B, H, N, P) states, as mobius builds keep them) on every kernel: within the budget, and the
    same bits as layout 0 transposed (only where the state is read and written differs)."""
    rng = np.random.default_rng(head_dim + state_size)
    inputs = scan_inputs(
        rng, t, batch=2, length=130, heads=2, head_dim=head_dim, groups=1, state_size=state_size, state_type=t
    )
    laid = dict(inputs, initial_state=np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2)))
    out, final = check_scan(emulated, laid, path, state_layout=1)
    plain_out, plain_final = run_scan(emulated, inputs, path)
    np.testing.assert_array_equal(out, plain_out)
    np.testing.assert_array_equal(final, plain_final.transpose(0, 1, 3, 2))


@pytest.mark.parametrize(("length", "token", "path"), [(100, 70, 1), (1, 0, 3)], ids=["half-path", "step"])
def test_a_nan_stays_in_its_head_and_after_its_token(
    emulated: ctypes.CDLL, state_kernel: str, length: int, token: int, path: int
) -> None:
    """A NaN time step at one token of head 1 (70: in the second chunk; or a one-token prompt's, on the step
    kernel): that head's outputs from that token on and its state are NaN; its earlier tokens and the other heads
    are what they are without it."""
    rng = np.random.default_rng(5)
    inputs = scan_inputs(rng, FLOAT16, batch=1, length=length, heads=4, head_dim=64, groups=2, state_size=128)
    inputs["dt"][0, token, 1] = np.nan
    out, final = run_scan(emulated, inputs, path)
    assert np.isnan(out[0, token:, 1]).all() and np.isnan(final[0, 1]).all()
    assert np.isfinite(out[0, :token, 1]).all()
    others = [0, 2, 3]
    assert np.isfinite(out[:, :, others]).all() and np.isfinite(final[:, others]).all()
    clean = dict(inputs, dt=inputs["dt"].copy())
    clean["dt"][0, token, 1] = 0
    ref_out, ref_final = run_scan(emulated, clean, path)
    np.testing.assert_array_equal(out[:, :, others], ref_out[:, :, others])
    np.testing.assert_array_equal(final[:, others], ref_final[:, others])


def test_the_state_switch_runs_another_kernel(emulated: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """RegisterStateScan is the half path's default; MAMBAFUSE_CHUNK_SCAN_CUDA_STATE=shared runs ChunkedScan, whose
    sums go in another order: its outputs are within the budget (the tests above) but not RegisterStateScan's bits,
    so the switch and the default are seen to act."""
    rng = np.random.default_rng(11)
    inputs = scan_inputs(rng, FLOAT16, batch=1, length=100, heads=2, head_dim=64, groups=1, state_size=128)
    monkeypatch.delenv(STATE_VARIABLE, raising=False)
    default = run_scan(emulated, inputs)
    monkeypatch.setenv(STATE_VARIABLE, "registers")
    registers = run_scan(emulated, inputs)
    monkeypatch.setenv(STATE_VARIABLE, "shared")
    shared = run_scan(emulated, inputs)
    for a, b in zip(default, registers, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(shared[0], registers[0])
    np.testing.assert_allclose(registers[0], shared[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    ("head_dim", "state_size", "length"), [(64, 128, 130), (40, 24, 70), (8, 16, 65)], ids=["real", "odd", "small"]
)
def test_the_kernel_for_any_widths(
    emulated: ctypes.CDLL,
    monkeypatch: pytest.MonkeyPatch,
    copy_mode: str,
    t: np.dtype,
    head_dim: int,
    state_size: int,
    length: int,
) -> None:
    """The chunked kernel for any widths (MAMBAFUSE_CHUNK_SCAN_CUDA_WIDTHS=any also at the models' widths), P and N
    padded to 16, two groups, state and D in T."""
    monkeypatch.setenv("MAMBAFUSE_CHUNK_SCAN_CUDA_WIDTHS", "any")
    rng = np.random.default_rng(head_dim + length)
    inputs = scan_inputs(
        rng,
        t,
        batch=1,
        length=length,
        heads=2,
        head_dim=head_dim,
        groups=2,
        state_size=state_size,
        d_type=t,
        state_type=t,
    )
    check_scan(emulated, inputs)


STEP_WIDTHS = {"real": (64, 128, 1), "mamba2-N64": (64, 64, 2), "vectors": (40, 24, 2), "scalars": (6, 10, 1)}


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_layout", [0, 1])
@pytest.mark.parametrize("widths", STEP_WIDTHS.values(), ids=STEP_WIDTHS.keys())
def test_the_one_token_step(emulated: ctypes.CDLL, t: np.dtype, state_layout: int, widths: tuple[int, ...]) -> None:
    """A one-token prompt (a decode step) takes the step kernel by default: within the budget in both state
    layouts, at the models' widths, widths of 4-element vectors and widths that are not (P = 6, N = 10), two batch
    rows, four heads in one or two groups, a state and D of the input type."""
    head_dim, state_size, groups = widths
    assert emulated.mambafuse_chunk_scan_resolve(head_dim, state_size, 1, 0) == 3
    rng = np.random.default_rng(head_dim + state_size + state_layout)
    inputs = scan_inputs(
        rng,
        t,
        batch=2,
        length=1,
        heads=4,
        head_dim=head_dim,
        groups=groups,
        state_size=state_size,
        d_type=t,
        state_type=t,
    )
    if state_layout == 1:
        inputs["initial_state"] = np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2))
    out, final = check_scan(emulated, inputs, path=0, state_layout=state_layout)
    asked = run_scan(emulated, inputs, path=3, state_layout=state_layout)
    np.testing.assert_array_equal(out, asked[0])
    np.testing.assert_array_equal(final, asked[1])


@pytest.mark.parametrize("state_layout", [0, 1])
@pytest.mark.parametrize("kind", ["float", "none"])
def test_the_one_token_step_with_a_float_time_step_and_state_or_none(
    emulated: ctypes.CDLL, state_layout: int, kind: str
) -> None:
    """The step with dt and dt_bias float for float16 x, B and C (a mobius build's decode step), a float32 state or
    none (zeros), and without D."""
    rng = np.random.default_rng(21 + state_layout)
    state_type = FLOAT if kind == "float" else None
    inputs = scan_inputs(
        rng, FLOAT16, batch=1, length=1, heads=4, head_dim=64, groups=1, state_size=128, state_type=state_type
    )
    inputs["dt"] = (rng.standard_normal(inputs["dt"].shape) - 1).astype(FLOAT)
    inputs["dt_bias"] = rng.standard_normal(inputs["dt_bias"].shape).astype(FLOAT)
    inputs["D"] = None
    if state_layout == 1 and state_type is not None:
        inputs["initial_state"] = np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2))
    check_scan(emulated, inputs, path=3, state_layout=state_layout)


def test_the_step_is_one_token_only(emulated: ctypes.CDLL) -> None:
    """Asked for with a longer prompt, the step path is the default's choice for it; the sequential kernel asked for
    runs a one-token prompt too."""
    assert emulated.mambafuse_chunk_scan_resolve(64, 128, 2, 3) == 1
    assert emulated.mambafuse_chunk_scan_resolve(64, 128, 1, 2) == 2
    assert emulated.mambafuse_chunk_scan_resolve(64, 128, 1, 1) == 1
    rng = np.random.default_rng(8)
    inputs = scan_inputs(rng, FLOAT16, batch=1, length=3, heads=2, head_dim=64, groups=1, state_size=128)
    check_scan(emulated, inputs, path=3)


def test_the_sequential_kernel(emulated: ctypes.CDLL) -> None:
    rng = np.random.default_rng(3)
    inputs = scan_inputs(rng, FLOAT16, batch=2, length=40, heads=2, head_dim=8, groups=1, state_size=24)
    check_scan(emulated, inputs, path=2)


def test_the_emulation_sees_a_wrong_result(emulated: ctypes.CDLL) -> None:
    """The check above can fail: a state changed after the kernel ran is outside the budget."""
    rng = np.random.default_rng(4)
    inputs = scan_inputs(rng, FLOAT16, batch=1, length=65, heads=2, head_dim=64, groups=1, state_size=64)
    out, final = run_scan(emulated, inputs)
    assert scan_budget_report(out, final, **inputs)[0]
    final[0, 1, 5, 7] *= 1.001
    assert not scan_budget_report(out, final, **inputs)[0]


def run_conv(
    emulated: ctypes.CDLL,
    inputs: dict[str, np.ndarray | None],
    *,
    channels_last: int,
    activation: str = "silu",
    round_once: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the emulated CausalConv1d; return y and the final state."""
    x, weight, state = inputs["x"], inputs["weight"], inputs["initial_state"]
    t = x.dtype
    batch = x.shape[0]
    length, channels = (x.shape[1], x.shape[2]) if channels_last else (x.shape[2], x.shape[1])
    state_len = state.shape[2] if state is not None else weight.shape[2] - 1
    y = np.full(x.shape, np.nan, t)
    final = np.full((batch, channels, state_len), np.nan, t)
    rc = emulated.mambafuse_causal_conv1d_launch_rounding(
        host_pointer(x),
        host_pointer(weight),
        host_pointer(inputs["bias"]),
        host_pointer(state),
        host_pointer(y),
        host_pointer(final),
        ONNX_TYPE[t],
        batch,
        channels,
        length,
        state_len,
        weight.shape[2],
        int(activation == "silu"),
        channels_last,
        round_once,
        None,
    )
    assert rc == 0
    return y, final


def check_conv(
    emulated: ctypes.CDLL,
    inputs: dict[str, np.ndarray | None],
    *,
    channels_last: int,
    activation: str = "silu",
    round_once: int = 0,
) -> np.ndarray:
    """Run the emulated CausalConv1d, assert it is within the budget (of ``round_once``'s rounding), return y."""
    y, final = run_conv(emulated, inputs, channels_last=channels_last, activation=activation, round_once=round_once)
    ok, message = conv_budget_report(
        y,
        final,
        inputs["x"],
        inputs["weight"],
        inputs["bias"],
        inputs["initial_state"],
        activation=activation,
        channels_last=channels_last,
        state_width=final.shape[2],
        round_once=round_once,
    )
    assert ok, message
    return y


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize(
    ("channels", "length", "width"),
    [(40, 24, 4), (37, 19, 4), (2048, 200, 4), (24, 9, 3)],
    ids=["vector", "scalar", "tiles", "any-width"],
)
def test_the_conv(
    emulated: ctypes.CDLL, t: np.dtype, channels_last: int, channels: int, length: int, width: int
) -> None:
    """CausalConv1d's kernels: 16-byte vectors and single channels (C = 37), many token tiles (2048 channels, 200
    tokens, batch 4: the channels-last grid is 2 channel blocks by the tiles that fit one round), and K = 3."""
    rng = np.random.default_rng(channels + length)
    batch = 4 if channels == 2048 else 2
    inputs = conv_inputs(
        rng,
        t=t,
        batch=batch,
        channels=channels,
        length=length,
        width=width,
        state_width=max(width - 1, 4),
        channels_last=channels_last,
    )
    check_conv(emulated, inputs, channels_last=channels_last)


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize(("channels", "length"), [(40, 24), (37, 19)], ids=["vector", "scalar"])
def test_the_conv_rounded_once(emulated: ctypes.CDLL, t: np.dtype, channels_last: int, channels: int, length: int):
    """``round_once`` (a mobius build's conv): every kernel path within the rounded-once budget, and its SiLU outputs
    not those of the default rounding (the flag reaches the kernel)."""
    rng = np.random.default_rng(channels + length + 1)
    inputs = conv_inputs(
        rng, t=t, batch=2, channels=channels, length=length, width=4, state_width=4, channels_last=channels_last
    )
    once = check_conv(emulated, inputs, channels_last=channels_last, round_once=1)
    each = check_conv(emulated, inputs, channels_last=channels_last)
    assert not np.array_equal(once, each)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_the_conv_over_many_tiles_and_a_part_step(emulated: ctypes.CDLL, t: np.dtype) -> None:
    """The channels-last kernel over 203 tokens: tiles of 16 (four steps each) and a last tile of 11 (two steps and a
    part step of three tokens), at batch 2."""
    rng = np.random.default_rng(203)
    inputs = conv_inputs(rng, t=t, batch=2, channels=48, length=203, width=4, state_width=4, channels_last=1)
    check_conv(emulated, inputs, channels_last=1)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_the_conv_step(emulated: ctypes.CDLL, t: np.dtype, channels_last: int, length: int) -> None:
    """A prompt of one to four tokens (a decode step through the op) takes the step kernel in either layout, within
    the budget of both roundings: with a state of K - 1 columns, of K + 2 (the final state then partly the initial
    state's columns) without a bias, and with none; 131 channels at batch 2, so the last block is partly empty."""
    assert emulated.mambafuse_causal_conv1d_path(4, length, channels_last) == 3
    rng = np.random.default_rng(300 + 2 * length + channels_last)
    for state_width, state, bias in ((3, True, True), (6, True, False), (3, False, True)):
        inputs = conv_inputs(
            rng,
            t=t,
            batch=2,
            channels=131,
            length=length,
            width=4,
            state_width=state_width,
            bias=bias,
            state=state,
            channels_last=channels_last,
        )
        for round_once in (0, 1):
            check_conv(emulated, inputs, channels_last=channels_last, round_once=round_once)


def test_the_conv_step_is_for_short_prompts_of_width_four(emulated: ctypes.CDLL) -> None:
    """Five tokens take the layout's prompt kernel again, and another width the any-width kernel at any length."""
    path = emulated.mambafuse_causal_conv1d_path
    assert [path(4, 5, 1), path(4, 5, 0), path(3, 1, 1), path(5, 1, 0)] == [1, 2, 4, 4]


def test_the_conv_step_sees_a_wrong_final_state(emulated: ctypes.CDLL) -> None:
    """The budget check catches a final state one column off (what a shifted window would write)."""
    rng = np.random.default_rng(5)
    inputs = conv_inputs(rng, t=FLOAT16, batch=1, channels=40, length=1, width=4, state_width=3, channels_last=1)
    x, weight, state = inputs["x"], inputs["weight"], inputs["initial_state"]
    y, final = run_conv(emulated, inputs, channels_last=1)
    report = dict(activation="silu", channels_last=1, state_width=3, round_once=0)
    assert conv_budget_report(y, final, x, weight, inputs["bias"], state, **report)[0]
    shifted = np.concatenate([state[:, :, :1], final[:, :, :2]], axis=2)
    assert not conv_budget_report(y, shifted, x, weight, inputs["bias"], state, **report)[0]
