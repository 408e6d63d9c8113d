"""DecodeMatMulNBits' CUDA kernels' logic without a GPU: the int4 GEMVs (the SM 90 bulk-copy kernel, the register-load
kernel, the float32 one) and the M > 8 dequantization built for the host emulation (contrib_ops/cuda/tools/
emulate_gemv.sh: g++ and the CUDA headers, no nvcc run; one std::thread per CUDA thread, mma.sync computed from every
lane's operands by its fragment layout, the bulk kernel's mbarriers and bulk copies in host_gemv_ptx.h), checked
against fusion/reference/decode_matmul.py's budget as tests/test_decode_matmul_cuda.py checks the real kernels.

What this catches: the nibble, zero-point and scale indexing, the lanes' and blocks' shares of the groups (the device
is made two multiprocessors, so a few blocks share many groups and a lane can have none), tiles past K and rows past
N, the stages' reuse, a read of a stage before its tile is waited for (a bulk copy lands only when a thread waits on
its mbarrier, and shared memory starts as NaN), the sums' meeting, the launcher's choice of kernel. What it cannot:
timing, the memory model (racecheck on a GPU), bank conflicts.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fusion.reference.decode_matmul import blocks_of, dequantize
from tests._cuda import ONNX_TYPE, TOOLS, build_emulation, emulated_library, host_pointer
from tests._decode_step import BFLOAT16, DTYPE_IDS, FLOAT, FLOAT16
from tests._int4 import declare, int4_weight, run_gemv

HALVES = (FLOAT16, BFLOAT16)
BULK_THREADS = 2 * 9 * 32  # two lanes of 8 compute warps and a producer warp
MMA_THREADS = 256


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("gemv_emulated")
    return declare(emulated_library("emulate_gemv.sh", "libmambafuse_gemv_emulated.so", out))


@pytest.fixture(scope="module")
def emulated_staged_zeros(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The kernels built with -DMAMBAFUSE_NBITS_STAGED_ZEROS=1: the bulk kernel's producer warp writes each tile's
    biased zero points into the stage, and its compute warps read them there."""
    out = tmp_path_factory.mktemp("gemv_emulated_staged_zeros")
    flags = "-DMAMBAFUSE_NBITS_STAGED_ZEROS=1"
    return declare(emulated_library("emulate_gemv.sh", "libmambafuse_gemv_emulated.so", out, cxx_flags=flags))


@pytest.fixture(autouse=True)
def two_multiprocessors(monkeypatch: pytest.MonkeyPatch) -> None:
    """An emulated device of two multiprocessors (4 blocks each): a grid of at most 8 blocks, so that a few blocks
    share out many groups of 16 columns."""
    monkeypatch.setenv("MAMBAFUSE_EMU_SMS", "2")
    monkeypatch.delenv("MAMBAFUSE_NBITS_KERNEL", raising=False)


