"""The CPU kernel suite on every instruction-set variant this machine can run, not only the widest.

The library picks its variant once per process, so each variant runs the CPU kernel suites in a
child process with MAMBAFUSE_CPU_ISA set. The baseline (SSE2 on x86-64, NEON on Arm) is what a user
without AVX2 gets.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import contrib_ops

REPO = Path(__file__).resolve().parents[1]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


VARIANTS = {
    "baseline": set(),
    "avx2": {"avx2", "fma", "f16c", "bmi2"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
}
EXPECTED_NAME = {"avx2": "avx2", "avx512": "avx512"}
#: The CPU kernel tests of every op of the library.
KERNEL_SUITES = (
    "tests/test_kernel_cpu.py",
    "tests/test_causal_conv1d_update_kernel.py",
    "tests/test_selective_state_update_kernel.py",
    "tests/test_mamba_chunk_scan_kernel.py",
    "tests/test_causal_conv1d_kernel.py",
    "tests/test_squared_relu_kernel.py",
)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_suite_on_variant(variant: str) -> None:
    flags = _cpu_flags()
    is_x86 = "sse2" in flags
    if variant != "baseline" and not is_x86:
        pytest.skip(f"{variant} is an x86-64 variant; this CPU is not x86-64")
    if not VARIANTS[variant] <= flags:
        pytest.skip(f"this CPU lacks {sorted(VARIANTS[variant] - flags)} for the {variant} variant")
    env = dict(os.environ, MAMBAFUSE_CPU_ISA=variant, MAMBAFUSE_LIBRARY=contrib_ops.library_path())
    probe = subprocess.run(
        [sys.executable, "-c", "import contrib_ops; print(contrib_ops.cpu_isa())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    selected = probe.stdout.strip()
    assert selected == EXPECTED_NAME.get(variant, selected), f"asked for {variant}, the library runs {selected}"
    if variant == "baseline":
        assert selected in {"sse2", "neon", "generic"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_SUITES],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, f"kernel suite failed on {selected}:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
