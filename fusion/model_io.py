"""Reading and writing models for the rewriter without risking the user's files.

- ``load`` reads a model with its external weights left on disk and refuses, with one line that names
  the problem, anything that would fail later: a truncated or non-ONNX file, duplicate value names,
  missing or truncated external data, an invalid graph. ONNX Runtime's contrib ops in the ONNX domain
  (``SimplifiedLayerNormalization``, written by transformers' exporter) are accepted: a model ONNX
  Runtime loads is not refused.
- ``check_output`` refuses an output path that is one of the input's files (the model or any external
  data file it reads), through any spelling: relative, ``..``, a symlink or a hard link.
- ``save`` writes atomically: every file goes to a hidden scratch directory beside the output and is
  renamed into place (data before model); the scratch directory is removed on errors and on SIGINT /
  SIGTERM (``interruptible``). Every external tensor of the output resolves from the output's directory.
  Where it replaces an earlier output whose ``<output>.data`` the new one does not use (an inline model
  written over one with external weights), that stale data file is removed after the new model is in place.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir


class RewriteError(Exception):
    """A model, path or argument the rewriter cannot work with; the message says what to do."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived while the rewriter was working; nothing half-written is left."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number


def first_line(error: BaseException) -> str:
    """Return the first line of an error's message (its type name when it has none)."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


# --- reading ----------------------------------------------------------------------------------------


def models_in(folder: Path) -> str:
    """Return what a directory given as a model holds, for the error that refuses it: the ONNX files in it
    (``; it holds model.onnx``), or that it is an onnxruntime-genai folder.

    A directory is never taken for the model it holds, even a single one: the output's default name and the
    external data both follow the model file, and a genai folder is ``mambafuse genai``'s (which also edits
    its config and adds the library).
    """
    folder = Path(folder)
    try:
        names = sorted(entry.name for entry in folder.iterdir() if entry.suffix == ".onnx" and entry.is_file())
    except OSError:
        return ""
    if (folder / "genai_config.json").is_file():
        return "; it is an onnxruntime-genai model folder: fuse it with mambafuse genai IN_DIR OUT_DIR"
    if len(names) == 1:
        return f"; it holds one model: {folder / names[0]}"
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"; it holds {len(names)} models ({shown}): name one"
    return "; it holds no .onnx file"


def check_input(path: Path) -> None:
    """Refuse an input that is no file: missing, or a directory (naming the models it holds)."""
    path = Path(path)
    if path.is_dir():
        raise RewriteError(f"{path}: is a directory, not an ONNX model{models_in(path)}")
    if not path.exists():
        raise RewriteError(f"{path}: no such file")


def load(path: Path) -> ir.Model:
    """Return the model at ``path`` with its external weights left on disk; RewriteError if unusable."""
    path = Path(path)
    check_input(path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as error:  # protobuf raises several types for garbage and truncated files
        raise RewriteError(f"{path}: not a readable ONNX model (truncated or not ONNX): {first_line(error)}") from None
    if not proto.HasField("graph") or len(proto.graph.node) == 0:
        raise RewriteError(f"{path}: not an ONNX model with a graph (empty, truncated or not ONNX)")
    _check_unique_names(path, proto.graph)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as error:
        raise RewriteError(f"{path}: not a valid ONNX graph: {first_line(error)}") from None
    base_dir = path.resolve().parent
    external = external_tensors(model)
    for tensor in external:  # initializers and attribute tensors alike
        tensor.base_dir = base_dir
    data_sizes = _check_external_data(path, external)
    _check_model(path, proto, data_sizes)
    return model


def _check_unique_names(path: Path, graph: onnx.GraphProto) -> None:
    """Refuse a graph in which two nodes (or a node and an input/initializer) produce the same name."""
    # An initializer may share its graph input's name (a default value); nothing else may repeat.
    producers: dict[str, str] = {v.name: "a graph input" for v in graph.input}
    producers.update({t.name: "an initializer" for t in graph.initializer})
    for index, node in enumerate(graph.node):
        where = f"node {node.name or f'{node.op_type} #{index}'!r}"
        for name in node.output:
            if not name:
                continue
            if name in producers:
                raise RewriteError(
                    f"{path}: value {name!r} is produced twice (by {producers[name]} and by {where}); "
                    "an ONNX graph names each value once"
                )
            producers[name] = where


def external_tensors(model: ir.Model) -> list[ir.ExternalTensor]:
    """Return every tensor of ``model`` whose data is in an external file: initializers of every graph
    and tensors in node attributes (Constant nodes saved with ``convert_attribute=True``), functions too."""
    found: list[ir.ExternalTensor] = []
    for graph in model.graphs():
        found += [v.const_value for v in graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    for graph in [model.graph, *model.functions.values()]:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for attribute in node.attributes.values():
                if attribute.type == ir.AttributeType.TENSOR and isinstance(attribute.value, ir.ExternalTensor):
                    found.append(attribute.value)
                elif attribute.type == ir.AttributeType.TENSORS:
                    found += [t for t in attribute.value if isinstance(t, ir.ExternalTensor)]
    return found


def _check_external_data(path: Path, external: list[ir.ExternalTensor]) -> dict[str, int]:
    """Refuse missing external data files, files outside the model's folder and tensors that reach past
    the end of theirs (truncated); return each location's file size.

    Outside the folder means after resolving symbolic links, as ONNX Runtime resolves them: it refuses to
    read such a file ("External data path escapes model directory"), so the model could not run.
    """
    folder = path.resolve().parent
    sizes: dict[str, int] = {}
    for tensor in external:
        location = tensor.location
        if location not in sizes:
            if Path(location).is_absolute():
                raise RewriteError(
                    f"{path}: external data location {location!r} is an absolute path; ONNX and ONNX Runtime "
                    "read only paths relative to the model's folder"
                )
            data = Path(tensor.path)
            if not data.is_file():
                raise RewriteError(f"{path}: external data file {location!r} is missing")
            resolved = data.resolve()
            if not resolved.is_relative_to(folder):
                through = " (through a symbolic link)" if data.absolute() != resolved else ""
                raise RewriteError(
                    f"{path}: external data file {location!r} resolves to {resolved}, outside the model's "
                    f"folder{through}; ONNX Runtime refuses to read it there: move or copy the data file "
                    "into the model's folder"
                )
            sizes[location] = data.stat().st_size
        length = tensor.length if tensor.length is not None else tensor.nbytes
        end = (tensor.offset or 0) + length
        if end > sizes[location]:
            raise RewriteError(
                f"{path}: external data file {location!r} is truncated: tensor {tensor.name!r} needs "
                f"bytes up to {end}, the file has {sizes[location]}"
            )
    return sizes


_NO_SCHEMA = re.compile(r"No Op registered for (\S+) with domain_version of \d+")
#: The private domain ONNX Runtime's contrib ops in the ONNX domain are checked under (see _check_model).
_CONTRIB_CHECK_DOMAIN = "mambafuse.onnxruntime-contrib"


def _onnxruntime_schemas() -> set[tuple[str, str]]:
    """Return (domain, op type) of every op ONNX Runtime registers, its contrib ops included."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

        return {(schema.domain, schema.name) for schema in ort_c.get_all_operator_schema()}
    except Exception:  # a build without schema export: fall back to ONNX's own checker only
        return set()


