"""The decode-step ops on the GPU (issue 28): SelectiveStateUpdate and CausalConv1dUpdate, ours against
mamba_ssm's Triton ``selective_state_update``, ONNX Runtime's ``com.microsoft::LinearAttention``
(update_rule="gated") and ``com.microsoft::CausalConvWithState`` on the CUDA EP, and a device-to-device copy of
the same bytes; real widths (Nemotron-H-8B, and n_groups = 1 models), batch 1 and 8. One process, one GPU.

Two measurements, each applied the same way to every column it compares:

1. Kernel time (ours, Triton, copy): the calls are captured in one CUDA graph (torch.cuda.CUDAGraph) and
   replayed; time per call = replay time / calls, median of 7 replays. L2-cold: the calls rotate through
   enough buffer sets that >= 4 x L2 of other buffers is touched between two uses of a set. Our kernels are
   launched through the self-check launcher (``libmambafuse_cuda_decode_bench.so``, ctypes, on PyTorch's
   capture stream), Triton's through mamba_ssm's Python wrapper (in place, as it is written), the copy is
   the faster of ``dst.copy_(src)`` and ``torch.mul(src, 1, out=dst)`` on state-sized buffers (bytes read +
   written = the kernel's state traffic).
2. Per node inside ONNX Runtime (ours vs ORT's contrib ops): models of K and 2K independent nodes (each node
   its own state buffers, L2-cold for the state update), run with IO binding (torch buffers) and
   ``enable_cuda_graph``; per node = (Run time at 2K - Run time at K) / K, so ORT's per-Run cost cancels.
   ORT's LinearAttention gets its inputs precomputed (q = C and k = B expanded to heads, v = dt * x,
   decay = A * dt), so it does less than ours (no softplus, dB * x or D skip); its state is (B, H, N, P). A third
   row puts a one-token MambaChunkScan with that state layout (what a mobius build's decode step runs after the
   ``linear_attention_scan`` rule; its step kernel) against the same LinearAttention.

    python benchmarks/bench_cuda_decode_ops.py --build build/cuda \
        --mamba-ssm .bench-vendor/mamba_ssm_triton --markdown $OUT/bench_cuda_decode_ops.md

A change to the state-update kernel is measured against the previous build in the same process, every column
in turn for several rounds, medians reported (``--baseline-build build/previous --rounds 7``): a GPU drifts by
a few % between measurements, more than two versions of a kernel may differ. ``--baseline-build`` repeats: a
build configured with ``-DMAMBAFUSE_SSU_TRAFFIC_FLOOR=ON`` (the state update's loads and stores without its
arithmetic) measures what that launch's memory traffic alone costs (a reference, not a proven bound), and
``-DMAMBAFUSE_SSU_TRAFFIC_FLOOR_OMIT=head;bc;x;out`` (any of them) leaves parts of that traffic out, to see what
each costs (the per-head loads, B and C, x, the output store; with every part left out: the state's own).

Needs torch with CUDA and the library built with -DMAMBAFUSE_CUDA=ON -DMAMBAFUSE_CUDA_TOOLS=ON (``--build``);
for the ORT rows onnxruntime-gpu (skipped without a CUDA provider); for the Triton column triton and einops and
a folder holding mamba_ssm's ``ops/triton/selective_state_update.py`` and ``softplus.py`` (its sdist carries
them; benchmark-only, never committed).
"""

# The timing closures below are called inside the loop iteration that defines them (B023 does not apply).
# ruff: noqa: B023

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

try:
    import onnxruntime as ort
except ImportError:  # the kernel-time rows need no ORT
    ort = None

L2_BYTES = 60 * 2**20  # H200; read from the device in main()
ONNX_OF = {
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.float32: onnx.TensorProto.FLOAT,
}
NP_OF = {torch.float16: np.float16, torch.float32: np.float32}
NAME_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Widths:
    name: str
    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_dim: int  # d_inner + 2 * groups * state_size
    kernel: int = 4


MODELS = {
    "nemotron-h-8b": Widths("Nemotron-H-8B", 128, 64, 128, 8, 8192 + 2 * 8 * 128),
    "bamba-9b": Widths("Bamba-9B (G = 1)", 128, 64, 256, 1, 8192 + 2 * 256),
    "zamba2-2.7b": Widths("Zamba2-2.7B (G = 1)", 80, 64, 64, 1, 5120 + 2 * 64),
}


# --- timing -----------------------------------------------------------------------------------------------


