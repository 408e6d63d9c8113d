"""The CoreML path (contrib_ops/APPLE.md), checked here with the CPU provider.

The CoreML execution provider cannot host custom-op kernels, so on a Mac a fused model must reach it as
the model-local function's stock-op body: ``contrib_ops.session`` leaves the library unregistered when
CoreML is the preferred provider, ONNX Runtime inlines the function (before its level-1 optimizations and
partitioning), and CoreML can take the inlined ops. This onnxruntime has no CoreML provider, so the tests
check the decision, the fallback numerics (the inlined body on the CPU provider, against
the reference at the budget), and which inlined ops CoreML would refuse, from the supported-op list
this onnxruntime wheel ships and the constraints of ONNX Runtime's CoreML op builders (contrib_ops/APPLE.md).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import contrib_ops
from fusion._chains import ChainSpec, build_chain, build_chain_sequence, chain_inputs, half_decode
from fusion.reference import DOMAIN, OP_TYPE, SUPPORTED_TYPES, budget_report, gated_group_rms_norm
from fusion.rewrite import rewrite_model

COREML_FIRST = ["CoreMLExecutionProvider", "CPUExecutionProvider"]
FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16

SPECS = {
    "A-f32-static": ChainSpec(leading=(2, 3), channels=64, group_size=16),
    "A-f32-dynamic": ChainSpec(leading=("batch", "seq"), channels=96, group_size=48, shape_as="dynamic"),
    "C-f16-decode": ChainSpec(
        leading=(1, 1),
        channels=7680,
        group_size=960,
        **half_decode(FLOAT16),
    ),
}


COREML_AVAILABLE = "CoreMLExecutionProvider" in ort.get_available_providers()


def coreml_session(model: onnx.ModelProto, **kwargs: Any) -> ort.InferenceSession:
    """contrib_ops.session with CoreML preferred; without CoreML, ORT warns and uses the CPU provider."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CoreMLExecutionProvider.*not in available provider")
        return contrib_ops.session(model, providers=COREML_FIRST, **kwargs)


def inlined_session(model: onnx.ModelProto, **kwargs: Any) -> ort.InferenceSession:
    """A session that runs the inlined function body on the CPU provider: the CoreML path's fallback here;
    where CoreML exists (a Mac) the same body on the CPU, CoreML itself being tested by test_on_coreml_*."""
    if COREML_AVAILABLE:
        return contrib_ops.session(model, providers=["CPUExecutionProvider"], use_library=False, **kwargs)
    return coreml_session(model, **kwargs)


def fused(spec: ChainSpec, chains: int = 1) -> onnx.ModelProto:
    model = build_chain(spec) if chains == 1 else build_chain_sequence(spec, chains, residual=True)
    result, report = rewrite_model(model)
    assert report.fused == chains, report.summary()
    assert report.function_attached
    return result


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]


def reference_of(model: onnx.ModelProto, node: onnx.NodeProto, y: np.ndarray, z: np.ndarray):
    """Return (expected, normed, w) of one fused node, the float64 reference with the node's attributes."""
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    w = initializers[node.input[2]]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    norm = attrs.get("norm_dtype")
    out = attrs.get("output_dtype")
    expected, normed = gated_group_rms_norm(
        y,
        z,
        w,
        epsilon=float(attrs["epsilon"]),
        group_size=int(attrs["group_size"]),
        norm_dtype=None if norm is None else SUPPORTED_TYPES[norm],
        output_dtype=None if out is None else SUPPORTED_TYPES[out],
        compute_dtype=np.float64,
        return_normed=True,
    )
    return expected, normed, w


# --- the decision -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("providers", "wanted"),
    [
        (COREML_FIRST, False),
        ([("CoreMLExecutionProvider", {"ModelFormat": "MLProgram"}), "CPUExecutionProvider"], False),
        (["CPUExecutionProvider"], True),
        (["CPUExecutionProvider", "CoreMLExecutionProvider"], True),  # CPU preferred: the kernel runs
        (["CUDAExecutionProvider", "CPUExecutionProvider"], True),
        (None, True),
        ([], True),
    ],
)
def test_wants_library_follows_the_preferred_provider(providers: list[Any] | None, wanted: bool) -> None:
    assert contrib_ops.wants_library(providers) is wanted


