"""The prefill benchmark's idle-time figures (benchmarks/bench_gpu_nemotron.py): how much of a Run's span no
kernel covers, from the (start, name, µs) launches CUPTI reports; and where a Run with ORT's CUDA graph spends its
wall time (``step --graph-attribution``), from the Runs' host ranges and the kernels' and copies' intervals."""

import math

from benchmarks import bench_gpu_nemotron as bench
from benchmarks.bench_gpu_nemotron import kernel_stats, record_kind, run_attribution


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


# --- where a Run with ORT's CUDA graph spends its wall time (run_attribution) ------------------------------------

# Three Runs (host start, end) with their kernels, copies and host CUDA API calls (start, end[, name]), µs:
#   Run 0, host 0-100:   kernels 10-30 and 25-50 (overlapping), copy 50-55, kernel 60-80
#   Run 1, host 120-230: kernel 135-150, copy 150-152, kernel 170-200
#   Run 2, host 250-340: kernels 262-300 and 290-310 (overlapping), no copy
HOSTS = [(0.0, 100.0), (120.0, 230.0), (250.0, 340.0)]
KERNELS = [(10.0, 30.0), (25.0, 50.0), (60.0, 80.0), (135.0, 150.0), (170.0, 200.0), (262.0, 300.0), (290.0, 310.0)]
COPIES = [(50.0, 55.0), (150.0, 152.0)]
CALLS = [
    (2.0, 8.0, "cudaGraphLaunch"),
    (55.0, 99.0, "cudaStreamSynchronize"),
    (105.0, 110.0, "cudaEventRecord"),  # between two Runs: in neither
    (121.0, 125.0, "cudaGraphLaunch"),
    (152.0, 229.0, "cudaStreamSynchronize"),
    (251.0, 260.0, "cudaGraphLaunch"),
    (300.0, 339.0, "cudaStreamSynchronize"),
]


def test_each_run_is_split_into_before_span_and_after():
    found = run_attribution(HOSTS, KERNELS, COPIES, CALLS)
    # by hand, per Run: before = first start - host start; span = last end - first start; busy = the union of the
    # kernels and copies (Run 0: 10-55 and 60-80 = 45 + 20; Run 1: 15 + 2 + 30; Run 2: 262-310); after = host end -
    # last end
    expected = [
        {"wall": 100.0, "before": 10.0, "span": 70.0, "busy": 65.0, "idle": 5.0, "after": 20.0},
        {"wall": 110.0, "before": 15.0, "span": 65.0, "busy": 47.0, "idle": 18.0, "after": 30.0},
        {"wall": 90.0, "before": 12.0, "span": 48.0, "busy": 48.0, "idle": 0.0, "after": 30.0},
    ]
    counts = [(3, 1, 5.0), (2, 1, 2.0), (2, 0, 0.0)]
    for run, want, (kernels, copies, copy_us) in zip(found["per_run"], expected, counts, strict=True):
        assert {key: run[key] for key in want} == want
        assert run["before"] + run["span"] + run["after"] == run["wall"]
        assert (run["kernels"], run["copies"], run["copy_us"]) == (kernels, copies, copy_us)
    # the medians of the three Runs, each figure on its own
    medians = {"wall": 100.0, "before": 12.0, "span": 65.0, "busy": 48.0, "idle": 5.0, "after": 30.0}
    assert {key: found[key] for key in medians} == medians
    assert (found["kernels"], found["copies"], found["copy_us"]) == (2, 1, 2.0)
    # between Runs: the GPU 135 - 80 = 55 and 262 - 200 = 62 (median 58.5), the host 20 and 20
    assert (found["gpu_gap"], found["host_gap"]) == (58.5, 20.0)
    assert (found["runs"], found["measured"], found["missing"]) == (3, 3, None)


def test_host_calls_are_summed_per_run_by_name():
    found = run_attribution(HOSTS, KERNELS, COPIES, CALLS)
    # per Run: synchronize 44, 77, 39 (median 44), graph launch 6, 4, 9 (median 6); the call between Runs in none
    assert found["calls"] == [("cudaStreamSynchronize", 44.0, 1), ("cudaGraphLaunch", 6.0, 1)]