def _check_model(path: Path, proto: onnx.ModelProto, data_sizes: dict[str, int]) -> None:
    """Run onnx.checker on the model; ops that only ONNX Runtime defines in the ONNX domain are allowed.

    The data files were checked already (``_check_external_data``). The checker reads a copy of the
    graph proto in a scratch folder, beside sparse stand-ins of the data files (same names and sizes, no
    data read or written): onnx 1.23's checker refuses a data file that is a symbolic link, which ONNX
    Runtime reads (a link inside the model's folder), and a copy is needed anyway when ONNX Runtime's
    contrib ops (``SimplifiedLayerNormalization``, as transformers' exporter and onnxscript's
    ``optimize_for_ort`` write it) sit in the ONNX domain: they are checked in a private domain.
    """
    known: set[tuple[str, str]] | None = None
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    moved = False
    for node in copy.graph.node:
        domain = node.domain if node.domain != "ai.onnx" else ""
        if domain == "" and not onnx.defs.has(node.op_type):
            known = _onnxruntime_schemas() if known is None else known
            if ("", node.op_type) in known:
                node.domain = _CONTRIB_CHECK_DOMAIN
                moved = True
    if moved:
        copy.opset_import.append(onnx.helper.make_opsetid(_CONTRIB_CHECK_DOMAIN, 1))
    try:
        if not data_sizes:
            onnx.checker.check_model(copy)
            return
        with tempfile.TemporaryDirectory(prefix="mambafuse-check-") as scratch:
            for location, size in data_sizes.items():
                stand_in = Path(scratch, location)
                if not stand_in.resolve().is_relative_to(Path(scratch).resolve()):  # checked above; never
                    raise RewriteError(f"{path}: external data location {location!r} is outside its folder")
                stand_in.parent.mkdir(parents=True, exist_ok=True)
                with open(stand_in, "wb") as file:
                    file.truncate(size)  # sparse: no disk blocks
            checked = Path(scratch, "model.onnx")
            onnx.save(copy, str(checked))
            onnx.checker.check_model(str(checked))
    except Exception as error:
        message = first_line(error)
        match = _NO_SCHEMA.search(message)
        raise RewriteError(f"{path}: invalid ONNX model: {match.group(0) if match else message}") from None


