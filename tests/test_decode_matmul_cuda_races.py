"""The int4 bulk-copy GEMV's synchronization, checked without a GPU: the host emulation (one std::thread per CUDA
thread; contrib_ops/cuda/tools/host_gemv_ptx.h's mbarriers, whose arrivals, waits and copy landings take one lock, so
they order what they order on the GPU) built with ThreadSanitizer, which reports two accesses to the same byte, one a
write, that nothing orders: a stage's bytes landing while a compute warp still reads the tile before them, the group
sums' slots written while warp 0 reads them; with the copies landing at their wait and where they are asked for. A
planted race, the compute warps giving a stage back before they have read it (with the copies landing where they are
asked for, so the next tile's bytes overwrite the stage while it is read), shows that the check sees one.

The emulated kernels run in a subprocess with libtsan preloaded (a ThreadSanitizer library cannot be loaded into an
uninstrumented Python otherwise); ``python -m tests.test_decode_matmul_cuda_races LIBRARY`` is that subprocess.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cuda import build_emulation, run_module_under_tsan
from tests.test_prefill_cuda_races import RACE, libtsan

REPO = Path(__file__).resolve().parent.parent
NBITS_SOURCE = REPO / "contrib_ops" / "cuda" / "decode_matmul_nbits_impl.cu"
# A compute warp's wait for its tile, and its release of the stage once every lane is done with it; the planted race
# releases the stage right after the wait, before the tile is read.
WAIT = "    WaitParity(SharedAddress(&full[stage]), (j / kBulkStages) & 1);\n"
RELEASE = "    if (lane == 0) MbarrierArrive(SharedAddress(&empty[stage]));\n"
# (T, M, K, N, block size, zero points), on an emulated device of one multiprocessor (4 blocks): one group of three
# tiles (a stage reused within a group), and 24 groups of one tile, 3 a lane (stages and sums slots reused).
CASES = [
    (10, 1, 12288, 16, 32, 1),
    (16, 3, 4096, 384, 128, 0),
]


def build(out: Path, source: Path | None = None, defines: str = "") -> Path:
    """The emulated GEMV library built with -fsanitize=thread (of `source` in place of the int4 kernels, with the
    preprocessor `defines`)."""
    build_emulation(
        "emulate_gemv.sh", out, *([str(source)] if source else []), cxx_flags=f"-fsanitize=thread -g {defines}"
    )
    return out / "libmambafuse_gemv_emulated.so"


def run_under_tsan(library: Path, runtime: str, copies: str) -> subprocess.CompletedProcess:
    """This module's main on `library` with libtsan preloaded, on an emulated device of one multiprocessor, the bulk
    copies landing at their wait ("deferred") or where they are asked for ("immediate")."""
    return run_module_under_tsan(
        "tests.test_decode_matmul_cuda_races",
        runtime,
        str(library),
        MAMBAFUSE_EMU_COPY=copies,
        MAMBAFUSE_EMU_SMS="1",
        MAMBAFUSE_NBITS_KERNEL="",  # the launcher's own choice (anything but "mma")
        OPENBLAS_NUM_THREADS="1",  # the float64 reference's BLAS threads are not instrumented
    )


def assert_race_free(result: subprocess.CompletedProcess) -> None:
    output = result.stdout + result.stderr
    assert RACE not in output, output[-6000:]
    assert result.returncode == 0, output[-4000:]
    assert f"{len(CASES)} cases within the budget" in result.stdout, output[-4000:]


@pytest.mark.parametrize("copies", ["deferred", "immediate"])
def test_the_bulk_kernel_has_no_unordered_access(tmp_path: Path, copies: str) -> None:
    runtime = libtsan()
    assert_race_free(run_under_tsan(build(tmp_path / "kernels"), runtime, copies))


def test_staged_zero_points_have_no_unordered_access(tmp_path: Path) -> None:
    """-DMAMBAFUSE_NBITS_STAGED_ZEROS=1: the producer warp's plain stores of a tile's zero points into a stage come
    after the compute warps' reads of the stage's previous tile (its wait on the stage's "empty" mbarrier) and before
    their reads of this tile (its arrival on "full"); the first case reuses a stage within a group."""
    library = build(tmp_path / "kernels", defines="-DMAMBAFUSE_NBITS_STAGED_ZEROS=1")
    assert_race_free(run_under_tsan(library, libtsan(), "immediate"))


def test_a_stage_given_back_before_it_is_read_is_reported(tmp_path: Path) -> None:
    runtime = libtsan()
    source = NBITS_SOURCE.read_text()
    assert source.count(WAIT) == 1 and source.count(RELEASE) == 1, "the kernel's wait or its release moved"
    planted = tmp_path / "early_release.cu"
    planted.write_text(source.replace(RELEASE, "").replace(WAIT, WAIT + RELEASE))
    result = run_under_tsan(build(tmp_path / "planted", planted), runtime, "immediate")
    assert RACE in result.stdout + result.stderr, (result.stdout + result.stderr)[-4000:]


def main(library: str) -> int:
    """Run CASES on the emulated library at `library`; print how many were within the budget."""
    import numpy as np

    from fusion.reference._bounds import bfloat16
    from tests._int4 import declare, run_gemv

    lib = declare(ctypes.CDLL(library))
    good = 0
    for type_id, m, k, n, block_size, zero_points in CASES:
        t = np.dtype(np.float16) if type_id == 10 else bfloat16
        try:
            run_gemv(lib, t, m, k, n, block_size, bool(zero_points), [type_id, m, k, n])
            good += 1
        except AssertionError as failure:
            print(failure)
    print(f"{good} cases within the budget")
    return 0 if good == len(CASES) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
