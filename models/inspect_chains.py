"""Find the gated group-RMSNorm chains of an ONNX model and say which docs/forms.md form each one is (A–H, and J:
Falcon-H1's weight multiply inside the grouped view).

A chain starts where the gate meets a sigmoid: ``Sigmoid(z)`` followed by ``Mul(z, σ)`` and a ``Mul`` with
the scan output ``y`` (or ORT's ``QuickGelu(z)`` followed by that ``Mul``). From there it runs forward to
the ``MatMul`` of ``out_proj``; the ``Cast`` / ``Constant`` / sequence nodes feeding it from outside are
listed as its inputs. Every other ``Sigmoid`` (the conv's SiLU, the MLP's, ...) is listed as "not a chain"
with the op types after it, so coverage can be checked by eye:

    python -m models.inspect_chains model.onnx [more.onnx ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

#: Nodes where the forward walk stops: out_proj and everything past it belong to the next layer.
_STOP_OPS = {"MatMul", "Gemm", "Einsum", "Conv", "MatMulNBits", "FusedMatMul"}
#: Int64 shape arithmetic around a Reshape: listed apart, not counted as chain nodes.
_SHAPE_OPS = {
    "Shape",
    "Gather",
    "Unsqueeze",
    "Squeeze",
    "Concat",
    "Slice",
    "ConstantOfShape",
    "Range",
    "Size",
}
_NORM_OPS = {
    "ReduceMean",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "SkipSimplifiedLayerNormalization",
}
_MAX_CHAIN_NODES = 48
_FLOAT_NAMES = {
    onnx.TensorProto.FLOAT: "f32",
    onnx.TensorProto.FLOAT16: "f16",
    onnx.TensorProto.BFLOAT16: "bf16",
    onnx.TensorProto.DOUBLE: "f64",
}


@dataclasses.dataclass
class Chain:
    """One gated-norm chain: its nodes in graph order, what feeds it from outside, and its docs/forms.md form."""

    start: str  # name of the Sigmoid / QuickGelu node
    ops: list[str]  # op types of the chain's compute nodes, in graph order (Casts included)
    steps: list[str]  # the same nodes with a short argument description
    inputs: list[str]  # producers outside the chain that only feed it (Cast, Constant, SequenceAt, ...)
    shape_ops: list[str]  # int64 shape arithmetic feeding its Reshapes
    form: str  # "A".."H", "J", "+"-joined when several apply, or "?" (not in the catalog)
    notes: list[str]

    @property
    def num_nodes(self) -> int:
        """Return how many nodes a fusion would replace (chain nodes plus absorbed input Casts)."""
        return len(self.ops) + sum(step.startswith("Cast") for step in self.inputs)


@dataclasses.dataclass
class Report:
    """Chains and non-chain sigmoids of one model."""

    path: str
    chains: list[Chain]
    other_sigmoids: list[str]  # "name: op types after it" for sigmoids that start no chain

    def forms(self) -> dict[str, int]:
        """Return how many chains of each form the model holds."""
        counts: dict[str, int] = {}
        for chain in self.chains:
            counts[chain.form] = counts.get(chain.form, 0) + 1
        return counts


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.nodes = list(model.graph.node)
        self.order = {id(n): i for i, n in enumerate(self.nodes)}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for out in node.output:
                self.producer[out] = node
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.graph_outputs = {o.name for o in model.graph.output}
        self.value_types = {
            v.name: v.type.tensor_type.elem_type
            for v in (*model.graph.value_info, *model.graph.input, *model.graph.output)
        }

    def constant_value(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            tensor = self.initializers[name]
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                # Weights left in a sidecar file: the shape is all the classification needs.
                return np.zeros(tuple(tensor.dims), dtype=np.float32) if np.prod(tensor.dims) > 4 else None
            return numpy_helper.to_array(tensor)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
                if attr.name == "value_float":
                    return np.array(attr.f, dtype=np.float32)
                if attr.name == "value_int":
                    return np.array(attr.i, dtype=np.int64)
                if attr.name in ("value_ints", "value_floats"):
                    return np.array(attr.ints or attr.floats)
        return None


def _attr(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _describe(graph: _Graph, node: onnx.NodeProto) -> str:
    """Return ``Op(arg, ...)`` with the constants and attributes that tell variants apart."""
    parts = []
    for inp in node.input:
        value = graph.constant_value(inp) if inp else None
        if value is not None and value.size <= 4:
            parts.append(np.array2string(value.reshape(-1), precision=6, separator=",").replace(" ", ""))
        elif value is not None:
            kind = "init" if inp in graph.initializers else "const"
            parts.append(f"{kind}{list(value.shape)}:{_FLOAT_NAMES.get(_elem_type(graph, inp), value.dtype.name)}")
        else:
            parts.append("·")
    attrs = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.INT:
            value = attr.i
            if attr.name == "to":
                value = _FLOAT_NAMES.get(attr.i, onnx.TensorProto.DataType.Name(attr.i))
            attrs.append(f"{attr.name}={value}")
        elif attr.type == onnx.AttributeProto.INTS:
            attrs.append(f"{attr.name}={list(attr.ints)}")
        elif attr.type == onnx.AttributeProto.FLOAT:
            attrs.append(f"{attr.name}={attr.f:g}")
    domain = f"{node.domain}::" if node.domain not in ("", "ai.onnx") else ""
    return f"{domain}{node.op_type}({', '.join(parts + attrs)})"


def _elem_type(graph: _Graph, name: str) -> int:
    if name in graph.initializers:
        return graph.initializers[name].data_type
    node = graph.producer.get(name)
    if node is not None and node.op_type == "Constant":
        attr = _attr(node, "value")
        if attr is not None:
            return attr.t.data_type
    return 0


def _gated_mul_after(graph: _Graph, silu_out: str) -> onnx.NodeProto | None:
    """Return the ``Mul(y, silu)`` that a silu output feeds, if it feeds exactly one such Mul."""
    consumers = graph.consumers.get(silu_out, [])
    if len(consumers) == 1 and consumers[0].op_type == "Mul":
        return consumers[0]
    return None


def _chain_start(graph: _Graph, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Return the first nodes of a gated-norm chain starting at ``node`` (Sigmoid, Mul, Mul), else None."""
    if node.op_type == "QuickGelu":
        gated = _gated_mul_after(graph, node.output[0])
        return [node, gated] if gated is not None else None
    if node.op_type != "Sigmoid":
        return None
    z = node.input[0]
    consumers = graph.consumers.get(node.output[0], [])
    if len(consumers) != 1 or consumers[0].op_type != "Mul" or z not in consumers[0].input:
        return None
    silu = consumers[0]
    gated = _gated_mul_after(graph, silu.output[0])
    if gated is None:
        return None
    # The gated product must be normalized (reshaped into groups, or an RMS norm op) to be this op;
    # a SiLU that multiplies something else (an MLP's gate) is not a chain.
    # Shape readers (TorchScript computes the view's sizes from the product) are shape arithmetic.
    after_nodes = [c for c in graph.consumers.get(gated.output[0], []) if c.op_type != "Shape"]
    if len(after_nodes) == 1 and after_nodes[0].op_type == "Cast":
        # TorchScript's Falcon-H1 export: a no-op Cast(to f32) between the product and the first Reshape.
        after_nodes = graph.consumers.get(after_nodes[0].output[0], [])
    after = {c.op_type for c in after_nodes}
    if not after & ({"Reshape", "Pow", "Mul"} | _NORM_OPS):
        return None
    return [node, silu, gated]


