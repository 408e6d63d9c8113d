"""Graph editing the rules share: dead producers after a fusion, every value of a model, fresh names, and
annotations rolled back after matching."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import onnx_ir as ir


def remove_dead_producers(values: Iterable[ir.Value | None]) -> int:
    """Remove the producers of ``values`` (and theirs, transitively) that nothing reads any more.

    Also drops initializers among them that lost their last reader. Returns how many nodes went.
    Used after a fusion: the shape arithmetic, Constant nodes and absorbed Casts around a chain are
    dead once the chain is gone; unrelated dead code elsewhere in the model is left alone.
    """
    removed = 0
    # Terminates: a value is pushed again only when a node was removed.
    work = [v for v in values if v is not None]
    while work:
        value = work.pop()
        if value.uses() or value.is_graph_output():
            continue
        graph = value.graph
        if value.is_initializer() and graph is not None and not value.is_graph_input():
            if value.name in graph.initializers:
                graph.initializers.pop(value.name)
            continue
        producer = value.producer()
        if producer is None or producer.graph is None:
            continue
        if any(out.uses() or out.is_graph_output() for out in producer.outputs):
            continue
        inputs = [v for v in producer.inputs if v is not None]  # removal detaches the inputs
        producer.graph.remove(producer, safe=True)
        removed += 1
        work.extend(inputs)
    return removed


def all_values(model: ir.Model) -> list[ir.Value]:
    """Return every value of the model: graph inputs, initializers and node outputs, functions too."""
    values: list[ir.Value] = []
    for graph in [*model.graphs(), *model.functions.values()]:
        values.extend(list(graph.inputs))
        if isinstance(graph, ir.Graph):
            values.extend(list(graph.initializers.values()))
        for node in ir.traversal.RecursiveGraphIterator(graph):
            values.extend(list(node.outputs))
    return values


class NameSource:
    """Fresh value names for one pass over ``model``: each differs from every name in the model and from the others."""

    def __init__(self, model: ir.Model) -> None:
        self._taken = {value.name for value in all_values(model) if value.name}

    def __call__(self, base: str) -> str:
        name, suffix = base, 1
        while name in self._taken:
            name, suffix = f"{base}_{suffix}", suffix + 1
        self._taken.add(name)
        return name


@contextlib.contextmanager
def value_info_preserved(model: ir.Model) -> Iterator[None]:
    """Restore the type and shape of every value that exists now, when the block ends.

    Matching annotates values as a side effect (the rewriter's constant propagation types Constant
    outputs; shape inference types everything); those annotations would show up as value_info in the
    saved model, so a chain that is not fused would not leave its graph byte-identical.
    """
    saved = [(value, value.type, value.shape) for value in all_values(model)]
    try:
        yield
    finally:
        for value, type_, shape in saved:
            value.type, value.shape = type_, shape
