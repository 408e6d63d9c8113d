"""Inputs for running prefill fixtures in the prefill rule tests (tests/test_*_rules.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort


def prompt_feeds(session: ort.InferenceSession, length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Feeds for a prompt of ``length`` tokens: random token ids, positions 0..length-1, 0 for transformers'
    exporter's scalar cache counters (an empty cache), random floats (of the input's type) otherwise."""
    feeds = {}
    for value in session.get_inputs():
        shape = [d if isinstance(d, int) else length for d in value.shape]
        if "int64" in value.type:
            if not shape:
                feeds[value.name] = np.zeros((), np.int64)
            elif "position" in value.name:
                feeds[value.name] = np.broadcast_to(np.arange(length), shape).astype(np.int64)
            else:
                feeds[value.name] = rng.integers(0, 32, size=shape).astype(np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float16 if "float16" in value.type else np.float32)
    return feeds
