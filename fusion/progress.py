"""Progress for slow commands: one updating line on a terminal's stderr, nothing in a log.

A command that can take more than a couple of seconds (``--verify`` on a big model, the before/after
report, rewriting a model with tens of GB of external weights) shows where it is when a person is
watching, and writes nothing extra when its stderr is a file or a pipe (CI logs, ``2> log``)::

    with progress("verify", total=len(nodes)) as bar:
        for node in nodes:
            check(node)
            bar.advance(message=node.name)

    for provider in track(providers, "measure"):
        measure(provider)

    with progress("load") as bar:          # no total: a counter / message only
        bar.update(message="reading weights")

The line is ``label: done/total message  elapsed`` (``\\r`` + erase-line, redrawn at most every 0.1 s)
and is erased when the block ends, so the command's real output is not interleaved with it.
``MAMBAFUSE_PROGRESS=0`` turns it off on a terminal too; ``MAMBAFUSE_PROGRESS=1`` forces it on (tests).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")

#: Environment switch: "0" never shows progress, "1" always does (even when stderr is not a terminal).
ENV = "MAMBAFUSE_PROGRESS"
#: Minimum seconds between two redraws (the last state is always drawn when asked to).
REDRAW_INTERVAL = 0.1


def is_live(stream: IO[str]) -> bool:
    """Return whether progress should be drawn on ``stream``: a terminal, unless ``$MAMBAFUSE_PROGRESS``."""
    setting = os.environ.get(ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty()) and os.environ.get("TERM") != "dumb"
    except ValueError:  # a closed stream
        return False


class Progress:
    """One status line; every method is a no-op when the stream is not live (see ``is_live``)."""

    def __init__(
        self, label: str = "", total: int | None = None, *, stream: IO[str] | None = None, enabled: bool = True
    ) -> None:
        self.label = label
        self.total = total
        self.count = 0
        self.message = ""
        self.stream = stream if stream is not None else sys.stderr
        #: Whether anything is drawn: a live stream (see ``is_live``) and not disabled (``--quiet``).
        self.live = enabled and is_live(self.stream)
        self._start = time.monotonic()
        self._last_draw = float("-inf")
        self._drawn = False

    def update(self, done: int | None = None, *, message: str | None = None, force: bool = False) -> None:
        """Set the count (``done``) and/or the message, and redraw if the last redraw is old enough."""
        if done is not None:
            self.count = done
        if message is not None:
            self.message = message
        if not self.live:
            return
        now = time.monotonic()
        if force or now - self._last_draw >= REDRAW_INTERVAL:
            self._last_draw = now
            self._draw(now)

    def advance(self, step: int = 1, *, message: str | None = None) -> None:
        """Add ``step`` to the count (and set the message)."""
        self.update(self.count + step, message=message)

    def __call__(self, done: int | None = None, total: int | None = None, message: str | None = None) -> None:
        """Callback form, for code that reports ``(done, total)`` itself."""
        if total is not None:
            self.total = total
        self.update(done, message=message)

    # The interface of the line-per-step progress that fusion/report.py grew first, so that it can be
    # swapped for this one: a step is drawn at once, a tick is throttled, done erases the line.

    def step(self, message: str) -> None:
        """Show ``message`` now (a new phase of the work)."""
        self.update(message=message, force=True)

    def tick(self, message: str) -> None:
        """Show ``message`` if the last redraw is old enough (a running count)."""
        self.update(message=message)

    def done(self) -> None:
        """Erase the line (same as ``close``)."""
        self.close()

    def text(self, now: float | None = None) -> str:
        """Return the status line (without the terminal control characters)."""
        elapsed = (time.monotonic() if now is None else now) - self._start
        count = f"{self.count}/{self.total}" if self.total is not None else (str(self.count) if self.count else "")
        parts = [f"{self.label}:" if self.label else "", count, self.message, f"{elapsed:.1f}s"]
        return " ".join(part for part in parts if part)

    def _draw(self, now: float) -> None:
        line = self.text(now)
        width = _terminal_width(self.stream)
        if len(line) > width - 1:
            line = line[: max(width - 2, 0)] + "…"
        self.stream.write("\r\033[K" + line)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the line (if one was drawn)."""
        if self.live and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False


def stdout_closed() -> int:
    """Handle a closed stdout (``mambafuse report … | head``): return 141, as a command ended by SIGPIPE.

    The reader is gone, so nothing more is printed; stdout is pointed at /dev/null so that Python's own
    flush at exit does not raise a second BrokenPipeError.
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 128 + 13  # SIGPIPE


def _terminal_width(stream: IO[str]) -> int:
    """Return the terminal's width; 80 when unknown (a pseudo-terminal without a size reports 0)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 80
    return columns if columns >= 20 else 80


@contextlib.contextmanager
def progress(label: str, total: int | None = None, *, stream: IO[str] | None = None) -> Iterator[Progress]:
    """Return a Progress for the block and erase its line when the block ends (also on an error)."""
    bar = Progress(label, total, stream=stream)
    bar.update(force=True)
    try:
        yield bar
    finally:
        bar.close()


def track(items: Iterable[T], label: str, total: int | None = None, *, stream: IO[str] | None = None) -> Iterator[T]:
    """Yield ``items``, counting them on a progress line (``total`` defaults to ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress(label, total, stream=stream) as bar:
        for item in items:
            yield item
            bar.advance()
