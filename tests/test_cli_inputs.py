"""Inputs of ``--verify`` and ``report`` on builder models (fusion/inputs.py), and what the command line
leaves on disk when a check cannot run or fails (README, "What the command line guarantees").

The mobius builds (tests/fixtures/mobius) name the attention mask's length ``past_seq_len + seq_len`` while
the cache is ``past_sequence_len`` and the new tokens ``sequence_len``: generated inputs must agree with
each other, or ORT's Attention rejects them (f16) or, worse, a check runs on inputs the model cannot mean
(f32).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fusion import inputs, rewrite, verify
from models.mobius import extract_builds

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "models"
MASK_DIM = "past_seq_len + seq_len"
#: One build per family and dtype (the cpu-target default variant); nemotron_h-g4 and zamba2-g2 have
#: attention layers (a KV cache and the expression-named mask), mamba2 has none.
BUILDS = [
    f"{model}-{dtype}-default-cpu"
    for model in ("nemotron_h-g4", "zamba2-g2", "mamba2-g4")
    for dtype in ("f32", "f16", "bf16")
]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return extract_builds(tmp_path_factory.mktemp("mobius-builds"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fusion", *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )


def _one_line_error(result: subprocess.CompletedProcess[str], prog: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in result.stderr
    return lines[0]


def _dims_line(stdout: str) -> dict[str, int]:
    match = re.search(r"^  inputs: .*; dims (.*)$", stdout, re.MULTILINE)
    assert match, stdout
    return {name: int(size) for name, size in (item.rsplit("=", 1) for item in match.group(1).split(", "))}


# --- the dims: expressions, defaults, bindings --------------------------------------------------------------


def _model(*shapes: list[int | str]) -> onnx.ModelProto:
    """A graph of one Identity per input, inputs float32 with the given (symbolic) shapes."""
    values = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, shape) for i, shape in enumerate(shapes)]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(shapes))]
    nodes = [helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(len(shapes))]
    return helper.make_model(helper.make_graph(nodes, "g", values, outputs))


MOBIUS_DIMS = _model(["batch", "sequence_len"], ["batch", MASK_DIM], ["batch", 4, "past_sequence_len", 16])


def test_expression_dims_follow_their_terms() -> None:
    default = inputs.resolve_dims(MOBIUS_DIMS)
    assert default[MASK_DIM] == default["past_sequence_len"] + default["sequence_len"]
    assert default["past_sequence_len"] > 1 and default["batch"] == 1
    bound = inputs.resolve_dims(MOBIUS_DIMS, {"past_sequence_len": 16, "sequence_len": 3}, strict=True)
    assert bound[MASK_DIM] == 19
    # The expression's own spelling of a term binds the input's dim too (one dim, two names).
    assert inputs.resolve_dims(MOBIUS_DIMS, {"past_seq_len": 5}, strict=True)["past_sequence_len"] == 5
    feeds = inputs.make_inputs(MOBIUS_DIMS, {"past_sequence_len": 16})
    assert feeds["x1"].shape[1] == feeds["x0"].shape[1] + feeds["x2"].shape[2] == 17


@pytest.mark.parametrize(
    ("text", "sizes", "value"),
    [
        ("a*b", {"a": 3, "b": 4}, 12),
        ("a - 1", {"a": 5}, 4),
        ("(a + b) // 2", {"a": 3, "b": 5}, 4),
        ("2*a+1", {"a": 3}, 7),
    ],
)
def test_expressions_evaluate(text: str, sizes: dict[str, int], value: int) -> None:
    expression = inputs.parse_expression(text)
    assert expression is not None and set(expression.names) == set(sizes)
    assert expression.evaluate(sizes) == value


@pytest.mark.parametrize("text", ["batch", "s17", "128", "__import__('os').system('x')", "a +", "unk__3"])
def test_non_expressions_are_names(text: str) -> None:
    assert inputs.parse_expression(text) is None


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ({"sequnce_len": 4}, "no such symbolic dim (its dims: 'batch', 'sequence_len'"),
        ({MASK_DIM: 5}, "disagrees with its terms"),
        ({"past_sequence_len": 4, "past_seq_len": 5}, "name one dim of the model"),
    ],
)
def test_bad_bindings(dims: dict[str, int], message: str) -> None:
    with pytest.raises(inputs.InputError, match=re.escape(message)):
        inputs.resolve_dims(MOBIUS_DIMS, dims, strict=True)


def test_two_input_dims_spelled_alike_stay_two_dims() -> None:
    """Only an expression's term stands for the dim spelled alike; two dims of the inputs are two dims."""
    assert inputs.resolve_dims(_model(["seq_len"], ["sequence_len"]), {"seq_len": 3}) == {
        "seq_len": 3,
        "sequence_len": 1,
    }


