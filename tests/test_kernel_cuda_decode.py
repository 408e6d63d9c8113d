"""The CUDA kernels of ai.mambafuse::SelectiveStateUpdate and ai.mambafuse::CausalConv1dUpdate against the op
references (fusion/reference/selective_state_update.py, fusion/reference/causal_conv1d_update.py) at their
accuracy budgets: every type combination, batch 1 and 8, G = 1, G = H and between, odd shapes, the real
Nemotron-H-8B widths, both state-update paths and every rows-per-lane variant, edge values, the state update's
special-value sweep (tests/test_selective_state_update_special.py: float32 overflow of exp(d * A), NaN and
+-Inf in every input), a CUDA-graph replay, and bad inputs.

Needs onnxruntime with the CUDA execution provider, a GPU, and the library built with -DMAMBAFUSE_CUDA=ON
(point $MAMBAFUSE_LIBRARY at it). Every session forbids CPU fallback, so a library without the CUDA kernels
fails instead of silently running the CPU ones.

Without a GPU, test_emulated_kernels_within_budget and test_emulated_special_values still check the kernels'
logic (indexing, lane mapping, shuffles, launch choices) against the same budgets, on the host emulation of
contrib_ops/cuda/tools/ (emulate_decode.sh: g++ and the CUDA headers, no GPU).
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from fusion.reference.causal_conv1d_update import budget_report as conv_budget_report
from fusion.reference.causal_conv1d_update import causal_conv1d_update
from fusion.reference.selective_state_update import budget_report as ssu_budget_report
from fusion.reference.selective_state_update import selective_state_update
from tests._cuda import ONNX_TYPE, cuda_problem, cuda_session, emulated_library, feeds_of, host_pointer
from tests._decode_step import DTYPE_IDS, DTYPES, FLOAT, FLOAT16, one_node_model
from tests.test_selective_state_update_special import special_cases

ort = pytest.importorskip("onnxruntime")
_problem = cuda_problem(ort)


@pytest.fixture(autouse=True)
def _needs_gpu(request: pytest.FixtureRequest) -> None:
    """Every test but the host emulation's needs the CUDA EP."""
    if _problem is not None and not request.node.name.startswith("test_emulated"):
        pytest.skip(_problem)


SSU = "SelectiveStateUpdate"
CONV = "CausalConv1dUpdate"
SSU_NAMES = ("state", "x", "dt", "dt_bias", "A", "B", "C", "D")
CONV_NAMES = ("x", "conv_state", "weight", "bias")
TYPE_COMBOS = [(t, s) for t in DTYPES for s in dict.fromkeys((FLOAT, t))]
TYPE_IDS = [f"T{DTYPE_IDS[t]}-S{DTYPE_IDS[s]}" for t, s in TYPE_COMBOS]


def run_cuda(op: str, inputs: list[tuple[str, np.ndarray | None]], outputs: list[tuple[str, np.dtype]], **attrs):
    sess = cuda_session(one_node_model(op, inputs, outputs, **attrs))
    results = sess.run(None, feeds_of(inputs))
    return [r.astype(np.dtype(dtype)) for r, (_, dtype) in zip(results, outputs, strict=True)]


# --- SelectiveStateUpdate -----------------------------------------------------------------------------------


def ssu_inputs(
    rng: np.random.Generator,
    *,
    t: np.dtype,
    s: np.dtype,
    batch: int = 2,
    heads: int = 8,
    head_dim: int = 5,
    state_size: int = 24,
    groups: int = 2,
    d_type: np.dtype | None = FLOAT,
    dt_bias: bool = True,
) -> dict[str, np.ndarray | None]:
    """Seeded inputs with a decode step's magnitudes (dt in softplus' range, A < 0)."""
    return {
        "state": rng.standard_normal((batch, heads, head_dim, state_size)).astype(s),
        "x": rng.standard_normal((batch, heads, head_dim)).astype(t),
        "dt": (rng.standard_normal((batch, heads)) - 2).astype(t),
        "dt_bias": rng.standard_normal(heads).astype(t) if dt_bias else None,
        "A": -np.exp(rng.uniform(-1, 3, heads)).astype(np.float32),
        "B": rng.standard_normal((batch, groups, state_size)).astype(t),
        "C": rng.standard_normal((batch, groups, state_size)).astype(t),
        "D": rng.standard_normal(heads).astype(d_type) if d_type is not None else None,
    }


