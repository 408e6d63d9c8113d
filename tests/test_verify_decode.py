"""``--verify`` on decode graphs: every fused node (the gated norm and the decode-step ops) is checked against
its op's reference budget on the model's real intermediate values, and a half-precision model's outputs get the
half-precision bound (ONNX Runtime's CPU run of the original drops the graph's float16 roundings)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from fusion import rewrite
from fusion.verify import verify
from models.fixtures import FIXTURE_DIR
from models.runtime import feeds, load_manifest, load_references

MANIFEST = load_manifest()
REFERENCES = load_references()


def _fused(stem: str, tmp_path: Path) -> tuple[Path, Path, dict]:
    record = MANIFEST["fixtures"][stem]
    source = FIXTURE_DIR / record["file"]
    output = tmp_path / "fused.onnx"
    assert rewrite.main([str(source), str(output)]) == 0
    return source, output, feeds(record, REFERENCES[stem])


@pytest.mark.parametrize("stem", ["nemotron_h-dynamo-fp32-decode", "nemotron_h-dynamo-fp16-decode"])
def test_verify_checks_every_fused_node(stem: str, tmp_path: Path) -> None:
    source, output, inputs = _fused(stem, tmp_path)
    result = verify(source, output, inputs=inputs)
    assert result["ok"], result["summary"]
    checked = [node for node in result["nodes"] if node["checked"]]
    # two Mamba layers: a gated norm, a conv update and a state update each; the MLP layer's squared ReLU
    assert len(checked) == 7 and all(node["within_budget"] for node in checked), result["nodes"]
    assert "7 of 7 within their op's accuracy budget" in result["summary"]


def test_verify_fails_a_fusion_that_computes_something_else(tmp_path: Path) -> None:
    """A fused node whose attributes do not say what the graph computed: its outputs, not its budget, fail."""
    source, output, inputs = _fused("nemotron_h-dynamo-fp32-decode", tmp_path)
    model = onnx.load(output)
    node = next(n for n in model.graph.node if n.op_type == "SelectiveStateUpdate")
    next(a for a in node.attribute if a.name == "dt_softplus").i = 0  # the graph applies softplus
    onnx.save(model, output)
    result = verify(source, output, inputs=inputs)
    assert not result["ok"]
    assert any(not o["within_budget"] for o in result["outputs"] if "recurrent_states" in o["name"]), result["summary"]


@pytest.mark.parametrize("op_type", ["CausalConv1dUpdate", "SelectiveStateUpdate"])
def test_the_node_check_rejects_a_kernel_output_off_its_budget(op_type: str, tmp_path: Path) -> None:
    """The per-node check compares the kernel's outputs with the op's reference: a perturbed one fails."""
    import numpy as np

    import contrib_ops
    from fusion import verify as verify_module

    _, output, inputs = _fused("nemotron_h-dynamo-fp32-decode", tmp_path)
    model = onnx.load(output)
    node = next(n for n in model.graph.node if n.op_type == op_type)
    names = [name for name in (*node.input, *node.output) if name]
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in known)
    session = contrib_ops.session(model, use_library=True)
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))
    arrays = [values[name] if name else None for name in (*node.input, *node.output)]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    check = verify_module._NODE_CHECKS[op_type]
    assert check(arrays, attrs)[0], "the kernel's real outputs are within budget"
    bad = [a.copy() if isinstance(a, np.ndarray) else a for a in arrays]
    bad[-2] = bad[-2] * np.float32(1 + 1e-4) + np.float32(1e-6)  # y / out, off by far more than the budget
    assert not check(bad, attrs)[0]


def test_debug_lists_the_decode_step_ops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = FIXTURE_DIR / MANIFEST["fixtures"]["nemotron_h-dynamo-fp32-decode"]["file"]
    assert rewrite.main([str(source), str(tmp_path / "fused.onnx"), "--debug"]) == 0
    debug = capsys.readouterr().err
    fused = debug.split("debug: fused chains:")[1].splitlines()
    assert sum("[CausalConv1dUpdate]: channels=128 width=4" in line for line in fused) == 2, debug
    assert sum("[SelectiveStateUpdate]: heads=4" in line for line in fused) == 2, debug
    assert sum("[form A]" in line for line in fused) == 2, debug
