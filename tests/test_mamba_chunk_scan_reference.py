"""The reference of ``MambaChunkScan`` (fusion/reference/mamba_chunk_scan.py, docs/mamba_chunk_scan.md): the
contract is the token-by-token recurrence, and its budget accepts every chunking of a float32 evaluation while
rejecting wrong math (decays at the wrong rate, a perturbed output, a lost state); a prompt in pieces, state
carried, equals the prompt at once; at one token the op is the decode step's ``SelectiveStateUpdate``."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusion.reference._common import bfloat16
from fusion.reference.mamba_chunk_scan import (
    budget_report,
    check_inputs,
    discretize,
    mamba_chunk_scan,
)
from fusion.reference.selective_state_update import selective_state_update

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), bfloat16]


def _inputs(
    rng: np.random.Generator,
    t: np.dtype = DTYPES[0],
    *,
    batch: int = 2,
    length: int = 37,
    heads: int = 4,
    head_dim: int = 8,
    groups: int = 2,
    state_size: int = 16,
    bias: bool = True,
    skip: bool = True,
    initial: bool = True,
) -> dict[str, np.ndarray | None]:
    return {
        "x": rng.standard_normal((batch, length, heads, head_dim)).astype(t),
        "dt": (rng.standard_normal((batch, length, heads)) - 1).astype(t),
        "dt_bias": rng.standard_normal(heads).astype(t) if bias else None,
        "A": -np.exp(rng.standard_normal(heads)).astype(np.float32),
        "B": rng.standard_normal((batch, length, groups, state_size)).astype(t),
        "C": rng.standard_normal((batch, length, groups, state_size)).astype(t),
        "D": rng.standard_normal(heads).astype(np.float32) if skip else None,
        "initial_state": rng.standard_normal((batch, heads, head_dim, state_size)).astype(np.float32)
        if initial
        else None,
    }


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_size", [None, 1, 4, 16, 37, 256])
@pytest.mark.parametrize("optional", ["all", "none"])
def test_every_chunking_is_within_the_budget(t: np.dtype, chunk_size: int | None, optional: str) -> None:
    rng = np.random.default_rng(7)
    present = optional == "all"
    inputs = _inputs(rng, t, bias=present, skip=present, initial=present)
    out, state = mamba_chunk_scan(**inputs, chunk_size=chunk_size)
    assert out.dtype == state.dtype == np.float32
    ok, summary = budget_report(out, state, **inputs)
    assert ok, summary


def test_a_long_prompt_with_strong_decay_is_within_the_budget() -> None:
    """Decay exponents summing to hundreds over the prompt (the budget's decay term), chunks of 64."""
    rng = np.random.default_rng(3)
    inputs = _inputs(rng, length=300, heads=2, groups=1, head_dim=4, state_size=8)
    inputs["A"] = np.array([-8.0, -0.05], np.float32)
    out, state = mamba_chunk_scan(**inputs, chunk_size=64)
    ok, summary = budget_report(out, state, **inputs)
    assert ok, summary


def test_the_budget_rejects_wrong_math() -> None:
    rng = np.random.default_rng(11)
    inputs = _inputs(rng)
    out, state = mamba_chunk_scan(**inputs, chunk_size=16)
    perturbed = out.copy()
    perturbed[:, 20] *= 1 + 1e-3
    assert not budget_report(perturbed, state, **inputs)[0]
    # decays 10 % off (A scaled by 0.9): the state carried through the prompt fades at the wrong rate
    shifted = dict(inputs, A=inputs["A"] * 0.9)
    wrong_out, wrong_state = mamba_chunk_scan(**shifted, chunk_size=16)
    assert not budget_report(wrong_out, wrong_state, **inputs)[0]
    assert not budget_report(out, np.zeros_like(state), **inputs)[0]
    nan = out.copy()
    nan[0, 0, 0, 0] = np.nan
    assert not budget_report(nan, state, **inputs)[0]


@pytest.mark.parametrize(
    ("dims", "empty"),
    [
        ({"batch": 0}, ("out", "final_state")),
        ({"head_dim": 0}, ("out", "final_state")),
        ({"state_size": 0}, ("final_state",)),
        ({"heads": 0, "groups": 1}, ("out", "final_state")),
    ],
    ids=["B0", "P0", "N0", "H0"],
)
def test_the_budget_of_empty_outputs(dims: dict[str, int], empty: tuple[str, ...]) -> None:
    """B, P, N or H = 0: an empty output is reported ("0 of 0"), not an exception; a wrong shape still fails, and
    with N = 0 the output (the skip D x alone) is still checked."""
    inputs = _inputs(np.random.default_rng(13), **dims)
    out, state = mamba_chunk_scan(**inputs, chunk_size=16)
    ok, summary = budget_report(out, state, **inputs)
    assert ok, summary
    for name in empty:
        assert f"{name}: 0 of 0 outside the budget" in summary, summary
    assert not budget_report(out, state[..., None], **inputs)[0]
    if "out" not in empty:
        assert out.size > 0
        assert not budget_report(out * np.float32(1 + 1e-3), state, **inputs)[0]


@pytest.mark.parametrize("t", DTYPES, ids=str)
def test_a_prompt_in_pieces_equals_the_prompt_at_once(t: np.dtype) -> None:
    """Chunked prefill: 37 tokens as 10 + 1 + 26, each piece from the state the last one left."""
    rng = np.random.default_rng(5)
    inputs = _inputs(rng, t)
    state = inputs["initial_state"]
    outs = []
    for start, end in ((0, 10), (10, 11), (11, 37)):
        piece = {k: v for k, v in inputs.items() if k not in ("initial_state",)}
        for name in ("x", "dt", "B", "C"):
            piece[name] = inputs[name][:, start:end]
        out, state = mamba_chunk_scan(**piece, initial_state=state, chunk_size=8)
        outs.append(out)
    ok, summary = budget_report(np.concatenate(outs, axis=1), state, **inputs)
    assert ok, summary


def test_at_one_token_it_is_the_decode_step() -> None:
    """T = 1 in float32: SelectiveStateUpdate's reference (the decode op) is within this op's budget."""
    rng = np.random.default_rng(9)
    inputs = _inputs(rng, length=1)
    out, present = selective_state_update(
        inputs["initial_state"],
        inputs["x"][:, 0],
        inputs["dt"][:, 0],
        inputs["dt_bias"],
        inputs["A"],
        inputs["B"][:, 0],
        inputs["C"][:, 0],
        inputs["D"],
        dt_softplus=1,
    )
    ok, summary = budget_report(out[:, None], present, **inputs)
    assert ok, summary


def test_the_n_p_state_layout_is_the_same_math_transposed() -> None:
    """state_layout 1 reads and writes (B, H, N, P) states: the same outputs as layout 0 on the transposed state,
    bit for bit (the reference computes in one layout), and a state in the other layout is refused by name."""
    inputs = _inputs(np.random.default_rng(5), np.dtype(np.float32), length=70, groups=2)
    head_dim, state_size = inputs["initial_state"].shape[2:]
    assert head_dim != state_size
    out, state = mamba_chunk_scan(**inputs, chunk_size=16)
    laid = dict(inputs, initial_state=np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2)))
    out_np, state_np = mamba_chunk_scan(**laid, state_layout=1, chunk_size=16)
    np.testing.assert_array_equal(out_np, out)
    np.testing.assert_array_equal(state_np, state.transpose(0, 1, 3, 2))
    ok, summary = budget_report(out_np, state_np, **laid, state_layout=1)
    assert ok, summary
    ok, _ = budget_report(out_np, state_np.transpose(0, 1, 3, 2), **laid, state_layout=1)
    assert not ok  # the shape differs: the budget names it
    with pytest.raises(ValueError, match="initial_state must have shape"):
        mamba_chunk_scan(**inputs, state_layout=1)
    with pytest.raises(ValueError, match="state_layout must be 0 or 1, got 2"):
        mamba_chunk_scan(**inputs, state_layout=2)