def ssu_check(inputs: dict[str, np.ndarray | None], dt_softplus: int = 1) -> list[np.ndarray]:
    """Run the CUDA kernel, assert both outputs are within the reference's budget, return them."""
    outputs = [("out", inputs["x"].dtype), ("present_state", inputs["state"].dtype)]
    out, state = run_cuda(SSU, [(n, inputs[n]) for n in SSU_NAMES], outputs, dt_softplus=dt_softplus)
    ok, msg = ssu_budget_report(out, state, *(inputs[n] for n in SSU_NAMES), dt_softplus=dt_softplus)
    assert ok, msg
    return [out, state]


@pytest.fixture
def ssu_env(monkeypatch: pytest.MonkeyPatch):
    """Sets the launcher's overrides (read at every launch) for one test."""

    def set_env(path: str | None = None, rows: str | None = None) -> None:
        for name, value in (("MAMBAFUSE_SSU_PATH", path), ("MAMBAFUSE_SSU_ROWS", rows)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)

    return set_env


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=TYPE_IDS)
@pytest.mark.parametrize("d_kind", ["D-f32", "D-T", "no-D"])
@pytest.mark.parametrize("dt_bias", [True, False], ids=["bias", "no-bias"])
def test_ssu_type_combinations(t: np.dtype, s: np.dtype, d_kind: str, dt_bias: bool) -> None:
    d_type = {"D-f32": FLOAT, "D-T": t, "no-D": None}[d_kind]
    rng = np.random.default_rng([DTYPES.index(t), DTYPES.index(s), len(d_kind), int(dt_bias)])
    ssu_check(ssu_inputs(rng, t=t, s=s, d_type=d_type, dt_bias=dt_bias, state_size=128))


# (batch, heads, head_dim, state_size, groups): G = 1, G = H and between; odd P and N (the scalar path);
# N = 64 (16-lane rows for float state, 8 for half), 256 (two chunks a lane) and 512 (past the vector path for
# float state).
SSU_SHAPES = [
    (1, 4, 8, 16, 1),
    (8, 6, 5, 24, 3),
    (1, 12, 16, 128, 12),
    (8, 16, 64, 64, 1),
    (8, 4, 7, 256, 2),
    (1, 3, 3, 33, 1),
    (1, 2, 64, 512, 1),
    (8, 12, 17, 128, 4),
]


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=TYPE_IDS)
@pytest.mark.parametrize("shape", SSU_SHAPES, ids=lambda v: "x".join(map(str, v)))
def test_ssu_shapes(t: np.dtype, s: np.dtype, shape: tuple[int, ...]) -> None:
    batch, heads, head_dim, state_size, groups = shape
    rng = np.random.default_rng(list(shape))
    inputs = ssu_inputs(
        rng, t=t, s=s, batch=batch, heads=heads, head_dim=head_dim, state_size=state_size, groups=groups
    )
    ssu_check(inputs)


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=TYPE_IDS)
@pytest.mark.parametrize("path", ["vector", "scalar"])
@pytest.mark.parametrize("rows", ["1", "2", "4"])
def test_ssu_paths_and_rows(t: np.dtype, s: np.dtype, path: str, rows: str, ssu_env) -> None:
    """Each kernel variant the launcher can pick, forced, on a shape where rows and heads end mid-block."""
    ssu_env(path="scalar" if path == "scalar" else None, rows=rows)
    rng = np.random.default_rng([int(rows), len(path)])
    ssu_check(ssu_inputs(rng, t=t, s=s, batch=3, heads=6, head_dim=37, state_size=128, groups=3))


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=TYPE_IDS)
@pytest.mark.parametrize("batch", [1, 8])
def test_ssu_real_width(t: np.dtype, s: np.dtype, batch: int) -> None:
    """Nemotron-H-8B: H = 128, P = 64, N = 128, G = 8 (the launcher's default block shape there)."""
    rng = np.random.default_rng(batch)
    ssu_check(ssu_inputs(rng, t=t, s=s, batch=batch, heads=128, head_dim=64, state_size=128, groups=8, d_type=t))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_ssu_without_softplus(t: np.dtype) -> None:
    rng = np.random.default_rng(3)
    inputs = ssu_inputs(rng, t=t, s=FLOAT)
    inputs["dt"] = np.abs(inputs["dt"].astype(np.float32) / 4).astype(t)
    ssu_check(inputs, dt_softplus=0)


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_ssu_edge_values(t: np.dtype) -> None:
    """dt above softplus' threshold, a zero and a very negative dt, and a NaN in the state: NaN reaches only its
    own present_state element and its own output row."""
    rng = np.random.default_rng(4)
    inputs = ssu_inputs(rng, t=t, s=FLOAT, batch=2, heads=4, head_dim=6, state_size=32, groups=2, dt_bias=False)
    inputs["dt"][0, 0], inputs["dt"][0, 1], inputs["dt"][1, 0] = 25.0, 0.0, -30.0
    inputs["state"][1, 2, 3, 5] = np.nan
    out, state = ssu_check(inputs)
    nan_out = np.argwhere(np.isnan(out.astype(np.float32)))
    nan_state = np.argwhere(np.isnan(state.astype(np.float32)))
    assert nan_out.tolist() == [[1, 2, 3]]
    assert nan_state.tolist() == [[1, 2, 3, 5]]


