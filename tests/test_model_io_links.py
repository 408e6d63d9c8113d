"""External data reached through symbolic links: read where ONNX Runtime reads it, else one line saying why.

ONNX Runtime resolves an external-data location (links included) and reads it when the file lies in the
model's folder, and refuses it otherwise ("External data path escapes model directory"). The rewriter
follows the same rule: a data file or a directory of the location that is a link inside the folder is
read (onnx 1.23's checker refuses any link, which made such models fail to load), one that leads outside
is refused with the location, where it leads and what to do; an absolute location likewise.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from fusion._chains import ChainSpec, build_chain
from fusion.rewrite import main

SPEC = ChainSpec(channels=256, group_size=64)


def _with_location(folder: Path, location: str, data_at: Path) -> Path:
    """Write the chain model to ``folder/model.onnx`` with its weights in ``data_at``, named ``location``."""
    data_at.parent.mkdir(parents=True, exist_ok=True)
    staging = data_at.parent / "staging.onnx"
    onnx.save(build_chain(SPEC), staging, save_as_external_data=True, location=data_at.name, size_threshold=512)
    model = onnx.load(staging, load_external_data=False)
    staging.unlink()
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    return folder / "model.onnx"


def _ort_loads(path: Path) -> bool:
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


LAYOUTS = {
    # location, where the data file really is, which link to make (link -> target), relative to tmp_path
    "linked directory inside": ("sub/w.data", "model/real/w.data", ("model/sub", "real")),
    "linked file inside": ("w.data", "model/real/w.data", ("model/w.data", "real/w.data")),
    "linked directory outside": ("sub/w.data", "elsewhere/w.data", ("model/sub", "../elsewhere")),
    "linked file outside": ("w.data", "elsewhere/w.data", ("model/w.data", "../elsewhere/w.data")),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_links_are_read_where_onnx_runtime_reads_them(
    layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    location, data_at, (link, target) = LAYOUTS[layout]
    path = _with_location(tmp_path / "model", location, tmp_path / data_at)
    os.symlink(target, tmp_path / link)
    inside = layout.endswith("inside")
    assert _ort_loads(path) == inside, "ONNX Runtime's rule changed: revisit model_io._check_external_data"

    output = tmp_path / "out.onnx"
    status = main([str(path), "-o", str(output)])
    if inside:
        assert status == 0, _error(capsys)
        assert _ort_loads(output)
    else:
        assert status == 2
        line = _error(capsys)
        assert f"external data file {location!r} resolves to {(tmp_path / data_at).resolve()}" in line, line
        assert "outside the model's folder (through a symbolic link)" in line and "into the model's folder" in line
        assert not output.exists()


def test_absolute_location_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "model" / "w.data"
    path = _with_location(tmp_path / "model", str(data), data)
    before = data.read_bytes()
    assert main([str(path), "-o", str(tmp_path / "out.onnx")]) == 2
    assert "is an absolute path" in _error(capsys)
    assert data.read_bytes() == before and not (tmp_path / "out.onnx").exists()
