"""``make demo``: optimize the bundled tiny Nemotron-H decode model, verify it, and report before vs after.

    python -m fusion.demo [--model FIXTURE_STEM] [--runs 200] [--out build/demo]

The model is one of the committed exports in tests/fixtures/models (made by ``python -m models.fixtures``
from a random-weight transformers config; no download), fed with the decode-step inputs recorded next
to it (a real cache, not made-up shapes). What runs is the product's own command line::

    mambafuse optimize MODEL OUT --verify --inputs INPUTS.npz --report ...
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

from fusion import optimize

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "models"
DEFAULT_MODEL = "nemotron_h-dynamo-fp32-decode"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"fixture stem (default {DEFAULT_MODEL})")
    parser.add_argument("--runs", type=int, default=200, help="timed runs per model for the report")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "demo", help="where to write the results")
    args = parser.parse_args(argv)

    source = FIXTURES / f"{args.model}.onnx"
    if not source.is_file():
        available = sorted(p.stem for p in FIXTURES.glob("*.onnx"))
        print(f"error: no bundled model {args.model!r}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / source.name
    shutil.copyfile(source, model)
    with np.load(FIXTURES / "references.npz") as references:
        prefix = f"{args.model}/input/"
        inputs = {key[len(prefix) :]: references[key] for key in references.files if key.startswith(prefix)}
    inputs_file = args.out / f"{args.model}.inputs.npz"
    np.savez(inputs_file, **inputs)

    fused = args.out / f"{args.model}.optimized.onnx"
    command = [str(model), str(fused), "--verify", "--inputs", str(inputs_file), "--report"]
    command += ["--runs", str(args.runs), "--report-json", str(args.out / "report.json")]
    try:
        import matplotlib  # noqa: F401

        command += ["--report-plot", str(args.out / "report.png")]
    except ImportError:
        pass
    print(f"mambafuse demo: {_shown(source)} (bundled tiny export, random weights)")
    print("$ mambafuse optimize " + " ".join(_shown(Path(c)) if c.startswith("/") else c for c in command))
    print(flush=True)
    code = optimize.main(command, prog="mambafuse optimize")
    if code == 0:
        print(f"\nresults in {_shown(args.out)}/")
    return code


def _shown(path: Path) -> str:
    """Return ``path`` relative to the repository when it is inside it (shorter lines), else as it is."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


if __name__ == "__main__":
    sys.exit(main())
