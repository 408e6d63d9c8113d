"""The CUDA kernel of ai.mambafuse::CausalConv1d against fusion/reference/causal_conv1d.py (docs/causal_conv1d.md)
at its accuracy budget: both layouts, every type, with and without bias and initial state, SiLU and none, prompts
around the kernel width and the channels-last kernel's token tiles (16 tokens where the grid is small) up to 2049
tokens, state widths K - 1 to K + 2, other kernel widths (the any-width kernel), channel counts on and off the
16-byte vector width up to 10240, batch 1 and 3, special values, a prompt in pieces equal to the whole bit for bit,
a CUDA-graph replay, where the node runs, and bad inputs.

Needs onnxruntime with the CUDA execution provider, a GPU, and the library built with -DMAMBAFUSE_CUDA=ON (point
$MAMBAFUSE_LIBRARY at it). Every session forbids CPU fallback, so a library without the CUDA kernel fails instead
of running the CPU one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from fusion.reference.causal_conv1d import budget_report
from tests._cuda import CUDA, cuda_problem, cuda_session, feeds_of
from tests._decode_step import DTYPE_IDS, DTYPES, FLOAT, FLOAT16, one_node_model
from tests.test_causal_conv1d_kernel import make_inputs as kernel_inputs

ort = pytest.importorskip("onnxruntime")
_problem = cuda_problem(ort)
pytestmark = pytest.mark.skipif(_problem is not None, reason=_problem or "")

OP = "CausalConv1d"
NAMES = ("x", "weight", "bias", "initial_state")


def make_inputs(
    rng: np.random.Generator, *, t: np.dtype, channels: int = 40, length: int = 24, **sizes: object
) -> dict[str, np.ndarray | None]:
    """The CPU kernel tests' seeded inputs (x and the state standard normal, the weight and bias at a conv's scale),
    with 40 channels (five 8-wide float16 vectors) and 24 tokens by default."""
    return kernel_inputs(rng, t=t, channels=channels, length=length, **sizes)


def node_model(inputs: dict[str, np.ndarray | None], **attrs: object) -> onnx.ModelProto:
    t = inputs["x"].dtype
    return one_node_model(OP, [(n, inputs[n]) for n in NAMES], [("y", t), ("final_state", t)], **attrs)


def run_cuda(inputs: dict[str, np.ndarray | None], **attrs: object) -> list[np.ndarray]:
    """Return (y, final_state) of the op on the CUDA EP, in x's type."""
    t = inputs["x"].dtype
    results = cuda_session(node_model(inputs, **attrs)).run(None, feeds_of(inputs.items()))
    return [r.astype(t) for r in results]


def check(
    inputs: dict[str, np.ndarray | None],
    *,
    state_width: int = 4,
    channels_last: int = 1,
    activation: str = "silu",
    label: str = "",
    round_once: int | None = None,
) -> list[np.ndarray]:
    """Run the CUDA kernel, assert its outputs are within the budget (the final state exact), and return them.
    ``round_once``: the attribute's value (None: absent)."""
    extra = {} if round_once is None else {"round_once": round_once}
    y, final_state = run_cuda(
        inputs, state_width=state_width, channels_last=channels_last, activation=activation, **extra
    )
    ok, message = budget_report(
        y,
        final_state,
        *(inputs[n] for n in NAMES),
        activation=activation,
        channels_last=channels_last,
        state_width=state_width,
        round_once=round_once or 0,
    )
    assert ok, f"{label} {message}"
    return [y, final_state]


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize(
    ("bias", "state"),
    [(True, True), (False, False), (True, False), (False, True)],
    ids=["all", "bare", "bias", "state"],
)
def test_types_layouts_and_optional_inputs(t, channels_last, activation, bias, state):
    """C = 40 and L = 24: the 16-byte vector kernels of both layouts."""
    rng = np.random.default_rng([DTYPES.index(t), channels_last, len(activation), int(bias), int(state)])
    inputs = make_inputs(rng, t=t, bias=bias, state=state, channels_last=channels_last)
    check(inputs, channels_last=channels_last, activation=activation)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize(("length", "channels"), [(1, 64), (65, 64), (300, 10240)])