@pytest.mark.parametrize(("t", "s"), TYPE_COMBOS, ids=TYPE_IDS)
@pytest.mark.parametrize("dt_softplus", [0, 1])
@pytest.mark.parametrize("state_size", [19, 32], ids=["N19-scalar", "N32-vector"])
def test_ssu_special_values(t: np.dtype, s: np.dtype, dt_softplus: int, state_size: int) -> None:
    """The special-value sweep of tests/test_selective_state_update_special.py on the CUDA kernel: dA = exp(d * A)
    overflowing (and underflowing) in float32 in both directions with dt_softplus 0 and 1, readouts whose float32
    sums overflow, NaN and +-Inf in every input; each case within the budget, whose special values are the
    float32 evaluation's (docs/selective_state_update.md), as the CPU kernel's and the function body's are."""
    failures = []
    for case, inputs in special_cases(t, s, dt_softplus, state_size):
        outputs = [("out", t), ("present_state", s)]
        out, state = run_cuda(SSU, [(n, inputs[n]) for n in SSU_NAMES], outputs, dt_softplus=dt_softplus)
        ok, msg = ssu_budget_report(out, state, *(inputs[n] for n in SSU_NAMES), dt_softplus=dt_softplus)
        if not ok:
            failures.append(f"{case}: {msg}")
    assert not failures, "\n".join(failures)


def test_ssu_matches_the_float32_reference_in_float() -> None:
    """With T = S = float every rounding is float32's: only exp/log1p and the readout's order may move the
    last bits, so the kernel is within a few float32 ulps of the reference evaluated in float32."""
    rng = np.random.default_rng(5)
    inputs = ssu_inputs(rng, t=FLOAT, s=FLOAT, batch=2, heads=8, head_dim=16, state_size=128, groups=2)
    out, state = ssu_check(inputs)
    ref_out, ref_state = selective_state_update(*(inputs[n] for n in SSU_NAMES))
    np.testing.assert_allclose(state, ref_state, rtol=3e-6, atol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4)


