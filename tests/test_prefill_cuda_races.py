"""The scan kernels' synchronization (the chunked half path's and the one-token step's), checked without a GPU: the host
emulation (one std::thread per CUDA thread, contrib_ops/cuda/tools/host_emulation.h, where the block barrier and the
named barriers are std::barrier) built with ThreadSanitizer, which reports two accesses to the same shared-memory byte,
one a write, that no barrier orders: by happens-before, so whatever order they ran in this time. compute-sanitizer's
racecheck on a GPU sees real timing, but it judges some barrier forms these kernels use by its own model
(docs/kernels.md); this is the exact check of the synchronization the source states. A planted race, RegisterStateScan's
helpers writing W into the buffer the state warps are reading, shows that the check sees one.

The emulated kernels run in a subprocess with libtsan preloaded (a ThreadSanitizer library cannot be loaded into an
uninstrumented Python otherwise); ``python -m tests.test_prefill_cuda_races LIBRARY`` is that subprocess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cuda import build_emulation, run_module_under_tsan

REPO = Path(__file__).resolve().parent.parent
SCAN_SOURCE = REPO / "contrib_ops" / "cuda" / "mamba_chunk_scan_impl.cu"
# The helpers' W buffer for the chunk they prepare (chunk c + 1 while the state warps read chunk c's); the planted
# race writes the other one, which the state warps are reading.
HELPERS_W = "\n      float* const wc = ws + (chunk & 1) * kQ * kRsLdw;"
PLANTED_W = "\n      float* const wc = ws + ((chunk + 1) & 1) * kQ * kRsLdw;"
RACE = "WARNING: ThreadSanitizer: data race"


def libtsan() -> str:
    """The path of g++'s ThreadSanitizer runtime; skip where there is none."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip("the host emulation needs g++ (C++20)")
    path = subprocess.run([cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.isfile(path):
        pytest.skip(f"{cxx} has no ThreadSanitizer runtime (libtsan.so)")
    return path


def build(out: Path, source: Path | None = None) -> Path:
    """The emulated prefill library built with -fsanitize=thread (of `source` in place of the scan kernels)."""
    build_emulation("emulate_prefill.sh", out, *([str(source)] if source else []), cxx_flags="-fsanitize=thread -g")
    return out / "libmambafuse_prefill_emulated.so"


def run_under_tsan(library: Path, runtime: str, *cases: str) -> subprocess.CompletedProcess:
    """This module's main on `library` and `cases` (KERNEL:TYPE:N:LENGTH:COPIES) with libtsan preloaded."""
    return run_module_under_tsan("tests.test_prefill_cuda_races", runtime, str(library), *cases)


# Both half-path kernels, both emulated copy orders, both 16-bit types and state sizes; 200 tokens are four chunks,
# so W's two buffers and the three staging slots are each reused.
CASES = [
    f"{kernel}:{t}:{n}:200:{copies}"
    for kernel in ("registers", "shared")
    for copies in ("deferred", "immediate")
    for t in ("float16", "bfloat16")
    for n in (128, 64)
]
# The one-token step kernel with the state (N, P), whose column sums meet in shared memory behind a barrier.
CASES += [f"step:{t}:{n}:1:deferred" for t in ("float16", "bfloat16") for n in (128, 64)]


def test_the_chunked_scan_kernels_have_no_unordered_shared_memory_access(tmp_path: Path) -> None:
    runtime = libtsan()
    result = run_under_tsan(build(tmp_path / "kernels"), runtime, *CASES)
    output = result.stdout + result.stderr
    assert RACE not in output, output[-6000:]
    assert result.returncode == 0, output[-4000:]
    assert f"{len(CASES)} cases within the budget" in result.stdout, output[-4000:]


def test_the_check_sees_a_planted_race(tmp_path: Path) -> None:
    runtime = libtsan()
    source = SCAN_SOURCE.read_text()
    assert source.count(HELPERS_W) == 1, "RegisterStateScan's helpers no longer pick W's buffer as this test expects"
    planted = tmp_path / "mamba_chunk_scan_impl.cu"
    planted.write_text(source.replace(HELPERS_W, PLANTED_W))
    result = run_under_tsan(build(tmp_path / "planted", planted), runtime, "registers:bfloat16:128:200:deferred")
    output = result.stdout + result.stderr
    assert RACE in output, output[-4000:]
    assert "RegisterStateScan" in output[output.index(RACE) :], output[-4000:]


def main(argv: list[str]) -> int:
    """Run the emulated scan on each case (KERNEL:TYPE:N:LENGTH:COPIES; KERNEL registers or shared: the chunked
    kernel's half path with that state; step: the one-token kernel, the state (N, P)) and check it against the
    budget."""
    import ctypes

    import numpy as np

    from tests._decode_step import BFLOAT16, FLOAT, FLOAT16
    from tests.test_mamba_chunk_scan_kernel import make_inputs
    from tests.test_prefill_cuda_emulation import check_scan, declare

    library = declare(ctypes.CDLL(argv[0]))
    types = {"float16": FLOAT16, "bfloat16": BFLOAT16}
    for case in argv[1:]:
        kernel, name, n, length, copies = case.split(":")
        step = kernel == "step"
        os.environ["MAMBAFUSE_CHUNK_SCAN_CUDA_STATE"] = "registers" if step else kernel
        os.environ["MAMBAFUSE_EMU_COPY"] = copies
        rng = np.random.default_rng(int(length) + int(n))
        inputs = make_inputs(
            rng,
            types[name],
            batch=1,
            length=int(length),
            heads=1,
            head_dim=64,
            groups=1,
            state_size=int(n),
            d_type=FLOAT,
            state_type=FLOAT,
        )
        if step:
            inputs["initial_state"] = np.ascontiguousarray(inputs["initial_state"].transpose(0, 1, 3, 2))
        check_scan(library, inputs, path=3 if step else 1, state_layout=1 if step else 0)
    print(f"{len(argv) - 1} cases within the budget", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