def test_a_kernel_belongs_to_the_last_run_started_before_it():
    hosts = [(0.0, 50.0), (100.0, 150.0)]
    # -20 to -5: before the first Run (a warm-up's), not counted; 45-60 ends after Run 0 returned (after < 0)
    kernels = [(-20.0, -5.0), (10.0, 40.0), (45.0, 60.0), (110.0, 140.0)]
    found = run_attribution(hosts, kernels)
    keys = ("kernels", "before", "span", "busy", "after")
    first, second = ({key: run[key] for key in keys} for run in found["per_run"])
    assert first == {"kernels": 2, "before": 10.0, "span": 50.0, "busy": 45.0, "after": -10.0}
    assert second == {"kernels": 1, "before": 10.0, "span": 30.0, "busy": 30.0, "after": 10.0}
    assert found["gpu_gap"] == 50.0  # 110 - 60


def test_a_run_without_gpu_work_is_left_out_of_the_medians():
    hosts = [(0.0, 100.0), (200.0, 300.0), (400.0, 500.0)]
    found = run_attribution(hosts, [(10.0, 90.0), (410.0, 470.0)])
    assert found["measured"] == 2
    assert found["before"] == 10.0 and found["span"] == 70.0 and found["after"] == 20.0  # (80 + 60) / 2, (10 + 30) / 2
    assert math.isnan(found["gpu_gap"])  # no two consecutive Runs both with GPU work


def test_no_kernel_records_say_so_instead_of_zeros():
    found = run_attribution([(0.0, 100.0), (200.0, 300.0)], [], [], [(5.0, 10.0, "cudaGraphLaunch")])
    assert found["missing"] is not None and "no kernel or copy" in found["missing"]
    assert all(math.isnan(found[key]) for key in ("before", "span", "busy", "idle", "after", "gpu_gap"))
    assert found["wall"] == 100.0 and found["measured"] == 0


def test_records_are_told_apart_by_kind_then_by_name():
    assert record_kind("kernel", "ampere_sgemm", True) == "kernel"
    assert record_kind("gpu_memcpy", "Memcpy DtoD (Device -> Device)", True) == "copy"
    assert record_kind("gpu_memset", "Memset (Device)", True) == "copy"
    assert record_kind("cuda_runtime", "cudaGraphLaunch", False) == "call"
    assert record_kind("gpu_user_annotation", "a range", True) is None  # a range drawn on the GPU's timeline
    assert record_kind("cpu_op", "aten::add", False) is None
    # a torch build without kineto's activity types: by device and name
    assert record_kind("", "Memset (Device)", True) == "copy"
    assert record_kind("", "void gemv<half>(...)", True) == "kernel"
    assert record_kind("", "cudaStreamSynchronize", False) == "call"
    assert record_kind("", "aten::add", False) is None


def _attribution_table(monkeypatch, found):
    """``graph_attribution_lines``' table rows for one variant whose profile is ``found``."""
    monkeypatch.setattr(bench, "DEVICE", "cuda")
    monkeypatch.setattr(bench, "graph_run_profile", lambda *args, **kwargs: found)
    timing = {True: {"before": {"median": 7726.0, "min": 7700.0, "max": 7800.0}}}
    lines = bench.graph_attribution_lines(
        None, None, "x", {"before": None}, {}, {}, None, 3, {}, timing, {"before": {"launches": 9}}
    )
    return [line for line in lines if line.startswith("| ")]


def test_the_table_says_when_cupti_reported_no_kernels(monkeypatch):
    found = {**run_attribution([(0.0, 100.0)], []), "walls": [101.0], "range_opens": 1.0, "range_closes": 2.0}
    header, row = _attribution_table(monkeypatch, found)
    assert row.startswith("| unfused | 7726 | 101 | CUPTI reported no kernel or copy in any of the 1 Runs")
    assert row.count("|") == header.count("|")  # the table's columns, empty, not zeros


def test_the_table_has_a_cell_per_column(monkeypatch):
    found = {
        **run_attribution(HOSTS, KERNELS, COPIES, CALLS),
        "walls": [100.0],
        "range_opens": 1.0,
        "range_closes": 2.0,
    }
    header, row = _attribution_table(monkeypatch, found)
    assert row == "| unfused | 7726 | 100 | 12 | 65 | 48 | 5 | 30 | 58 | 20 | 2 + 1 (9) | 2.0 |"
    assert row.count("|") == header.count("|")