def test_rounded_once(t, channels_last, activation, length, channels):
    """``round_once = 1`` (ONNX Runtime's CausalConvWithState, a mobius build's conv) within the budget of y rounded
    once, on every kernel path (the real width's vectors, short prompts); float32's and the plain conv's outputs the
    same bits as the default rounding's."""
    rng = np.random.default_rng(length)
    inputs = make_inputs(rng, t=t, length=length, channels=channels, channels_last=channels_last)
    once = check(inputs, channels_last=channels_last, activation=activation, round_once=1)
    each = check(inputs, channels_last=channels_last, activation=activation)
    np.testing.assert_array_equal(once[1], each[1])
    if t == FLOAT or activation == "none":
        np.testing.assert_array_equal(once[0], each[0])


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 8, 15, 16, 17, 19, 33, 300, 2048, 2049])
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
def test_prompt_lengths(length, channels_last):
    """Prompts shorter than the state (the final state keeps part of the initial one), around the kernel width,
    around the channels-last kernel's 16-token tiles and its 4-token steps (a last step of 1, 2, 3 tokens), long
    prompts; in channels-first, lengths on and off the vector width (the vector and the scalar kernel)."""
    rng = np.random.default_rng([length, channels_last])
    for t in DTYPES:
        inputs = make_inputs(rng, t=t, batch=3, channels=24, length=length, channels_last=channels_last)
        check(inputs, channels_last=channels_last, label=f"T={DTYPE_IDS[t]}")


@pytest.mark.parametrize(("width", "state_width"), [(4, 3), (4, 4), (4, 6), (3, 2), (2, 1), (1, 0), (5, 4)])
def test_widths_and_state_widths(width, state_width):
    """causal-conv1d's S = K - 1, transformers' S = K, a wider state; the other kernel widths take the any-width
    kernel (with its final-state kernel; K = 1 has an empty state)."""
    rng = np.random.default_rng([width, state_width])
    for channels_last in (1, 0):
        for t in DTYPES:
            inputs = make_inputs(rng, t=t, width=width, state_width=state_width, length=11, channels_last=channels_last)
            check(inputs, state_width=state_width, channels_last=channels_last, label=f"T={DTYPE_IDS[t]}")


@pytest.mark.parametrize(("channels", "batch"), [(1, 1), (5, 3), (33, 1), (10240, 1), (10240, 3)])
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
def test_channel_counts_and_batches(channels, batch, channels_last):
    """Channel counts off the vector width (the channels-last scalar kernel) and the real conv dim (10 blocks of
    1024 float16 channels, 20 of 512 float), at batch 1 and 3."""
    rng = np.random.default_rng([channels, batch, channels_last])
    length = {(10240, 1): 200, (10240, 3): 40}.get((channels, batch), 70)
    for t in DTYPES:
        inputs = make_inputs(rng, t=t, batch=batch, channels=channels, length=length, channels_last=channels_last)
        check(inputs, channels_last=channels_last, label=f"T={DTYPE_IDS[t]}")


