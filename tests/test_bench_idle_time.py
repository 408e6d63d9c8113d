"""The prefill benchmark's idle-time figures (benchmarks/bench_gpu_nemotron.py): how much of a Run's span no
kernel covers, from the (start, name, µs) launches CUPTI reports."""

import math

from benchmarks.bench_gpu_nemotron import kernel_stats


def _runs(pattern, runs, period=1000.0):
    """``runs`` copies of ``pattern`` ((offset, name, µs) within a Run), one every ``period`` µs."""
    return [(r * period + offset, name, us) for r in range(runs) for offset, name, us in pattern]


def test_idle_time_is_the_span_not_covered_by_kernels():
    # a: 0-10, b: 30-40 (a gap of 20), c: 35-60 (overlaps b), d: 100-101 (a gap of 40)
    pattern = [(0.0, "a", 10.0), (30.0, "b", 10.0), (35.0, "c", 25.0), (100.0, "d", 1.0)]
    stats = kernel_stats(_runs(pattern, 4), 4)
    assert stats["span"] == 101.0
    assert stats["idle"] == 60.0
    assert [(us, before, after) for us, before, after in stats["gaps"][:2]] == [(40.0, "c", "d"), (20.0, "a", "b")]


def test_the_gaps_are_medians_over_the_runs():
    runs = []
    for r, gap in enumerate([5.0, 7.0, 500.0]):  # one slow Run does not move the median
        runs += [(r * 1000.0, "a", 10.0), (r * 1000.0 + 10.0 + gap, "b", 10.0)]
    stats = kernel_stats(runs, 3)
    assert stats["idle"] == 7.0
    assert stats["gaps"][0] == (7.0, "a", "b")


def test_runs_that_differ_give_no_idle_figures():
    launches = [(0.0, "a", 1.0), (5.0, "b", 1.0), (1000.0, "b", 1.0), (1005.0, "a", 1.0)]
    stats = kernel_stats(launches, 2)
    assert math.isnan(stats["idle"]) and stats["gaps"] == []