# --- where the output may go ------------------------------------------------------------------------


def _same_file(left: Path, right: Path) -> bool:
    """Return whether two paths name one file: the same path resolved, or the same inode (hard link)."""
    if left.resolve() == right.resolve():
        return True
    try:
        return os.path.samefile(left, right)
    except OSError:
        return False


def data_file_name(output: Path) -> str:
    """Return the name of the external data file written beside ``output`` when it gets its own."""
    return output.name + ".data"


def writes_own_data(model: ir.Model, output: Path, external: list[ir.ExternalTensor] | None = None) -> bool:
    """Return whether saving ``model`` to ``output`` writes a data file (else it refers to the input's)."""
    external = external_tensors(model) if external is None else external
    directory = output.resolve().parent
    return bool(external) and not all(Path(t.base_dir).resolve() == directory for t in external)


def check_output(input_path: Path, model: ir.Model, output: Path, *, choose: str = "choose another -o") -> None:
    """Refuse an output (or the data file it would write) that is one of the input's files; ``choose`` ends the
    message with what the user should change (the option they gave the output with)."""
    external = external_tensors(model)
    inputs = [Path(input_path), *{Path(t.path) for t in external}]
    targets = [output]
    if writes_own_data(model, output, external):
        targets.append(output.parent / data_file_name(output))
    for target in targets:
        if not target.exists() and not target.is_symlink():
            continue
        for source in inputs:
            if _same_file(target, source):
                what = "the input model" if source == inputs[0] else f"the input's external data file {source.name!r}"
                raise RewriteError(f"{target}: is {what}; refusing to overwrite the input: {choose}")


# --- writing ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGTERM (and SIGINT) into ``Interrupted`` for the block, so cleanup code runs."""

    def handler(signal_number: int, _frame: object) -> None:
        raise Interrupted(signal_number)

    previous = {}
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread: signals stay as they are
            previous[signal_number] = signal.signal(signal_number, handler)
    try:
        yield
    finally:
        for signal_number, old in previous.items():
            signal.signal(signal_number, old)