def test_session_for_coreml_leaves_the_library_unregistered(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[Any] = []
    monkeypatch.setattr(contrib_ops, "register", registered.append)
    monkeypatch.setattr(contrib_ops, "library_path", lambda: pytest.fail("library_path() looked up for CoreML"))
    model = fused(SPECS["A-f32-static"])
    session = coreml_session(model)
    assert registered == []
    # It loaded without the library: ONNX Runtime inlined the function, no custom kernel was needed.
    expected = [*COREML_FIRST] if COREML_AVAILABLE else ["CPUExecutionProvider"]
    assert session.get_providers() == expected


@pytest.mark.parametrize(
    ("providers", "use_library", "registrations"),
    [(COREML_FIRST, True, 1), (["CPUExecutionProvider"], None, 1), (["CPUExecutionProvider"], False, 0)],
    ids=["coreml-forced", "cpu-default", "cpu-refused"],
)
def test_use_library_overrides_the_decision(
    monkeypatch: pytest.MonkeyPatch, providers: list[str], use_library: bool | None, registrations: int
) -> None:
    registered: list[Any] = []
    monkeypatch.setattr(contrib_ops, "register", registered.append)  # record, register nothing
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CoreMLExecutionProvider.*not in available provider")
        contrib_ops.session(fused(SPECS["A-f32-static"]), providers=providers, use_library=use_library)
    assert len(registered) == registrations


# --- the fallback numerics --------------------------------------------------------------------------


@pytest.mark.parametrize("form", list(SPECS))
def test_inlined_function_matches_the_reference(form: str) -> None:
    """The fused model without the library (ORT inlines the body) is within the budget of docs/op.md."""
    spec = SPECS[form]
    model = fused(spec)
    (node,) = fused_nodes(model)
    feeds = chain_inputs(spec)
    assert list(node.input[:2]) == ["y", "z"], "the fused node reads the graph inputs directly"
    actual = inlined_session(model).run(None, feeds)[0]
    expected, normed, w = reference_of(model, node, feeds["y"], feeds["z"])
    ok, message = budget_report(actual, expected, normed=normed, weight=w)
    assert ok, message


def test_inlined_functions_of_a_multi_chain_model_match_the_reference() -> None:
    """Three fused chains in sequence with residual Adds: every fused node's output (made a graph output)
    against the reference evaluated on that node's actual input."""
    spec = SPECS["A-f32-static"]
    model = fused(spec, chains=3)
    nodes = fused_nodes(model)
    assert len(nodes) == 3
    dims = [*spec.leading, spec.channels]
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(
        helper.make_tensor_value_info(n.output[0], FLOAT, dims) for n in nodes if n.output[0] not in known
    )
    feeds = chain_inputs(spec)
    session = inlined_session(model)
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, feeds), strict=True))
    y = feeds["y"]
    for index, node in enumerate(nodes):
        actual = results[node.output[0]]
        expected, normed, w = reference_of(model, node, y, feeds["z"])
        ok, message = budget_report(actual, expected, normed=normed, weight=w)
        assert ok, f"chain {index}: {message}"
        y = actual + y  # the residual Add, float32 like ORT's
    np.testing.assert_array_equal(results[names[0]], y)


# --- what CoreML would take -------------------------------------------------------------------------


def coreml_mlprogram_ops() -> dict[str, str]:
    """Return {op_type: note} of the ai.onnx ops in the CoreML MLProgram list this onnxruntime ships."""
    path = Path(ort.__file__).parent / "tools" / "mobile_helpers" / "coreml_supported_mlprogram_ops.md"
    if not path.is_file():
        pytest.skip(f"onnxruntime {ort.__version__} ships no CoreML supported-op list ({path})")
    ops = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\|ai\.onnx[:.](\w+)\|(.*)\|$", line.strip())
        if match:
            ops[match.group(1)] = match.group(2)
    return ops


