"""fusion.progress: one updating line on a terminal, nothing on a file or pipe."""

from __future__ import annotations

import io
import os

import pytest

from fusion import progress as progress_module
from fusion.progress import Progress, is_live, progress, track


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress_module.ENV, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(progress_module, "REDRAW_INTERVAL", 0.0)  # draw every update


def test_quiet_when_not_a_terminal() -> None:
    log = io.StringIO()
    with progress("verify", total=3, stream=log) as bar:
        for _ in range(3):
            bar.advance(message="node")
    assert list(track(range(4), "measure", stream=log)) == [0, 1, 2, 3]
    assert log.getvalue() == ""


def test_terminal_gets_one_erased_line() -> None:
    terminal = FakeTerminal()
    with progress("verify", total=2, stream=terminal) as bar:
        bar.advance(message="first")
        assert bar.text().startswith("verify: 1/2 first ")
        bar.advance(message="second")
    written = terminal.getvalue()
    assert "verify: 0/2" in written and "verify: 1/2 first" in written and "verify: 2/2 second" in written
    assert "\n" not in written  # redrawn in place, never scrolls
    assert written.endswith("\r\033[K")  # erased at the end, so real output starts on a clean line


def test_line_is_erased_when_the_block_raises() -> None:
    terminal = FakeTerminal()
    with pytest.raises(RuntimeError), progress("load", stream=terminal) as bar:
        bar.update(message="reading weights")
        raise RuntimeError("boom")
    assert terminal.getvalue().endswith("\r\033[K")


def test_track_counts_items_and_takes_len() -> None:
    terminal = FakeTerminal()
    assert list(track(["CPU", "CUDA"], "measure", stream=terminal)) == ["CPU", "CUDA"]
    assert "measure: 0/2" in terminal.getvalue() and "measure: 2/2" in terminal.getvalue()


def test_callback_form_sets_total() -> None:
    terminal = FakeTerminal()
    bar = Progress("write", stream=terminal)
    bar(5, 10, "weights")
    assert (bar.count, bar.total, bar.message) == (5, 10, "weights")
    assert "write: 5/10 weights" in terminal.getvalue()


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_live(FakeTerminal()) and not is_live(io.StringIO())
    monkeypatch.setenv(progress_module.ENV, "0")
    assert not is_live(FakeTerminal())
    monkeypatch.setenv(progress_module.ENV, "1")
    assert is_live(io.StringIO())
    monkeypatch.delenv(progress_module.ENV)
    monkeypatch.setenv("TERM", "dumb")
    assert not is_live(FakeTerminal())


def test_redraws_are_throttled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_module, "REDRAW_INTERVAL", 3600.0)
    terminal = FakeTerminal()
    with progress("report", total=1000, stream=terminal) as bar:
        for _ in range(1000):
            bar.advance()
    assert terminal.getvalue().count("report:") == 1  # the first draw only; then erased
    assert bar.count == 1000


def test_step_tick_done_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step/tick/done interface (what fusion/report.py uses): steps draw at once, ticks are throttled."""
    monkeypatch.setattr(progress_module, "REDRAW_INTERVAL", 3600.0)
    terminal = FakeTerminal()
    bar = Progress(stream=terminal)
    bar.step("loading models")
    bar.tick("timing 1/200")  # within the interval: not drawn
    bar.step("[CPU] optimizing and profiling")
    bar.done()
    written = terminal.getvalue()
    assert "loading models" in written and "[CPU] optimizing and profiling" in written
    assert "timing 1/200" not in written
    assert written.endswith("\r\033[K") and "\n" not in written
    assert not bar.text().startswith(":")  # no label, no dangling colon


def test_disabled_draws_nothing_on_a_terminal() -> None:
    terminal = FakeTerminal()
    bar = Progress("report", stream=terminal, enabled=False)  # --quiet
    bar.step("loading models")
    bar.advance()
    bar.done()
    assert terminal.getvalue() == "" and bar.count == 1


def test_long_lines_fit_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line wider than the terminal is cut to fit; a terminal that reports no size counts as 80 wide."""
    for columns, width in ((40, 40), (0, 80)):
        monkeypatch.setattr(progress_module.os, "get_terminal_size", lambda fd, c=columns: os.terminal_size((c, 24)))
        terminal = FakeTerminal()
        terminal.fileno = lambda: 2  # type: ignore[method-assign]
        with progress("verify", stream=terminal) as bar:
            bar.step("x" * 200)
        drawn = [line for line in terminal.getvalue().split("\r\033[K") if line]
        assert drawn and all(len(line) <= width - 1 for line in drawn), (columns, drawn)
        assert drawn[-1].startswith("verify: xxx") and drawn[-1].endswith("…")