def test_ssu_cuda_graph_replay() -> None:
    """ORT's CUDA graph: the node is captured on ORT's stream at the first Run and replayed; new input values
    written into the bound device buffers give the new step's results (no allocation or host sync inside)."""
    rng = np.random.default_rng(6)
    first = ssu_inputs(rng, t=FLOAT16, s=FLOAT, batch=2, heads=8, head_dim=16, state_size=64, groups=4)
    outputs = [("out", FLOAT16), ("present_state", FLOAT)]
    model = one_node_model(SSU, [(n, first[n]) for n in SSU_NAMES], outputs)
    sess = cuda_session(model, enable_cuda_graph="1")
    binding = sess.io_binding()
    bound = {}
    for name, value in feeds_of([(n, first[n]) for n in SSU_NAMES]).items():
        bound[name] = ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0)
        binding.bind_ortvalue_input(name, bound[name])
    out_value = ort.OrtValue.ortvalue_from_shape_and_type(first["x"].shape, np.float16, "cuda", 0)
    state_value = ort.OrtValue.ortvalue_from_shape_and_type(first["state"].shape, np.float32, "cuda", 0)
    binding.bind_ortvalue_output("out", out_value)
    binding.bind_ortvalue_output("present_state", state_value)
    for step in range(3):
        inputs = (
            first
            if step == 0
            else ssu_inputs(rng, t=FLOAT16, s=FLOAT, batch=2, heads=8, head_dim=16, state_size=64, groups=4)
        )
        for name, value in feeds_of([(n, inputs[n]) for n in SSU_NAMES]).items():
            bound[name].update_inplace(value)
        sess.run_with_iobinding(binding)
        ok, msg = ssu_budget_report(out_value.numpy(), state_value.numpy(), *(inputs[n] for n in SSU_NAMES))
        assert ok, f"step {step}: {msg}"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.update(state=i["state"].astype(np.float16)), "state must be float or"),
        (lambda i: i.update(A=i["A"].astype(np.float16)), "A must be float"),
        (lambda i: i.update(C=i["C"][:, :1]), "C must have B's shape"),
        (lambda i: i.update(dt=i["dt"][:, :3]), "dt must have shape"),
    ],
    ids=["state-type", "A-type", "C-shape", "dt-shape"],
)
def test_ssu_bad_inputs_name_the_input(change, message: str) -> None:
    rng = np.random.default_rng(7)
    inputs = ssu_inputs(rng, t=FLOAT, s=FLOAT)
    change(inputs)
    outputs = [("out", FLOAT), ("present_state", inputs["state"].dtype)]
    with pytest.raises(Exception, match=message):
        run_cuda(SSU, [(n, inputs[n]) for n in SSU_NAMES], outputs)


# --- CausalConv1dUpdate -------------------------------------------------------------------------------------


def conv_inputs(
    rng: np.random.Generator,
    *,
    t: np.dtype,
    batch: int = 2,
    channels: int = 70,
    length: int = 1,
    state_len: int = 3,
    width: int = 4,
    bias: bool = True,
    weight_3d: bool = True,
) -> dict[str, np.ndarray | None]:
    weight_shape = (channels, 1, width) if weight_3d else (channels, width)
    return {
        "x": rng.standard_normal((batch, channels, length)).astype(t),
        "conv_state": rng.standard_normal((batch, channels, state_len)).astype(t),
        "weight": (rng.standard_normal(weight_shape) / 2).astype(t),
        "bias": rng.standard_normal(channels).astype(t) if bias else None,
    }