def after_level1(model: onnx.ModelProto, tmp_path: Path) -> onnx.ModelProto:
    """Return the graph as the providers' GetCapability sees it: function inlined, level-1 optimized."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(tmp_path / "level1.onnx")
    inlined_session(model, session_options=options)
    return onnx.load(options.optimized_model_filepath)


def coreml_refusals(model: onnx.ModelProto, supported: dict[str, str]) -> dict[str, set[str]]:
    """Return {op_type: reasons} for the nodes CoreML's MLProgram builders would refuse or change.

    The rules are those of ONNX Runtime's CoreML op builders (onnxruntime/core/providers/coreml/builders/
    impl/*.cc) that hold in every version read; contrib_ops/APPLE.md has the sources.
    """
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    produced = {o for n in model.graph.node for o in n.output}
    refusals: dict[str, set[str]] = {}

    def refuse(node: onnx.NodeProto, reason: str) -> None:
        refusals.setdefault(node.op_type, set()).add(reason)

    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
            refuse(node, "not in the MLProgram op list")
            continue
        if node.op_type == "Reshape" and node.input[1] not in constants:
            refuse(node, "new shape is not a constant initializer")
        if node.op_type == "Slice" and any(name not in constants for name in node.input[1:]):
            refuse(node, "starts/ends/axes/steps are not constant initializers")
        if node.op_type == "ReduceMean" and len(node.input) > 1 and node.input[1] not in constants:
            refuse(node, "axes are not a constant initializer")
        if node.op_type == "Reciprocal":
            refuse(node, "lowered to inverse(x, epsilon=1e-4): 1/(x + 1e-4)")
        if node.op_type == "Cast":
            to = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "to")
            if to not in (FLOAT, FLOAT16, onnx.TensorProto.INT32, onnx.TensorProto.BOOL):
                refuse(node, f"Cast to {onnx.TensorProto.DataType.Name(to)}")
            if node.input[0] not in produced:
                refuse(node, "Cast of a graph input (the builder needs a producing node)")
    return refusals


#: What CoreML would refuse in the inlined body of fusion/function/gated_group_rms_norm.py today (contrib_ops/APPLE.md,
#: "CoreML"). Update both when the body changes.
CURRENT_BODY_REFUSALS = {
    "A-f32-static": {},
    # With dynamic shapes ORT cannot fold the Reshape targets to constants, which CoreML requires.
    "A-f32-dynamic": {"Reshape": {"new shape is not a constant initializer"}},
}


@pytest.mark.parametrize("form", list(CURRENT_BODY_REFUSALS))
def test_coreml_refusals_of_the_current_body_are_the_documented_ones(form: str, tmp_path: Path) -> None:
    optimized = after_level1(fused(SPECS[form]), tmp_path)
    refusals = coreml_refusals(optimized, coreml_mlprogram_ops())
    assert refusals == CURRENT_BODY_REFUSALS[form], (
        f"the CoreML verdict on the inlined function changed; update contrib_ops/APPLE.md and this table:\n{refusals}"
    )


def test_static_shapes_fold_the_shape_arithmetic_before_partitioning(tmp_path: Path) -> None:
    """With static shapes ORT's level-1 constant folding turns Shape/Slice/Concat into constant Reshape
    targets and drops the no-op float Casts, so CoreML sees the arithmetic only."""
    optimized = after_level1(fused(SPECS["A-f32-static"]), tmp_path)
    ops = [n.op_type for n in optimized.graph.node]
    assert not {"Shape", "Slice", "Concat", "Unsqueeze", "Cast", "Constant"} & set(ops), ops
    constants = {i.name: numpy_helper.to_array(i) for i in optimized.graph.initializer}
    targets = [constants[n.input[1]].tolist() for n in optimized.graph.node if n.op_type == "Reshape"]
    # C / group_size is computed, not -1 (newer CoreML Reshape builders refuse -1): see APPLE.md.
    assert targets == [[2, 3, 4, 16], [2, 3, 64]]


def run_on_coreml(
    model: onnx.ModelProto, spec: ChainSpec, capfd: pytest.CaptureFixture[str]
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Run ``model`` on CoreML (MLProgram, CPU compute units so the numerics are fp32); return its output
    and (partitions, nodes, nodes supported by CoreML) from the provider's GetCapability log line."""
    options = ort.SessionOptions()
    options.log_severity_level = 1  # the partition summary is an info message
    session = ort.InferenceSession(
        model.SerializeToString(),
        options,
        providers=[("CoreMLExecutionProvider", {"ModelFormat": "MLProgram", "MLComputeUnits": "CPUOnly"})],
    )
    summary = re.search(
        r"number of partitions supported by CoreML: (\d+).*?number of nodes in the graph: (\d+)"
        r".*?number of nodes supported by CoreML: (\d+)",
        capfd.readouterr().err,
        re.S,
    )
    assert summary, "no GetCapability summary from the CoreML provider in the log"
    feeds = chain_inputs(spec)
    (actual,) = session.run(None, {"y": feeds["y"], "z": feeds["z"]})
    return actual, (int(summary.group(1)), int(summary.group(2)), int(summary.group(3)))


@pytest.mark.skipif(not COREML_AVAILABLE, reason="needs onnxruntime with the CoreML provider (macOS)")
def test_on_coreml_the_body_is_one_partition_within_budget(capfd: pytest.CaptureFixture[str]) -> None:
    spec = SPECS["A-f32-static"]
    model = fused(spec)
    actual, (partitions, nodes, supported) = run_on_coreml(model, spec, capfd)
    assert (partitions, supported) == (1, nodes), f"{partitions} partitions, {supported} of {nodes} nodes"
    (node,) = fused_nodes(model)
    feeds = chain_inputs(spec)
    expected, normed, w = reference_of(model, node, feeds["y"], feeds["z"])
    ok, message = budget_report(actual, expected, normed=normed, weight=w)
    assert ok, message
