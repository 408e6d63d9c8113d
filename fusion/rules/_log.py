"""What a fusion did to each chain it met: fused (with the fused node's attributes) or refused (with the reason).

Every rule module records into a ``FusionLog``; the orchestration (fusion/rewrite.py, the registry) reads it for
its report. It lives below both so that neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir


@dataclasses.dataclass
class ChainRecord:
    """One chain, keyed by its first Reshape (the anchor): its form, and fused or why not."""

    location: str
    form: str
    fused: bool = False
    reason: str | None = None
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FusionLog:
    """Records, per chain anchor node, the last check outcome of the fusion rules."""

    chains: dict[ir.Node, ChainRecord] = dataclasses.field(default_factory=dict)

    def record(self, anchor: ir.Node, form: str, *, reason: str | None = None, **attributes: Any) -> None:
        """Record a refusal (``reason``) or a fusion (no reason) of the chain at ``anchor``."""
        previous = self.chains.get(anchor)
        if previous is not None and previous.fused:
            return
        self.chains[anchor] = ChainRecord(location(anchor), form, reason is None, reason, attributes)

    def __repr__(self) -> str:
        # What an onnxscript user sees of the rule set's log: per chain, where, its form, fused or why not
        # (the default repr printed every anchor ir.Node in full).
        records = list(self.chains.values())
        fused = sum(record.fused for record in records)
        chains = ", ".join(
            f"{record.location!r} form {record.form} " + ("fused" if record.fused else f"refused: {record.reason}")
            for record in records
        )
        return f"FusionLog({fused} fused, {len(records) - fused} refused: [{chains}])"


def location(node: ir.Node) -> str:
    """Return a readable location of ``node``: its name, else its op type and first output name."""
    if node.name:
        return node.name
    output = node.outputs[0].name if node.outputs else None
    return f"{node.op_type} -> {output}" if output else f"{node.op_type} (unnamed)"
