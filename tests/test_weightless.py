"""benchmarks/_weightless.py: a model folder packed without its large weights and unpacked with seeded ones."""

from __future__ import annotations

import json
import tarfile

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from benchmarks import _weightless


def _folder(tmp_path, data_type=np.float16):
    """A folder like a genai build: model.onnx (a MatMul by a large weight, plus a small bias) with its
    external data, and a config file."""
    rng = np.random.default_rng(7)
    weight = (rng.standard_normal((128, 96)) * 0.02 + 0.001).astype(data_type)
    bias = rng.standard_normal(96).astype(data_type)
    scale = rng.standard_normal(96).astype(data_type)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(data_type))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["xb"]),
            helper.make_node("Mul", ["xb", "s"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", elem, [2, 128])],
        [helper.make_tensor_value_info("y", elem, [2, 96])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b"), numpy_helper.from_array(scale, "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder = tmp_path / "build"
    folder.mkdir()
    onnx.save(model, folder / "model.onnx", save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    (folder / "genai_config.json").write_text(json.dumps({"model": {"type": "test"}}))
    return folder, weight, bias, scale


def test_pack_leaves_out_large_weights_and_unpack_fills_them_at_their_scale(tmp_path):
    folder, weight, bias, scale = _folder(tmp_path)
    archive = tmp_path / "packed.tar.xz"
    manifest = _weightless.pack(folder, archive, min_bytes=1024)
    assert [entry["name"] for entry in manifest["left_out"]] == ["w"]
    assert archive.stat().st_size < weight.nbytes  # the weight's bytes are not in the archive
    with tarfile.open(archive) as tar:
        kept = tar.extractfile("model.onnx.data.kept").read()
    assert len(kept) == bias.nbytes + scale.nbytes

    dest = _weightless.unpack(archive, tmp_path / "unpacked")
    assert sorted(p.name for p in dest.iterdir()) == ["genai_config.json", "model.onnx", "model.onnx.data"]
    assert (dest / "genai_config.json").read_text() == (folder / "genai_config.json").read_text()
    assert (dest / "model.onnx.data").stat().st_size == (folder / "model.onnx.data").stat().st_size
    model = onnx.load(dest / "model.onnx")
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(values["b"], bias)
    np.testing.assert_array_equal(values["s"], scale)
    filled = values["w"]
    assert filled.dtype == weight.dtype and filled.shape == weight.shape
    assert not np.array_equal(filled, weight)
    assert abs(float(filled.astype(np.float64).std()) - float(weight.astype(np.float64).std())) < 0.1 * weight.std()
    assert abs(float(filled.astype(np.float64).mean()) - 0.001) < 0.002

    # The unpacked model runs, and a second unpack writes the same weights (seeded by name).
    session = ort.InferenceSession(str(dest / "model.onnx"), providers=["CPUExecutionProvider"])
    out = session.run(None, {"x": np.ones((2, 128), np.float16)})[0]
    assert np.isfinite(out).all()
    again = _weightless.unpack(archive, tmp_path / "again")
    assert (again / "model.onnx.data").read_bytes() == (dest / "model.onnx.data").read_bytes()


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_other_float_types(tmp_path, name):
    import ml_dtypes

    data_type = np.float32 if name == "float32" else ml_dtypes.bfloat16
    folder, weight, bias, _ = _folder(tmp_path, data_type)
    archive = tmp_path / "packed.tar.xz"
    _weightless.pack(folder, archive, min_bytes=1024)
    dest = _weightless.unpack(archive, tmp_path / "unpacked")
    model = onnx.load(dest / "model.onnx")
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(values["b"].astype(np.float32), bias.astype(np.float32))
    filled = values["w"].astype(np.float64)
    assert abs(filled.std() - weight.astype(np.float64).std()) < 0.1 * weight.astype(np.float64).std()


def test_bad_input_is_named(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _weightless.main(["pack", str(empty), str(tmp_path / "a.tar.xz")]) == 1
    assert "no .onnx model" in capsys.readouterr().err
    assert not (tmp_path / "a.tar.xz").exists()
    folder, *_ = _folder(tmp_path)
    archive = tmp_path / "packed.tar.xz"
    assert _weightless.main(["pack", str(folder), str(archive), "--min-bytes", "1024"]) == 0
    (tmp_path / "taken").mkdir()
    assert _weightless.main(["unpack", str(archive), str(tmp_path / "taken")]) == 1
    assert "already exists" in capsys.readouterr().err
    truncated = tmp_path / "truncated.tar.xz"
    truncated.write_bytes(archive.read_bytes()[:100])
    assert _weightless.main(["unpack", str(truncated), str(tmp_path / "t")]) == 1
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
