"""The CPU kernel of ai.mambafuse::MambaChunkScan against fusion/reference/mamba_chunk_scan.py
(docs/mamba_chunk_scan.md): every output within ``budget_report``'s budget of the float64 recurrence, over the types,
the optional inputs, prompt lengths around the kernel's chunk size, the group mappings, the time step's attributes,
a prompt fed in pieces, thread counts and chunk sizes; bad inputs are errors that name the input; the library's
per-instruction-set copies of Eigen do not share a symbol."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

import contrib_ops
from fusion.reference.mamba_chunk_scan import budget_report
from tests._decode_step import BFLOAT16, DTYPE_IDS, DTYPES, FLOAT, FLOAT16, one_node_model, run, session

OP = "MambaChunkScan"
NAMES = ("x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state")
OUTPUTS = [("out", FLOAT), ("final_state", FLOAT)]
#: The kernel's chunk size (contrib_ops/cpu/mamba_chunk_scan_impl.h, kDefaultChunkSize).
Q = 64
#: The environment variable that sets the kernel's chunk size (read per run).
CHUNK_VARIABLE = "MAMBAFUSE_CHUNK_SCAN_CHUNK"
REPO = Path(__file__).resolve().parents[1]


def make_inputs(
    rng: np.random.Generator,
    t: np.dtype = FLOAT,
    *,
    batch: int = 2,
    length: int = 70,
    heads: int = 4,
    head_dim: int = 8,
    groups: int = 2,
    state_size: int = 16,
    dt_bias: bool = True,
    d_type: np.dtype | None = FLOAT,
    state_type: np.dtype | None = FLOAT,
) -> dict[str, np.ndarray | None]:
    """Return seeded inputs with a Mamba-2 prompt's magnitudes (dt in softplus' range, A < 0). Head 0 decays slowly
    (A = -0.02): with A alone from the usual range (down to -4.5 a unit of time) the state's share of a chunk's later
    rows falls below the budget, and a kernel reading the wrong state or C there would pass."""
    a = -np.exp(rng.uniform(-2, 1.5, heads)).astype(np.float32)
    a[:1] = -0.02  # (no head: nothing)
    return {
        "x": rng.standard_normal((batch, length, heads, head_dim)).astype(t),
        "dt": (rng.standard_normal((batch, length, heads)) - 1).astype(t),
        "dt_bias": rng.standard_normal(heads).astype(t) if dt_bias else None,
        "A": a,
        "B": rng.standard_normal((batch, length, groups, state_size)).astype(t),
        "C": rng.standard_normal((batch, length, groups, state_size)).astype(t),
        "D": rng.standard_normal(heads).astype(d_type) if d_type is not None else None,
        "initial_state": rng.standard_normal((batch, heads, head_dim, state_size)).astype(state_type)
        if state_type is not None
        else None,
    }


def run_kernel(inputs: dict[str, np.ndarray | None], threads: int = 1, **attrs: object) -> list[np.ndarray]:
    return run(OP, [(n, inputs[n]) for n in NAMES], OUTPUTS, threads=threads, **attrs)


def check(inputs: dict[str, np.ndarray | None], threads: int = 1, **attrs: object) -> list[np.ndarray]:
    """Run the kernel, assert both outputs are float32 and within the budget, and return them."""
    out, state = run_kernel(inputs, threads, **attrs)
    assert out.dtype == state.dtype == FLOAT
    ok, summary = budget_report(out, state, **inputs, **attrs)
    assert ok, summary
    return [out, state]


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("d_kind", ["D-f32", "D-T", "no-D"])
@pytest.mark.parametrize("state_kind", ["S-f32", "S-T", "no-state"])
@pytest.mark.parametrize("dt_bias", [True, False], ids=["bias", "no-bias"])
def test_types_and_optional_inputs(t: np.dtype, d_kind: str, state_kind: str, dt_bias: bool) -> None:
    """x/dt/dt_bias/B/C in T; D and initial_state float, T or absent; dt_bias present or not. 70 tokens: a full
    chunk and a short one."""
    d_type = {"D-f32": FLOAT, "D-T": t, "no-D": None}[d_kind]
    state_type = {"S-f32": FLOAT, "S-T": t, "no-state": None}[state_kind]
    check(make_inputs(np.random.default_rng(1), t, dt_bias=dt_bias, d_type=d_type, state_type=state_type))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("length", [1, 2, Q - 1, Q, Q + 1, 3 * Q + 5, 300])
def test_prompt_lengths(t: np.dtype, length: int) -> None:
    """One token, a short prompt, around one chunk, several chunks and a short last one, a few hundred."""
    check(make_inputs(np.random.default_rng(2), t, batch=1, length=length, heads=4, groups=2))


@pytest.mark.parametrize(("heads", "groups"), [(6, 1), (6, 2), (6, 6)], ids=["G1", "G2", "G=H"])
@pytest.mark.parametrize("batch", [1, 3])
def test_groups_and_batch(heads: int, groups: int, batch: int) -> None:
    """Head h reads group h // (H / G); batch rows are independent."""
    inputs = make_inputs(np.random.default_rng(3), FLOAT16, batch=batch, heads=heads, groups=groups, length=100)
    out, state = check(inputs)
    if batch == 3:
        # a batch row alone gives that row's bits: each head's arithmetic is the same whatever the work split
        row = {k: None if v is None else v[1:2] if v.ndim > 1 else v for k, v in inputs.items()}
        one_out, one_state = check(row)
        np.testing.assert_array_equal(one_out.view(np.uint32), out[1:2].view(np.uint32))
        np.testing.assert_array_equal(one_state.view(np.uint32), state[1:2].view(np.uint32))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    "attrs",
    [
        {"dt_softplus": 0},
        {"dt_softplus": 0, "dt_min": 0.01, "dt_max": 0.2},
        {"dt_min": 0.05, "dt_max": 0.5},
        {"dt_softplus": 1, "dt_min": 0.0, "dt_max": float("inf")},
    ],
    ids=["no-softplus", "no-softplus-limits", "softplus-limits", "defaults-explicit"],
)
def test_time_step_attributes(t: np.dtype, attrs: dict[str, float]) -> None:
    """Softplus off (a non-negative dt, as the budget needs), the model's time_step_limit, in T."""
    inputs = make_inputs(np.random.default_rng(4), t, length=90)
    if attrs.get("dt_softplus", 1) == 0:
        inputs["dt"] = np.abs(inputs["dt"].astype(np.float32) / 4).astype(t)
        inputs["dt_bias"] = np.abs(inputs["dt_bias"].astype(np.float32) / 4).astype(t)
    check(inputs, **attrs)