@pytest.mark.parametrize("t", [FLOAT, FLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
def test_prompt_in_pieces_equals_the_prompt(t, channels_last):
    """Three pieces (37 tokens, 1, 62), each starting from the last one's final state: the outputs and state of the
    whole prompt, bit for bit (each output's sum reads the same K values in the same order)."""
    rng = np.random.default_rng(7)
    inputs = make_inputs(rng, t=t, length=100, channels=48, channels_last=channels_last)
    whole_y, whole_state = check(inputs, channels_last=channels_last)
    axis = 1 if channels_last else 2
    pieces, state = [], inputs["initial_state"]
    for start, stop in ((0, 37), (37, 38), (38, 100)):
        piece = dict(inputs, x=np.take(inputs["x"], range(start, stop), axis=axis), initial_state=state)
        y, state = check(piece, channels_last=channels_last, label=f"piece {start}:{stop}")
        pieces.append(y)
    np.testing.assert_array_equal(np.concatenate(pieces, axis=axis).view(np.uint8), whole_y.view(np.uint8))
    np.testing.assert_array_equal(state.view(np.uint8), whole_state.view(np.uint8))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
def test_special_values(t, channels_last):
    """NaN in one channel's input (in that channel's outputs and copied into its final state), sums that overflow T
    to infinity, conv outputs beyond |v| = 80 (the sigmoid's any-value path, which the other outputs of that
    thread's 8 or 4 channels then take too) and subnormal inputs and sums: each where the reference puts it."""
    rng = np.random.default_rng([DTYPES.index(t), channels_last])
    inputs = make_inputs(rng, t=t, batch=2, channels=40, length=24, channels_last=channels_last)
    x, weight, bias = inputs["x"], inputs["weight"], inputs["bias"]
    at = (lambda b, tok, c: (b, tok, c)) if channels_last else (lambda b, tok, c: (b, c, tok))
    x[at(0, 22, 3)] = np.nan
    weight[9, 0, :] = 2.0
    x[at(1, 5, 9)] = 60000.0 if t == FLOAT16 else 3e38  # twice that is past T's largest value
    weight[17, 0, :] = 1.0
    x[at(0, slice(8, 12), 17)] = -25.0  # v = -100 at token 11 (every tap), -75, -50, -25 before it
    x[at(1, slice(8, 12), 17)] = 25.0
    bias[30] = 0.0
    x[at(0, slice(0, 24), 30)] = 1e-6 if t == FLOAT16 else 1e-39  # subnormal in T, and so are the sums
    y, final_state = check(inputs, channels_last=channels_last)
    nan_y = np.argwhere(np.isnan(y.astype(np.float32)))
    channel_axis = 2 if channels_last else 1
    assert len(nan_y) and set(nan_y[:, channel_axis]) == {3} and set(nan_y[:, 0]) == {0}, nan_y
    assert np.isnan(final_state[0, 3].astype(np.float32)).sum() == 1


@pytest.mark.parametrize("length", [1, 2, 4])
@pytest.mark.parametrize("channels_last", [1, 0], ids=["BLC", "BCL"])
def test_short_prompts_take_the_step_kernel(length, channels_last):
    """A decode step through the op (one to four tokens: the step kernel) at the real conv dim, batch 1 and 3, every
    type and both roundings, with a state of K - 1 columns (mobius' cache), K + 2 (the final state partly the initial
    state's columns) and none; a NaN in one channel's token stays in that channel's output and final state."""
    rng = np.random.default_rng([length, channels_last, 5])
    for t in DTYPES:
        for batch, state_width, state in ((1, 3, True), (3, 6, True), (3, 3, False)):
            inputs = make_inputs(
                rng,
                t=t,
                batch=batch,
                channels=10240,
                length=length,
                state_width=state_width,
                state=state,
                channels_last=channels_last,
            )
            label = f"T={DTYPE_IDS[t]} B={batch} S={state_width} state={state}"
            for round_once in (0, 1):
                check(inputs, state_width=state_width, channels_last=channels_last, round_once=round_once, label=label)
        inputs = make_inputs(rng, t=t, batch=2, channels=40, length=length, state_width=3, channels_last=channels_last)
        inputs["x"][(1, length - 1, 7) if channels_last else (1, 7, length - 1)] = np.nan
        y, final_state = check(inputs, state_width=3, channels_last=channels_last, label=f"T={DTYPE_IDS[t]} NaN")
        nan_y = np.argwhere(np.isnan(y.astype(np.float32)))
        channel_axis = 2 if channels_last else 1
        assert len(nan_y) and set(nan_y[:, channel_axis]) == {7} and set(nan_y[:, 0]) == {1}, nan_y
        assert np.argwhere(np.isnan(final_state.astype(np.float32))).tolist() == [[1, 7, 2]]


@pytest.mark.parametrize("length", [40, 1], ids=["prompt", "one-token"])
def test_one_run_in_a_cuda_graph(length):
    """ORT's CUDA graph: the node is captured on ORT's stream at the first run and replayed; new input values
    written into the bound device buffers give the new prompt's results (no allocation or host sync inside). A
    one-token prompt (the step kernel) too: a decode step replayed from a captured graph."""
    rng = np.random.default_rng(11)
    first = make_inputs(rng, t=FLOAT16, batch=1, channels=64, length=length)
    sess = cuda_session(node_model(first, state_width=4), enable_cuda_graph="1")
    binding = sess.io_binding()
    bound = {}
    for name, value in feeds_of(first.items()).items():
        bound[name] = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        binding.bind_ortvalue_input(name, bound[name])
    y_value = ort.OrtValue.ortvalue_from_shape_and_type(first["x"].shape, np.float16, "cuda", 0)
    state_value = ort.OrtValue.ortvalue_from_shape_and_type(first["initial_state"].shape, np.float16, "cuda", 0)
    binding.bind_ortvalue_output("y", y_value)
    binding.bind_ortvalue_output("final_state", state_value)
    for step in range(3):
        inputs = first if step == 0 else make_inputs(rng, t=FLOAT16, batch=1, channels=64, length=length)
        for name, value in feeds_of(inputs.items()).items():
            bound[name].update_inplace(value)
        sess.run_with_iobinding(binding)
        ok, message = budget_report(y_value.numpy(), state_value.numpy(), *(inputs[n] for n in NAMES), state_width=4)
        assert ok, f"step {step}: {message}"


def test_the_node_runs_on_the_cuda_provider(tmp_path: Path):
    """ORT's profile names the provider that ran the node: CUDA's, the library's kernel (not a CPU kernel, not a
    function body: the one-node model has none)."""
    inputs = make_inputs(np.random.default_rng(3), t=FLOAT16)
    sess = cuda_session(node_model(inputs, state_width=4), profile_prefix=str(tmp_path / "profile"))
    sess.run(None, feeds_of(inputs.items()))
    events = json.loads(Path(sess.end_profiling()).read_text())
    providers = {
        e["args"].get("provider") for e in events if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == OP
    }
    assert providers == {CUDA}, providers


BAD = {
    "x rank": (lambda i: i.update(x=i["x"][0]), "x must be 3-D"),
    "weight channels": (lambda i: i.update(weight=i["weight"][:5]), "weight must have shape"),
    "bias shape": (lambda i: i.update(bias=i["bias"][:3]), "bias must have shape"),
    "state shape": (lambda i: i.update(initial_state=i["initial_state"][..., :2]), "initial_state must have shape"),
    "weight type": (lambda i: i.update(weight=i["weight"].astype(np.float16)), "weight must have x's type"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_inputs_are_errors(case):
    """The CPU op's checks and messages (the CUDA op shares its validation)."""
    change, message = BAD[case]
    inputs = make_inputs(np.random.default_rng(0), t=FLOAT)
    change(inputs)
    model = one_node_model(OP, [(n, inputs[n]) for n in NAMES], [("y", FLOAT), ("final_state", FLOAT)], state_width=4)
    with pytest.raises(Exception, match=f"CausalConv1d: .*{message}"):
        cuda_session(model).run(None, feeds_of(inputs.items()))


def test_state_width_below_the_kernel_is_an_error():
    inputs = make_inputs(np.random.default_rng(0), t=FLOAT, state_width=2, state=False)
    with pytest.raises(Exception, match="state_width must be at least K - 1 = 3"):
        run_cuda(inputs, state_width=2)


def test_missing_state_width_is_an_error_at_session_creation():
    inputs = make_inputs(np.random.default_rng(0), t=FLOAT, state=False)
    with pytest.raises(Exception, match="the attribute state_width .* is required"):
        run_cuda(inputs)
