"""Olive: the ``MambafuseGatedGroupRMSNorm`` surgeon in ``GraphSurgeries`` workflows, evaluated by Olive.

The workflows run once per session in a subprocess (``tests/_olive_workflows.py``: Olive's import is slow
and sets up logging and telemetry globally); the tests read what it wrote. Olive's sessions register no
mambafuse library, so everything Olive ran went through the model-local function; the tests compare
that against the unfused model and against the fused model with the library (the kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import contrib_ops

ROOT = Path(__file__).resolve().parent.parent
DOMAIN, OP_TYPE = "ai.mambafuse", "GatedGroupRMSNorm"
MAMBA2_LAYERS = 2


@pytest.fixture(scope="module")
def olive_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the Olive workflows once; return their output directory (fail with Olive's log otherwise)."""
    out = tmp_path_factory.mktemp("olive")
    env = {
        **os.environ,
        # Olive's telemetry: off (CI detection disables it before its first event), and the hub offline.
        "CI": "1",
        "OLIVE_DISABLE_TELEMETRY": "1",
        "OLIVE_TELEMETRY_CACHE_DIR": str(out / "telemetry"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_olive_workflows.py"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    (out / "olive.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        pytest.fail(f"Olive workflows failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
    return out


def _fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if (node.domain, node.op_type) == (DOMAIN, OP_TYPE)]


def _arrays(run: Path, name: str, kind: str) -> dict[str, np.ndarray]:
    with np.load(run / "olive_session_outputs.npz") as data:
        prefix = f"{name}/{kind}/"
        return {key[len(prefix) :]: data[key] for key in data.files if key.startswith(prefix)}


def _max_rel_diff(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    assert actual.keys() == expected.keys()
    worst = 0.0
    for name, e in expected.items():
        a = actual[name].astype(np.float64)
        scale = max(float(np.max(np.abs(e))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a - e.astype(np.float64)))) / scale)
    return worst


def _session_outputs(path: Path, feeds: dict[str, np.ndarray], *, library: bool) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    if library:
        contrib_ops.register(options)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return {o.name: v for o, v in zip(session.get_outputs(), session.run(None, feeds), strict=True)}


def test_surgeon_fuses_in_graph_surgeries(olive_run: Path) -> None:
    """python -m fusion.olive CONFIG: GraphSurgeries with our surgeon fuses both chains of the fixture."""
    original = onnx.load(ROOT / "tests" / "fixtures" / "models" / "nemotron_h-dynamo-fp32-prefill.onnx")
    fused = onnx.load(olive_run / "fixture" / "model.onnx")
    assert len(_fused_nodes(fused)) == 2
    # the surgeon runs every fusion: in this prefill the scans, the prompt convs and the MLP's squared ReLU too, each
    # with its function
    fused_ops = Counter(n.op_type for n in fused.graph.node if n.domain == DOMAIN)
    assert fused_ops == {OP_TYPE: 2, "MambaChunkScan": 2, "CausalConv1d": 2, "SquaredRelu": 1}
    assert sorted(f.name for f in fused.functions if f.domain == DOMAIN) == sorted(fused_ops)
    before, after = Counter(n.op_type for n in original.graph.node), Counter(n.op_type for n in fused.graph.node)
    # each layer's gate sigmoid and its conv's SiLU sigmoid go
    assert after["ReduceMean"] == before["ReduceMean"] - 2 and after["Sigmoid"] == before["Sigmoid"] - 4
    log = (olive_run / "olive.log").read_text()
    assert "MambafuseGatedGroupRMSNorm: fused: 2, refused: 0" in log  # the surgeon's report in Olive's log


def test_olive_evaluates_the_fused_model(olive_run: Path, library: str) -> None:
    """Olive's evaluator and its sessions run the fused model (function body) with the original's outputs."""
    metrics = json.loads((olive_run / "fixture" / "metrics.json").read_text())
    assert metrics["latency-avg"]["value"] > 0
    feeds = _arrays(olive_run, "fixture", "input")
    in_olive = _arrays(olive_run, "fixture", "output")
    original = _session_outputs(
        ROOT / "tests" / "fixtures" / "models" / "nemotron_h-dynamo-fp32-prefill.onnx", feeds, library=False
    )
    kernel = _session_outputs(olive_run / "fixture" / "model.onnx", feeds, library=True)
    assert _max_rel_diff(in_olive, original) <= 1e-5
    assert _max_rel_diff(kernel, in_olive) <= 1e-5


def test_mobius_builder_then_surgeon_runs_in_olive(olive_run: Path, library: str) -> None:
    """MobiusBuilder → GraphSurgeries(ours): the output runs in Olive's session like MobiusBuilder's alone."""
    feeds = _arrays(olive_run, "mobius", "input")
    assert feeds.keys() == _arrays(olive_run, "mobius_only", "input").keys()
    in_olive = _arrays(olive_run, "mobius", "output")
    unfused = _arrays(olive_run, "mobius_only", "output")
    assert "logits" in in_olive
    assert _max_rel_diff(in_olive, unfused) <= 1e-5
    kernel = _session_outputs(olive_run / "mobius" / "model.onnx", feeds, library=True)
    assert _max_rel_diff(kernel, unfused) <= 1e-5
    # The surgeon ran on MobiusBuilder's model: its report names that model's node counts.
    nodes_before = len(onnx.load(olive_run / "mobius_only" / "model.onnx", load_external_data=False).graph.node)
    nodes_after = len(onnx.load(olive_run / "mobius" / "model.onnx", load_external_data=False).graph.node)
    assert (
        f"MambafuseGatedGroupRMSNorm: nodes: {nodes_before} -> {nodes_after}" in (olive_run / "olive.log").read_text()
    )


def test_mobius_builder_chains_are_fused(olive_run: Path) -> None:
    """mobius writes form I (the weight as RMSNormalization's scale, one group here): every chain fused."""
    fused = onnx.load(olive_run / "mobius" / "model.onnx")
    nodes = _fused_nodes(fused)
    assert len(nodes) == MAMBA2_LAYERS
    attributes = [{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} for node in nodes]
    assert all(a["group_size"] == 64 for a in attributes)  # Mamba2ForCausalLM's norm: one group of C = 64
    assert not any(node.op_type == "RMSNormalization" and "mixer" in node.name for node in fused.graph.node)
    assert (
        "MambafuseGatedGroupRMSNorm: gated group-RMSNorm chains found: 2 (I: 2)"
        in (olive_run / "olive.log").read_text()
    )


def test_surgeon_is_registered_and_checks_its_arguments(olive_run: Path) -> None:
    """Importing fusion.olive registers the surgeon; bad arguments and min_fused give one clear error."""
    checks = json.loads((olive_run / "checks.json").read_text())
    assert checks["registered"] is True
    assert checks["argument_errors"] == [
        "MambafuseGatedGroupRMSNorm: 'function' must be true or false, got 'yes'",
        "MambafuseGatedGroupRMSNorm: 'min_fused' must be a non-negative integer, got -1",
        "MambafuseGatedGroupRMSNorm: 'opt_in': no opt-in fusion named 'nope' (choices: linear_attention_scan, "
        "causal_conv_with_state, decode_matmul, decode_matmul_nbits)",
        "MambafuseGatedGroupRMSNorm: 'opt_in' must be a list of fusion names, got 3",
    ]
    assert checks["opt_in_ops"] == [
        "CausalConv1d",
        "DecodeMatMul",
        "GatedGroupRMSNorm",
        "MambaChunkScan",
        "SquaredRelu",
    ]
    assert checks["min_fused_error"] is not None
    assert "MambafuseGatedGroupRMSNorm: fused 2 chains, min_fused is 3" in checks["min_fused_error"]


#: Olive's int4 passes (tests/_olive_workflows.py: INT4_PASSES) and what DecodeMatMulNBits makes of their products:
#: RTN and k-quant write MatMulNBits with packed uint8 zero points (or none), HQQ with float zero points, which the
#: op does not take (each refused with that reason).
INT4_ROUTES = {"rtn": True, "kquant": True, "hqq": False}


@pytest.mark.parametrize(("route", "replaced"), sorted(INT4_ROUTES.items()))
def test_olive_int4_routes_fuse_every_op(olive_run: Path, route: str, replaced: bool) -> None:
    """A decode export quantized by Olive's int4 passes: every Mamba-2 op fused in every layer, with parity to the
    quantized model; with ``--opt-in decode_matmul_nbits`` each 4-bit product it takes replaced, computing the same
    bit for bit on the CPU (its function is the MatMulNBits it replaced)."""
    from fusion.rewrite import rewrite_model
    from models.fixtures import TF525_FIXTURE_DIR
    from models.runtime import feeds, load_manifest, load_references
    from tests.test_decode_step_rules import TOLERANCE, scaled_error

    stem = "nemotron_h-dynamo-fp32-decode"
    record = load_manifest(TF525_FIXTURE_DIR)["fixtures"][stem]
    quantized = onnx.load(olive_run / f"int4-{route}" / "model.onnx")
    products = sum(node.op_type == "MatMulNBits" for node in quantized.graph.node)
    assert products > 0
    plain, report = rewrite_model(quantized)
    opted, opted_report = rewrite_model(quantized, opt_in=["decode_matmul_nbits"])
    for model in (plain, opted):
        counts = Counter(node.op_type for node in model.graph.node)
        for op in ("GatedGroupRMSNorm", "CausalConv1dUpdate", "SelectiveStateUpdate"):
            assert counts[op] == record["num_mamba_layers"], report.summary()
    counts = Counter(node.op_type for node in opted.graph.node)
    assert counts["DecodeMatMulNBits"] == (products if replaced else 0), opted_report.summary()
    if not replaced:
        assert "the zero points are float, not packed uint8" in opted_report.summary()
    inputs = feeds(record, load_references(TF525_FIXTURE_DIR)[stem])

    def outputs(model: onnx.ModelProto) -> list[np.ndarray]:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, inputs)

    expected = outputs(quantized)
    for fused_value, opted_value, original in zip(outputs(plain), outputs(opted), expected, strict=True):
        np.testing.assert_array_equal(opted_value, fused_value)
        error, floor = scaled_error(np.asarray(fused_value), np.asarray(original))
        assert error <= TOLERANCE["fp32"] + floor