def test_the_time_step_is_rounded_and_clamped_in_the_activation_type() -> None:
    """dt + dt_bias and the softplus are rounded to T (float16 here), then clamped to the model's limits in T."""
    x = np.ones((1, 4, 1, 1), np.float16)
    dt = np.array([[[1.0], [0.0004], [-30.0], [25.0]]], np.float16)
    bias = np.array([0.0007], np.float16)
    d, a, u = discretize(x, dt, bias, np.array([-2.0], np.float32), 1, 0.001, 20.5)
    d1 = (dt.astype(np.float32) + bias.astype(np.float32)).astype(np.float16).astype(np.float32)
    soft = np.log1p(np.exp(d1)).astype(np.float16).astype(np.float32)
    expected = np.where(d1 > 20, d1, soft)
    expected = np.clip(expected, np.float32(np.float16(0.001)), np.float32(np.float16(20.5)))
    assert d.dtype == np.float16
    np.testing.assert_array_equal(d.astype(np.float32), expected)
    assert d[0, 2, 0] == np.float16(0.001)  # softplus(-30) is below the lower limit
    assert d[0, 3, 0] == np.float16(20.5)  # 25 passes softplus unchanged, then the upper limit
    np.testing.assert_array_equal(a, np.float32(-2.0) * d.astype(np.float32))
    np.testing.assert_array_equal(u[..., 0], d.astype(np.float32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.update(x=i["x"][0]), "x must be (B, T, H, P)"),
        (lambda i: i.update(x=i["x"][:, :0]), "at least one token"),
        (lambda i: i.update(B=i["B"][:, :3]), "B must have shape [2, 37, G, N]"),
        (lambda i: i.update(C=i["C"][..., :4]), "B and C must have the same shape"),
        (
            lambda i: i.update(B=i["B"][:, :, :1].repeat(3, 2), C=i["C"][:, :, :1].repeat(3, 2)),
            "multiple of the groups",
        ),
        (lambda i: i.update(dt=i["dt"][:, :, :2]), "dt must have shape [2, 37, 4]"),
        (lambda i: i.update(initial_state=i["initial_state"][..., :3]), "initial_state must have shape"),
        (lambda i: i.update(dt=i["dt"].astype(np.float16)), "dt must have x's type"),
        (lambda i: i.update(dt_bias=i["dt_bias"].astype(np.float16)), "dt_bias must have dt's type float32"),
        (lambda i: i.update(A=i["A"].astype(np.float16)), "A must be float"),
        (lambda i: i.update(x=i["x"].astype(np.float64)), "x must be float, float16 or bfloat16"),
    ],
)
def test_bad_inputs_are_named(change, message: str) -> None:
    inputs = _inputs(np.random.default_rng(0))
    change(inputs)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_inputs(**inputs)


