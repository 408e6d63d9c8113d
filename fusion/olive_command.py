"""``mambafuse olive CONFIG``: run an Olive workflow config with the mambafuse surgeon registered.

The arguments and the config file are checked before Olive is imported (its import takes seconds), so a
wrong command line answers at once. Then ``fusion.olive`` is imported, which registers the surgeon
``MambafuseGatedGroupRMSNorm`` (Olive has no plugin entry points), and ``olive.workflows.run`` runs the
config in this process.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

#: The config formats Olive reads (``olive.common.config_utils.load_config_file``).
SUFFIXES = (".json", ".yaml", ".yml")


def usage(prog: str) -> str:
    """Return the command's help text."""
    return f"""usage: {prog} CONFIG  (an Olive workflow config: .json, .yaml or .yml)

Run an Olive workflow (olive.workflows.run) with the mambafuse surgeon registered, so that a
GraphSurgeries pass can name it:

  "fuse": {{"type": "GraphSurgeries", "surgeries": [{{"surgeon": "MambafuseGatedGroupRMSNorm"}}]}}

The surgeon's options: "function" (attach the model-local function, default true: Olive's own
sessions run the fused model through it) and "min_fused" (fail the pass when fewer chains are fused,
default 0). `olive run --config CONFIG` does not import the surgeon; this command does. Needs olive-ai
(pip install 'mambafuse[olive]'). Workflow examples: docs/olive.md.

exit status:
  0    the workflow ran
  1    Olive or one of its passes failed (one line: the error's type and first line)
  2    bad command line, a missing or unreadable config, or Olive not installed"""


class _BadArguments(Exception):
    pass


def check_config(argv: Sequence[str]) -> Path:
    """Return the config path of the command line ``argv``; raise _BadArguments saying what is wrong."""
    if len(argv) != 1:
        raise _BadArguments(f"expected one CONFIG file, got {len(argv)} arguments")
    if argv[0].startswith("-"):
        raise _BadArguments(f"unknown option {argv[0]!r}")
    config = Path(argv[0])
    if not config.is_file():
        raise _BadArguments(f"{config}: no such file" if not config.exists() else f"{config}: is not a file")
    if config.suffix not in SUFFIXES:
        raise _BadArguments(f"{config}: Olive reads .json, .yaml and .yml configs, not {config.suffix or 'no suffix'}")
    try:
        text = config.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise _BadArguments(f"{config}: cannot be read ({type(error).__name__})") from None
    if config.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise _BadArguments(f"{config}: not valid JSON (line {error.lineno}: {error.msg})") from None
        if not isinstance(data, dict):
            raise _BadArguments(f"{config}: an Olive workflow config is a JSON object, not {type(data).__name__}")
    return config


def main(argv: Sequence[str] | None = None, *, prog: str = "mambafuse olive") -> int:
    """Run the command line; return the exit status (see ``usage``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(usage(prog))
        return 0
    try:
        config = check_config(args)
    except _BadArguments as error:
        print(f"{prog}: error: {error} (see --help)", file=sys.stderr)
        return 2
    try:
        importlib.import_module("fusion.olive")  # registers the surgeon; says how to install olive-ai
        from olive.workflows import run
    except ImportError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        run(str(config))
    except BrokenPipeError:
        from fusion.progress import stdout_closed

        return stdout_closed()
    except Exception as error:  # Olive's and the passes' errors: one line
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
        # pydantic's first line only counts the errors ("1 validation error for RunConfig"): add the first one.
        message = "; ".join(lines[:3]) if type(error).__name__ == "ValidationError" else lines[0]
        print(f"{prog}: error: {type(error).__name__}: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m fusion.olive_command"))
