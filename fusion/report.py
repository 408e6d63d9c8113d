"""Before/after report of a fusion: graph nodes, kernel dispatches per Run, latency, output error.

``python -m fusion.report BEFORE.onnx AFTER.onnx [--providers P1,P2] [--runs 200] [--json out.json]
[--plot out.png]`` — and the same report behind ``python -m fusion.rewrite IN.onnx --report``.

Everything is measured, nothing estimated:
- static: nodes in each graph, the ai.mambafuse nodes and how many other nodes fewer the fused graph has
  (``chain_nodes``: the original's other nodes less the fused graph's); and for each execution
  provider the graph ONNX Runtime really runs (saved after its optimizations at the chosen level):
  nodes, Memcpy nodes, and how many provider partitions the executed kernels form;
- kernel executions per ``Run``, from ONNX Runtime's profiler (``cat == "Node"`` events ending in
  ``_kernel_time``, grouped by the ``model_run`` event that contains them), by provider and op type:
  counts only, no time (under the profiler each kernel's duration includes the profiler's own
  bookkeeping: the demo model's profiled kernels add up to ~800 us a Run against a ~115 us Run);
- latency per ``Run``: median and p90 over N runs after warm-up, before and after interleaved in one
  process, with IO binding on GPU providers so host copies are not what is measured;
- the largest absolute difference between the two models' outputs, so a speedup cannot hide a wrong
  answer.

The fused nodes run with mambafuse's custom-op library (its kernels) by default, and the report says so;
``--no-library`` measures both models without it, the fused nodes then running through their model-local
function (ONNX Runtime inlines its stock-op body), as on a machine without mambafuse.

The JSON keys ``before/after.{nodes, kernels_per_run, latency_us.{median, p90}}``, ``fused_nodes``,
``max_abs_error`` and ``environment`` are stable: tools read them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from fusion.inputs import HELP as INPUTS_HELP
from fusion.inputs import (
    InputError,
    RejectedRun,
    describe,
    first_run,
    holds_bfloat16,
    ignored_note,
    load_inputs,
    make_inputs,
    parse_dims,
    resolve_dims,
    split_provided,
)
from fusion.model_io import first_line
from fusion.progress import ENV as PROGRESS_ENV
from fusion.progress import Progress, stdout_closed
from fusion.reference import DOMAIN, OP_TYPE

SCHEMA_VERSION = 1
GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider"})


class ReportError(Exception):
    """A problem with the report's arguments or models, with a message for the user."""


# --- inputs: fusion/inputs.py (make_inputs, load_inputs, parse_dims are re-exported here) -----------


# --- static counts --------------------------------------------------------------------------------


def count_nodes(model: onnx.ModelProto) -> int:
    """Return the number of nodes in the main graph (functions and subgraphs not expanded)."""
    return len(model.graph.node)


def count_fused(model: onnx.ModelProto) -> int:
    """Return the number of ai.mambafuse nodes (every fused op) in the main graph."""
    return sum(fused_by_op(model).values())


