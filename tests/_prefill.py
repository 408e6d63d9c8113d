"""Helpers the prefill rule tests share (tests/test_mamba_chunk_scan_rules.py, tests/test_causal_conv1d_rules.py): the
prefill fixtures, a fused model with its op's model-local function, a CPU session, and prompt inputs."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def prefill_fixtures() -> list[Path]:
    """Every prefill fixture: transformers 5.24 and 5.25, the other families, the exports traced at a chunk multiple."""
    patterns = (
        "*prefill*.onnx",
        "transformers-5.25/*prefill*.onnx",
        "families/*prefill*.onnx",
        "padded/*prefill*.onnx",
    )
    return sorted(Path(p) for pattern in patterns for p in glob.glob(str(FIXTURES / pattern)))


def fixture_id(path: Path) -> str:
    return os.path.relpath(path, FIXTURES)


def with_function(model: ir.Model, function: onnx.FunctionProto) -> onnx.ModelProto:
    """``model`` as a proto carrying ``function`` (a fused op's model-local body), with the opsets it imports."""
    proto = ir.serde.serialize_model(model)
    proto.functions.append(function)
    domains = {o.domain for o in proto.opset_import}
    for domain, version in ((function.domain, 1), *((o.domain, o.version) for o in function.opset_import)):
        if domain not in domains:
            proto.opset_import.append(onnx.helper.make_opsetid(domain, version))
            domains.add(domain)
    return proto


def session(proto: onnx.ModelProto) -> ort.InferenceSession:
    """An ONNX Runtime CPU session of ``proto`` (without the mambafuse library: fused ops run their functions)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def prompt_feeds(session: ort.InferenceSession, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Feeds for a prompt of ``length`` tokens: random token ids, positions 0..length-1, 0 for transformers'
    exporter's scalar cache counters (an empty cache), random floats (of the input's type) otherwise."""
    feeds = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else length for d in value.shape]
        if "int64" in value.type:
            if not shape:
                feeds[value.name] = np.zeros((), np.int64)
            elif "position" in value.name:
                feeds[value.name] = np.broadcast_to(np.arange(length), shape).astype(np.int64)
            else:
                feeds[value.name] = rng.integers(0, 32, size=shape).astype(np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float16 if "float16" in value.type else np.float32)
    return feeds