@pytest.mark.parametrize("t", HALVES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("zero_points", [False, True], ids=["no-zp", "zp"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(
    ("k", "n"),
    [(5110, 40), (8192, 520)],
    ids=["padded-K-rows-past-N", "shared-groups"],
)
def test_bulk_kernel(emulated, t, zero_points, block_size, m, k, n):
    """The bulk-copy kernel (what SM 90 runs where every tile's rows are whole 16-byte pieces): K = 5110 (a second
    tile of 1024 k, the last block padded past K, A read without 16-byte loads) and a partial group of 8 rows over
    three blocks (their second lanes idle), or 33 groups over 8 blocks of two lanes, 2 or 3 groups a lane, each group
    two full tiles (each stage and sums slot reused)."""
    seed = [HALVES.index(t), int(zero_points), block_size, m, k, n]
    assert run_gemv(emulated, t, m, k, n, block_size, zero_points, seed) == BULK_THREADS


@pytest.mark.parametrize("t", HALVES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("zero_points", [False, True], ids=["no-zp", "zp"])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize(("k", "n"), [(5110, 40), (8192, 520)], ids=["padded-K-rows-past-N", "shared-groups"])
def test_bulk_kernel_with_staged_zero_points(emulated_staged_zeros, t, zero_points, block_size, m, k, n):
    """The bulk kernel with the zero points staged by its producer warp (rows past N, a tile of 1024 k, stages and
    groups reused), with zero points and without (the stage's layout grows either way)."""
    seed = [HALVES.index(t), int(zero_points), block_size, m, k, n, 5]
    assert run_gemv(emulated_staged_zeros, t, m, k, n, block_size, zero_points, seed) == BULK_THREADS


@pytest.mark.parametrize("t", HALVES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("zero_points", [False, True], ids=["no-zp", "zp"])
@pytest.mark.parametrize(("k", "n", "block_size"), [(4352, 40, 32), (100, 37, 16), (520, 24, 128)])
@pytest.mark.parametrize("m", [1, 8])
def test_register_load_kernel(emulated, monkeypatch, t, zero_points, k, n, block_size, m):
    """The register-load kernel: chosen with MAMBAFUSE_NBITS_KERNEL=mma on a bulk layout, and by the launcher where
    the rows are not whole 16-byte pieces (an odd number of 16-k blocks) or a block is not whole in K."""
    if k == 4352:
        monkeypatch.setenv("MAMBAFUSE_NBITS_KERNEL", "mma")
    seed = [HALVES.index(t), int(zero_points), k, n, block_size, m, 1]
    assert run_gemv(emulated, t, m, k, n, block_size, zero_points, seed) == MMA_THREADS


@pytest.mark.parametrize("zero_points", [False, True], ids=["no-zp", "zp"])
@pytest.mark.parametrize("m", [1, 3])
def test_float32_kernel(emulated, zero_points, m):
    run_gemv(emulated, FLOAT, m, 100, 37, 32, zero_points, [int(zero_points), m, 2])


@pytest.mark.parametrize("t", (FLOAT, FLOAT16, BFLOAT16), ids=DTYPE_IDS.get)
@pytest.mark.parametrize("zero_points", [False, True], ids=["no-zp", "zp"])
@pytest.mark.parametrize(("k", "n", "block_size"), [(100, 37, 16), (4352, 5, 32), (300, 3, 128)])
def test_dequantization(emulated, t, zero_points, k, n, block_size):
    """The M > 8 path's W (N rows of K padded to whole blocks) equals (q - zp) * scale rounded once to T, bit for
    bit, padding included."""
    rng = np.random.default_rng([int(zero_points), k, n, block_size, 3])
    b, scales, zp = int4_weight(rng, k, n, block_size, t, zero_points)
    k_pad = blocks_of(k, block_size) * block_size
    w = np.full((n, k_pad), np.nan, dtype=t)
    status = emulated.mambafuse_dequantize_int4_launch(
        ONNX_TYPE[np.dtype(t)], k, n, block_size, host_pointer(b), host_pointer(scales), host_pointer(zp),
        host_pointer(w), None,
    )  # fmt: skip
    assert status == 0
    expected = dequantize(b, scales, zp, k=k_pad, n=n, block_size=block_size).T.astype(t)
    bits = np.uint32 if t == FLOAT else np.uint16
    np.testing.assert_array_equal(w.view(bits), expected.view(bits))


def test_a_stage_read_before_its_wait_shows(tmp_path):
    """The emulation's own check: a variant of the kernel whose compute warps read a stage before waiting on its
    tile fails (NaN from the fill, or the previous tile), so a pass above means the waits are where they must be."""
    source = (TOOLS.parent / "decode_matmul_nbits_impl.cu").read_text()
    wait = "    WaitParity(SharedAddress(&full[stage]), (j / kBulkStages) & 1);\n"
    done = "    __syncwarp();  // every lane is done with the stage\n"
    assert source.count(wait) == 1 and source.count(done) == 1, "the kernel's wait or its release moved"
    variant = tmp_path / "late_wait.cu"
    variant.write_text(source.replace(wait, "").replace(done, wait + done))
    build_emulation("emulate_gemv.sh", tmp_path / "out", str(variant))
    lib = declare(ctypes.CDLL(str(tmp_path / "out" / "libmambafuse_gemv_emulated.so")))
    with pytest.raises(AssertionError, match="outside the budget"):
        run_gemv(lib, FLOAT16, 1, 4352, 40, 32, False, [4])