def _walk_chain(graph: _Graph, start: list[onnx.NodeProto]) -> list[onnx.NodeProto] | None:
    """Return every node reachable forward from the chain start up to (not including) out_proj."""
    seen = {id(n): n for n in start}
    frontier = [start[-1]]
    while frontier:
        node = frontier.pop()
        for out in node.output:
            for consumer in graph.consumers.get(out, []):
                # A Shape of a chain value starts int64 shape math (found from the Reshape's shape input).
                if id(consumer) in seen or consumer.op_type in _STOP_OPS or consumer.op_type == "Shape":
                    continue
                if consumer.op_type == "Reshape" and out == consumer.input[1]:
                    continue
                seen[id(consumer)] = consumer
                frontier.append(consumer)
                if len(seen) > _MAX_CHAIN_NODES:
                    return None
    return sorted(seen.values(), key=lambda n: graph.order[id(n)])


def _outside_inputs(graph: _Graph, chain: list[onnx.NodeProto]) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """Return (feeder nodes, shape nodes): producers outside the chain whose outputs only feed the chain."""
    members = {id(n) for n in chain}
    feeders: dict[int, onnx.NodeProto] = {}
    shapes: dict[int, onnx.NodeProto] = {}

    def visit_shape(name: str, depth: int) -> None:
        # Everything upstream of a Reshape's shape input is int64 shape arithmetic.
        node = graph.producer.get(name)
        if node is None or id(node) in members or id(node) in shapes or depth > 40:
            return
        shapes[id(node)] = node
        for inp in node.input:
            if inp:
                visit_shape(inp, depth + 1)

    def visit(name: str, depth: int) -> None:
        node = graph.producer.get(name)
        if node is None or id(node) in members or depth > 12:
            return
        if node.op_type in _SHAPE_OPS or (node.op_type == "Constant" and _elem_type(graph, node.output[0]) == 7):
            visit_shape(name, 0)
        elif node.op_type in ("Cast", "Constant", "SequenceAt", "SplitToSequence", "Identity"):
            feeders[id(node)] = node
            if node.op_type in ("Cast", "SequenceAt", "Identity"):
                visit(node.input[0], depth + 1)

    for node in chain:
        for index, inp in enumerate(node.input):
            if not inp:
                continue
            if node.op_type == "Reshape" and index == 1:
                visit_shape(inp, 0)
            else:
                visit(inp, 0)
    key = lambda n: graph.order[id(n)]  # noqa: E731
    return sorted(feeders.values(), key=key), sorted(shapes.values(), key=key)


