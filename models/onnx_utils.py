"""ONNX-only helpers of the exporters: validity check, the one graph repair, atomic save (no torch needed)."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import onnx
import onnx.external_data_helper
import onnx.helper


def model_opset(model: onnx.ModelProto) -> int:
    """Return the default-domain opset version of ``model``."""
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def strip_debug_metadata(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop per-node ``metadata_props`` and ``doc_string`` (exporter stack traces) in place; return ``model``.

    They are most of a tiny export's bytes and carry no semantics, so fixtures stay small.
    """
    for graph in _graphs(model.graph):
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
    for function in model.functions:
        for node in function.node:
            del node.metadata_props[:]
            node.doc_string = ""
    return model


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def repair_negative_transpose_perm(model: onnx.ModelProto) -> list[str]:
    """Rewrite negative ``Transpose`` perm entries to ``p % rank`` in place; return what was repaired.

    TorchScript's exporter writes ``transpose(-1, -2)`` as a perm with negative entries, which the ONNX
    spec does not allow (``onnx.checker`` accepts it; ONNX Runtime refuses to load the model). The rank
    is the perm's length, so the fix is exact and changes nothing else.
    """
    repairs = []
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.op_type != "Transpose":
                continue
            for attr in node.attribute:
                if attr.name == "perm" and any(p < 0 for p in attr.ints):
                    rank = len(attr.ints)
                    fixed = [p % rank for p in attr.ints]
                    repairs.append(f"Transpose {node.name}: perm {list(attr.ints)} -> {fixed}")
                    attr.ints[:] = fixed
    return repairs


#: Above this many bytes of weights a model is saved with its weights in ``<file>.data`` (protobuf
#: cannot hold 2 GiB; real-width models get there).
EXTERNAL_DATA_THRESHOLD = 1 << 30


def ort_only_ops(model: onnx.ModelProto) -> list[str]:
    """Return the default-domain op types of ``model`` that ONNX does not define (ONNX Runtime does)."""
    return sorted({n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)})


def check(model: onnx.ModelProto | str) -> str:
    """Run ``onnx.checker``; return "ok", or a note when its only objection is ORT-only default-domain ops.

    transformers' ``ort_fusions="cpu"`` writes ``SimplifiedLayerNormalization`` in the default ONNX
    domain, where ONNX Runtime registers it (it is not an ONNX op, and not in ``com.microsoft``).
    ``onnx.checker`` rejects such a graph; ONNX Runtime runs it. That is not repaired: moving the node
    to another domain would stop ONNX Runtime from finding its kernel. The rest of the graph is still
    checked (on a copy with those nodes parked in a private domain); any other error raises.
    """
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        proto = onnx.load(model, load_external_data=False) if isinstance(model, str) else model
        unknown = ort_only_ops(proto)
        first = str(e).strip().splitlines()[0]
        if not unknown or not any(op in first for op in unknown):
            raise
        parked = copy.deepcopy(proto)
        for node in parked.graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in unknown:
                node.domain = "mambafuse.ort_default_domain"
        parked.opset_import.append(onnx.helper.make_opsetid("mambafuse.ort_default_domain", 1))
        onnx.checker.check_model(parked)
        return f"onnx.checker: {first} (ORT-only ops in the default domain: {', '.join(unknown)})"
    return "ok"


def save_atomic(model: onnx.ModelProto, path: str | os.PathLike) -> list[Path]:
    """Write ``model`` to ``path`` so that readers never see a half-written file; return the files written.

    Weights are inline, or in ``<path>.data`` beside it when they exceed ``EXTERNAL_DATA_THRESHOLD``.
    Both files are written under temporary names in the same directory and renamed into place, the
    data file first, so the ``.onnx`` never points at missing weights.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    external = weight_bytes > EXTERNAL_DATA_THRESHOLD
    tmp_model = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp_data = path.with_name(f".{path.name}.data.{os.getpid()}.tmp")
    written = []
    try:
        if external:
            model = copy.deepcopy(model)
            # The location is the final name: the temporary data file is renamed to it before the model.
            onnx.external_data_helper.convert_model_to_external_data(
                model, all_tensors_to_one_file=True, location=f"{path.name}.data", size_threshold=1024
            )
            _write_external_data(model, tmp_data)
        with open(tmp_model, "wb") as f:
            f.write(model.SerializeToString())
        for tmp in (tmp_model, tmp_data):
            if tmp.exists():
                os.chmod(tmp, 0o644)
        if external:
            os.replace(tmp_data, path.with_name(f"{path.name}.data"))
            written.append(path.with_name(f"{path.name}.data"))
        os.replace(tmp_model, path)
        written.insert(0, path)
    finally:
        for tmp in (tmp_model, tmp_data):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return written


def _write_external_data(model: onnx.ModelProto, data_path: Path) -> None:
    """Move every tensor marked external (by ``convert_model_to_external_data``) into ``data_path``."""
    with open(data_path, "wb") as data:
        for tensor in onnx.external_data_helper._get_all_tensors(model):
            if not onnx.external_data_helper.uses_external_data(tensor) or not tensor.HasField("raw_data"):
                continue
            offset = data.tell()
            data.write(tensor.raw_data)
            length = len(tensor.raw_data)
            # Pad to a 4 KiB boundary so the next tensor can be memory-mapped aligned.
            data.write(b"\0" * (-data.tell() % 4096))
            onnx.external_data_helper.set_external_data(
                tensor, location=tensor.external_data[0].value, offset=offset, length=length
            )
            tensor.ClearField("raw_data")