def graph_us(fn: Callable[[int], object], sets: int, min_calls: int = 32, repeats: int = 7) -> float:
    """Median time per call, the calls captured in one CUDA graph; call i uses buffer set i % sets."""
    calls = sets * max(1, math.ceil(min_calls / sets))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(sets, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % sets)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def engine_copy_us(src: list[torch.Tensor], dst: list[torch.Tensor], sets: int) -> float:
    """``copy_``: in a graph a memcpy node, run by the copy engines (~2.7 TB/s at some sizes, and no kernel
    launch: at a few MB the fastest copy there is)."""
    return graph_us(lambda i: dst[i].copy_(src[i]), sets)


def kernel_copy_us(src: list[torch.Tensor], dst: list[torch.Tensor], sets: int) -> float:
    """An elementwise copy kernel (``torch.mul(src, 1, out=dst)``, 16-byte vectorized)."""
    return graph_us(lambda i: torch.mul(src[i], 1, out=dst[i]), sets)


def copy_us(src: list[torch.Tensor], dst: list[torch.Tensor], sets: int) -> float:
    """The copy ceiling: the faster of the copy engines and a copy kernel, each measured like the kernels."""
    return min(engine_copy_us(src, dst, sets), kernel_copy_us(src, dst, sets))


def cold_sets(set_bytes: int, cap: int = 4096) -> int:
    """Buffer sets to rotate through so that a set comes back only after >= 4 x L2 of other traffic."""
    return min(cap, max(2, math.ceil(4 * L2_BYTES / max(set_bytes, 1))))


