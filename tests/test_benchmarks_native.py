"""The native benchmark programs under benchmarks/ build warning-free and run (they measure; nothing here
asserts a timing)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_kernel_isa import _cpu_flags

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_pipe_floor_builds_and_reports(tmp_path: Path) -> None:
    program = tmp_path / "pipe_floor"
    subprocess.run(
        [
            "g++",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-mavx512f",
            "-mavx512dq",
            str(ROOT / "benchmarks/pipe_floor.cc"),
            "-o",
            str(program),
        ],
        check=True,
    )
    if not {"avx512f", "avx512dq"} <= _cpu_flags():
        pytest.skip("built; running it needs AVX-512 (F and DQ) on this CPU")
    out = subprocess.run([str(program), "2000"], check=True, capture_output=True, text=True).stdout
    floors = [float(x) for x in re.findall(r"row >= ([0-9.]+) us", out)]
    assert len(floors) == 2 and all(f > 0 for f in floors), out