def fused_by_op(model: onnx.ModelProto) -> dict[str, int]:
    """Return the main graph's ai.mambafuse nodes by op type (GatedGroupRMSNorm first, as the rewrite runs)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (item[0] != OP_TYPE, item[0])))


def _load(path_or_model: str | os.PathLike[str] | onnx.ModelProto, what: str) -> onnx.ModelProto:
    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model
    path = Path(path_or_model)
    if path.is_dir():
        raise ReportError(f"{what} model {str(path)!r} is a directory, not an ONNX model{_models_in(path)}")
    if not path.is_file():
        raise ReportError(f"{what} model {str(path)!r} does not exist")
    try:
        # External weights stay on disk: the graph is all the static counts need, ORT reads the file itself.
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for a damaged file
        raise ReportError(f"{what} model {str(path)!r} is not a readable ONNX model ({type(exc).__name__})") from None


def _models_in(folder: Path) -> str:
    """Return ``; it holds a.onnx, b.onnx`` for the ONNX files directly in ``folder`` (what the user may mean)."""
    from fusion.model_io import models_in

    return models_in(folder)


# --- measurement ----------------------------------------------------------------------------------


@dataclass
class ProviderResult:
    """What one model measured on one execution provider."""

    optimized_nodes: int = 0
    memcpy_nodes: int = 0
    partitions: int = 0
    kernels_per_run: int = 0
    kernels_by_provider: dict[str, int] = field(default_factory=dict)
    kernels_by_op: dict[str, int] = field(default_factory=dict)
    #: Sum of the profiled kernel durations of one Run (median over the profiled runs), and per op type.
    #: Not in the table nor the JSON: under the profiler every kernel's duration includes the profiler's
    #: own bookkeeping (a few us a node, several times a small kernel's time), so these are larger than
    #: the unprofiled latency and do not move with it. Only comparisons within one profile hold (the
    #: benchmarks use them that way, with that caveat).
    kernel_us_per_run: float = 0.0
    kernel_us_by_op: dict[str, float] = field(default_factory=dict)
    latency_us: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Return the measured fields (not the profiler's inflated kernel durations)."""
        data = asdict(self)
        del data["kernel_us_per_run"], data["kernel_us_by_op"]
        return data


