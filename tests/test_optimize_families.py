"""``mambafuse optimize`` fuses at least what ``mambafuse rewrite`` fuses, on every family's fixtures.

optimize runs onnxscript's ORT fusions too, which rewrite some Mamba-2 chains into spellings the rules do not
prove (Falcon-H1's grouped norm, whose RMS their rms_normalization takes): it runs mambafuse's fusions first, on
the graph as exported. Every fixture of the families set (tests/fixtures/models/families/) and the dynamo
exports of transformers 5.25, per ai.mambafuse op: optimize's count >= rewrite's.
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path

import onnx
import pytest

from fusion.optimize import optimize_model
from fusion.rewrite import rewrite_model
from models.fixtures import FAMILY_FIXTURE_DIR, TF525_FIXTURE_DIR

FIXTURES = sorted(FAMILY_FIXTURE_DIR.glob("*.onnx")) + sorted(TF525_FIXTURE_DIR.glob("*-dynamo-fp32-*.onnx"))


@cache
def _counts(path: Path, optimize: bool) -> Counter:
    model = onnx.load(path)
    fused, _ = (optimize_model if optimize else rewrite_model)(model)
    return Counter(n.op_type for n in fused.graph.node if n.domain == "ai.mambafuse")


@pytest.mark.parametrize("path", FIXTURES, ids=[f"{p.parent.name}/{p.stem}" for p in FIXTURES])
def test_optimize_fuses_at_least_what_rewrite_fuses(path: Path) -> None:
    rewritten, optimized = _counts(path, False), _counts(path, True)
    short = {op: (optimized[op], count) for op, count in rewritten.items() if optimized[op] < count}
    assert not short, f"{path.name}: optimize vs rewrite per op {short}"
