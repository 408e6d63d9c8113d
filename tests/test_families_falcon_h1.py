"""Falcon-H1 gate-before-norm (form J: the weight multiplies the groups before the second Reshape), fused.

The same checks as ``tests/test_families.py`` applies to the other families, on every Falcon-H1 fixture
with ``mamba_norm_before_gate=False`` (dynamo, dynamo-noopt, TorchScript mixer, transformers; fp32 and
fp16; prefill and decode): fused == ``expected_fused`` (every Mamba layer) with no chain left; the fused
graph, with and without the mambafuse library, against the original and against torch; decode fixtures
generate torch's greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.test_families import _stems, check_fused_outputs, check_fused_tokens, check_fusion_count

FALCON_H1 = ("falcon_h1",)


def test_every_falcon_h1_exporter_is_covered() -> None:
    from tests.test_families import FIXTURES

    exporters = {FIXTURES[stem]["exporter"] for stem in _stems(FALCON_H1)}
    assert exporters == {"dynamo", "dynamo-noopt", "torchscript", "transformers"}, sorted(exporters)
    assert _stems(FALCON_H1, cpu=True, decode=True), "no Falcon-H1 decode fixture"


@pytest.mark.parametrize("stem", _stems(FALCON_H1))
def test_falcon_h1_fuses_every_chain(stem: str) -> None:
    check_fusion_count(stem)


@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
@pytest.mark.parametrize("stem", _stems(FALCON_H1, cpu=True))
def test_falcon_h1_fused_matches_original_and_torch(stem: str, use_library: bool, library: str) -> None:
    check_fused_outputs(stem, use_library)


@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
@pytest.mark.parametrize("stem", _stems(FALCON_H1, cpu=True, decode=True))
def test_falcon_h1_fused_decode_generates_torchs_tokens(stem: str, use_library: bool, library: str) -> None:
    check_fused_tokens(stem, use_library)