def conv_check(inputs: dict[str, np.ndarray | None], activation: str = "silu") -> list[np.ndarray]:
    t = inputs["x"].dtype
    y, present = run_cuda(
        CONV, [(n, inputs[n]) for n in CONV_NAMES], [("y", t), ("present_state", t)], activation=activation
    )
    ok, msg = conv_budget_report(y, present, *(inputs[n] for n in CONV_NAMES), activation=activation)
    assert ok, msg
    return [y, present]


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(
    ("batch", "channels", "length", "state_len", "width"),
    [(1, 130, 1, 3, 4), (8, 70, 1, 4, 4), (2, 33, 3, 3, 4), (8, 17, 1, 2, 3), (1, 9, 2, 6, 5), (2, 5, 4, 0, 1)],
    ids=lambda v: str(v),
)
def test_conv(t, activation, bias, batch, channels, length, state_len, width) -> None:
    """S = K - 1 (mobius, ORT) and S = K (transformers), L = 1 and L > 1, the unrolled K = 4 kernel and others."""
    rng = np.random.default_rng([batch, channels, length, state_len, width, int(bias)])
    inputs = conv_inputs(
        rng,
        t=t,
        batch=batch,
        channels=channels,
        length=length,
        state_len=state_len,
        width=width,
        bias=bias,
        weight_3d=batch % 2 == 0,
    )
    y, present = conv_check(inputs, activation)
    _, ref_present = causal_conv1d_update(*(inputs[n] for n in CONV_NAMES), activation=activation)
    assert present.tobytes() == ref_present.tobytes()  # a copy of the window: bit for bit


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("batch", [1, 8])
def test_conv_real_width(t: np.dtype, batch: int) -> None:
    """Nemotron-H-8B's conv: 10240 channels, K = 4, with the state as transformers (S = K) and mobius (S = K - 1)
    keep it."""
    for state_len in (3, 4):
        rng = np.random.default_rng([batch, state_len])
        conv_check(conv_inputs(rng, t=t, batch=batch, channels=10240, state_len=state_len))


@pytest.mark.parametrize("t", DTYPES, ids=DTYPE_IDS.get)
def test_conv_edge_values(t: np.dtype) -> None:
    """Large |v| (the sigmoid's overflow-free form), zeros, and a NaN that stays in its channel."""
    rng = np.random.default_rng(8)
    inputs = conv_inputs(rng, t=t, batch=2, channels=8, bias=False)
    inputs["x"][0, :4, 0] = np.array([60.0, -60.0, 0.0, 1e4], np.float32).astype(t)
    inputs["conv_state"][1, 3, 2] = np.nan
    y, _ = conv_check(inputs)
    assert np.argwhere(np.isnan(y.astype(np.float32))).tolist() == [[1, 3, 0]]


def test_conv_bad_inputs_name_the_input() -> None:
    rng = np.random.default_rng(9)
    inputs = conv_inputs(rng, t=FLOAT, state_len=2, width=4)  # S < K - 1
    with pytest.raises(Exception, match="K - 1"):
        run_cuda(CONV, [(n, inputs[n]) for n in CONV_NAMES], [("y", FLOAT), ("present_state", FLOAT)])


# --- the kernels' logic without a GPU: the host emulation --------------------------------------------------


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = emulated_library("emulate_decode.sh", "libmambafuse_decode_emulated.so", tmp_path_factory.mktemp("emulated"))
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.mambafuse_ssu_launch.argtypes = [p] * 10 + [i, i, i] + [i64] * 5 + [i, p]
    lib.mambafuse_conv_update_launch.argtypes = [p] * 6 + [i] + [i64] * 5 + [i, p]
    return lib


