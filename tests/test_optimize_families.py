"""``mambafuse optimize`` fuses at least what ``mambafuse rewrite`` fuses, on every fixture of every family.

optimize runs onnxscript's ORT fusions too, which rewrite some Mamba-2 chains into spellings the rules do not
prove (Falcon-H1's grouped norm: their rms_normalization takes its RMS and folds its weight into a (groups, group
size) scale); it runs mambafuse's fusions first, on the graph as exported. Every ``.onnx`` fixture of
tests/fixtures/models/ and its families/, batch/ and padded/ sets, and the dynamo fp32 exports of transformers
5.25, per ai.mambafuse op: optimize's count >= rewrite's. A refusal left after optimize is never the rules' bare
"does not match any chain form" where rewrite, on the graph as exported, gave a reason.

The fixtures run in worker processes, one per core (optimize takes 1-10 s a fixture on one core): the selected
ones are handed to the workers when the first test of this file starts.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from pathlib import Path

import onnx_ir as ir
import pytest

from fusion.optimize import optimize_model
from fusion.rewrite import rewrite_model
from models.fixtures import BATCH_FIXTURE_DIR, FAMILY_FIXTURE_DIR, FIXTURE_DIR, PADDED_FIXTURE_DIR, TF525_FIXTURE_DIR

FIXTURES = [
    *(
        path
        for folder in (FIXTURE_DIR, FAMILY_FIXTURE_DIR, BATCH_FIXTURE_DIR, PADDED_FIXTURE_DIR)
        for path in sorted(folder.glob("*.onnx"))
    ),
    *sorted(TF525_FIXTURE_DIR.glob("*-dynamo-fp32-*.onnx")),
]
BARE = "does not match any chain form"


def _fused_and_refused(path: str) -> dict[str, tuple[Counter, list[str]]]:
    """Return, for ``rewrite`` and ``optimize`` of the fixture at ``path``: its ai.mambafuse nodes per op type and
    the reasons of its refusals (all ops)."""
    results = {}
    for name, transform in (("rewrite", rewrite_model), ("optimize", optimize_model)):
        model, report = transform(ir.load(path))
        report = getattr(report, "rewrite", report)
        counts = Counter(node.op_type for node in model.graph if node.domain == "ai.mambafuse")
        reasons = [reason for _, reason in report.refused]
        reasons += [reason for op in report.decode.values() for _, reason in op["refused"]]
        results[name] = (counts, reasons)
    return results


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest):
    """Start every selected fixture's optimize and rewrite in worker processes; yield path -> Future."""
    selected = [
        item.callspec.params["path"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    workers = min(os.cpu_count() or 1, len(selected))
    pool: Executor | None = None
    if workers > 1:
        # spawn, not fork: the parent has ONNX Runtime's thread pools, which a forked child would inherit broken
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures: dict[Path, Future] = {}
    for path in selected:
        if pool is not None:
            futures[path] = pool.submit(_fused_and_refused, str(path))
        else:
            futures[path] = Future()
            futures[path].set_result(_fused_and_refused(str(path)))
    yield futures
    if pool is not None:
        pool.shutdown(cancel_futures=True)


def test_every_fixture_set_is_covered() -> None:
    for folder in (FIXTURE_DIR, FAMILY_FIXTURE_DIR, BATCH_FIXTURE_DIR, PADDED_FIXTURE_DIR):
        assert any(path.parent == folder for path in FIXTURES), f"no fixture of {folder}"


@pytest.mark.parametrize("path", FIXTURES, ids=[str(p.relative_to(FIXTURE_DIR).with_suffix("")) for p in FIXTURES])
def test_optimize_fuses_at_least_what_rewrite_fuses(path: Path, results: dict[Path, Future]) -> None:
    found = results[path].result()
    (rewritten, rewrite_reasons), (optimized, optimize_reasons) = found["rewrite"], found["optimize"]
    short = {
        op: f"optimize {optimized[op]} < rewrite {count}" for op, count in rewritten.items() if optimized[op] < count
    }
    assert not short, f"{path.name}: {short}"
    if not any(BARE in reason for reason in rewrite_reasons):
        bare = [reason for reason in optimize_reasons if reason == BARE]
        assert not bare, f"{path.name}: optimize refuses with the bare {BARE!r}; rewrite: {rewrite_reasons}"