def _function_model(inputs: dict[str, np.ndarray], attributes: dict[str, float | int], opset: int) -> onnx.ModelProto:
    from fusion.function.mamba_chunk_scan import INPUTS, OUTPUTS, make_function
    from fusion.reference._common import DOMAIN

    to_onnx = {
        np.dtype(np.float32): TensorProto.FLOAT,
        np.dtype(np.float16): TensorProto.FLOAT16,
        bfloat16: TensorProto.BFLOAT16,
    }
    graph = helper.make_graph(
        [helper.make_node("MambaChunkScan", list(INPUTS), list(OUTPUTS), domain=DOMAIN, **attributes)],
        "scan",
        [helper.make_tensor_value_info(name, to_onnx[inputs[name].dtype], list(inputs[name].shape)) for name in INPUTS],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, list(inputs["x"].shape)),
            helper.make_tensor_value_info("final_state", TensorProto.FLOAT, list(inputs["initial_state"].shape)),
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
        functions=[make_function(opset)],
    )
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("t", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("length", "groups", "attributes"),
    [
        (37, 2, {}),
        (1, 1, {}),
        # several of the body's 64-token chunks: the state carried between them, a partial last chunk
        (64, 2, {}),
        (3 * 64 + 7, 2, {}),
        (20, 4, {"dt_softplus": 0, "dt_min": 0.001, "dt_max": 0.5}),
        (9, 1, {"dt_min": 0.01, "dt_max": 2.0}),
        # both states (B, H, N, P): the body's Ifs transpose them in and out
        (70, 2, {"state_layout": 1}),
        (1, 1, {"state_layout": 0}),
    ],
)
def test_the_function_body_in_onnx_runtime_is_within_the_budget(
    t: np.dtype, length: int, groups: int, attributes: dict[str, float | int]
) -> None:
    rng = np.random.default_rng(21)
    inputs = _inputs(rng, t, length=length, groups=groups)
    if attributes.get("state_layout") == 1:
        inputs["initial_state"] = np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2))
    model = _function_model(inputs, attributes, 18)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        # numpy has no bfloat16 ONNX Runtime takes: its bits, typed as BFLOAT16
        values = {
            name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), TensorProto.BFLOAT16)
            if a.dtype == bfloat16
            else ort.OrtValue.ortvalue_from_numpy(a)
            for name, a in feeds.items()
        }
        return session.run_with_ort_values(None, values)

    out, state = (value.numpy() for value in run(inputs))
    ok, summary = budget_report(out, state, **inputs, **attributes)
    assert ok, summary
    # absent optional inputs, as a caller passes them to the body: dt_bias -0.0, D and the initial state zeros
    missing = dict(inputs, dt_bias=np.full_like(inputs["dt_bias"], -0.0), D=np.zeros_like(inputs["D"]))
    missing["initial_state"] = np.zeros_like(inputs["initial_state"])
    out, state = (value.numpy() for value in run(missing))
    plain = dict(inputs, dt_bias=None, D=None, initial_state=None)
    ok, summary = budget_report(out, state, **plain, **attributes)
    assert ok, summary


@pytest.mark.parametrize("t", [np.dtype(np.float32), np.dtype(np.float16)], ids=str)
@pytest.mark.parametrize("chunk_size", [8, 64])
@pytest.mark.parametrize("initial", [False, True], ids=["no-state", "state"])
def test_transformers_own_chunk_scan_is_within_the_budget(t: np.dtype, chunk_size: int, initial: bool) -> None:
    """The contract is what exporters trace: transformers' torch fallback (``mamba2_chunk_scan``, the function
    every Mamba-2 family's prefill exports) meets the budget at its chunk sizes, 45 tokens (not a multiple)."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    scan = getattr(modeling.mamba2_chunk_scan, "__wrapped__", modeling.mamba2_chunk_scan)
    inputs = _inputs(np.random.default_rng(13), t, length=45, initial=initial)
    as_torch = {k: None if v is None else torch.from_numpy(v) for k, v in inputs.items()}
    out, state = scan(
        as_torch["x"],
        as_torch["dt"],
        as_torch["A"],
        as_torch["B"],
        as_torch["C"],
        chunk_size,
        D=as_torch["D"],
        dt_bias=as_torch["dt_bias"],
        initial_states=as_torch["initial_state"],
        dt_softplus=True,
        return_final_states=True,
    )
    ok, summary = budget_report(out.float().numpy(), state.float().numpy(), **inputs)
    assert ok, summary