def _embed_attribute_tensors(model: ir.Model) -> None:
    """Read external tensors held in node attributes into memory, so the output carries them inline."""
    for graph in [model.graph, *model.functions.values()]:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for name, attribute in list(node.attributes.items()):
                if attribute.type == ir.AttributeType.TENSOR and isinstance(attribute.value, ir.ExternalTensor):
                    tensor = attribute.value
                    node.attributes[name] = ir.AttrTensor(name, ir.Tensor(tensor.numpy(), name=tensor.name))


def _tensor_callback(progress: Callable[[int, int, str], None] | None) -> Callable[..., None] | None:
    """Return an onnx-ir save callback that reports tensors written and the data file's size so far."""
    if progress is None:
        return None
    written = 0

    def callback(_tensor: object, info: ir.external_data.CallbackInfo) -> None:
        nonlocal written
        written += 1  # callbacks may come out of index order (onnx-ir writes with several threads)
        progress(written, info.total, f"tensors, {info.offset / 2**20:,.0f} MiB into {info.filename}")

    return callback


def _tensor_protos(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Yield every tensor of ``graph`` that may hold external data: initializers and attribute tensors, in
    subgraphs too."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensor_protos(attribute.g)
            for subgraph in attribute.graphs:
                yield from _tensor_protos(subgraph)


def _stale_data_file(model: ir.Model, output: Path, data_name: str) -> Path | None:
    """Return ``<output>.data`` when the file at ``output``, about to be replaced, uses it and the new model
    will not (it is inline, or refers to other files): the old output's weights, left behind otherwise.

    Only a data file the replaced model names is removed: a file of that name that belongs to anything else
    (the old output does not name it, or cannot be read) stays, and so does one the new model refers to.
    """
    data = output.parent / data_name
    if not output.is_file() or not (data.is_file() or data.is_symlink()):
        return None
    try:
        old = onnx.load(str(output), load_external_data=False)
    except Exception:  # not a model we can read: leave the files beside it alone
        return None
    tensors = [*_tensor_protos(old.graph)]
    for function in old.functions:
        tensors += _tensor_protos(onnx.helper.make_graph(function.node, function.name, [], []))
    located = {
        os.path.normpath(entry.value) for tensor in tensors for entry in tensor.external_data if entry.key == "location"
    }
    if data_name not in located:
        return None
    if any(_same_file(data, Path(tensor.path)) for tensor in external_tensors(model)):
        return None
    return data


def save(model: ir.Model, output: Path, *, progress: Callable[[int, int, str], None] | None = None) -> list[Path]:
    """Write ``model`` to ``output`` atomically, keeping external weights external.

    In the directory of the original data files the output refers to them (no copy); elsewhere its
    initializers go to its own ``<output>.data`` and external tensors held in node attributes are read
    and written inline. Either way all files are written in a temporary directory beside ``output`` and
    moved into place, data before model; that directory is gone afterwards, also after an error or a
    signal. ``progress(done, total, message)`` (a ``fusion.progress.Progress`` is one) is called as each
    tensor of the data file is written: the copy of a large model's weights takes minutes. Returns the files
    removed: the stale ``<output>.data`` of an output it replaced that the new one does not use
    (``_stale_data_file``), removed after the new model is in place.
    """
    output = Path(output).resolve()
    own_data = writes_own_data(model, output)
    data_name = data_file_name(output)
    stale = None if own_data else _stale_data_file(model, output, data_name)
    if own_data:
        _embed_attribute_tensors(model)
    scratch = Path(tempfile.mkdtemp(prefix=".mambafuse-", dir=output.parent))
    try:
        if own_data:
            ir.save(model, scratch / output.name, external_data=data_name, callback=_tensor_callback(progress))
            os.replace(scratch / data_name, output.parent / data_name)
        else:
            ir.save(model, scratch / output.name)
        os.replace(scratch / output.name, output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if stale is None:
        return []
    stale.unlink(missing_ok=True)
    return [stale]
