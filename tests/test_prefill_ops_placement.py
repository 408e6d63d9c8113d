"""Where the prefill ops run: their CPU kernels are registered unless the session turns them off
(``mambafuse.prefill_cpu_kernels`` = "0"), which ``contrib_ops.session`` does when the preferred provider is not the
CPU's: ONNX Runtime would place a node that its GPU provider has no kernel for on the CPU kernel and copy the
prompt's tensors across, where without a kernel it inlines the node's model-local function on the GPU. With the
library's CUDA kernels (MambaChunkScan) the node itself runs on the GPU."""

from __future__ import annotations

import contextlib

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

import contrib_ops
from fusion.function import mamba_chunk_scan as scan_function
from fusion.reference.mamba_chunk_scan import budget_report

H, P, G, N, T = 4, 8, 2, 16, 70


def _model(with_function: bool) -> onnx.ModelProto:
    f32 = onnx.TensorProto.FLOAT
    names = ["x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state"]
    shapes = [[1, T, H, P], [1, T, H], [H], [H], [1, T, G, N], [1, T, G, N], [H], [1, H, P, N]]
    graph = oh.make_graph(
        [oh.make_node("MambaChunkScan", names, ["out", "final_state"], domain="ai.mambafuse")],
        "scan",
        [oh.make_tensor_value_info(n, f32, s) for n, s in zip(names, shapes, strict=True)],
        [
            oh.make_tensor_value_info("out", f32, [1, T, H, P]),
            oh.make_tensor_value_info("final_state", f32, [1, H, P, N]),
        ],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("ai.mambafuse", 1)], ir_version=10
    )
    if with_function:
        model.functions.append(scan_function.make_function(18))
    return model


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((1, T, H, P)).astype(np.float32),
        "dt": rng.standard_normal((1, T, H)).astype(np.float32),
        "dt_bias": (0.5 * rng.standard_normal(H)).astype(np.float32),
        "A": -(rng.random(H) + 0.5).astype(np.float32),
        "B": rng.standard_normal((1, T, G, N)).astype(np.float32),
        "C": rng.standard_normal((1, T, G, N)).astype(np.float32),
        "D": rng.standard_normal(H).astype(np.float32),
        "initial_state": rng.standard_normal((1, H, P, N)).astype(np.float32),
    }


def _options(prefill_cpu_kernels: str | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if prefill_cpu_kernels is not None:
        options.add_session_config_entry(contrib_ops.PREFILL_CPU_KERNELS_KEY, prefill_cpu_kernels)
    return options


@pytest.mark.parametrize("setting", [None, "1"])
def test_the_kernel_runs_a_node_without_function(setting):
    feeds = _inputs()
    session = contrib_ops.session(_model(False), session_options=_options(setting), use_library=True)
    out, state = session.run(None, feeds)
    assert budget_report(out, state, **feeds)[0]


def test_turned_off_the_kernel_is_not_registered():
    with pytest.raises(Exception, match="MambaChunkScan"):
        session = contrib_ops.session(_model(False), session_options=_options("0"), use_library=True)
        session.run(None, _inputs())


def test_turned_off_the_function_runs_the_node():
    """With the CPU kernels off, a CPU session inlines the node's function. A library built with its CUDA kernels
    declares MambaChunkScan to every session (its CUDA kernel's registration), so ORT no longer inlines the function
    on the CPU: the session then fails naming the op — the setting is for GPU-first sessions, which run that kernel."""
    feeds = _inputs()
    if contrib_ops.has_cuda_kernels():
        with pytest.raises(Exception, match="MambaChunkScan"):
            session = contrib_ops.session(_model(True), session_options=_options("0"), use_library=True)
            session.run(None, feeds)
        return
    session = contrib_ops.session(_model(True), session_options=_options("0"), use_library=True)
    out, state = session.run(None, feeds)
    ok, summary = budget_report(out, state, **feeds)
    assert ok, summary


def test_session_turns_them_off_for_a_gpu_first_provider_list():
    options = _options(None)
    # a CPU-only onnxruntime may refuse the GPU provider; the entry is set before the session is made
    with contextlib.suppress(Exception):
        contrib_ops.session(
            _model(True), providers=["CUDAExecutionProvider", "CPUExecutionProvider"], session_options=options
        )
    assert options.get_session_config_entry(contrib_ops.PREFILL_CPU_KERNELS_KEY) == "0"
    cpu_options = _options(None)
    contrib_ops.session(_model(True), session_options=cpu_options)
    with pytest.raises(RuntimeError):
        cpu_options.get_session_config_entry(contrib_ops.PREFILL_CPU_KERNELS_KEY)


def test_on_cuda_the_fused_prefill_runs_on_the_gpu(tmp_path):
    """A fused prefill fixture in a CUDA session made by ``contrib_ops.session``: no prefill node runs a CPU kernel
    (ORT's profile), and the logits equal the unfused graph's on CUDA within the half type's rounding."""
    import json
    from pathlib import Path

    from fusion import rewrite
    from tests._cuda import CUDA, cuda_problem, with_supported_ir

    problem = cuda_problem(ort)
    if problem is not None:
        pytest.skip(problem)
    source = Path(__file__).parent / "fixtures" / "models" / "nemotron_h-dynamo-fp16-prefill.onnx"
    fused_path = tmp_path / "fused.onnx"
    assert rewrite.main([str(source), "-o", str(fused_path)]) == 0
    fused = with_supported_ir(onnx.load(str(fused_path)))
    assert {n.op_type for n in fused.graph.node if n.domain == "ai.mambafuse"} >= {"MambaChunkScan", "CausalConv1d"}
    options = _options(None)
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = contrib_ops.session(fused, providers=[CUDA, "CPUExecutionProvider"], session_options=options)
    feeds = {"input_ids": (np.arange(40, dtype=np.int64)[None] * 7) % 50}
    (got,) = session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    on_cpu = {
        e["args"].get("op_name")
        for e in events
        if e.get("cat") == "Node" and e.get("args", {}).get("provider") == "CPUExecutionProvider"
    }
    assert not on_cpu & {"MambaChunkScan", "CausalConv1d"}, on_cpu
    on_cuda = {
        e["args"].get("op_name") for e in events if e.get("cat") == "Node" and e.get("args", {}).get("provider") == CUDA
    }
    assert {"MambaChunkScan", "CausalConv1d"} <= on_cuda, f"ran as function bodies, not on the CUDA kernels: {on_cuda}"
    original = with_supported_ir(onnx.load(str(source)))
    (expected,) = ort.InferenceSession(original.SerializeToString(), providers=[CUDA]).run(None, feeds)
    scale = float(np.max(np.abs(expected.astype(np.float64))))
    assert np.max(np.abs(got.astype(np.float64) - expected)) <= 0.02 * scale