def wall_us(fn: Callable[[], object], iters: int = 60, repeats: int = 5) -> float:
    """Median over repeats of the mean host wall time per call (an ORT Run returns when its work is done)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times)


# --- the implementations ----------------------------------------------------------------------------------


class Ours:
    """The decode-step launchers through ctypes (tools/cuda_decode_bench_launch.cc)."""

    def __init__(self, build: Path) -> None:
        path = build / "cuda" / "libmambafuse_cuda_decode_bench.so"
        if not path.is_file():
            raise SystemExit(f"error: {path} not found (build with -DMAMBAFUSE_CUDA=ON -DMAMBAFUSE_CUDA_TOOLS=ON)")
        lib = ctypes.CDLL(str(path))
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.mambafuse_ssu_launch.argtypes = [p] * 10 + [i, i, i] + [i64] * 5 + [i, p]
        lib.mambafuse_ssu_launch.restype = i
        lib.mambafuse_ssu_describe.argtypes = [i, i] + [i64] * 5 + [ctypes.c_char_p, i64]
        lib.mambafuse_ssu_describe.restype = i
        lib.mambafuse_conv_update_launch.argtypes = [p] * 6 + [i] + [i64] * 5 + [i, p]
        lib.mambafuse_conv_update_launch.restype = i
        self.lib = lib

    @staticmethod
    def _ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    def ssu(self, state, x, dt, dt_bias, A, B, C, D, out, present) -> None:
        batch, heads, head_dim, state_size = state.shape
        rc = self.lib.mambafuse_ssu_launch(
            *(self._ptr(t) for t in (state, x, dt, dt_bias, A, B, C, D, out, present)),
            ONNX_OF[x.dtype],
            ONNX_OF[state.dtype],
            ONNX_OF[D.dtype if D is not None else x.dtype],
            batch,
            heads,
            head_dim,
            state_size,
            B.shape[1],
            1,
            torch.cuda.current_stream().cuda_stream,
        )
        if rc != 0:
            raise RuntimeError(f"mambafuse_ssu_launch returned {rc}")

    def describe(self, t_dtype, s_dtype, batch: int, w: Widths) -> str:
        text = ctypes.create_string_buffer(256)
        self.lib.mambafuse_ssu_describe(
            ONNX_OF[t_dtype], ONNX_OF[s_dtype], batch, w.heads, w.head_dim, w.state_size, w.groups, text, 256
        )
        return text.value.decode()

    def conv(self, x, conv_state, weight, bias, y, present, silu: bool = True) -> None:
        batch, channels, length = x.shape
        rc = self.lib.mambafuse_conv_update_launch(
            *(self._ptr(t) for t in (x, conv_state, weight, bias, y, present)),
            ONNX_OF[x.dtype],
            batch,
            channels,
            length,
            conv_state.shape[2],
            weight.shape[-1],
            int(silu),
            torch.cuda.current_stream().cuda_stream,
        )
        if rc != 0:
            raise RuntimeError(f"mambafuse_conv_update_launch returned {rc}")


def load_triton_ssu(folder: Path | None) -> tuple[Callable | None, str]:
    """mamba_ssm's Triton selective_state_update from its source files alone (no mamba_ssm install)."""
    if folder is None:
        return None, "no --mamba-ssm folder given"
    source = folder / "selective_state_update.py"
    if not source.is_file():
        return None, f"{source} not found"
    try:
        for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):  # bare packages, no __init__ code
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules.setdefault(name, package)
        for name, file in (
            ("mamba_ssm.ops.triton.softplus", "softplus.py"),
            ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update.py"),
        ):
            spec = importlib.util.spec_from_file_location(name, folder / file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        return module.selective_state_update, "mamba_ssm " + folder.name
    except Exception as error:  # noqa: BLE001 - report and go on without the column
        return None, f"import failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


# --- kernel time ------------------------------------------------------------------------------------------


def ssu_buffers(w: Widths, batch: int, t_dtype, s_dtype, sets: int, gen: torch.Generator):
    dev = "cuda"

    def randn(*shape, dtype=t_dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    H, P, N, G = w.heads, w.head_dim, w.state_size, w.groups
    common = {
        "x": randn(batch, H, P),
        "dt": randn(batch, H, scale=0.5) - 2,
        "dt_bias": randn(H, scale=0.5),
        "A": -torch.exp(torch.rand(H, generator=gen, device=dev) * 3 - 1),
        "B": randn(batch, G, N),
        "C": randn(batch, G, N),
        "D": randn(H),
    }
    states = [randn(batch, H, P, N, dtype=s_dtype) for _ in range(sets)]
    presents = [torch.empty_like(s) for s in states]
    return common, states, presents


def ours_ssu(lib: Ours, c: dict[str, torch.Tensor], out: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``lib``'s state update on ``ssu_buffers``' common inputs: call(state, present)."""
    inputs = (c["x"], c["dt"], c["dt_bias"], c["A"], c["B"], c["C"], c["D"], out)
    return lambda state, present: lib.ssu(state, *inputs, present)


def triton_ssu_call(triton_ssu, w: Widths, batch: int, c: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], object]:
    """mamba_ssm's Triton kernel on ``ssu_buffers``' common inputs, as vLLM and transformers call it (dt, dt_bias,
    A and D expanded over the head dim, stride 0), updating ``state`` in place: call(state)."""
    H, P, N = w.heads, w.head_dim, w.state_size
    dt3 = c["dt"][:, :, None].expand(batch, H, P)
    bias2 = c["dt_bias"][:, None].expand(H, P)
    A3 = c["A"][:, None, None].expand(H, P, N)
    D2 = c["D"][:, None].expand(H, P)
    return lambda state: triton_ssu(state, c["x"], dt3, A3, c["B"], c["C"], D=D2, dt_bias=bias2, dt_softplus=True)


def baseline_names(folders: list[Path]) -> dict[str, Path]:
    """A column name for each baseline build: "baseline" for one, else each folder's name (made unique)."""
    if len(folders) == 1:
        return {"baseline": folders[0]}
    names: dict[str, Path] = {}
    for folder in folders:
        name = folder.name or str(folder)
        while name in names or name in ("ours", "copy", "copy engines", "copy kernel", "triton"):
            name += "'"
        names[name] = folder
    return names


def bench_ssu_kernels(
    ours: Ours,
    triton_ssu,
    w: Widths,
    batch: int,
    t_dtype,
    s_dtype,
    gen,
    baselines: dict[str, Ours] | None = None,
    rounds: int = 1,
) -> dict:
    """Ours, the baseline builds' kernels (by name), the copy and Triton on the same buffers; with rounds > 1 they
    are measured in turn, round after round, and each reports its median (a GPU's speed drifts by a few % from
    one measurement to the next, more than two versions of a kernel may differ)."""
    state_bytes = batch * w.heads * w.head_dim * w.state_size * torch.tensor([], dtype=s_dtype).element_size()
    sets = cold_sets(2 * state_bytes)
    common, states, presents = ssu_buffers(w, batch, t_dtype, s_dtype, sets, gen)
    out = torch.empty_like(common["x"])
    c = common

    def kernel(lib: Ours) -> Callable[[int], object]:
        call = ours_ssu(lib, c, out)
        return lambda i: call(states[i], presents[i])

    calls = {"ours": lambda: graph_us(kernel(ours), sets)}
    for name, lib in (baselines or {}).items():
        calls[name] = lambda lib=lib: graph_us(kernel(lib), sets)
    calls["copy engines"] = lambda: engine_copy_us(states, presents, sets)
    calls["copy kernel"] = lambda: kernel_copy_us(states, presents, sets)
    if triton_ssu is not None:
        triton = triton_ssu_call(triton_ssu, w, batch, c)
        calls["triton"] = lambda: graph_us(lambda i: triton(states[i]), sets)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(call())
    row = {name: statistics.median(values) for name, values in times.items()}
    row.update(copy=min(row["copy engines"], row["copy kernel"]), bytes=2 * state_bytes, sets=sets)
    return row


def lane_settings(w: Widths, s_dtype) -> list[int | None]:
    """The vector path's lanes a row to sweep: the launcher's own (None) and half of it where a lane then takes
    two 16-byte chunks (MAMBAFUSE_SSU_LANES)."""
    chunks = w.state_size * torch.tensor([], dtype=s_dtype).element_size() // 16
    own = min(32, 1 << max(0, (chunks - 1).bit_length()))
    return [None] + ([own // 2] if own > 1 and own // 2 * 2 >= chunks else [])


def bench_ssu_rows(ours: Ours, w: Widths, batch: int, t_dtype, s_dtype, gen) -> dict[str, float]:
    """Our kernel at each rows-per-lane setting (MAMBAFUSE_SSU_ROWS), with the per-head chain in every thread or
    shared by the block (MAMBAFUSE_SSU_SHARED_HEAD), and at each lanes-a-row setting of ``lane_settings``
    (MAMBAFUSE_SSU_LANES, the chain as the launcher chooses): the launcher's overrides, fixed at capture."""
    state_bytes = batch * w.heads * w.head_dim * w.state_size * torch.tensor([], dtype=s_dtype).element_size()
    sets = cold_sets(2 * state_bytes)
    c, states, presents = ssu_buffers(w, batch, t_dtype, s_dtype, sets, gen)
    call = ours_ssu(ours, c, torch.empty_like(c["x"]))
    times = {}
    for lanes in lane_settings(w, s_dtype):
        for rows in ("1", "2", "4"):
            for shared in ("0", "1") if lanes is None else (None,):
                settings = {"MAMBAFUSE_SSU_ROWS": rows}
                settings |= {"MAMBAFUSE_SSU_LANES": str(lanes)} if lanes else {}
                settings |= {"MAMBAFUSE_SSU_SHARED_HEAD": shared} if shared else {}
                os.environ.update(settings)
                try:
                    key = f"rows {rows}" + (f", {lanes} lanes" if lanes else "") + (", shared" if shared == "1" else "")
                    times[key] = graph_us(lambda i: call(states[i], presents[i]), sets)
                finally:
                    for name in settings:
                        del os.environ[name]
    return times


def bench_conv_kernels(ours: Ours, w: Widths, batch: int, t_dtype, gen) -> dict:
    C, K = w.conv_dim, w.kernel
    size = torch.tensor([], dtype=t_dtype).element_size()
    traffic = batch * C * (2 * (K - 1) + 2) * size  # state read + written, x read, y written
    sets = cold_sets(traffic)
    x = [torch.randn(batch, C, 1, generator=gen, device="cuda").to(t_dtype) for _ in range(sets)]
    st = [torch.randn(batch, C, K - 1, generator=gen, device="cuda").to(t_dtype) for _ in range(sets)]
    y = [torch.empty_like(v) for v in x]
    pr = [torch.empty_like(v) for v in st]
    weight = torch.randn(C, 1, K, generator=gen, device="cuda").to(t_dtype)
    bias = torch.randn(C, generator=gen, device="cuda").to(t_dtype)
    src = [torch.cat([a.flatten(), b.flatten()]) for a, b in zip(x, st, strict=True)]
    dst = [torch.empty_like(v) for v in src]
    row = {"bytes": traffic, "sets": sets}
    row["ours"] = graph_us(lambda i: ours.conv(x[i], st[i], weight, bias, y[i], pr[i]), sets)
    row["copy"] = copy_us(src, dst, sets)
    return row


# --- per node inside ONNX Runtime ------------------------------------------------------------------------


def model_of(nodes: list, inputs: list, outputs: list) -> bytes:
    graph = oh.make_graph(nodes, "bench", inputs, outputs)
    model = oh.make_model(
        graph,
        opset_imports=[
            oh.make_opsetid("", 18),
            oh.make_opsetid("ai.mambafuse", 1),
            oh.make_opsetid("com.microsoft", 1),
        ],
    )
    model.ir_version = 10  # onnxruntime-gpu 1.31 rejects newer
    return model.SerializeToString()


def vi(name: str, dtype, shape) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, ONNX_OF[dtype], list(shape))


class OrtBench:
    """Models of K independent nodes on the CUDA EP, IO-bound to torch buffers, with ORT's CUDA graph."""

    def __init__(self, library: Path) -> None:
        self.library = library

    def run_us(self, model: bytes, buffers: dict[str, torch.Tensor], with_library: bool) -> float:
        options = ort.SessionOptions()
        if with_library:
            options.register_custom_ops_library(str(self.library))
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        sess = ort.InferenceSession(model, options, providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
        binding = sess.io_binding()
        outputs = {o.name for o in sess.get_outputs()}
        for name, t in buffers.items():
            bind = binding.bind_output if name in outputs else binding.bind_input
            bind(name, "cuda", 0, NP_OF[t.dtype], list(t.shape), t.data_ptr())
        return wall_us(lambda: sess.run_with_iobinding(binding))

    def per_node(self, build: Callable[[int], tuple[bytes, dict]], k: int, with_library: bool) -> float:
        times = []
        for count in (k, 2 * k):
            model, buffers = build(count)
            times.append(self.run_us(model, buffers, with_library))
            del buffers
            torch.cuda.empty_cache()
        return (times[1] - times[0]) / k

    def versus(self, build_ours: Callable, build_theirs: Callable, k: int) -> tuple[float, str]:
        """Ours per node (with the library) and the table's "ORT op us | ORT/ours" cells for ORT's op (a failure of
        ORT's op reported in them, so the other rows still come)."""
        mine = self.per_node(build_ours, k, True)
        try:
            theirs = self.per_node(build_theirs, k, False)
        except Exception as error:  # noqa: BLE001 - report the failure, keep the other rows
            return mine, f"failed: {str(error).splitlines()[0][:120]} | -"
        return mine, f"{theirs:.2f} | {theirs / mine:.2f}x"


def nodes_for(state_bytes: int) -> int:
    """K for the per-node rows: enough nodes that their states (read and written) are 4x the L2 (state updates
    L2-cold), 8 to 64."""
    return max(8, min(64, math.ceil(4 * L2_BYTES / (2 * state_bytes))))


def ssu_ort_models(w: Widths, batch: int, t_dtype, s_dtype, gen):
    """(ours(K), linear_attention(K)) builders: models and their bound buffers."""
    H, P, N, G = w.heads, w.head_dim, w.state_size, w.groups

    def randn(*shape, dtype=t_dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    def ours(k: int):
        shared = {
            "x": randn(batch, H, P),
            "dt": randn(batch, H, scale=0.5) - 2,
            "dt_bias": randn(H, scale=0.5),
            "A": -torch.exp(torch.rand(H, generator=gen, device="cuda") * 3 - 1),
            "B": randn(batch, G, N),
            "C": randn(batch, G, N),
            "D": randn(H),
        }
        buffers = dict(shared)
        nodes, inputs, outputs = [], [vi(n, t.dtype, t.shape) for n, t in shared.items()], []
        for i in range(k):
            buffers[f"state{i}"] = randn(batch, H, P, N, dtype=s_dtype)
            buffers[f"out{i}"] = torch.empty(batch, H, P, dtype=t_dtype, device="cuda")
            buffers[f"present{i}"] = torch.empty(batch, H, P, N, dtype=s_dtype, device="cuda")
            inputs.append(vi(f"state{i}", s_dtype, (batch, H, P, N)))
            outputs += [vi(f"out{i}", t_dtype, (batch, H, P)), vi(f"present{i}", s_dtype, (batch, H, P, N))]
            nodes.append(
                oh.make_node(
                    "SelectiveStateUpdate",
                    [f"state{i}", "x", "dt", "dt_bias", "A", "B", "C", "D"],
                    [f"out{i}", f"present{i}"],
                    domain="ai.mambafuse",
                    dt_softplus=1,
                )
            )
        return model_of(nodes, inputs, outputs), buffers

    def linear_attention(k: int):
        la = s_dtype  # mobius' graphs run LinearAttention in the state's type (float32: every input cast)
        shared = {
            "q": randn(batch, 1, H * N, dtype=la),
            "k": randn(batch, 1, H * N, dtype=la),
            "v": randn(batch, 1, H * P, dtype=la),
            "decay": -torch.rand(batch, 1, H, generator=gen, device="cuda").to(la),
        }
        buffers = dict(shared)
        nodes, inputs, outputs = [], [vi(n, t.dtype, t.shape) for n, t in shared.items()], []
        for i in range(k):
            buffers[f"past{i}"] = randn(batch, H, N, P, dtype=la)
            buffers[f"o{i}"] = torch.empty(batch, 1, H * P, dtype=la, device="cuda")
            buffers[f"present{i}"] = torch.empty(batch, H, N, P, dtype=la, device="cuda")
            inputs.append(vi(f"past{i}", la, (batch, H, N, P)))
            outputs += [vi(f"o{i}", la, (batch, 1, H * P)), vi(f"present{i}", la, (batch, H, N, P))]
            nodes.append(
                oh.make_node(
                    "LinearAttention",
                    ["q", "k", "v", f"past{i}", "decay"],
                    [f"o{i}", f"present{i}"],
                    domain="com.microsoft",
                    update_rule="gated",
                    q_num_heads=H,
                    kv_num_heads=H,
                    scale=1.0,
                )
            )
        return model_of(nodes, inputs, outputs), buffers

    return ours, linear_attention


def chunk_scan_ort_model(w: Widths, batch: int, gen):
    """Builder of K one-token MambaChunkScan nodes as a mobius build's decode step runs them after the scan's rule:
    x, B and C float16, dt, dt_bias, A, D and the state float32, the state (B, H, N, P) (state_layout 1), the
    output float32; each node its own state buffers."""
    H, P, N, G = w.heads, w.head_dim, w.state_size, w.groups

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    def build(k: int):
        shared = {
            "x": randn(batch, 1, H, P, dtype=torch.float16),
            "dt": randn(batch, 1, H, scale=0.5) - 2,
            "dt_bias": randn(H, scale=0.5),
            "A": -torch.exp(torch.rand(H, generator=gen, device="cuda") * 3 - 1),
            "B": randn(batch, 1, G, N, dtype=torch.float16),
            "C": randn(batch, 1, G, N, dtype=torch.float16),
            "D": randn(H),
        }
        buffers = dict(shared)
        nodes, inputs, outputs = [], [vi(n, t.dtype, t.shape) for n, t in shared.items()], []
        for i in range(k):
            buffers[f"state{i}"] = randn(batch, H, N, P)
            buffers[f"out{i}"] = torch.empty(batch, 1, H, P, dtype=torch.float32, device="cuda")
            buffers[f"present{i}"] = torch.empty(batch, H, N, P, dtype=torch.float32, device="cuda")
            inputs.append(vi(f"state{i}", torch.float32, (batch, H, N, P)))
            outputs += [
                vi(f"out{i}", torch.float32, (batch, 1, H, P)),
                vi(f"present{i}", torch.float32, (batch, H, N, P)),
            ]
            nodes.append(
                oh.make_node(
                    "MambaChunkScan",
                    ["x", "dt", "dt_bias", "A", "B", "C", "D", f"state{i}"],
                    [f"out{i}", f"present{i}"],
                    domain="ai.mambafuse",
                    dt_softplus=1,
                    state_layout=1,
                )
            )
        return model_of(nodes, inputs, outputs), buffers

    return build


def conv_ort_models(w: Widths, batch: int, t_dtype, gen):
    C, K = w.conv_dim, w.kernel

    def build(k: int, op: str):
        shared = {
            "x": torch.randn(batch, C, 1, generator=gen, device="cuda").to(t_dtype),
            "weight": torch.randn(C, 1, K, generator=gen, device="cuda").to(t_dtype),
            "bias": torch.randn(C, generator=gen, device="cuda").to(t_dtype),
        }
        buffers = dict(shared)
        nodes, inputs, outputs = [], [vi(n, t.dtype, t.shape) for n, t in shared.items()], []
        for i in range(k):
            buffers[f"state{i}"] = torch.randn(batch, C, K - 1, generator=gen, device="cuda").to(t_dtype)
            buffers[f"y{i}"] = torch.empty(batch, C, 1, dtype=t_dtype, device="cuda")
            buffers[f"present{i}"] = torch.empty(batch, C, K - 1, dtype=t_dtype, device="cuda")
            inputs.append(vi(f"state{i}", t_dtype, (batch, C, K - 1)))
            outputs += [vi(f"y{i}", t_dtype, (batch, C, 1)), vi(f"present{i}", t_dtype, (batch, C, K - 1))]
            if op == "ours":
                nodes.append(
                    oh.make_node(
                        "CausalConv1dUpdate",
                        ["x", f"state{i}", "weight", "bias"],
                        [f"y{i}", f"present{i}"],
                        domain="ai.mambafuse",
                        activation="silu",
                    )
                )
            else:
                nodes.append(
                    oh.make_node(
                        "CausalConvWithState",
                        ["x", "weight", "bias", f"state{i}"],
                        [f"y{i}", f"present{i}"],
                        domain="com.microsoft",
                        activation="silu",
                    )
                )
        return model_of(nodes, inputs, outputs), buffers

    return (lambda k: build(k, "ours")), (lambda k: build(k, "ort"))


# --- report -----------------------------------------------------------------------------------------------


def environment(args) -> list[str]:
    props = torch.cuda.get_device_properties(0)
    lines = [
        f"GPU: {props.name}, {props.multi_processor_count} SMs, "
        f"L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MB, "
        f"{props.total_memory / 2**30:.0f} GiB",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {platform.python_version()}",
    ]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton: not importable")
    lines.append(
        f"onnxruntime {ort.__version__ if ort else 'not importable'}"
        + (f", providers {ort.get_available_providers()}" if ort else "")
    )
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        lines.append(f"nvidia-smi (driver, SM clock, memory clock, max SM clock): {smi.stdout.strip()}")
    except (OSError, subprocess.SubprocessError):
        pass
    lines.append(f"library: {args.build}" + "".join(f"; baseline: {b}" for b in args.baseline_build or []))
    return lines


def main() -> int:
    global L2_BYTES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, required=True, help="CMake build dir (CUDA + tools)")
    parser.add_argument(
        "--mamba-ssm",
        type=Path,
        default=None,
        help="folder with mamba_ssm's ops/triton selective_state_update.py and softplus.py",
    )
    parser.add_argument("--models", default="nemotron-h-8b,bamba-9b,zamba2-2.7b", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--no-ort", action="store_true", help="skip the rows inside ONNX Runtime")
    parser.add_argument(
        "--baseline-build",
        type=Path,
        action="append",
        default=None,
        help="another build dir (e.g. the previous commit's): its state-update kernel measured beside ours; "
        "repeat it for several (each a column, named by its folder)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="state-update kernel rounds, medians (default 1; 5 with a baseline)"
    )
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    L2_BYTES = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", L2_BYTES) or L2_BYTES
    models = [MODELS[m] for m in args.models.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    ours = Ours(args.build)
    baselines = {name: Ours(folder) for name, folder in baseline_names(args.baseline_build or []).items()}
    rounds = args.rounds or (5 if baselines else 1)
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    triton_ssu, triton_note = load_triton_ssu(args.mamba_ssm)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t_start = time.time()
    md: list[str] = ["# Decode-step ops on the GPU (benchmarks/bench_cuda_decode_ops.py)", ""]
    md += [f"- {line}" for line in environment(args)] + [f"- Triton column: {triton_note}", ""]
    print("\n".join(md))

    def emit(lines: list[str]) -> None:
        print("\n".join(lines), flush=True)
        md.extend(lines)

    # 1. SelectiveStateUpdate, kernel time.
    emit(
        [
            "## SelectiveStateUpdate, kernel time (CUDA graph, L2-cold), T = fp16"
            + (f", medians of {rounds} rounds, every column measured in each" if rounds > 1 else ""),
            "",
            "| model | B | state | bytes (R+W) | ours us | ours GB/s | % of copy | copy us | % of copy kernel "
            "| copy kernel us | Triton us | Triton/ours "
            + "".join(f"| {name} us | {name}/ours " for name in baselines)
            + "| our launch |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(baselines) + "---|",
        ]
    )
    for w in models:
        for batch in batches:
            for s_dtype in (torch.float32, torch.float16):
                r = bench_ssu_kernels(ours, triton_ssu, w, batch, torch.float16, s_dtype, gen, baselines, rounds)
                tri = r.get("triton")
                emit(
                    [
                        f"| {w.name} | {batch} | {NAME_OF[s_dtype]} | {r['bytes'] / 1e6:.1f} MB | {r['ours']:.2f} | "
                        f"{r['bytes'] / r['ours'] / 1e3:.0f} | {100 * r['copy'] / r['ours']:.0f} % | {r['copy']:.2f} | "
                        f"{100 * r['copy kernel'] / r['ours']:.0f} % | {r['copy kernel']:.2f} | "
                        + (f"{tri:.2f} | {tri / r['ours']:.2f}x" if tri else "- | -")
                        + "".join(f" | {r[name]:.2f} | {r[name] / r['ours']:.2f}x" for name in baselines)
                        + f" | {ours.describe(torch.float16, s_dtype, batch, w)} |"
                    ]
                )
    emit(
        [
            "",
            "Rows per lane (MAMBAFUSE_SSU_ROWS), the per-head chain per thread or shared (MAMBAFUSE_SSU_SHARED_HEAD)"
            " and, where a lane can take two chunks, half the lanes a row (MAMBAFUSE_SSU_LANES), fp16 x, us per"
            " call, one measurement each (the launcher's own choice in the table above):",
            "",
        ]
    )
    for w in models:
        for s_dtype in (torch.float32, torch.float16):
            for batch in batches:
                times = bench_ssu_rows(ours, w, batch, torch.float16, s_dtype, gen)
                emit(
                    [
                        f"- {w.name}, {NAME_OF[s_dtype]} state, B = {batch}: "
                        + ", ".join(f"{k}: {v:.2f}" for k, v in times.items())
                    ]
                )

    # 2. CausalConv1dUpdate, kernel time.
    emit(
        [
            "",
            "## CausalConv1dUpdate, kernel time (CUDA graph, L2-cold), K = 4, S = K - 1, L = 1",
            "",
            "| model | B | T | channels | bytes | ours us | copy us | % of copy |",
            "|---|---|---|---|---|---|---|---|",
        ]
    )
    for w in models:
        for batch in batches:
            for t_dtype in (torch.float16, torch.float32):
                r = bench_conv_kernels(ours, w, batch, t_dtype, gen)
                emit(
                    [
                        f"| {w.name} | {batch} | {NAME_OF[t_dtype]} | {w.conv_dim} | {r['bytes'] / 1e3:.0f} KB | "
                        f"{r['ours']:.2f} | {r['copy']:.2f} | {100 * r['copy'] / r['ours']:.0f} % |"
                    ]
                )

    # 3. Inside ONNX Runtime: ours vs ORT's contrib ops.
    if args.no_ort or ort is None or "CUDAExecutionProvider" not in ort.get_available_providers():
        emit(["", "ORT rows skipped: " + ("--no-ort" if args.no_ort else "no onnxruntime with the CUDA provider")])
    else:
        bench = OrtBench(args.build / "libmambafuse_ops.so")
        emit(
            [
                "",
                "## Per node inside ONNX Runtime (CUDA EP, IO binding, enable_cuda_graph; (Run(2K) - Run(K)) / K)",
                "",
                "| op | model | B | types | K | ours us | ORT op us | ORT/ours |",
                "|---|---|---|---|---|---|---|---|",
            ]
        )
        for w in models[:2]:
            for batch in batches:
                for s_dtype in (torch.float32, torch.float16):
                    k = nodes_for(batch * w.heads * w.head_dim * w.state_size * (4 if s_dtype == torch.float32 else 2))
                    build_ours, build_la = ssu_ort_models(w, batch, torch.float16, s_dtype, gen)
                    mine, theirs_text = bench.versus(build_ours, build_la, k)
                    emit(
                        [
                            f"| SelectiveStateUpdate vs LinearAttention | {w.name} | {batch} | x fp16, state "
                            f"{NAME_OF[s_dtype]} (LA all {NAME_OF[s_dtype]}) | {k} | {mine:.2f} | {theirs_text} |"
                        ]
                    )
                # The mobius decode step's scan: MambaChunkScan (one token, state_layout 1) where the rule put it,
                # against the LinearAttention it replaced (float32, as mobius runs it); the step kernel's row.
                k = nodes_for(batch * w.heads * w.head_dim * w.state_size * 4)
                build_la = ssu_ort_models(w, batch, torch.float16, torch.float32, gen)[1]
                mine, theirs_text = bench.versus(chunk_scan_ort_model(w, batch, gen), build_la, k)
                emit(
                    [
                        f"| MambaChunkScan (T = 1, state (N, P)) vs LinearAttention | {w.name} | {batch} | x, B, C "
                        f"fp16, the rest fp32 (LA all fp32) | {k} | {mine:.2f} | {theirs_text} |"
                    ]
                )
                mine, theirs_text = bench.versus(*conv_ort_models(w, batch, torch.float16, gen), 32)
                emit(
                    [
                        f"| CausalConv1dUpdate vs CausalConvWithState | {w.name} | {batch} | fp16 | 32 | {mine:.2f} | "
                        f"{theirs_text} |"
                    ]
                )
    emit(["", f"Total time: {time.time() - t_start:.0f} s"])
    if args.markdown:
        args.markdown.write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
