"""The ``mambafuse`` console command: ``mambafuse rewrite …``, ``mambafuse report …``, ``mambafuse genai …``,
``mambafuse olive …``, ``mambafuse --version``.

Each subcommand is the module's own command line with the same arguments and exit statuses
(``mambafuse rewrite ARGS`` is ``python -m fusion.rewrite ARGS``, ``mambafuse report ARGS`` is
``python -m fusion.report ARGS``, ``mambafuse genai ARGS`` is ``python -m fusion.genai ARGS``,
``mambafuse olive CONFIG`` is ``python -m fusion.olive CONFIG``); this module only dispatches.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib import metadata

PACKAGE = "mambafuse"

USAGE = f"""usage: {PACKAGE} [--version] [-h] COMMAND [ARGS...]

Fuse the Mamba-2 mixer's decode step (CausalConv1dUpdate, SelectiveStateUpdate) and its gated group-RMSNorm
(GatedGroupRMSNorm) into ai.mambafuse nodes, and optimize the rest of the model for ONNX Runtime.

commands:
  optimize  the whole model: every mambafuse fusion, onnxscript's ORT fusions, the decode attention onto
            GroupQueryAttention (fp16/bf16), then the mambafuse fusions again (python -m fusion.optimize):
            {PACKAGE} optimize model.onnx [OUT.onnx] [--verify] ...
  rewrite   fuse a model's chains (python -m fusion.rewrite): {PACKAGE} rewrite model.onnx [--verify] ...
  report    dispatches and latency before vs after (python -m fusion.report): {PACKAGE} report before.onnx after.onnx
  genai     fuse an onnxruntime-genai model folder (python -m fusion.genai): {PACKAGE} genai IN_DIR OUT_DIR
            (--config-only: only the genai_config.json edit, the unfused baseline genai 0.18 can load)
  olive     run an Olive workflow config with the mambafuse surgeon registered: {PACKAGE} olive CONFIG.json

'{PACKAGE} COMMAND --help' shows a command's options."""


def version() -> str:
    """Return the installed package's version (from its metadata), or "unknown" when not installed."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown (not installed; run from a source tree)"


def _version_text() -> str:
    import contrib_ops

    try:
        library = contrib_ops.library_path()
    except contrib_ops.LibraryNotFoundError:
        library = "not found (build it: make build, or pip install .)"
    return f"{PACKAGE} {version()}\ncustom-op library: {library}"


def _rewrite(argv: Sequence[str]) -> int:
    from fusion import rewrite

    return rewrite.main(list(argv), prog=f"{PACKAGE} rewrite")


def _report(argv: Sequence[str]) -> int:
    from fusion import report

    return report.main(list(argv), prog=f"{PACKAGE} report")


def _optimize(argv: Sequence[str]) -> int:
    from fusion import optimize

    return optimize.main(list(argv), prog=f"{PACKAGE} optimize")


def _genai(argv: Sequence[str]) -> int:
    from fusion import genai

    return genai.main(list(argv), prog=f"{PACKAGE} genai")


def _olive(argv: Sequence[str]) -> int:
    from fusion import olive_command  # checks the arguments before Olive's slow import

    return olive_command.main(list(argv), prog=f"{PACKAGE} olive")


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "optimize": _optimize,
    "rewrite": _rewrite,
    "report": _report,
    "genai": _genai,
    "olive": _olive,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mambafuse``; return the exit status (the subcommand's, or 2 for a bad command line)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args or args[0] in ("-h", "--help"):
            print(USAGE, file=sys.stdout if args else sys.stderr)
            return 0 if args else 2
        if args[0] in ("-V", "--version"):
            print(_version_text())
            return 0
        command = COMMANDS.get(args[0])
        if command is None:
            print(
                f"{PACKAGE}: error: unknown command {args[0]!r} (commands: {', '.join(COMMANDS)}; see --help)",
                file=sys.stderr,
            )
            return 2
        return command(args[1:])
    except SystemExit as exit_:  # argparse exits on --help and on bad arguments
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    except BrokenPipeError:  # `mambafuse … | head` (the usage and --version too): the reader left
        from fusion.progress import stdout_closed

        return stdout_closed()
    except KeyboardInterrupt:
        print(f"{PACKAGE}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