def _classify(graph: _Graph, chain: list[onnx.NodeProto], feeders: list[onnx.NodeProto]) -> tuple[str, list[str]]:
    """Return (form, notes) for a chain, by the docs/forms.md catalog's distinguishing marks."""
    ops = [n.op_type for n in chain]
    notes: list[str] = []
    forms: list[str] = []
    if _weight_in_group(chain):
        # Falcon-H1's spelling: the weight multiplies the [.., G, gs] groups before the second Reshape.
        # It is J whatever exporter wrote it (the catalog's most specific marker after mobius' I).
        notes.append("weight Mul inside the grouped view, before the second Reshape")
        return "J", notes
    casts_in = [n for n in feeders if n.op_type == "Cast"]
    casts_chain = [n for n in chain if n.op_type == "Cast"]
    constants = [n for n in feeders if n.op_type == "Constant"]
    sequence = [n for n in feeders if n.op_type in ("SequenceAt", "SplitToSequence")]

    for node in (n for n in chain if n.op_type == "SimplifiedLayerNormalization"):
        forms.append("F")
        scale = graph.constant_value(node.input[1]) if len(node.input) > 1 else None
        ones = scale is not None and bool(np.all(scale == 1))
        domain = node.domain or "default"
        notes.append(
            f"inner norm: {domain}-domain SimplifiedLayerNormalization, scale "
            + ("all ones" if ones else "NOT all ones")
        )
    if "QuickGelu" in ops:
        forms.append("G")
    if "RMSNormalization" in ops:
        forms.append("H")
    for node in chain:
        if node.op_type == "Pow":
            exponent = graph.constant_value(node.input[1])
            if exponent is not None and np.allclose(exponent, -0.5):
                forms.append("H")
                notes.append("rsqrt as Pow(., -0.5)")
        if node.op_type == "Mul" and node.input[0] == node.input[1]:
            forms.append("H")
            notes.append("square as Mul(x, x)")
    for node in (n for n in chain if n.op_type == "Div"):
        numerator = graph.constant_value(node.input[0])
        if numerator is not None and numerator.size == 1 and np.allclose(numerator, 1.0):
            forms.append("E")
            notes.append("rsqrt as Div(1, Sqrt)")
        else:
            forms.append("G")
            notes.append("Mul(x, 1/Sqrt) folded to Div(x, Sqrt)")
    reduce = next((n for n in chain if n.op_type == "ReduceMean"), None)
    if reduce is not None and _attr(reduce, "axes") is not None:
        notes.append("ReduceMean axes as attribute")
    weight_cast = any(n.op_type == "Cast" and n.input[0] in graph.initializers for n in casts_in + casts_chain)
    # D's marks (scalars as Constant nodes, an explicit weight Cast, the gate from a sequence); TorchScript's
    # form E has Constant nodes too, so they only mean D when E's Div(1, Sqrt) is absent.
    # F's all-ones norm scale is a Constant node too: not a mark of D there.
    if "E" not in forms and "F" not in forms and (constants or sequence or weight_cast):
        forms.append("D")
    if sequence:
        notes.append("gate from SplitToSequence/SequenceAt")
    if weight_cast:
        notes.append("explicit Cast of the weight initializer")
    noop = [n for n in casts_in + casts_chain if _is_noop_cast(graph, n)]
    if noop:
        notes.append(f"{len(noop)} no-op f32->f32 Cast(s)")
    if not forms:
        # The Cast pattern tells A / B / C apart.
        final_mul = next((n for n in reversed(chain) if n.op_type == "Mul"), None)
        half_weight_mul = final_mul is not None and any(
            _elem_type(graph, i) in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) for i in final_mul.input
        )
        if not casts_in and not casts_chain:
            forms.append("A")
        elif half_weight_mul and len(casts_in) >= 2:
            forms.append("C")
        elif len(casts_in) == 1 and casts_chain:
            forms.append("B")
        else:
            forms.append("?")
    form = "+".join(sorted(set(forms), key=forms.index))
    return form, notes


