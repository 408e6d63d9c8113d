"""Drive the exported fixtures in ONNX Runtime: their manifest, sample feeds, and a greedy decode loop.

Shared by the tests, benchmarks and the demo so that "how to feed a decode graph its cache" is written
once: ``manifest.json`` says which output feeds which input on the next step (``cache_map``), and
``references.npz`` holds the cache that torch's ``generate()`` built from the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from models.fixtures import FIXTURE_DIR, GREEDY_TOKENS

_NP_TYPES = {"FLOAT": np.float32, "FLOAT16": np.float16, "INT64": np.int64, "INT32": np.int32}


def load_manifest(fixture_dir: Path = FIXTURE_DIR) -> dict[str, Any]:
    """Return the parsed ``manifest.json`` of a fixture directory."""
    return json.loads((Path(fixture_dir) / "manifest.json").read_text())


def load_references(fixture_dir: Path = FIXTURE_DIR) -> dict[str, dict[str, np.ndarray]]:
    """Return ``{stem: {key: array}}`` from ``references.npz`` (``input/<name>``, ``output/<name>``, ...)."""
    grouped: dict[str, dict[str, np.ndarray]] = {}
    with np.load(Path(fixture_dir) / "references.npz") as refs:
        for key in refs.files:
            stem, rest = key.split("/", 1)
            grouped.setdefault(stem, {})[rest] = refs[key]
    return grouped


def feeds(record: dict[str, Any], refs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return the ORT feeds of a fixture's sample step, cast to the graph's input types."""
    result = {}
    for spec in record["inputs"]:
        value = refs[f"input/{spec['name']}"]
        np_type = _NP_TYPES.get(spec["dtype"])
        if np_type is None:
            raise ValueError(f"input {spec['name']} is {spec['dtype']}: no numpy type (bf16 needs DLPack)")
        result[spec["name"]] = value.astype(np_type)
    return result


def greedy_decode(
    session: Any,
    record: dict[str, Any],
    refs: dict[str, np.ndarray],
    steps: int = GREEDY_TOKENS,
    logits: list[np.ndarray] | None = None,
) -> list[int]:
    """Return ``steps`` greedy tokens from a decode graph, feeding its cache outputs back as inputs.

    Starts from the fixture's sample step (the token after the prompt, its position, the prompt's cache). With
    ``logits``, each step's last-position logits (float32) are appended to it.
    """
    if record["mode"] != "decode":
        raise ValueError(f"{record['file']} is a {record['mode']} graph; greedy decoding needs a decode graph")
    step = feeds(record, refs)
    output_names = [o.name for o in session.get_outputs()]
    tokens = []
    for _ in range(steps):
        outputs = dict(zip(output_names, session.run(None, step), strict=True))
        last = outputs["logits"][0, -1].astype(np.float32)
        if logits is not None:
            logits.append(last)
        token = int(np.argmax(last))
        tokens.append(token)
        step = {name: outputs[out] for out, name in record["cache_map"].items()}
        step["input_ids"] = np.array([[token]], dtype=np.int64)
        if "input/position_ids" in refs:  # Mamba2's decode step takes no position ids
            step["position_ids"] = feeds_position(refs, len(tokens))
    return tokens


def feeds_position(refs: dict[str, np.ndarray], offset: int) -> np.ndarray:
    """Return the position ids of the decode step ``offset`` steps after the fixture's sample step."""
    return (refs["input/position_ids"] + offset).astype(np.int64)
