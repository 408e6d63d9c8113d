"""A hint line of a rewrite's report, with what it is about, so that a caller can drop the ones its own choices
settle without matching their text (``mambafuse genai`` drops the CPU int4 hint on a folder for another provider and
the builder-op hints of the fusions a folder's provider runs by default)."""

from __future__ import annotations

#: The topic of the hint to requantize int4 products at accuracy_level 4 for the CPU (fusion.int4).
CPU_INT4 = "cpu_int4_accuracy_level"


class Hint(str):
    """A hint's text (what is printed and written to JSON), with ``topic``: ``CPU_INT4``, or the name of the opt-in
    fusion a builder-op hint names."""

    topic: str

    def __new__(cls, text: str, topic: str = "") -> Hint:
        hint = super().__new__(cls, text)
        hint.topic = topic
        return hint


def topic_of(hint: str) -> str:
    """The topic of ``hint`` ("" for a plain string)."""
    return getattr(hint, "topic", "")