def _weight_in_group(chain: list[onnx.NodeProto]) -> bool:
    """Return whether two Muls (normalize, then weight) sit between the reduction and the last Reshape."""
    reduce_at = next((i for i, n in enumerate(chain) if n.op_type == "ReduceMean"), None)
    last_reshape = max((i for i, n in enumerate(chain) if n.op_type == "Reshape"), default=None)
    if reduce_at is None or last_reshape is None or last_reshape < reduce_at:
        return False
    return sum(n.op_type == "Mul" for n in chain[reduce_at:last_reshape]) >= 2


def _is_noop_cast(graph: _Graph, node: onnx.NodeProto) -> bool:
    """Return whether a Cast to f32 reads a value that is already f32 (as far as the graph tells)."""
    to = _attr(node, "to")
    if to is None or to.i != onnx.TensorProto.FLOAT:
        return False
    source = graph.value_types.get(node.input[0]) or _elem_type(graph, node.input[0])
    return source == onnx.TensorProto.FLOAT


def inspect_model(model: onnx.ModelProto | str | Path) -> Report:
    """Return the chains (with forms) and the non-chain sigmoids of ``model``."""
    path = str(model) if not isinstance(model, onnx.ModelProto) else "<model>"
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    graph = _Graph(model)
    chains, others = [], []
    for node in graph.nodes:
        if node.op_type not in ("Sigmoid", "QuickGelu"):
            continue
        start = _chain_start(graph, node)
        nodes = _walk_chain(graph, start) if start else None
        if not nodes or not any(n.op_type in _NORM_OPS for n in nodes):
            if node.op_type == "Sigmoid":
                after = [c.op_type for c in graph.consumers.get(node.output[0], [])]
                nxt = [
                    c.op_type
                    for a in graph.consumers.get(node.output[0], [])
                    for o in a.output
                    for c in graph.consumers.get(o, [])
                ]
                others.append(f"{node.name}: Sigmoid -> {after} -> {nxt[:4]}")
            continue
        feeders, shapes = _outside_inputs(graph, nodes)
        form, notes = _classify(graph, nodes, feeders)
        compute = [n for n in nodes if n.op_type not in _SHAPE_OPS]
        chains.append(
            Chain(
                start=node.name,
                ops=[n.op_type for n in compute],
                steps=[_describe(graph, n) for n in compute],
                inputs=[_describe(graph, n) for n in feeders],
                shape_ops=[n.op_type for n in shapes] + [n.op_type for n in nodes if n.op_type in _SHAPE_OPS],
                form=form,
                notes=notes,
            )
        )
    return Report(path=path, chains=chains, other_sigmoids=others)


def format_report(report: Report, verbose: bool = True) -> str:
    """Return a human-readable listing of one model's chains."""
    lines = [f"{report.path}: {len(report.chains)} chain(s) {report.forms()}"]
    for index, chain in enumerate(report.chains):
        lines.append(f"  chain {index} form {chain.form}, {chain.num_nodes} nodes, starts at {chain.start}")
        lines.append(f"    ops:    {' -> '.join(chain.ops)}")
        if verbose:
            for step in chain.steps:
                lines.append(f"      {step}")
        if chain.inputs:
            lines.append(f"    inputs: {'; '.join(chain.inputs)}")
        if chain.shape_ops:
            lines.append(f"    shape:  {len(chain.shape_ops)} int64 nodes ({', '.join(sorted(set(chain.shape_ops)))})")
        if chain.notes:
            lines.append(f"    notes:  {'; '.join(chain.notes)}")
    for other in report.other_sigmoids:
        lines.append(f"  not a chain: {other}")
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    """Print the chains of every model given on the command line."""
    parser = argparse.ArgumentParser(prog="python -m models.inspect_chains", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("-q", "--quiet", action="store_true", help="op sequences only, no per-node arguments")
    args = parser.parse_args(list(argv) if argv is not None else None)
    status = 0
    for path in args.models:
        try:
            print(format_report(inspect_model(path), verbose=not args.quiet))
        except (OSError, onnx.onnx_cpp2py_export.checker.ValidationError, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