def test_a_name_with_an_operator_but_no_dim_among_its_terms_is_a_name() -> None:
    assert inputs.resolve_dims(_model(["batch-size", 4], ["seq"])) == {"batch-size": 1, "seq": 1}


def test_an_expression_below_one_is_refused() -> None:
    with pytest.raises(inputs.InputError, match="'n - 1' = 0"):
        inputs.resolve_dims(_model(["n"], ["n - 1"]))


def test_a_total_length_is_past_plus_sequence() -> None:
    model = _model(["batch", "sequence_length"], ["batch", "total_sequence_length"], [1, "past_sequence_length", 2])
    dims = inputs.resolve_dims(model, {"past_sequence_length": 5})
    assert dims["total_sequence_length"] == 6


def test_inputs_too_large_for_memory_are_refused_before_allocating() -> None:
    with pytest.raises(inputs.InputError, match="choose smaller --dim sizes"):
        inputs.make_inputs(MOBIUS_DIMS, {"sequence_len": 10**11})


# --- the command line on the mobius builds -------------------------------------------------------------------


@pytest.mark.parametrize("stem", BUILDS)
def test_verify_on_every_family_and_dtype(stem: str, builds: Path, tmp_path: Path) -> None:
    model, output = builds / stem / "model.onnx", tmp_path / "fused.onnx"
    result = _cli("rewrite", str(model), "-o", str(output), "--verify")
    if "bf16" in stem:
        # ORT's CPU provider cannot run the original: the check cannot run, so nothing is written.
        assert result.returncode == 2
        assert "bfloat16" in _one_line_error(result, "mambafuse rewrite")
        assert not output.exists() and not Path(f"{output}.data").exists()
        return
    assert result.returncode == 0, result.stderr
    assert "PASS" in result.stdout and output.exists()
    dims = _dims_line(result.stdout)
    declared = inputs.dim_params(onnx.load(model, load_external_data=False))
    assert set(dims) == set(declared)
    if MASK_DIM in dims:
        assert dims[MASK_DIM] == dims["past_sequence_len"] + dims["sequence_len"]
        assert dims["past_sequence_len"] > 1, "a decode step with a cache, not an empty one"


def test_verify_with_bound_dims(builds: Path, tmp_path: Path) -> None:
    model, output = builds / "zamba2-g2-f16-default-cpu" / "model.onnx", tmp_path / "fused.onnx"
    result = _cli(
        "rewrite", str(model), "-o", str(output), "--verify", "--dim", "past_sequence_len=3", "--dim", "sequence_len=2"
    )
    assert result.returncode == 0, result.stderr
    assert _dims_line(result.stdout)[MASK_DIM] == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dim", "sequnce_len=4"], "--dim 'sequnce_len': the model has no such symbolic dim"),
        (["--dim", f"{MASK_DIM}=5"], "disagrees with its terms"),
        (["--dim", "sequence_len=100000000000"], "choose smaller --dim sizes"),
    ],
)
@pytest.mark.parametrize("command", ["--verify", "--report"])
def test_bad_dims_fail_before_writing(
    command: str, args: list[str], message: str, builds: Path, tmp_path: Path
) -> None:
    model, output = builds / "nemotron_h-g4-f16-default-cpu" / "model.onnx", tmp_path / "fused.onnx"
    result = _cli("rewrite", str(model), "-o", str(output), command, *args)
    assert result.returncode == 2
    assert message in _one_line_error(result, "mambafuse rewrite")
    assert list(tmp_path.iterdir()) == [], "nothing is written before every argument is checked"