def _emulated_ssu(
    emulated: ctypes.CDLL, inputs: dict[str, np.ndarray], t: type, s: type, dt_softplus: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Run the host emulation of the CUDA state update on ``inputs``; return out and present (both start NaN)."""
    batch, heads, head_dim, state_size = inputs["state"].shape
    out = np.full(inputs["x"].shape, np.nan, t)
    present = np.full(inputs["state"].shape, np.nan, s)
    rc = emulated.mambafuse_ssu_launch(
        *(host_pointer(inputs[n]) for n in SSU_NAMES),
        host_pointer(out),
        host_pointer(present),
        ONNX_TYPE[t],
        ONNX_TYPE[s],
        ONNX_TYPE[inputs["D"].dtype],
        batch,
        heads,
        head_dim,
        state_size,
        inputs["B"].shape[1],
        dt_softplus,
        None,
    )
    assert rc == 0
    return out, present


def test_emulated_kernels_within_budget(emulated: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both kernels, emulated on the host, within the references' budgets: every (T, S) pair on both state-update
    paths and rows 1/2/4 (odd P, G between 1 and H, N = 24 vector / 33 scalar / 256 two chunks a lane / 16 with
    fewer lanes a row than rows a lane), and
    the conv with K = 4 (unrolled; S = K - 1 and K at L = 1, its decode path; L = 3) and K = 3. Outputs start as
    NaN."""
    rng = np.random.default_rng(11)
    cases = 0
    for (t, s), (path, rows, shape) in itertools.product(
        TYPE_COMBOS,
        [
            (None, "4", (2, 6, 5, 24, 3)),
            ("scalar", "2", (1, 4, 3, 33, 1)),
            (None, "1", (1, 4, 3, 256, 4)),
            (None, "4", (1, 3, 7, 16, 1)),  # 4 rows, 4 (float) or 2 (half) lanes a row: both readouts
        ],
    ):
        monkeypatch.setenv("MAMBAFUSE_SSU_ROWS", rows)
        if path:
            monkeypatch.setenv("MAMBAFUSE_SSU_PATH", path)
        else:
            monkeypatch.delenv("MAMBAFUSE_SSU_PATH", raising=False)
        batch, heads, head_dim, state_size, groups = shape
        inputs = ssu_inputs(
            rng, t=t, s=s, batch=batch, heads=heads, head_dim=head_dim, state_size=state_size, groups=groups, d_type=t
        )
        out, present = _emulated_ssu(emulated, inputs, t, s)
        ok, msg = ssu_budget_report(out, present, *(inputs[n] for n in SSU_NAMES))
        assert ok, f"T={DTYPE_IDS[t]} S={DTYPE_IDS[s]} {path} rows={rows} {shape}: {msg}"
        cases += 1
    for t, (batch, channels, length, state_len, width) in itertools.product(
        DTYPES, [(2, 37, 1, 3, 4), (2, 21, 1, 4, 4), (1, 20, 3, 4, 4), (2, 9, 1, 3, 3)]
    ):
        inputs = conv_inputs(rng, t=t, batch=batch, channels=channels, length=length, state_len=state_len, width=width)
        y = np.full(inputs["x"].shape, np.nan, t)
        present = np.full(inputs["conv_state"].shape, np.nan, t)
        rc = emulated.mambafuse_conv_update_launch(
            *(host_pointer(inputs[n]) for n in CONV_NAMES),
            host_pointer(y),
            host_pointer(present),
            ONNX_TYPE[t],
            batch,
            channels,
            length,
            state_len,
            width,
            1,
            None,
        )
        assert rc == 0
        ok, msg = conv_budget_report(y, present, *(inputs[n] for n in CONV_NAMES))
        assert ok, f"conv T={DTYPE_IDS[t]} {(batch, channels, length, state_len, width)}: {msg}"
        cases += 1
    assert cases == len(TYPE_COMBOS) * 4 + 12


def test_emulated_special_values(emulated: ctypes.CDLL) -> None:
    """test_ssu_special_values on the host emulation of the CUDA kernel (glibc's expf and log1pf for CUDA's): every
    (T, S) pair, dt_softplus 0 and 1, the scalar path (N = 19) and the vector path (N = 32)."""
    failures = []
    cases = 0
    for (t, s), dt_softplus, state_size in itertools.product(TYPE_COMBOS, [0, 1], [19, 32]):
        for case, inputs in special_cases(t, s, dt_softplus, state_size):
            out, present = _emulated_ssu(emulated, inputs, t, s, dt_softplus)
            ok, msg = ssu_budget_report(out, present, *(inputs[n] for n in SSU_NAMES), dt_softplus=dt_softplus)
            if not ok:
                failures.append(
                    f"T={DTYPE_IDS[t]} S={DTYPE_IDS[s]} softplus={dt_softplus} N={state_size} {case}: {msg}"
                )
            cases += 1
    assert not failures, "\n".join(failures[:20])
    assert cases == len(TYPE_COMBOS) * 2 * 2 * len(list(special_cases(FLOAT, FLOAT, 0)))


@pytest.mark.parametrize(
    ("heads", "head_dim", "state_size", "s", "batch", "rows", "blocks", "shared"),
    [
        # Nemotron-H-8B (N = 128, G = 8): one wave at batch 1 (2 rows a lane), waves at batch 8 (4 rows a lane);
        # the half state in waves takes the per-head chain from one warp.
        (128, 64, 128, FLOAT, 1, 2, 1024, False),
        (128, 64, 128, FLOAT, 8, 4, 4096, False),
        (128, 64, 128, FLOAT16, 1, 2, 512, False),
        (128, 64, 128, FLOAT16, 8, 4, 2048, True),
        # Bamba-9B (N = 256): a float32 state is two chunks a lane, which takes the chain from one warp too.
        (128, 64, 256, FLOAT, 1, 2, 1024, True),
        (128, 64, 256, FLOAT16, 1, 2, 1024, False),
        # Zamba2-2.7B (N = 64, G = 1): 640 blocks at 4 rows, fewer than 8 a SM, so 2 rows.
        (80, 64, 64, FLOAT, 8, 4, 1280, False),
        (80, 64, 64, FLOAT16, 8, 2, 1280, False),
        (80, 64, 64, FLOAT16, 1, 2, 160, False),
        # A small model: 2 rows would leave SMs idle.
        (8, 64, 128, FLOAT, 1, 1, 128, False),
    ],
)
def test_emulated_launch_choice(
    emulated: ctypes.CDLL,
    heads: int,
    head_dim: int,
    state_size: int,
    s: np.dtype,
    batch: int,
    rows: int,
    blocks: int,
    shared: bool,
) -> None:
    """Rows per lane as the H200 sweep chose them (benchmarks/RESULTS.md): 4 where that still gives every SM 8
    blocks, else 2, and 1 only where 2 would leave an SM without a block (the emulation reports 132 SMs); the
    per-head chain shared by the block for a half state at 4 rows a lane and for a lane of two chunks."""
    described = emulated_describe(emulated, heads, head_dim, state_size, s, batch)
    assert f"{rows} rows a lane" in described and f"{blocks} blocks of 128" in described, described
    assert ("per-head chain shared" in described) == shared, described


def emulated_describe(
    emulated: ctypes.CDLL, heads: int, head_dim: int, state_size: int, s: np.dtype, batch: int
) -> str:
    """The emulated launcher's choice for fp16 x at these widths, as the benchmark prints it."""
    emulated.mambafuse_ssu_describe.argtypes = (
        [ctypes.c_int, ctypes.c_int]
        + [ctypes.c_int64] * 5
        + [
            ctypes.c_char_p,
            ctypes.c_int64,
        ]
    )
    text = ctypes.create_string_buffer(256)
    groups = 8 if heads == 128 else 1
    rc = emulated.mambafuse_ssu_describe(
        ONNX_TYPE[FLOAT16], ONNX_TYPE[s], batch, heads, head_dim, state_size, groups, text, 256
    )
    assert rc == 0
    return text.value.decode()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"MAMBAFUSE_SSU_LANES": "16"}, "16 lanes a row x 2 chunk(s) of 4"),
        ({"MAMBAFUSE_SSU_LANES": "8"}, "32 lanes a row x 1 chunk(s) of 4"),  # 4 chunks a lane: not taken
        ({"MAMBAFUSE_SSU_LANES": "12"}, "32 lanes a row x 1 chunk(s) of 4"),  # not a power of two
        ({"MAMBAFUSE_SSU_SHARED_HEAD": "1"}, "per-head chain shared"),
    ],
)
def test_emulated_launch_overrides(
    emulated: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, settings: dict[str, str], expected: str
) -> None:
    """The benchmark's tuning overrides (Nemotron-H-8B, f32 state, batch 1): taken where the kernel has the
    shape, ignored otherwise."""
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    assert expected in emulated_describe(emulated, 128, 64, 128, FLOAT, 1)
