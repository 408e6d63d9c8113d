"""MambaChunkScan's chunked CUDA kernels on the GPU against the op's float64 budget, without ONNX Runtime: launched
through libmambafuse_cuda_prefill_bench.so on PyTorch's buffers, the inputs from the test suite's make_inputs (numpy,
seeded), the outputs checked with fusion.reference.mamba_chunk_scan.budget_report. Both kernels of the models' widths
(P = 64, N = 128 or 64; float16 and bfloat16): the state in registers (the default) and in shared memory
(MAMBAFUSE_CHUNK_SCAN_CUDA_STATE=shared), which must also agree within 1e-4; then a mobius build's form (a float
time step with 16-bit x, B and C, the states (B, H, N, P): state_layout 1); one-token prompts also through the step
kernel. For a GPU session where the onnxruntime-gpu suites (tests/test_mamba_chunk_scan_cuda.py) cannot run; they
remain the suites of record.

    python3 contrib_ops/cuda/tools/scan_budget_gpu.py <libmambafuse_cuda_prefill_bench.so>
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from fusion.reference.mamba_chunk_scan import budget_report  # noqa: E402
from tests.test_mamba_chunk_scan_kernel import make_inputs  # noqa: E402

ONNX_TYPE = {np.dtype(np.float32): 1, np.dtype(np.float16): 10}


def onnx_type(array: np.ndarray) -> int:
    return ONNX_TYPE.get(array.dtype, 16)  # ml_dtypes' bfloat16


def to_torch(array: np.ndarray | None) -> torch.Tensor | None:
    if array is None:
        return None
    if array.dtype in ONNX_TYPE:
        return torch.from_numpy(np.ascontiguousarray(array)).cuda()
    bits = np.ascontiguousarray(array).view(np.uint16).astype(np.int32) << 16  # bfloat16 → float32, exact
    return torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).cuda()


def run(launch, inputs: dict, kernel: str, state_layout: int = 0, path: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One launch on the chunked path (1) with ``kernel``'s state, or the one-token step kernel (3)."""
    os.environ["MAMBAFUSE_CHUNK_SCAN_CUDA_STATE"] = kernel
    batch, length, heads, head_dim = inputs["x"].shape
    groups, n = inputs["B"].shape[2:]
    dev = {k: to_torch(v) for k, v in inputs.items()}
    out = torch.full((batch, length, heads, head_dim), float("nan"), device="cuda")
    state_dims = (n, head_dim) if state_layout == 1 else (head_dim, n)
    state = torch.full((batch, heads, *state_dims), float("nan"), device="cuda")
    d, init = inputs["D"], inputs["initial_state"]

    def ptr(v):
        return None if v is None else v.data_ptr()

    rc = launch(
        *(ptr(dev[k]) for k in ("x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state")), out.data_ptr(),
        state.data_ptr(), onnx_type(inputs["x"]), onnx_type(inputs["dt"]), 1 if d is None else onnx_type(d),
        1 if init is None else onnx_type(init), batch, length, heads, head_dim, groups, n, 1, 0.0, float("inf"),
        state_layout, path, torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip
    torch.cuda.synchronize()
    if rc != 0:
        raise RuntimeError(f"launch returned {rc}")
    return out.cpu().numpy(), state.cpu().numpy()


def main() -> int:
    lib = ctypes.CDLL(sys.argv[1])
    launch = lib.mambafuse_chunk_scan_launch_layout
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    launch.argtypes = [p] * 10 + [ctypes.c_int] * 4 + [i64] * 6 + [ctypes.c_int, ctypes.c_float, ctypes.c_float]
    launch.argtypes += [ctypes.c_int, ctypes.c_int, p]
    import ml_dtypes  # noqa: PLC0415

    types = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
    failures = cases = 0
    plain = itertools.product(types, (128, 64), (1, 2, 63, 64, 65, 129, 300, 1000), ("f32", "T", "none"), (False,))
    mobius = itertools.product(types, (128, 64), (1, 65, 300), ("f32", "T"), (True,))
    for t, n, length, extras, as_mobius in itertools.chain(mobius, plain):  # the mobius form first
        kind = {"f32": np.float32, "T": t, "none": None}[extras]
        rng = np.random.default_rng(length + n)
        inputs = make_inputs(
            rng, t, batch=2, length=length, heads=4, head_dim=64, groups=2, state_size=n, d_type=kind, state_type=kind
        )
        layout = 0
        if as_mobius:  # a float time step, the states (B, H, N, P)
            inputs["dt"] = (rng.standard_normal(inputs["dt"].shape) - 1).astype(np.float32)
            inputs["dt_bias"] = rng.standard_normal(inputs["dt_bias"].shape).astype(np.float32)
            inputs["initial_state"] = np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2))
            layout = 1
        results = {k: run(launch, inputs, k, layout) for k in ("shared", "registers")}
        checked = dict(results)
        if length == 1:  # the one-token step kernel too (the default for one token)
            checked["step"] = run(launch, inputs, "registers", layout, path=3)
        for k, (out, state) in checked.items():
            ok, summary = budget_report(out, state, **inputs, state_layout=layout)
            cases += 1
            if not ok:
                failures += 1
                print(f"FAIL {k} {t} N={n} T={length} {extras} mobius={as_mobius}: {summary}")
        for a, b in zip(results["registers"], results["shared"], strict=True):
            if not np.allclose(a, b, rtol=1e-4, atol=1e-4):
                failures += 1
                worst = np.abs(a - b).max()
                print(f"FAIL registers vs shared {t} N={n} T={length} {extras} mobius={as_mobius}: {worst:.3g}")
    print(f"{cases} kernel runs within the budget: {cases - failures} of {cases}; failures {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