@pytest.fixture(scope="module")
def fused_f16(builds: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model = builds / "nemotron_h-g4-f16-default-cpu" / "model.onnx"
    output = tmp_path_factory.mktemp("fused") / "fused.onnx"
    assert rewrite.main([str(model), "-o", str(output)]) == 0
    return model, output


def test_report_on_a_builder_model(fused_f16: tuple[Path, Path], tmp_path: Path) -> None:
    model, fused = fused_f16
    out = tmp_path / "r.json"
    result = _cli("report", str(model), str(fused), "--runs", "3", "--warmup", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    dims = json.loads(out.read_text())["dims"]
    assert dims[MASK_DIM] == dims["past_sequence_len"] + dims["sequence_len"]
    assert "dims batch=1, sequence_len=1" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dim", "sequnce_len=4"], "no such symbolic dim (its dims: 'batch'"),
        (["--dim", "sequence_len=100000000000"], "choose smaller --dim sizes"),
        (["--dim", "past_sequence_len=4", "--dim", "past_seq_len=5"], "these name one dim of the model"),
    ],
)
def test_report_bad_dims(args: list[str], message: str, fused_f16: tuple[Path, Path]) -> None:
    model, fused = fused_f16
    result = _cli("report", str(model), str(fused), "--runs", "2", *args)
    assert result.returncode == 2
    assert message in _one_line_error(result, "mambafuse report")


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("mobius", "a model input is bfloat16"),  # bf16 inputs: numpy cannot make them
        (str(FIXTURES / "nemotron_h-dynamo-bf16-prefill.onnx"), "no bfloat16 kernels"),  # int inputs, bf16 inside
    ],
)
def test_report_on_bfloat16_on_the_cpu_says_why(model: str, message: str, builds: Path) -> None:
    path = str(builds / "nemotron_h-g4-bf16-default-cpu" / "model.onnx") if model == "mobius" else model
    result = _cli("report", path, path, "--runs", "2")
    assert result.returncode == 2
    assert message in _one_line_error(result, "mambafuse report")


# --- nothing written before the checks; nothing unverified kept -------------------------------------------