@dataclass
class Report:
    """The before/after report; ``to_json()`` has the stable schema described in the module docstring."""

    before_nodes: int
    after_nodes: int
    chain_nodes: int
    fused_nodes: int
    providers: list[str]
    before: dict[str, ProviderResult]
    after: dict[str, ProviderResult]
    max_abs_error: float
    max_abs_error_by_output: dict[str, float]
    runs: int
    dims: dict[str, int]
    environment: dict[str, Any]
    #: The fused model's ai.mambafuse nodes by op type, less the original's.
    fused_by_op: dict[str, int] = field(default_factory=dict)
    #: The custom-op library the sessions registered (its path), or None (--no-library: the fused nodes ran
    #: through their model-local function).
    library: str | None = None
    #: How a prefill graph's sequence length was chosen (fusion.inputs.prefill_note), or None.
    dims_note: str | None = None

    def _fused_text(self) -> str:
        by_op = ", ".join(f"{count} {op_type}" for op_type, count in self.fused_by_op.items() if count)
        return f"{self.fused_nodes} ai.mambafuse nodes ({by_op or 'none'})"

    def _nodes_text(self) -> str:
        """Return what the fusions did to the node count, with the arithmetic of the "graph nodes" row."""
        if not self.fused_nodes:
            return f"{self._fused_text()}"
        net = self.after_nodes - self.before_nodes
        return (
            f"{self._fused_text()} where the original had {self.chain_nodes} other nodes "
            f"(graph nodes: -{self.chain_nodes} + {self.fused_nodes} = {net:+d})"
        )

    def library_text(self) -> str:
        """Return how the fused nodes ran: the library's kernels, or the model-local function (--no-library)."""
        if self.library:
            return (
                f"after: the fused nodes run the mambafuse library's kernels ({self.library}); "
                "--no-library runs them through their model-local function"
            )
        return "after: the fused nodes run through their model-local function, without the mambafuse library"

    def to_json(self) -> dict[str, Any]:
        def side(nodes: int, results: dict[str, ProviderResult]) -> dict[str, Any]:
            first = results[self.providers[0]]
            return {
                "nodes": nodes,
                "kernels_per_run": {p: r.kernels_per_run for p, r in results.items()},
                "latency_us": dict(first.latency_us),
                "by_provider": {p: r.to_json() for p, r in results.items()},
            }

        return {
            "schema_version": SCHEMA_VERSION,
            "before": side(self.before_nodes, self.before),
            "after": side(self.after_nodes, self.after),
            "fused_nodes": self.fused_nodes,
            "fused_by_op": dict(self.fused_by_op),
            "chain_nodes": self.chain_nodes,
            "max_abs_error": self.max_abs_error,
            "max_abs_error_by_output": self.max_abs_error_by_output,
            "runs": self.runs,
            "dims": self.dims,
            "dims_note": self.dims_note,
            "library": self.library,
            "environment": self.environment,
        }

    def table(self) -> str:
        """Return the aligned terminal table: one block per provider, change as a number and a percentage."""
        rows: list[tuple[str, str, str, str, str]] = [("", "before", "after", "change", "")]

        def add(label: str, before: float, after: float, unit: str, fmt: str = "{:.0f}") -> None:
            delta = after - before
            pct = f"{100.0 * delta / before:+.1f} %" if before else "n/a"
            rows.append(
                (
                    label,
                    fmt.format(before) + unit,
                    fmt.format(after) + unit,
                    f"{fmt.format(delta)}{unit}",
                    pct,
                )
            )

        add("graph nodes", self.before_nodes, self.after_nodes, "")
        for provider in self.providers:
            b, a = self.before[provider], self.after[provider]
            short = provider.removesuffix("ExecutionProvider")
            rows.append((f"[{short}]", "", "", "", ""))
            add("  nodes after ORT optimization", b.optimized_nodes, a.optimized_nodes, "")
            add("  kernel dispatches per Run", b.kernels_per_run, a.kernels_per_run, "")
            # by op type, the ones whose count changed (most removed first): where the dispatches went
            changed = {
                op: (b.kernels_by_op.get(op, 0), a.kernels_by_op.get(op, 0))
                for op in {*b.kernels_by_op, *a.kernels_by_op}
                if b.kernels_by_op.get(op, 0) != a.kernels_by_op.get(op, 0)
            }
            for op, (before_count, after_count) in sorted(changed.items(), key=lambda kv: (kv[1][1] - kv[1][0], kv[0])):
                add(f"    {op}", before_count, after_count, "")
            add("  provider partitions", b.partitions, a.partitions, "")
            add("  memcpy nodes", b.memcpy_nodes, a.memcpy_nodes, "")
            add("  latency median", b.latency_us["median"], a.latency_us["median"], " us", "{:.1f}")
            add("  latency p90", b.latency_us["p90"], a.latency_us["p90"], " us", "{:.1f}")
            if a.latency_us["median"]:
                rows.append(
                    (
                        "  speedup (median)",
                        "",
                        f"{b.latency_us['median'] / a.latency_us['median']:.2f}x",
                        "",
                        "",
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            f"{self._nodes_text()}; max |after - before| over outputs = {self.max_abs_error:.3g}",
            self.library_text(),
        ]
        for r in rows:
            cells = [f"{r[0]:<{widths[0]}}"] + [
                f"{cell:>{width}}" for cell, width in zip(r[1:], widths[1:], strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
        env = self.environment
        note = f" ({self.dims_note})" if self.dims_note else ""
        lines.append(
            f"{self.runs} runs, dims {describe(self.dims)}{note}; onnxruntime {env['onnxruntime']}, "
            f"{env['cpu']}, {env['intra_op_threads']} intra-op threads"
        )
        return "\n".join(lines)


def environment(threads: int) -> dict[str, Any]:
    """Return where the numbers were measured: CPU, threads, library versions, providers."""
    import onnxruntime as ort

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "intra_op_threads": threads,
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "onnx": onnx.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _session(
    model_bytes: bytes,
    provider: str,
    threads: int,
    level: Any,
    *,
    profile: bool = False,
    optimized_path: str | None = None,
    use_library: bool = True,
) -> Any:
    import onnxruntime as ort

    import contrib_ops

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = level
    options.log_severity_level = 4  # errors reach the user through the exception, once
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tempfile.gettempdir(), f"mambafuse_profile_{os.getpid()}")
    if optimized_path:
        options.optimized_model_filepath = optimized_path
    providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
    # The library is registered where the provider can host it (unless --no-library); a model without fused
    # nodes ignores it.
    return contrib_ops.session(
        model_bytes, providers=providers, session_options=options, use_library=None if use_library else False
    )


def _loaded(what: str, provider: str, open_session: Callable[[], Any], bfloat16: bool = False) -> Any:
    """Return ``open_session()``; a model ONNX Runtime cannot load is a ReportError that says why
    (``bfloat16``: the model holds bfloat16 values, which ONNX Runtime's CPU provider cannot run all of)."""
    try:
        return open_session()
    except Exception as error:
        message = first_line(error)
        if provider == "CPUExecutionProvider" and (bfloat16 or "bfloat16" in message):
            raise ReportError(
                f"the {what} model does not load in ONNX Runtime's CPU provider, which has no bfloat16 kernels "
                "for some of its ops; report bfloat16 models on CUDA (--providers CUDAExecutionProvider). "
                f"ONNX Runtime: {message}"
            ) from None
        raise ReportError(f"the {what} model does not load in ONNX Runtime ({provider}): {message}") from None


def profile_kernels(events: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Return the kernel events of each ``model_run`` in a profile, in execution order."""
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    kernels = sorted(
        (e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")),
        key=lambda e: e["ts"],
    )
    grouped: list[list[dict[str, Any]]] = [[] for _ in runs]
    for k in kernels:
        for i, run in enumerate(runs):
            if run["ts"] <= k["ts"] <= run["ts"] + run["dur"]:
                grouped[i].append(k)
                break
    return grouped


def count_partitions(providers_in_order: Iterable[str]) -> int:
    """Return the number of maximal runs of one provider in an execution order."""
    count, previous = 0, None
    for p in providers_in_order:
        if p != previous:
            count, previous = count + 1, p
    return count


class _Runner:
    """One session plus the way it is run: IO binding on GPU providers, plain run() on the CPU."""

    def __init__(self, session: Any, feeds: dict[str, np.ndarray], provider: str) -> None:
        self.session = session
        self.feeds = feeds
        self.outputs = [o.name for o in session.get_outputs()]
        self.binding = None
        if provider in GPU_PROVIDERS:
            import onnxruntime as ort

            device = "cuda" if provider != "ROCMExecutionProvider" else "cuda"
            binding = session.io_binding()
            for name, arr in feeds.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, device, 0))
            for name in self.outputs:
                binding.bind_output(name, device, 0)
            self.binding = binding

    def __call__(self) -> None:
        if self.binding is not None:
            self.binding.synchronize_inputs()
            self.session.run_with_iobinding(self.binding)
            self.binding.synchronize_outputs()
        else:
            self.session.run(self.outputs, self.feeds)

    def results(self) -> list[np.ndarray]:
        return self.session.run(self.outputs, self.feeds)


def _started(session: Any, provider: str, feeds: dict[str, np.ndarray]) -> _Runner:
    """Return a runner of ``session`` on ``feeds`` that has run once."""
    runner = _Runner(session, feeds, provider)
    runner()
    return runner


def _level(name: str) -> Any:
    """Return ONNX Runtime's graph optimization level called ``name``."""
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if name not in levels:
        raise ReportError(f"optimization level must be one of {', '.join(levels)}, got {name!r}")
    return levels[name]


def _rejects(what: str, short: str, error: BaseException, used_dims: dict[str, int]) -> ReportError:
    return ReportError(
        f"the {what} model rejects its inputs on {short} ({first_line(error)}); dims used: "
        f"{describe(used_dims)}; bind its symbolic dims with --dim NAME=SIZE or give real inputs "
        "with --inputs FILE.npz"
    )


def _check_runs_without_library(protos: dict[str, onnx.ModelProto]) -> None:
    """Refuse --no-library for a model whose ai.mambafuse nodes have no model-local function (nothing else runs
    them without the library: a model written with --no-function, or saved by an ONNX Runtime session)."""
    for what, proto in protos.items():
        functions = {(f.domain, f.name) for f in proto.functions}
        missing = sorted(
            {n.op_type for n in proto.graph.node if n.domain == DOMAIN} - {n for d, n in functions if d == DOMAIN}
        )
        if missing:
            raise ReportError(
                f"--no-library: the {what} model's {', '.join(missing)} nodes have no model-local function (written "
                "with --no-function?), so only the library runs them; measure it with the library"
            )


def measure(
    before: onnx.ModelProto | str | os.PathLike[str],
    after: onnx.ModelProto | str | os.PathLike[str],
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    runs: int = 200,
    warmup: int = 20,
    threads: int = 1,
    dims: dict[str, int] | None = None,
    optimization_level: str = "all",
    profile_runs: int = 10,
    inputs: dict[str, np.ndarray] | None = None,
    progress: Progress | None = None,
    library: bool = True,
) -> Report:
    """Return the before/after Report of two models on each provider (see the module docstring).

    ``library=False`` (``--no-library``) registers mambafuse's custom-op library in no session: the fused nodes
    run through their model-local function. Arrays of ``inputs`` that name no input of the models are ignored.
    """
    import onnxruntime as ort

    import contrib_ops

    progress = progress or Progress("report", enabled=False)
    if runs < 1:
        raise ReportError(f"--runs must be >= 1, got {runs}")
    available = ort.get_available_providers()
    for p in providers:
        if p not in available:
            raise ReportError(
                f"provider {p!r} is not available in this onnxruntime (available: {', '.join(available)})"
            )
    level = _level(optimization_level)

    progress.step("loading models")
    paths = {}
    protos = {}
    for what, m in (("before", before), ("after", after)):
        protos[what] = _load(m, what)
        paths[what] = m if not isinstance(m, onnx.ModelProto) else None
    model_bytes = {}
    for what in ("before", "after"):
        # ORT reads external data relative to the model's path: load from the path when there is one.
        if paths[what] is not None:
            model_bytes[what] = str(paths[what])
        else:
            model_bytes[what] = protos[what].SerializeToString()
    inputs_of = {
        what: {v.name for v in proto.graph.input} - {t.name for t in proto.graph.initializer}
        for what, proto in protos.items()
    }
    if inputs_of["before"] != inputs_of["after"]:
        only_before = sorted(inputs_of["before"] - inputs_of["after"])
        only_after = sorted(inputs_of["after"] - inputs_of["before"])
        raise ReportError(
            f"the models have different inputs: only before {only_before}, only after {only_after}; "
            "compare a model with its own fused version"
        )
    if not library:
        _check_runs_without_library(protos)
    try:
        library_path = contrib_ops.library_path() if library else None
    except contrib_ops.LibraryNotFoundError as error:
        raise ReportError(
            f"{first_line(error)}; build it (make build), or measure through the model-local function: --no-library"
        ) from None
    inputs, _ = split_provided(protos["before"], inputs)
    # A prefill graph runs at several chunks by default, at one chunk where the original rejects that
    # (fusion/inputs.py): the first run of the original on the first provider decides the inputs of every run.
    feeds: dict[str, np.ndarray] | None = None
    used_dims: dict[str, int] = {}
    dims_note: str | None = None

    before_nodes, after_nodes = count_nodes(protos["before"]), count_nodes(protos["after"])
    before_ops, after_ops = fused_by_op(protos["before"]), fused_by_op(protos["after"])
    fused_ops = {op_type: count - before_ops.get(op_type, 0) for op_type, count in after_ops.items()}
    fused = sum(fused_ops.values())
    chain_nodes = before_nodes - after_nodes + fused if fused > 0 else 0

    results: dict[str, dict[str, ProviderResult]] = {"before": {}, "after": {}}
    outputs: dict[str, dict[str, list[np.ndarray]]] = {"before": {}, "after": {}}
    for provider in providers:
        short = provider.removesuffix("ExecutionProvider")
        runners = {}
        for what in ("before", "after"):
            progress.step(f"[{short}] {what}: optimizing and profiling")
            res = ProviderResult()
            with tempfile.TemporaryDirectory() as tmp:
                optimized = os.path.join(tmp, "optimized.onnx")
                open_session = functools.partial(
                    _session,
                    model_bytes[what],
                    provider,
                    threads,
                    level,
                    profile=True,
                    optimized_path=optimized,
                    use_library=library,
                )
                session = _loaded(what, provider, open_session, holds_bfloat16(protos[what]))
                opt_model = onnx.load(optimized, load_external_data=False)
                res.optimized_nodes = count_nodes(opt_model)
                res.memcpy_nodes = sum(1 for n in opt_model.graph.node if n.op_type.startswith("Memcpy"))
                # the first run pays one-time costs; it is dropped
                if feeds is None:
                    try:
                        accepted = first_run(
                            protos["before"], dims, inputs, functools.partial(_started, session, provider)
                        )
                    except RejectedRun as rejected:
                        raise _rejects(what, short, rejected.error, rejected.dims) from None
                    runner, feeds, used_dims, dims_note = accepted.result, accepted.feeds, accepted.dims, accepted.note
                else:
                    runner = _Runner(session, feeds, provider)
                    try:
                        runner()
                    except Exception as error:
                        raise _rejects(what, short, error, used_dims) from None
                for _ in range(profile_runs):
                    runner()
                profile_path = session.end_profiling()
                try:
                    events = json.loads(Path(profile_path).read_text())
                finally:
                    Path(profile_path).unlink(missing_ok=True)
            per_run = profile_kernels(events)[1:]
            last = per_run[-1]
            res.kernels_per_run = len(last)
            res.kernel_us_per_run = statistics.median(sum(e["dur"] for e in run) for run in per_run)
            by_op: dict[str, list[float]] = {}
            for run in per_run:
                totals = Counter()
                for e in run:
                    totals[e["args"].get("op_name", "?")] += e["dur"]
                for op, total in totals.items():
                    by_op.setdefault(op, []).append(total)
            res.kernel_us_by_op = {op: statistics.median(v) for op, v in by_op.items()}
            res.kernels_by_provider = dict(Counter(e["args"].get("provider", "?") for e in last))
            res.kernels_by_op = dict(Counter(e["args"].get("op_name", "?") for e in last))
            res.partitions = count_partitions(e["args"].get("provider", "?") for e in last)
            results[what][provider] = res
            runners[what] = _Runner(_session(model_bytes[what], provider, threads, level), feeds, provider)
            outputs[what][provider] = runners[what].results()

        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(warmup):
            runners["before"]()
            runners["after"]()
        for i in range(runs):
            # Interleaved, so that drift (frequency, other load) hits both sides alike.
            for what in ("before", "after") if i % 2 == 0 else ("after", "before"):
                t0 = time.perf_counter()
                runners[what]()
                times[what].append((time.perf_counter() - t0) * 1e6)
            progress.tick(f"[{short}] timing {i + 1}/{runs}")
        for what in ("before", "after"):
            t = sorted(times[what])
            results[what][provider].latency_us = {
                "median": statistics.median(t),
                "p90": t[min(len(t) - 1, int(0.9 * len(t)))],
                "min": t[0],
            }
    progress.done()

    errors: dict[str, float] = {}
    names = [o.name for o in protos["before"].graph.output]
    for provider in providers:
        for name, b, a in zip(names, outputs["before"][provider], outputs["after"][provider], strict=True):
            with np.errstate(invalid="ignore"):
                diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
            worst = float(np.nanmax(diff)) if diff.size else 0.0
            errors[f"{provider}:{name}"] = max(worst, errors.get(f"{provider}:{name}", 0.0))
    return Report(
        before_nodes=before_nodes,
        after_nodes=after_nodes,
        chain_nodes=chain_nodes,
        fused_nodes=fused,
        fused_by_op=fused_ops,
        providers=list(providers),
        before=results["before"],
        after=results["after"],
        max_abs_error=max(errors.values(), default=0.0),
        max_abs_error_by_output=errors,
        runs=runs,
        dims=used_dims,
        environment=environment(threads),
        library=library_path,
        dims_note=dims_note,
    )


def plot(report: Report, path: str | os.PathLike[str]) -> None:
    """Write a PNG with dispatches and median latency, before vs after, per provider."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("--plot needs matplotlib: pip install 'mambafuse[plot]'") from None
    providers = report.providers
    labels = [p.removesuffix("ExecutionProvider") for p in providers]
    x = np.arange(len(providers))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in (
        (axes[0], lambda r: r.kernels_per_run, "kernel dispatches per Run"),
        (axes[1], lambda r: r.latency_us["median"], "latency per Run, median (us)"),
    ):
        b = [key(report.before[p]) for p in providers]
        a = [key(report.after[p]) for p in providers]
        ax.bar(x - 0.2, b, 0.4, label="before", color="#9aa5b1")
        ax.bar(x + 0.2, a, 0.4, label="after (mambafuse)", color="#2f7ed8")
        ax.set_xticks(x, labels)
        ax.set_title(title, fontsize=10)
        for xi, (bv, av) in enumerate(zip(b, a, strict=True)):
            ax.annotate(f"{bv:.0f}" if bv >= 10 else f"{bv:.1f}", (xi - 0.2, bv), ha="center", va="bottom", fontsize=8)
            ax.annotate(f"{av:.0f}" if av >= 10 else f"{av:.1f}", (xi + 0.2, av), ha="center", va="bottom", fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report._fused_text()}; max |error| {report.max_abs_error:.2g}", fontsize=10)
    fig.tight_layout()
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def write_json(report: Report, path: str | os.PathLike[str]) -> None:
    """Write the report's JSON atomically."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    os.replace(tmp, target)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the report's options to a parser (shared with ``fusion.rewrite --report``)."""
    parser.add_argument("--providers", default="CPUExecutionProvider", help="comma-separated execution providers")
    parser.add_argument("--runs", type=int, default=200, help="timed runs per model (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed runs first (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE", help="bind a symbolic dimension")
    parser.add_argument("--inputs", metavar="FILE.npz", help="real model inputs (arrays named by input)")
    parser.add_argument(
        "--optimization-level",
        default="all",
        choices=["disable", "basic", "extended", "all"],
        help="ORT graph optimization level",
    )
    parser.add_argument("--json", dest="json_path", metavar="OUT.json", help="write the report as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG of dispatches and latency (needs matplotlib)")
    parser.add_argument(
        "--no-library",
        action="store_true",
        help="measure without mambafuse's custom-op library: the fused nodes run through their model-local "
        "function (ONNX Runtime inlines its stock-op body), as where mambafuse is not installed",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def check_arguments(
    before: Any, args: argparse.Namespace, notes: list[str] | None = None
) -> tuple[list[str], dict[str, int], dict[str, np.ndarray] | None]:
    """Return (providers, dims, inputs) of the report's arguments, every one checked against ``before``.

    Checked before any measuring (and, behind ``rewrite --report``, before anything is written): the
    numbers, the output paths, the providers (available in this onnxruntime), the ``--dim`` names (the
    model's own, see fusion/inputs.py) and the inputs they make (their size, their element types), and
    that a model holding bfloat16 loads in the CPU provider when it is asked for. Raises ReportError or
    InputError with the reason. The ``--inputs`` arrays that name no input of the model are left out, and
    ``notes`` (when given) gets a line that says which.
    """
    import onnxruntime as ort

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    if not providers:
        raise ReportError("--providers is empty")
    if getattr(args, "threads", 1) < 1:
        raise ReportError(f"--threads must be >= 1, got {args.threads}")
    if getattr(args, "warmup", 0) < 0:
        raise ReportError(f"--warmup must be >= 0, got {args.warmup}")
    if args.runs < 1:
        raise ReportError(f"--runs must be >= 1, got {args.runs}")
    for option, value in (("--json", args.json_path), ("--plot", args.plot)):
        # Checked before minutes of measuring, not after.
        if value and not Path(value).resolve().parent.is_dir():
            raise ReportError(f"{option}: directory {str(Path(value).parent)!r} does not exist")
    available = ort.get_available_providers()
    for p in providers:
        if p not in available:
            raise ReportError(
                f"provider {p!r} is not available in this onnxruntime (available: {', '.join(available)})"
            )
    dims = parse_dims(args.dim)
    proto = _load(before, "before")
    inputs, ignored = split_provided(proto, load_inputs(args.inputs) if getattr(args, "inputs", None) else None)
    if notes is not None and (note := ignored_note(ignored, proto)):
        notes.append(note)
    used = resolve_dims(proto, dims, inputs, strict=True)
    make_inputs(proto, provided=inputs, resolved=used)  # sizes and element types, before any session
    if "CPUExecutionProvider" in providers and holds_bfloat16(proto):
        source = str(before) if not isinstance(before, onnx.ModelProto) else before.SerializeToString()
        _loaded(
            "before",
            "CPUExecutionProvider",
            functools.partial(_session, source, "CPUExecutionProvider", 1, _level("all")),
            bfloat16=True,
        )
    return providers, dims, inputs


def run_from_args(
    before: Any,
    after: Any,
    args: argparse.Namespace,
    print_fn: Callable[[str], None] = print,
    note_fn: Callable[[str], None] | None = None,
) -> Report:
    """Check the arguments, measure, print the table, and write the JSON/PNG the arguments ask for.

    ``note_fn`` gets the notes on the arguments (the ``--inputs`` arrays ignored); default: stderr.
    """
    notes: list[str] = []
    providers, dims, inputs = check_arguments(before, args, notes)
    for note in notes:
        (note_fn or (lambda text: print(f"note: {text}", file=sys.stderr)))(note)
    report = measure(
        before,
        after,
        providers=providers,
        runs=args.runs,
        warmup=args.warmup,
        threads=args.threads,
        dims=dims,
        inputs=inputs,
        optimization_level=args.optimization_level,
        progress=Progress("report", enabled=not args.quiet),
        library=not getattr(args, "no_library", False),
    )
    print_fn(report.table())
    if args.json_path:
        write_json(report, args.json_path)
    if args.plot:
        plot(report, args.plot)
    return report


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, no usage block: bad arguments are reported like every other error.
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m fusion.report") -> int:
    """Run the command line; return the exit status (0 ok, 1 ONNX Runtime failed, 2 bad argument or model)."""
    parser = _Parser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=f"""\
generated inputs:
{INPUTS_HELP}

exit status:
  0    measured and printed
  1    ONNX Runtime failed while measuring (one line: its error)
  2    bad argument or model, or one ONNX Runtime cannot load or feed (bfloat16 on the CPU provider,
       inputs it rejects); every argument is checked before measuring
  141  stdout closed by its reader (| head)

environment:
  {PROGRESS_ENV}=0 never draws the progress line on stderr, =1 always does (default: on a terminal)""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("before", help="the original model")
    parser.add_argument("after", help="the fused model")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run_from_args(
            args.before, args.after, args, note_fn=lambda text: print(f"{prog}: note: {text}", file=sys.stderr)
        )
    except BrokenPipeError:  # `mambafuse report … | head`: the reader left; no error of ours
        return stdout_closed()
    except (ReportError, InputError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prog}: error: out of memory while measuring; choose smaller --dim sizes", file=sys.stderr)
        return 1
    except Exception as exc:  # ORT's own errors: one line, not a traceback
        print(f"{prog}: error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
