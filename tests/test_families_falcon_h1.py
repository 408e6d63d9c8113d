"""Falcon-H1 gate-before-norm (form J: the weight multiplies the groups before the second Reshape), fused.

The same checks as ``tests/test_families.py`` applies to the other families, on the Falcon-H1 fixtures
with ``mamba_norm_before_gate=False`` (dynamo-noopt's spelling is not fused yet: ``PENDING_RULE``):
fused == ``expected_fused`` (every Mamba layer) with no chain left;
the fused graph, with and without the mambafuse library, against the original and against torch; decode
fixtures generate torch's greedy tokens.
"""

from __future__ import annotations

import pytest

from models.fixtures import PENDING_RULE
from tests.test_families import FIXTURES, _stems, check_fused_outputs, check_fused_tokens, check_fusion_count


def _falcon_h1(stems: list[str]) -> list[str]:
    """Falcon-H1 fixtures, less the exporters the committed rule does not fuse yet (``PENDING_RULE``: the
    families table says which and why; their tests come with the rule)."""
    return [s for s in stems if ("falcon_h1", FIXTURES[s]["exporter"]) not in PENDING_RULE]


def test_falcon_h1_has_fused_fixtures() -> None:
    assert _falcon_h1(_stems(("falcon_h1",), cpu=True, decode=True)), "no Falcon-H1 decode fixture to fuse"


@pytest.mark.parametrize("stem", _falcon_h1(_stems(("falcon_h1",))))
def test_falcon_h1_fuses_every_chain(stem: str) -> None:
    check_fusion_count(stem)


@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
@pytest.mark.parametrize("stem", _falcon_h1(_stems(("falcon_h1",), cpu=True)))
def test_falcon_h1_fused_matches_original_and_torch(stem: str, use_library: bool, library: str) -> None:
    check_fused_outputs(stem, use_library)


@pytest.mark.parametrize("use_library", [True, False], ids=["library", "function"])
@pytest.mark.parametrize("stem", _falcon_h1(_stems(("falcon_h1",), cpu=True, decode=True)))
def test_falcon_h1_fused_decode_generates_torchs_tokens(stem: str, use_library: bool, library: str) -> None:
    check_fused_tokens(stem, use_library)
