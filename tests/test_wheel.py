"""The package as users get it: ``python -m build`` makes an sdist and a wheel, and the wheel works installed.

``python -m build`` (no isolation: the build backend comes from the test environment) builds the sdist and
then the wheel *from the unpacked sdist*, in a fresh build directory: the C++ library is compiled from what
the sdist ships, so a source file missing from it fails here. The wheel is installed with ``--no-deps``
into a fresh virtualenv, run from a directory outside the repository.

Its dependencies (onnxruntime, onnx, onnxscript, ... ~100 MB) are not reinstalled: a ``.pth`` line puts
the test environment's site-packages on the fresh venv's path *after* its own. A directory named in a
``.pth`` file is appended to ``sys.path`` without its own ``.pth`` files being run, so the editable
install's import hook of the test environment stays off; and the test asserts that every mambafuse module,
the custom-op library, the console script and the package metadata come from the fresh venv, so a
leftover of the source tree or the editable install cannot make it pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FIXTURE = ROOT / "tests" / "fixtures" / "models" / "nemotron_h-dynamo-fp32-prefill.onnx"
LIBRARY_NAME = "libmambafuse_ops.so"


def _run(args: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, args))} exited {result.returncode}:\n{(result.stdout + result.stderr)[-4000:]}"
        )
    return result


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAMBAFUSE_LIBRARY", "PYTHONHOME")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the sdist and, from it, the wheel once; return the directory holding both."""
    out = tmp_path_factory.mktemp("dist")
    env = _clean_env()
    # The ONNX Runtime headers the editable build already fetched (Debian's libonnxruntime-dev), when
    # there: the wheel build then needs no second download. Without them CMake fetches its own copy.
    cached = next(iter(sorted((ROOT / "build").glob("*/_deps/ort-headers/include"))), None)
    if cached is not None and "ONNXRUNTIME_ROOT" not in env:
        env["ONNXRUNTIME_ROOT"] = str(cached.parent)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], env=env, timeout=1800)
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return a fresh virtualenv with the wheel installed (--no-deps; dependencies visible, see above)."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", path])
    (wheel,) = dist.glob("mambafuse-*.whl")
    _run([sys.executable, "-m", "pip", "--python", path / "bin" / "python", "install", "--no-deps", "-q", wheel])
    site = Path(
        _run([path / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    )
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return path


def test_sdist_and_wheel_contents(dist: Path) -> None:
    version = PROJECT["version"]
    (sdist,) = dist.glob("mambafuse-*.tar.gz")
    (wheel,) = dist.glob("mambafuse-*.whl")
    assert sdist.name == f"mambafuse-{version}.tar.gz"
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ("pyproject.toml", "README.md", "contrib_ops/CMakeLists.txt", "docs/op.md", "docs/forms.md"):
        assert needed in names, f"{needed} missing from the sdist"
    assert not any(name.startswith((".venv/", "build/")) for name in names)

    with zipfile.ZipFile(wheel) as archive:
        files = set(archive.namelist())
        metadata = archive.read(f"mambafuse-{version}.dist-info/METADATA").decode()
        entry_points = archive.read(f"mambafuse-{version}.dist-info/entry_points.txt").decode()
    assert f"contrib_ops/{LIBRARY_NAME}" in files  # the compiled library is inside the package
    assert {
        "fusion/rewrite.py",
        "fusion/report.py",
        "fusion/cli.py",
        "fusion/olive/__init__.py",
        "fusion/olive/__main__.py",
        "fusion/rules/registry.py",
        "fusion/shapes/dims.py",
        "contrib_ops/__init__.py",
    } <= files
    assert not any(name.endswith((".cc", ".h", ".cu", ".cuh", "CMakeLists.txt")) for name in files)
    # the model-building tooling stays in the repository: the wheel claims no generic top-level name but its own
    top_level = {name.split("/", 1)[0] for name in files if "/" in name and ".dist-info/" not in name}
    assert top_level == {"fusion", "contrib_ops"}, top_level
    assert "mambafuse = fusion.cli:main" in entry_points
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for dependency in PROJECT["dependencies"]:
        assert any(r.replace(" ", "") == dependency.replace(" ", "") for r in requires), f"{dependency} not required"
    assert any("olive-ai" in r and 'extra == "olive"' in r for r in requires)


def test_installed_wheel_uses_its_own_files(venv: Path, tmp_path: Path) -> None:
    code = (
        "import json, importlib.metadata as md, contrib_ops, fusion, fusion.rewrite, fusion.rules\n"
        "print(json.dumps({'modules': [contrib_ops.__file__, fusion.__file__, fusion.rewrite.__file__,"
        " fusion.rules.__file__], 'library': contrib_ops.library_path(),"
        " 'dist': str(md.distribution('mambafuse')._path), 'version': md.version('mambafuse')}))\n"
    )
    result = _run([venv / "bin" / "python", "-c", code], cwd=tmp_path, env=_clean_env())
    found = json.loads(result.stdout)
    site = str(venv)
    for path in [*found["modules"], found["library"], found["dist"]]:
        assert path.startswith(site), f"{path} is not from the installed wheel in {site}"
    assert found["library"].endswith(f"contrib_ops/{LIBRARY_NAME}")
    assert found["version"] == PROJECT["version"]


def test_installed_console_command_fuses_and_runs_a_model(venv: Path, tmp_path: Path) -> None:
    env = _clean_env()
    mambafuse = venv / "bin" / "mambafuse"
    version = _run([mambafuse, "--version"], cwd=tmp_path, env=env).stdout.splitlines()
    assert version[0] == f"mambafuse {PROJECT['version']}"
    assert version[1].startswith(f"custom-op library: {venv}")

    model = tmp_path / "model.onnx"
    shutil.copy(FIXTURE, model)
    result = _run([mambafuse, "rewrite", model, "--verify"], cwd=tmp_path, env=env)
    assert "fused: 2, refused: 0" in result.stdout
    assert "verify (mambafuse library): PASS" in result.stdout
    assert (tmp_path / "model.fused.onnx").is_file()

    # The same through the module entry point, and the fused model run with the wheel's kernel.
    _run([venv / "bin" / "python", "-m", "fusion.rewrite", model, "-o", tmp_path / "again.onnx"], cwd=tmp_path, env=env)
    code = (
        "import numpy as np, onnx, contrib_ops, onnxruntime as ort\n"
        "from fusion.reference import DOMAIN\n"
        # this prefill's two Mamba layers (gated norms, chunked scans and prompt convs) and its MLP layer's squared
        # ReLU, all run by the wheel's kernels
        "fused_ops = sorted(n.op_type for n in onnx.load('again.onnx').graph.node if n.domain == DOMAIN)\n"
        "mamba = ['CausalConv1d', 'GatedGroupRMSNorm', 'MambaChunkScan'] * 2\n"
        "assert fused_ops == sorted([*mamba, 'SquaredRelu']), fused_ops\n"
        "feeds = {'input_ids': np.arange(8, dtype=np.int64)[None] % 64}\n"
        "original = ort.InferenceSession('model.onnx', providers=['CPUExecutionProvider']).run(None, feeds)[0]\n"
        "fused = contrib_ops.session('again.onnx').run(None, feeds)[0]\n"  # the wheel's kernel
        "print(float(np.max(np.abs(fused - original)) / np.max(np.abs(original))))\n"
    )
    relative = float(_run([venv / "bin" / "python", "-c", code], cwd=tmp_path, env=env).stdout)
    assert relative <= 1e-5, f"fused vs original logits: {relative:.3g} of the logit scale"
