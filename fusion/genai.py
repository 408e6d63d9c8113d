"""Fuse an onnxruntime-genai model folder: fused ``model.onnx``, the custom-op library beside it, config set.

Command line::

    python -m fusion.genai IN_FOLDER OUT_FOLDER [--no-library | --no-function] [--keep-model-type] [--json] [--debug]
    python -m fusion.genai IN_FOLDER OUT_FOLDER --config-only       # the unfused baseline genai can load

IN_FOLDER is a folder as ``mobius build ... --runtime ort-genai`` (or onnxruntime-genai's own builder)
writes it: ``genai_config.json``, the decoder model it names (``model.decoder.filename``) with its external
data, tokenizer files. OUT_FOLDER (new, or an empty directory) gets

- the decoder model with every gated group-RMSNorm chain fused (``fusion.rewrite``; its external weights
  in ``<filename>.data`` beside it, as ``python -m fusion.rewrite`` writes them for another directory);
- every other file of IN_FOLDER, copied unchanged (the input model's own data files excepted);
- mambafuse's custom-op library, copied beside the model, and ``genai_config.json`` with
  ``model.decoder.session_options.custom_ops_library`` set to its file name. onnxruntime-genai looks the
  file up in the model folder, an execution-provider library folder or the working directory, and
  refuses paths with ``..``: a bare name in the model folder is what works wherever the folder is moved.
  With ``--no-library`` neither: the folder runs the fused nodes through the model-local function (ONNX
  Runtime inlines it), on any machine and provider, without mambafuse installed; slower than the unfused
  model, as the function's stock-op body has more nodes than the chain it replaced (1.13-1.31x on CPU decode
  steps, ``benchmarks/bench_function_body.py``).

onnxruntime-genai 0.18 does not know the ``model.type`` mobius writes for these families (``nemotron_h``,
``zamba2``, ``mamba2``: "Unsupported model_type in config.json"). By default the command declares such a
folder as genai's generic ``decoder`` with the model's conv / recurrent state names (a config-only change;
genai 0.18 then generates with all three on CPU, the same greedy tokens as ONNX Runtime run step by step)
and prints each change; when the names do not allow it, it fails and says why. ``--keep-model-type``
writes the config unchanged instead (for a genai that knows the type), with a note that genai 0.18 cannot
load the folder. (``--genai-config-edit``, the opt-in of earlier versions, is accepted: it makes the edit
required, an error for a model type it does not edit.)

Fusions that are right but not faster on every execution provider (``--opt-in``) follow the folder's provider
(``fusion.rules.registry.FOLDER_OPT_IN``): a folder that runs on the CPU (no ``provider_options`` in its config) or
on CUDA gets ``linear_attention_scan`` and ``causal_conv_with_state`` by default, its ``LinearAttention`` and
``CausalConvWithState`` nodes run as ``MambaChunkScan`` and ``CausalConv1d`` (faster on a prompt and on a decode step
on both: on an H100 the Nemotron-H-8B-shaped build's 2048-token prompt 3.27x and its decode step 1.10x with ORT's CUDA
graph, against 1.04x and 1.03x without them; benchmarks/RESULTS.md); the scans only where a layer's state has at
least ``SCAN_MIN_STATE`` elements. A folder for another provider gets none. ``--opt-in NAME`` adds fusions to those
(a named scan runs whatever its state's size); ``--keep-builder-ops`` drops the provider's, leaving only the
``--opt-in`` names.

``--config-only`` writes that config edit alone: OUT_FOLDER is IN_FOLDER with every file copied unchanged (the
model unfused, no library) but ``genai_config.json``, declared as genai's ``decoder``. That is the baseline a
fused folder is compared with, which genai 0.18 cannot load as mobius writes it. A folder whose model type
genai already loads needs no edit, and the option refuses it (run the input folder as it is).

The input folder is never modified. OUT_FOLDER is assembled in a hidden directory beside it and renamed
into place: it appears complete or not at all. On a terminal one status line shows the data being
written (tensors and MiB: a large model's weights take minutes; ``MAMBAFUSE_PROGRESS=0`` hides it).
Exit status 0 ok, 2 error (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusion.model_io import Interrupted, RewriteError, external_tensors, first_line, interruptible, load, save
from fusion.progress import progress, track
from fusion.rewrite import (
    Report,
    add_accuracy_level_argument,
    add_opt_in_argument,
    drop_settled_hints,
    provider_opt_in,
    rewrite_model,
)
from fusion.rules.registry import FOLDER_OPT_IN

CONFIG_NAME = "genai_config.json"

#: Model types onnxruntime-genai 0.18 rejects ("Unsupported model_type in config.json: <type>").
GENAI_UNSUPPORTED_TYPES = ("nemotron_h", "zamba2", "mamba2")


class GenaiFolderError(RewriteError):
    """A folder, config or argument this command cannot work with; the message says what to do."""


def read_config(folder: Path) -> dict[str, Any]:
    """Return the parsed ``genai_config.json`` of ``folder``; GenaiFolderError when it is not a genai folder."""
    if not folder.exists():
        raise GenaiFolderError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise GenaiFolderError(f"{folder}: not a folder (give the model folder that holds {CONFIG_NAME})")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise GenaiFolderError(f"{folder}: no {CONFIG_NAME}; not an onnxruntime-genai model folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GenaiFolderError(f"{path}: not valid JSON ({first_line(error)})") from None
    decoder = config.get("model", {}).get("decoder") if isinstance(config.get("model"), dict) else None
    if not isinstance(decoder, dict) or not isinstance(decoder.get("filename"), str):
        raise GenaiFolderError(f"{path}: no model.decoder.filename; which model to fuse is not said")
    filename = decoder["filename"]
    if Path(filename).is_absolute() or ".." in Path(filename).parts:
        raise GenaiFolderError(f"{path}: model.decoder.filename {filename!r} is not a file of the folder")
    if not (folder / filename).is_file():
        raise GenaiFolderError(f"{folder}: model.decoder.filename {filename!r} does not exist")
    return config


def genai_support(config: dict[str, Any]) -> str | None:
    """Return why onnxruntime-genai 0.18 cannot load a folder with this config, or None when it can."""
    model_type = config["model"].get("type")
    if model_type not in GENAI_UNSUPPORTED_TYPES:
        return None
    return f'onnxruntime-genai 0.18 cannot load model type {model_type!r} ("Unsupported model_type")'


def _template(names: list[str], suffix: str) -> str | None:
    """Return ``<prefix>%d<suffix>`` when every name of ``names`` ending in ``suffix`` has one prefix."""
    prefixes = set()
    for name in names:
        head, dot, _ = name.rpartition(".")
        if dot and name.endswith(suffix) and head.rpartition(".")[2].isdigit():
            prefixes.add(head.rpartition(".")[0] + ".")
    return f"{prefixes.pop()}%d{suffix}" if len(prefixes) == 1 else None


def edit_config_for_genai(config: dict[str, Any], input_names: list[str], output_names: list[str]) -> list[str]:
    """Make a Nemotron-H / Zamba2 / Mamba2 config loadable by genai 0.18 (in place); return what was changed.

    ``model.type`` becomes ``decoder``; ``past_conv_names`` / ``past_recurrent_names`` and their present
    counterparts are taken from the model's own ``*.conv_state`` / ``*.ssm_state`` inputs and outputs.
    """
    model_type = config["model"].get("type")
    if model_type not in GENAI_UNSUPPORTED_TYPES:
        raise GenaiFolderError(
            f"--genai-config-edit: model type {model_type!r} is not one it edits ({', '.join(GENAI_UNSUPPORTED_TYPES)})"
        )
    decoder = config["model"]["decoder"]
    names = {
        ("inputs", "past_conv_names"): _template(input_names, ".conv_state"),
        ("inputs", "past_recurrent_names"): _template(input_names, ".ssm_state"),
        ("outputs", "present_conv_names"): _template(output_names, ".conv_state"),
        ("outputs", "present_recurrent_names"): _template(output_names, ".ssm_state"),
    }
    missing = [key for (_, key), value in names.items() if value is None]
    if missing:
        raise GenaiFolderError(
            f"--genai-config-edit: the model's conv/ssm state names do not follow one pattern ({', '.join(missing)})"
        )
    changes = [f"model.type: {model_type!r} -> 'decoder'"]
    config["model"]["type"] = "decoder"
    for (section, key), value in names.items():
        decoder.setdefault(section, {})[key] = value
        changes.append(f"model.decoder.{section}.{key} = {value!r}")
    return changes


def _library() -> Path:
    import contrib_ops

    try:
        return Path(contrib_ops.library_path())
    except Exception as error:  # the package raises when the library was never built
        raise GenaiFolderError(f"mambafuse custom-op library not found: {first_line(error)}") from None


def _check_output_folder(source: Path, output: Path) -> None:
    source, resolved = source.resolve(), output.resolve()
    if resolved == source or source in resolved.parents:
        raise GenaiFolderError(f"{output}: is inside the input folder; choose an output folder elsewhere")
    if resolved in source.parents:
        raise GenaiFolderError(f"{output}: contains the input folder; choose another output folder")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise GenaiFolderError(f"{output}: exists and is not an empty folder; choose a new output folder")
    if not resolved.parent.is_dir():
        raise GenaiFolderError(f"{output.parent}: output's parent folder does not exist")


def fuse_folder(
    source: Path,
    output: Path,
    *,
    function: bool = True,
    library: bool = True,
    genai_config_edit: bool | None = None,
    opt_in: Sequence[str] | None = None,
    folder_defaults: bool = True,
    int4_accuracy_level: int | None = None,
) -> tuple[Report, dict[str, Any]]:
    """Write OUT_FOLDER from a genai model folder (module docstring); return the rewrite report and a summary.
    ``opt_in``: opt-in fusions to run too (``rewrite_model``'s), besides the folder's provider's where
    ``folder_defaults`` (``FOLDER_OPT_IN`` of its provider, the scan's where its states are large enough or it is
    named in ``opt_in``; none for a provider not there). All of them are the summary's ``opt_in``, the provider's
    its ``folder_opt_in``, the provider (``folder_provider``) its ``provider``.
    ``int4_accuracy_level``: as ``rewrite_model``'s.

    ``genai_config_edit``: None (the default) edits the config when genai 0.18 does not know the model
    type, True requires the edit, False keeps the config's model type. ``library=False`` writes no
    library and no ``custom_ops_library`` (the fused nodes run through the function, which it needs).
    """
    source, output = Path(source), Path(output)
    if not library and not function:
        raise GenaiFolderError(
            "--no-library with --no-function: nothing could run the fused nodes (keep the function or the library)"
        )
    config = read_config(source)
    _check_output_folder(source, output)
    library_path = _library() if library else None
    existing = (config["model"]["decoder"].get("session_options") or {}).get("custom_ops_library")
    if library_path is None:
        if existing and Path(existing).name in _library_names():
            # The input is a folder this command wrote: drop the library it named (and its copy, below).
            del config["model"]["decoder"]["session_options"]["custom_ops_library"]
    elif existing and Path(existing).name != library_path.name:
        # genai takes one custom-op library per session: replacing it would break the model's other ops.
        raise GenaiFolderError(
            f"{source / CONFIG_NAME}: already names custom_ops_library {existing!r}; genai loads one library "
            "per session, so mambafuse's cannot be added"
        )
    model_name = config["model"]["decoder"]["filename"]
    model = load(source / model_name)
    config_changes: list[str] = []
    edit = genai_config_edit
    if edit is None:
        edit = genai_support(config) is not None
    if edit:
        input_names = [v.name for v in model.graph.inputs]
        output_names = [v.name for v in model.graph.outputs]
        try:
            config_changes = edit_config_for_genai(config, input_names, output_names)
        except GenaiFolderError as error:
            if genai_config_edit:
                raise
            raise GenaiFolderError(
                f"{genai_support(config)} and its config cannot be declared as genai's 'decoder': "
                f"{str(error).removeprefix('--genai-config-edit: ')}; rerun with --keep-model-type to write "
                "the folder with its config unchanged"
            ) from None
    # The input model and its data files are replaced by the fused model and its own data file.
    model_files = {(source / model_name).resolve()} | {Path(t.path).resolve() for t in external_tensors(model)}
    provider = folder_provider(config)
    named = tuple(opt_in or ())
    defaults, notes = provider_opt_in(model, provider, named) if folder_defaults else ((), [])
    opt_in = tuple(dict.fromkeys((*defaults, *named)))
    fused, report = rewrite_model(model, function=function, opt_in=opt_in, int4_accuracy_level=int4_accuracy_level)
    drop_settled_hints(report, provider, defaults=folder_defaults)  # the notes say why a default was kept

    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.resolve().parent))
    try:
        entries = [
            entry
            for entry in sorted(source.iterdir())
            if entry.resolve() not in model_files
            and entry.name != CONFIG_NAME
            and (library_path is not None or entry.name not in _library_names())  # --no-library on our output
        ]
        for entry in track(entries, "copying the folder's other files"):
            if entry.is_dir():
                shutil.copytree(entry, scratch / entry.name, symlinks=False)
            else:
                shutil.copy2(entry, scratch / entry.name)
        (scratch / model_name).parent.mkdir(parents=True, exist_ok=True)
        with progress(f"writing {model_name}") as bar:
            save(fused, scratch / model_name, progress=bar)
        if library_path is not None:
            shutil.copy2(library_path, scratch / library_path.name)
            session_options = config["model"]["decoder"].setdefault("session_options", {})
            session_options["custom_ops_library"] = library_path.name
        (scratch / CONFIG_NAME).write_text(json.dumps(config, indent=4) + "\n")
        _publish(scratch, output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = dict(
        output=str(output),
        model=model_name,
        custom_ops_library=library_path.name if library_path is not None else None,
        model_type=config["model"].get("type"),
        config_changes=config_changes,
        genai_cannot_load=genai_support(config),
        opt_in=list(opt_in),
        folder_opt_in=list(defaults),
        provider=provider,
        notes=notes,
    )
    return report, summary


def folder_provider(config: dict[str, Any]) -> str:
    """The execution provider a genai config runs its decoder on: "cpu" where its provider_options name none, else
    the first one they name, in lower case ("cuda", "dml", ...)."""
    session_options = config["model"]["decoder"].get("session_options") or {}
    for entry in session_options.get("provider_options") or ():
        if isinstance(entry, dict) and entry:
            return str(next(iter(entry))).lower()
    return "cpu"


def edit_folder(source: Path, output: Path) -> dict[str, Any]:
    """Write OUT_FOLDER as IN_FOLDER with only the genai config edit (``--config-only``); return a summary.

    Every file is copied unchanged, the model unfused; ``genai_config.json`` gets ``edit_config_for_genai``'s
    changes. GenaiFolderError for a model type that needs no edit or cannot be declared as genai's decoder.
    """
    source, output = Path(source), Path(output)
    config = read_config(source)
    _check_output_folder(source, output)
    why = genai_support(config)
    if why is None:
        raise GenaiFolderError(
            f"--config-only: nothing to edit: onnxruntime-genai 0.18 loads model type "
            f"{config['model'].get('type')!r} as it is; run {source} itself as the unfused baseline"
        )
    model = load(source / config["model"]["decoder"]["filename"])  # checked as fuse_folder checks it
    try:
        changes = edit_config_for_genai(
            config, [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]
        )
    except GenaiFolderError as error:
        raise GenaiFolderError(
            f"--config-only: {why} and its config cannot be declared as genai's 'decoder': "
            f"{str(error).removeprefix('--genai-config-edit: ')}"
        ) from None
    scratch = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.resolve().parent))
    try:
        entries = [entry for entry in sorted(source.iterdir()) if entry.name != CONFIG_NAME]
        for entry in track(entries, "copying the folder's files"):
            if entry.is_dir():
                shutil.copytree(entry, scratch / entry.name, symlinks=False)
            else:
                shutil.copy2(entry, scratch / entry.name)
        (scratch / CONFIG_NAME).write_text(json.dumps(config, indent=4) + "\n")
        _publish(scratch, output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    library = (config["model"]["decoder"].get("session_options") or {}).get("custom_ops_library")
    return dict(
        output=str(output),
        model=config["model"]["decoder"]["filename"],
        custom_ops_library=library,
        model_type=config["model"].get("type"),
        config_changes=changes,
        genai_cannot_load=None,
        fused=False,
    )


def _publish(scratch: Path, output: Path) -> None:
    """Move the assembled folder ``scratch`` to ``output`` (absent, or an empty folder) in one rename."""
    umask = os.umask(0)
    os.umask(umask)
    scratch.chmod(0o777 & ~umask)  # mkdtemp makes it private; the folder is the user's deliverable
    if output.exists():
        output.rmdir()  # empty (checked before anything was written)
    os.replace(scratch, output)


def _library_names() -> set[str]:
    """Return the file names mambafuse's custom-op library has on any platform."""
    import contrib_ops

    return set(contrib_ops._LIBRARY_NAMES.values())


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="Fuse the gated group-RMSNorm chains of an onnxruntime-genai model folder into a new folder "
        "that genai runs with mambafuse's kernels.",
        epilog="Exit status: 0 the folder was written; 2 an error (one line; no output folder); 130/143 "
        "interrupted (no output folder). MAMBAFUSE_PROGRESS=0 never draws the progress line on stderr, =1 "
        "always does (default: on a terminal).",
    )
    parser.add_argument(
        "input", type=Path, help="genai model folder (genai_config.json, model.onnx, ...); never modified"
    )
    parser.add_argument("output", type=Path, help="new (or empty) folder to write")
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument(
        "--no-library",
        action="store_true",
        help="write no custom-op library and no custom_ops_library: the fused nodes run through the model-local "
        "function, without mambafuse (portable, but slower than the kernels and than the unfused model)",
    )
    runs.add_argument("--no-function", action="store_true", help="omit the model-local function (library only)")
    edits = parser.add_mutually_exclusive_group()
    edits.add_argument(
        "--keep-model-type",
        action="store_true",
        help="keep genai_config.json's model type; by default a Nemotron-H / Zamba2 / Mamba2 folder, whose types "
        "genai 0.18 rejects, is declared as genai's 'decoder' with its conv/recurrent state names",
    )
    edits.add_argument(
        "--genai-config-edit",
        action="store_true",
        help="require that edit (the default makes it where needed): an error for another model type",
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write that config edit alone, no fusion: the folder with its model unfused and no library, which "
        "genai 0.18 can load (the baseline to compare the fused folder with)",
    )
    add_opt_in_argument(parser)
    add_accuracy_level_argument(parser)
    parser.add_argument(
        "--keep-builder-ops",
        action="store_true",
        help="no opt-in fusion but those --opt-in names: by default a folder for the CPU or CUDA gets "
        + ", ".join(FOLDER_OPT_IN["cpu"])
        + " (its LinearAttention and CausalConvWithState nodes as MambaChunkScan and CausalConv1d, faster there) "
        "besides any --opt-in names",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--debug", action="store_true", help="tracebacks for unexpected errors")
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m fusion.genai") -> int:
    """Run the command line; return the exit status (0 ok, 2 error, 130/143 signal). ``prog`` names the
    command in usage and error lines (``mambafuse genai`` from the console script)."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.config_only:
        conflicting = [
            option
            for option, given in (
                ("--no-library", args.no_library),
                ("--no-function", args.no_function),
                ("--keep-model-type", args.keep_model_type),
                ("--opt-in", bool(args.opt_in)),
                ("--keep-builder-ops", args.keep_builder_ops),
                ("--int4-accuracy-level", args.int4_accuracy_level is not None),
            )
            if given
        ]
        if conflicting:
            parser.error(f"argument --config-only: not allowed with {conflicting[0]} (--config-only does not fuse)")
    report: Report | None = None
    try:
        with interruptible():
            edit = True if args.genai_config_edit else False if args.keep_model_type else None
            if args.config_only:
                summary = edit_folder(args.input, args.output)
            else:
                report, summary = fuse_folder(
                    args.input,
                    args.output,
                    function=not args.no_function,
                    library=not args.no_library,
                    genai_config_edit=edit,
                    opt_in=args.opt_in,
                    folder_defaults=not args.keep_builder_ops,
                    int4_accuracy_level=args.int4_accuracy_level,
                )
    except Interrupted as interrupted:
        print(f"{prog}: interrupted ({interrupted}); no output folder was written", file=sys.stderr)
        return 128 + interrupted.signal_number
    except (RewriteError, OSError) as error:
        print(f"{prog}: error: {first_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:
        if args.debug:
            raise
        print(f"{prog}: internal error (rerun with --debug for details): {first_line(error)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**summary, **(report.to_dict() if report is not None else {})}, indent=2))
    else:
        if report is not None:
            print(report.summary())
        for change in summary["config_changes"]:
            print(f"genai_config.json: {change}")
        if report is not None and summary["folder_opt_in"]:
            provider = summary["provider"].upper() if summary["provider"] in ("cpu", "cuda") else summary["provider"]
            print(
                f"opted in (the {provider} folder's default; --keep-builder-ops: none): "
                + ", ".join(summary["folder_opt_in"])
            )
        for note in summary.get("notes", []):  # a --config-only summary has none
            print(note)
        if report is None:
            runs_with = "not fused: the model and every other file copied unchanged, only genai_config.json edited"
        elif summary["custom_ops_library"]:
            runs_with = f"custom_ops_library: {summary['custom_ops_library']}"
        else:
            runs_with = "no library: the fused nodes run through the model-local function"
        print(f"wrote {summary['output']} ({runs_with})")
    if summary["genai_cannot_load"]:
        print(
            f"{prog}: note: {summary['genai_cannot_load']}; rerun without --keep-model-type to declare it as "
            "genai's 'decoder' with its conv/recurrent states",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