def test_report_provider_missing_fails_before_writing(tmp_path: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: the case is a machine without it")
    output = tmp_path / "fused.onnx"
    model = FIXTURES / "nemotron_h-dynamo-fp32-prefill.onnx"
    result = _cli("rewrite", str(model), "-o", str(output), "--report", "--providers", "CUDAExecutionProvider")
    assert result.returncode == 2
    assert "provider 'CUDAExecutionProvider' is not available" in _one_line_error(result, "mambafuse rewrite")
    assert "wrote" not in result.stdout and list(tmp_path.iterdir()) == []


def test_failed_verification_keeps_no_output(
    builds: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output that fails --verify (here: a tolerance no fp16 model meets) is removed, and the user told."""
    monkeypatch.setattr(verify, "END_TO_END_RTOL", {np.dtype(np.float32): 0.0, np.dtype(np.float16): 0.0})
    output = tmp_path / "fused.onnx"
    code = rewrite.main([str(builds / "nemotron_h-g4-f16-default-cpu" / "model.onnx"), "-o", str(output), "--verify"])
    out = capsys.readouterr().out
    assert code == 1
    assert "verify (mambafuse library): FAIL" in out or "verify (model-local function" in out
    assert out.strip().splitlines()[-1].startswith("verification failed: removed ")
    assert list(tmp_path.iterdir()) == [], "an output that failed verification is not kept (nor its data file)"
    code = rewrite.main(
        [str(builds / "nemotron_h-g4-f16-default-cpu" / "model.onnx"), "-o", str(output), "--verify", "--json"]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["output"] is None and data["removed"] == [str(output), f"{output}.data"]
    assert list(tmp_path.iterdir()) == []


def test_fused_model_failing_to_run_keeps_no_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*_args: object) -> None:
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : boom")

    monkeypatch.setattr(verify, "_check_fused_nodes", broken)
    output = tmp_path / "fused.onnx"
    assert rewrite.main([str(FIXTURES / "nemotron_h-dynamo-fp32-prefill.onnx"), "-o", str(output), "--verify"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "the fused model failed in ONNX Runtime" in lines[0] and f"removed {output}" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "stem", ["zamba2-g2-f32-default-cpu", "mamba2-g4-f16-default-cpu", "nemotron_h-g1-f32-default-cpu"]
)
def test_report_default_inputs_on_other_builds(stem: str, builds: Path) -> None:
    model = str(builds / stem / "model.onnx")
    result = _cli("report", model, model, "--runs", "2", "--warmup", "0")
    assert result.returncode == 0, result.stderr
    assert "dims batch=1, sequence_len=1" in result.stdout


DECODE = FIXTURES / "nemotron_h-dynamo-fp32-decode.onnx"  # every cache dim its own name: s26, s35, ...


def _reshaped(path: Path) -> Path:
    """Write a model whose input must hold 6 elements (Reshape to [2, 3]) and whose graph says so nowhere
    else: at the default size 1 ONNX Runtime rejects it."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, 3])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [shape],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_inputs_the_model_rejects_are_one_line_with_the_dims(tmp_path: Path) -> None:
    model = _reshaped(tmp_path / "reshape.onnx")
    result = _cli("report", str(model), str(model), "--runs", "2")
    assert result.returncode == 2
    line = _one_line_error(result, "mambafuse report")
    assert "the before model rejects its inputs" in line and "dims used: n=1" in line and "--inputs" in line
    output = tmp_path / "out" / "fused.onnx"
    output.parent.mkdir()
    result = _cli("rewrite", str(model), "-o", str(output), "--verify")
    assert result.returncode == 2
    line = _one_line_error(result, "mambafuse rewrite")
    assert "the original model rejects its inputs" in line and "dims used: n=1" in line
    assert list(output.parent.iterdir()) == []


# --- sizes the graph pins ----------------------------------------------------------------------------------


def _graph_model(nodes, inputs_, value_info, initializers=()) -> onnx.ModelProto:
    outputs = [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs_, outputs, list(initializers), value_info=value_info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_graph_dims_from_concat_broadcast_and_matmul() -> None:
    f = TensorProto.FLOAT
    model = _graph_model(
        [
            helper.make_node("Concat", ["cache", "new"], ["cat"], axis=2),  # cache (a, b, c) ++ (1, 128, 1)
            helper.make_node("Mul", ["state", "decay"], ["decayed"]),  # (d, e, g) * (1, 4, 1): e = 4 only
            helper.make_node("MatMul", ["row", "w"], ["proj"]),  # (1, k) @ (16, 8): k = 16
            helper.make_node("Add", ["p", "q"], ["sum"]),  # (h) + (i): one dim, no size
            helper.make_node("Concat", ["u", "v"], ["both"], axis=0),  # (2, j) ++ (3, 5) and (1, j) ++ (1, 6)
            helper.make_node("Concat", ["u2", "v2"], ["both2"], axis=0),
        ],
        [
            helper.make_tensor_value_info("cache", f, ["a", "b", "c"]),
            helper.make_tensor_value_info("state", f, ["d", "e", "g"]),
            helper.make_tensor_value_info("row", f, [1, "k"]),
            helper.make_tensor_value_info("p", f, ["h"]),
            helper.make_tensor_value_info("q", f, ["i"]),
            helper.make_tensor_value_info("u", f, [2, "j"]),
            helper.make_tensor_value_info("u2", f, [1, "j"]),
        ],
        [
            helper.make_tensor_value_info("new", f, [1, 128, 1]),
            helper.make_tensor_value_info("decay", f, [1, 4, 1]),
            helper.make_tensor_value_info("v", f, [3, 5]),
            helper.make_tensor_value_info("v2", f, [1, 6]),
        ],
        [helper.make_tensor("w", TensorProto.FLOAT, [16, 8], [0.0] * 128)],
    )
    # j meets 5 and 6: pinned to neither; c (the concatenated axis), d and g (broadcast against 1) stay free
    assert inputs.graph_dims(model) == {"a": 1, "b": 128, "e": 4, "k": 16}
    dims = inputs.resolve_dims(model)
    assert (dims["a"], dims["b"], dims["e"], dims["k"]) == (1, 128, 4, 16)
    assert (dims["c"], dims["d"], dims["j"]) == (1, 1, 1)
    # the user's binding wins over the graph's
    assert inputs.resolve_dims(model, {"b": 7})["b"] == 7
    # one symbol is one dim: h and i meet, so a size for one is a size for both
    linked = _graph_model(
        [helper.make_node("Add", ["p", "q"], ["sum"]), helper.make_node("Mul", ["q", "r"], ["prod"])],
        [
            helper.make_tensor_value_info("p", f, ["h"]),
            helper.make_tensor_value_info("q", f, ["i"]),
            helper.make_tensor_value_info("r", f, [9]),
        ],
        [],
    )
    assert inputs.graph_dims(linked) == {"h": 9, "i": 9}


def test_graph_minimums_from_declared_expressions() -> None:
    f = TensorProto.FLOAT
    model = _graph_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", f, [1, "s84"])],
        [helper.make_tensor_value_info("conv", f, [1, "s84 - 2"]), helper.make_tensor_value_info("z", f, ["s84 + 1"])],
    )
    assert inputs.graph_minimums(model) == {"s84": 3}
    assert inputs.resolve_dims(model)["s84"] == 3
    assert inputs.resolve_dims(model, {"s84": 5})["s84"] == 5


def test_verify_a_dynamo_decode_export_with_default_dims(tmp_path: Path) -> None:
    """torch dynamo names every cache dim on its own (s26, s35, ...): the graph pins them (the conv state's
    channels by its Concat with the new step, the SSM state's by the decay it is multiplied with, the
    conv cache's length by the convolution over it), so --verify runs without --dim."""
    output = tmp_path / "fused.onnx"
    result = _cli("rewrite", str(DECODE), "-o", str(output), "--verify")
    assert result.returncode == 0, result.stderr
    assert output.is_file()
    dims = _dims_line(result.stdout)
    original = onnx.load(str(DECODE), load_external_data=False)
    state = next(v for v in original.graph.input if v.name == "past.layers.0.recurrent_states.0")
    conv = next(v for v in original.graph.input if v.name == "past.layers.0.conv_states.0")
    assert [dims[d.dim_param] for d in state.type.tensor_type.shape.dim] == [1, 4, 16, 8]  # (B, H, P, N)
    assert [dims[d.dim_param] for d in conv.type.tensor_type.shape.dim] == [1, 128, 3]  # (B, C, K - 1)


def test_optimized_model_failing_to_run_is_called_the_optimized_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """optimize's output holds onnxscript's fusions too: its run failure names the optimized model."""
    from fusion import optimize

    def broken(*_args: object) -> None:
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : boom")

    monkeypatch.setattr(verify, "_check_fused_nodes", broken)
    output = tmp_path / "optimized.onnx"
    assert optimize.main([str(FIXTURES / "nemotron_h-dynamo-fp32-decode.onnx"), str(output), "--verify"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "the optimized model failed in ONNX Runtime" in lines[0], lines
    assert list(tmp_path.iterdir()) == []
