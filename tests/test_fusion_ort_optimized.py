"""Form G: real exports after ONNX Runtime's own optimizer (QuickGelu, Div(x, Sqrt), fp16 Casts) still fuse.

Users often keep the model ONNX Runtime optimized (``SessionOptions.optimized_model_filepath``) and feed
that to the rewriter: every chain must still be found, and the fused model must agree with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import contrib_ops
from fusion.rewrite import rewrite_model

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "models"
CASES = [
    "nemotron_h-dynamo-fp32-decode",
    "nemotron_h-dynamo-fp16-decode",
    "zamba2-transformers-fp16-decode",
    "nemotron_h-torchscript-fp32-prefill",
]
LEVELS = {"extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def _manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())["fixtures"]


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("stem", CASES)
def test_ort_optimized_exports_fuse_and_agree(stem: str, level: str, tmp_path: Path) -> None:
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[level]
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(FIXTURES / f"{stem}.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    assert "QuickGelu" in {n.op_type for n in optimized.graph.node}, "ORT did not rewrite the silu: not form G"

    fused, report = rewrite_model(optimized)
    assert report.fused == _manifest()[stem]["num_mamba_layers"], report.summary()
    assert set(report.chains_found) == {"G"}
    # The conv's silu is a QuickGelu too (outside the chains): exactly one per chain goes away.
    quick_gelus = [sum(n.op_type == "QuickGelu" for n in m.graph.node) for m in (optimized, fused)]
    assert quick_gelus[0] - quick_gelus[1] == report.fused

    with np.load(FIXTURES / "references.npz") as refs:
        prefix = f"{stem}/input/"
        feeds = {k[len(prefix) :]: refs[k] for k in refs.files if k.startswith(prefix)}
    types = {i.name: i.type.tensor_type.elem_type for i in optimized.graph.input}
    feeds = {k: v.astype(onnx.helper.tensor_dtype_to_np_dtype(types[k])) for k, v in feeds.items()}
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3
    want = ort.InferenceSession(optimized.SerializeToString(), quiet, providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    got = contrib_ops.session(fused, use_library=True).run(None, feeds)
    for w, g in zip(want, got, strict=True):
        tolerance = (2e-2 if w.dtype == np.float16 else 1e-3) * max(float(np.abs(w).max()), 1e-30)
        assert np.abs(g.astype(np.float64) - w.astype(np.float64)).max() <= tolerance