def test_the_time_step_limits_change_the_result() -> None:
    """The limits are applied: a clamp that bites moves the output outside the unclamped budget."""
    inputs = make_inputs(np.random.default_rng(5), FLOAT, length=40)
    out, state = check(inputs, dt_min=0.3, dt_max=0.4)
    assert not budget_report(out, state, **inputs)[0]


def test_time_steps_around_the_softplus_threshold() -> None:
    """dt + dt_bias of 25, 20 and 19.5 (torch's threshold is 20; softplus there equals its input in float16, so this
    checks the large steps' decays and inputs, not which branch ran) are within the budget."""
    inputs = make_inputs(np.random.default_rng(6), FLOAT16, length=12, heads=4, groups=1)
    inputs["A"] = np.full(4, -0.01, np.float32)  # decays of dt ~ 20 stay representable in the output
    dt = inputs["dt"].astype(np.float32)
    dt[:, :, 0], dt[:, :, 1], dt[:, :, 2] = 25.0, 20.0, 19.5
    inputs["dt"] = dt.astype(FLOAT16)
    inputs["dt_bias"][:] = 0
    check(inputs)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_a_prompt_in_pieces_equals_the_prompt_at_once(t: np.dtype) -> None:
    """Chunked prefill: 4 pieces (50 + 1 + 77 + 62 tokens), each from the final_state the last one left, are within
    the budget of the whole prompt, and so is the prompt at once."""
    inputs = make_inputs(np.random.default_rng(7), t, length=190, state_type=t)
    whole_out, whole_state = check(inputs)
    state, outs = inputs["initial_state"], []
    for start, end in ((0, 50), (50, 51), (51, 128), (128, 190)):
        piece = dict(inputs, initial_state=state)
        for name in ("x", "dt", "B", "C"):
            piece[name] = inputs[name][:, start:end]
        out, state = run_kernel(piece)
        outs.append(out)
    out = np.concatenate(outs, axis=1)
    ok, summary = budget_report(out, state, **inputs)
    assert ok, summary
    np.testing.assert_allclose(out, whole_out, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(state, whole_state, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("t", [FLOAT, FLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    ("heads", "head_dim", "groups", "state_size"),
    [(32, 64, 2, 128), (20, 64, 1, 64)],
    ids=["nemotron-h-head-shape", "zamba2-head-shape"],
)
def test_threads_give_the_same_bits(t: np.dtype, heads: int, head_dim: int, groups: int, state_size: int) -> None:
    """Real head shapes (Nemotron-H: P 64, N 128, 16 heads a group; Zamba2: P 64, N 64, one group) over 1 and 2
    intra-op threads: within the budget, and the same bits (the heads are split into items by the machine's size,
    not the session's thread count, and each item's arithmetic does not depend on which thread runs it)."""
    inputs = make_inputs(
        np.random.default_rng(8),
        t,
        batch=1,
        length=150,
        heads=heads,
        head_dim=head_dim,
        groups=groups,
        state_size=state_size,
    )
    one = check(inputs, threads=1)
    two = check(inputs, threads=2)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("chunk", [1, 7, 64, 128, 256])
@pytest.mark.parametrize("t", [FLOAT, BFLOAT16], ids=DTYPE_IDS.get)
def test_every_chunk_size_is_within_the_budget(chunk: int, t: np.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk size is the kernel's choice (MAMBAFUSE_CHUNK_SCAN_CHUNK overrides it): from 1, the sequential
    scan, to longer than the prompt, with strong and weak decays over 300 tokens."""
    monkeypatch.setenv(CHUNK_VARIABLE, str(chunk))
    inputs = make_inputs(np.random.default_rng(9), t, batch=1, length=300, heads=2, groups=1)
    inputs["A"] = np.array([-8.0, -0.05], np.float32)
    check(inputs)


@pytest.mark.parametrize("value", ["0", "-3", "lots", "5000"])
def test_a_bad_chunk_size_variable_is_an_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNK_VARIABLE, value)
    with pytest.raises(Exception, match=f"{CHUNK_VARIABLE} must be a whole number"):
        run_kernel(make_inputs(np.random.default_rng(10), length=5))


def test_a_nan_stays_in_its_head() -> None:
    """Special values are not specified by the contract; the kernel keeps a NaN time step in the head that reads it
    (from its token on: earlier tokens of its chunk may see 0 * NaN in the causal product)."""
    inputs = make_inputs(np.random.default_rng(11), FLOAT, batch=2, length=100, heads=4, groups=2)
    dt = inputs["dt"]
    dt[1, 70, 2] = np.nan
    out, state = run_kernel(inputs)
    nan_heads = {(b, h) for b, h in zip(*np.nonzero(np.isnan(out).any(axis=(1, 3))), strict=True)}
    assert nan_heads == {(1, 2)}, f"NaN outside head (1, 2): {sorted(nan_heads)}"
    assert np.isnan(out[1, 70:, 2]).all() and np.isnan(state[1, 2]).all()
    assert not np.isnan(out[1, :64, 2]).any(), "a NaN reached an earlier chunk"
    assert np.isnan(state).sum() == state[1, 2].size


def test_an_empty_batch_gives_empty_outputs() -> None:
    out, state = run_kernel(make_inputs(np.random.default_rng(15), batch=0, length=5))
    assert out.shape == (0, 5, 4, 8) and state.shape == (0, 4, 8, 16)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_no_state_or_no_head_channels(t: np.dtype) -> None:
    """N = 0: no state, the output is the skip D x alone (one float32 product: exact); P = 0: empty outputs. (The
    budget's float64 evaluation takes no empty arrays, so the values are compared directly.)"""
    inputs = make_inputs(np.random.default_rng(16), t, length=70, state_size=0)
    out, state = run_kernel(inputs)
    assert state.shape == (2, 4, 8, 0)
    skip = inputs["D"].astype(FLOAT)[None, None, :, None] * inputs["x"].astype(FLOAT)
    np.testing.assert_array_equal(out, skip)
    out, state = run_kernel(make_inputs(np.random.default_rng(17), t, length=70, head_dim=0))
    assert out.shape == (2, 70, 4, 0) and state.shape == (2, 4, 0, 16)


def _bad(change) -> dict[str, np.ndarray | None]:
    inputs = make_inputs(np.random.default_rng(12), length=10)
    change(inputs)
    return inputs


@pytest.mark.parametrize("t", [FLOAT16, BFLOAT16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("softplus", [1, 0])
@pytest.mark.parametrize("length", [1, 70, 200])
def test_a_float_time_step_with_16_bit_x_b_and_c(t: np.dtype, softplus: int, length: int) -> None:
    """dt and dt_bias float with x, B and C of a 16-bit type (a graph that computes the time step in float32): no
    rounding of the time step to T, and exactly what the op computes on x, B and C widened to float (a 16-bit value is
    exact in float32), bit for bit; within the budget."""
    rng = np.random.default_rng(length + softplus)
    inputs = make_inputs(rng, t, length=length, d_type=FLOAT, state_type=t)
    inputs["dt"] = (rng.standard_normal(inputs["dt"].shape) - 1).astype(FLOAT)  # not values of T
    inputs["dt_bias"] = rng.standard_normal(inputs["dt_bias"].shape).astype(FLOAT)
    attrs = {"dt_softplus": softplus, "dt_min": 0.001 if softplus else 0.0, "dt_max": 7.3}
    mixed = check(inputs, **attrs)
    widened = {n: v if v is None or n in ("dt", "dt_bias") else v.astype(FLOAT) for n, v in inputs.items()}
    for a, b in zip(mixed, run_kernel(widened, **attrs), strict=True):
        np.testing.assert_array_equal(a, b)


def _transposed_state(inputs: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    """``inputs`` with the initial state in state_layout 1's (B, H, N, P)."""
    state = inputs["initial_state"]
    return dict(inputs, initial_state=None if state is None else np.ascontiguousarray(state.transpose(0, 1, 3, 2)))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_kind", ["S-f32", "S-T", "no-state"])
@pytest.mark.parametrize("length", [1, Q + 6])
def test_the_state_in_n_p_layout(t: np.dtype, state_kind: str, length: int) -> None:
    """state_layout 1: both states (B, H, N, P), P != N so that a layout mix-up cannot pass; within the budget, and
    the same values as the (B, H, P, N) run transposed (an Eigen product of either storage order may round its sums
    differently, so compared within float32's error, not bit for bit)."""
    state_type = {"S-f32": FLOAT, "S-T": t, "no-state": None}[state_kind]
    rng = np.random.default_rng(length)
    inputs = make_inputs(rng, t, length=length, head_dim=8, state_size=16, state_type=state_type)
    laid = _transposed_state(inputs)
    out, state = check(laid, state_layout=1)
    assert state.shape == (2, 4, 16, 8)
    plain_out, plain_state = run_kernel(inputs)
    np.testing.assert_allclose(out, plain_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, plain_state.transpose(0, 1, 3, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("state_layout", [0, 1])
def test_decode_steps_one_token_at_a_time(t: np.dtype, state_layout: int) -> None:
    """A prompt fed one token a call (the kernel's one-pass decode step), each from the last call's final state, in
    either state layout: the outputs and the last state within the budget of the prompt at once."""
    inputs = make_inputs(np.random.default_rng(17), t, length=20, head_dim=8, state_size=16, state_type=FLOAT)
    if state_layout == 1:
        inputs = _transposed_state(inputs)
    state, outs = inputs["initial_state"], []
    for token in range(20):
        piece = dict(inputs, initial_state=state)
        for name in ("x", "dt", "B", "C"):
            piece[name] = inputs[name][:, token : token + 1]
        out, state = run_kernel(piece, state_layout=state_layout)
        outs.append(out)
    ok, summary = budget_report(np.concatenate(outs, axis=1), state, **inputs, state_layout=state_layout)
    assert ok, summary


def test_a_state_in_the_other_layout_is_an_error() -> None:
    """A (B, H, P, N) state given to a state_layout 1 node (P != N) is refused with the layout named."""
    inputs = make_inputs(np.random.default_rng(15), length=3)
    expected = r"initial_state must have shape \[2, 4, 16, 8\] \(B, H, N, P\), state_layout 1"
    with pytest.raises(Exception, match=expected):
        run_kernel(inputs, state_layout=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.update(x=i["x"][0]), "x must be 4-D (B, T, H, P), got shape [10, 4, 8]"),
        (lambda i: i.update(x=i["x"][:, :0], dt=i["dt"][:, :0], B=i["B"][:, :0], C=i["C"][:, :0]), "x: the prompt"),
        (lambda i: i.update(B=i["B"][:, :9]), "B must have shape [2, 10, G, N]"),
        (lambda i: i.update(C=i["C"][:, :, :, :4]), "B and C must have the same shape"),
        (lambda i: i.update(C=i["C"][:, :, :, :, None]), "C must have shape [2, 10, G, N]"),
        (
            lambda i: i.update(B=np.zeros((2, 10, 3, 16), np.float32), C=np.zeros((2, 10, 3, 16), np.float32)),
            "the heads H = 4 (x's third axis) must be a multiple of the groups G = 3",
        ),
        (lambda i: i.update(dt=i["dt"][:, :, :2]), "dt must have shape [2, 10, 4] (B, T, H)"),
        (lambda i: i.update(dt_bias=i["dt_bias"][:3]), "dt_bias must have shape [4] (H)"),
        (lambda i: i.update(A=i["A"][None]), "A must have shape [4] (H)"),
        (lambda i: i.update(D=i["D"][:2]), "D must have shape [4] (H)"),
        (lambda i: i.update(initial_state=i["initial_state"][..., :3]), "initial_state must have shape [2, 4, 8, 16]"),
        (lambda i: i.update(dt=i["dt"].astype(FLOAT16)), "dt must have x's type float or be float, got float16"),
        (
            lambda i: i.update(**{n: i[n].astype(FLOAT16) for n in ("x", "B", "C")}, dt=i["dt"].astype(BFLOAT16)),
            "dt must have x's type float16 or be float, got bfloat16",
        ),
        (
            lambda i: i.update(**{n: i[n].astype(FLOAT16) for n in ("x", "B", "C", "dt_bias")}),
            "dt_bias must have dt's type float, got float16",
        ),
        (lambda i: i.update(B=i["B"].astype(BFLOAT16)), "B must have x's type float, got bfloat16"),
        (lambda i: i.update(A=i["A"].astype(FLOAT16)), "A must be float, got float16"),
        (lambda i: i.update(D=i["D"].astype(FLOAT16)), "D must be float or x's type float, got float16"),
        (
            lambda i: i.update(initial_state=i["initial_state"].astype(BFLOAT16)),
            "initial_state must be float or x's type float, got bfloat16",
        ),
    ],
)
def test_bad_inputs_name_the_input(change, message: str) -> None:
    with pytest.raises(Exception, match=r"MambaChunkScan: .*") as info:
        run_kernel(_bad(change))
    assert message in str(info.value)


def test_an_unsupported_type_of_x_is_an_error() -> None:
    """x of type double (the test helpers feed only the op's types: the model is edited)."""
    inputs = make_inputs(np.random.default_rng(14), length=3)
    model = one_node_model(OP, [(n, inputs[n]) for n in NAMES], OUTPUTS)
    wide = {"x", "dt", "dt_bias", "B", "C"}
    for value in model.graph.input:
        if value.name in wide:
            value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    feeds = {n: inputs[n].astype(np.float64) if n in wide else inputs[n] for n in NAMES}
    with pytest.raises(Exception, match="MambaChunkScan: x has element type double; supported: float, float16"):
        session(model).run(None, feeds)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"dt_softplus": 2}, "dt_softplus must be 0 or 1, got 2"),
        ({"state_layout": 2}, "state_layout must be 0 or 1, got 2"),
        ({"dt_min": float("nan")}, "dt_min must be a number, got NaN"),
        ({"dt_max": float("nan")}, "dt_max must be a number, got NaN"),
    ],
)
def test_bad_attributes_are_errors_at_session_creation(attrs: dict[str, float], message: str) -> None:
    with pytest.raises(Exception, match=message):
        run_kernel(make_inputs(np.random.default_rng(13), length=4), **attrs)


def _libraries_with_symbols(nm: str) -> list[tuple[Path, str]]:
    """Return (library, its demangled symbol table) for the library the tests load and the build trees' copies of
    it (an installed library is stripped; the build tree keeps the linked one) that nm lists, and that have this op
    (a build tree may be older than it)."""
    candidates = [Path(contrib_ops.library_path()), *sorted(REPO.glob("build/*/libmambafuse_ops.so"))]
    found = []
    for library in dict.fromkeys(p.resolve() for p in candidates):
        listed = subprocess.run([nm, "-C", str(library)], capture_output=True, text=True).stdout
        if "MambaChunkScan" in listed:
            found.append((library, listed))
    return found


def test_each_instruction_set_level_has_its_own_eigen() -> None:
    """Eigen's templates are compiled into every level's math core (generic, AVX2, AVX-512 on x86-64): each copy must
    be in that level's namespace (CMake's Eigen=Eigen_<level>), or the linker keeps one level's copy of each inline
    function for all of them (AVX-512 instructions on a CPU without them). None may be exported."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    libraries = _libraries_with_symbols(nm)
    if not libraries:
        pytest.skip(
            "no build of the library with a symbol table (the installed one is stripped; `make build` keeps one)"
        )
    isa = contrib_ops.cpu_isa()
    expected = {"isa_generic", "isa_avx2", "isa_avx512"} if isa in ("sse2", "avx2", "avx512") else {"isa_generic"}
    for library, listed in libraries:
        eigen = [line for line in listed.splitlines() if "Eigen" in line]
        levels = {m.group(1) for line in eigen for m in re.finditer(r"\bEigen_(isa_[a-z0-9]+)::", line)}
        shared = [line for line in eigen if re.search(r"(?<![\w])Eigen::", line)]
        assert not shared, f"{library}: {len(shared)} Eigen symbols outside a level's namespace, e.g. {shared[:3]}"
        assert expected <= levels, f"{library}: Eigen's namespaces {sorted(levels)}, expected {sorted(expected)}"
    for library in {Path(contrib_ops.library_path()), *(lib for lib, _ in libraries)}:
        exported = subprocess.run([nm, "-D", "-C", "--defined-only", str(library)], capture_output=True, text=True)
        assert "Eigen" not in exported.stdout, f"{library} exports Eigen symbols"
