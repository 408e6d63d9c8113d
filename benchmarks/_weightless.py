"""Carry a random-weight model folder without its weights, and fill them in again where it is unpacked.

The real-width benchmark models (``benchmarks/_genai_real_width.py``) are 2–4 GB of random weights, built here with
mobius and transformers, and measured on a GPU machine that cannot build them and to which a few tens of MB can
be carried at a time. ``pack`` writes the folder as a small archive: every file as it is, except that the external
data of each float initializer of ``--min-bytes`` or more is left out and replaced by its mean and standard
deviation; ``unpack`` extracts it and writes those initializers again as seeded normal values with the same mean
and deviation (the seed is derived from the initializer's name, so two unpacks agree). Everything else — the
graph, the small tensors (norms, A, D, dt_bias, conv weights), the tokenizer and the configs — arrives as packed.

So the unpacked model is the same graph with other random weights of the same scale: for timings and for
comparing two variants of it (unfused vs fused, both made from the unpacked folder), not for comparing its outputs
with the packed original's.

    python -m benchmarks._weightless pack FOLDER ARCHIVE.tar.xz [--min-bytes 1048576]
    python -m benchmarks._weightless unpack ARCHIVE.tar.xz DEST
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import onnx

MANIFEST = "weightless.json"
_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: np.dtype(np.float32),
    onnx.TensorProto.FLOAT16: np.dtype(np.float16),
    onnx.TensorProto.BFLOAT16: np.dtype(np.uint16),  # stored as the upper half of a float32
}
_CHUNK = 1 << 24  # elements generated at a time


def _external(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _models(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.onnx"))


def _as_float32(raw: np.ndarray, data_type: int) -> np.ndarray:
    if data_type == onnx.TensorProto.BFLOAT16:
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def _from_float32(values: np.ndarray, data_type: int) -> np.ndarray:
    if data_type == onnx.TensorProto.BFLOAT16:
        bits = values.astype(np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return values.astype(_FLOAT_TYPES[data_type])


def _left_out(folder: Path, min_bytes: int) -> list[dict]:
    """The external float initializers of ``min_bytes`` or more in the folder's models, with their statistics."""
    entries = []
    for model_path in _models(folder):
        model = onnx.load(model_path, load_external_data=False)
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = _external(tensor)
            length = int(info.get("length", 0))
            if length < min_bytes or tensor.data_type not in _FLOAT_TYPES:
                continue
            offset = int(info.get("offset", 0))
            dtype = _FLOAT_TYPES[tensor.data_type]
            data = np.fromfile(folder / info["location"], dtype=dtype, count=length // dtype.itemsize, offset=offset)
            values = _as_float32(data, tensor.data_type)
            entries.append(
                {
                    "name": tensor.name,
                    "file": info["location"],
                    "offset": offset,
                    "length": length,
                    "data_type": int(tensor.data_type),
                    "mean": float(np.mean(values, dtype=np.float64)),
                    "std": float(np.std(values, dtype=np.float64)),
                }
            )
    return entries


def pack(folder: Path, archive: Path, min_bytes: int = 1 << 20) -> dict:
    """Write ``folder`` to ``archive`` (tar.xz) without the data of its large float initializers; return the
    manifest."""
    folder = Path(folder)
    if not _models(folder):
        raise ValueError(f"{folder}: no .onnx model in the folder")
    left_out = _left_out(folder, min_bytes)
    by_file: dict[str, list[dict]] = {}
    for entry in left_out:
        by_file.setdefault(entry["file"], []).append(entry)
    sizes = {name: (folder / name).stat().st_size for name in by_file}
    manifest = {"left_out": left_out, "sizes": sizes}
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=archive.parent, prefix=archive.name, suffix=".tmp", delete=False) as handle:
        temporary = Path(handle.name)
    try:
        with tarfile.open(temporary, "w:xz") as tar:
            for path in sorted(folder.rglob("*")):
                name = path.relative_to(folder).as_posix()
                if path.is_dir():
                    continue
                if name not in by_file:
                    tar.add(path, arcname=name)
                    continue
                # The data file as the ranges that stay, end to end (the manifest's sizes and offsets rebuild it).
                ranges = sorted((e["offset"], e["offset"] + e["length"]) for e in by_file[name])
                kept = io.BytesIO()
                with path.open("rb") as source:
                    position = 0
                    for start, end in [*ranges, (sizes[name], sizes[name])]:
                        if start > position:
                            source.seek(position)
                            kept.write(source.read(start - position))
                        position = max(position, end)
                info = tarfile.TarInfo(name + ".kept")
                info.size = kept.tell()
                kept.seek(0)
                tar.addfile(info, kept)
            text = json.dumps(manifest, indent=1).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
        os.replace(temporary, archive)
    finally:
        temporary.unlink(missing_ok=True)
    return manifest


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def unpack(archive: Path, dest: Path) -> Path:
    """Extract ``archive`` into ``dest`` (which must not exist) and fill its left-out initializers; return
    ``dest``."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest}: already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + "."))
    umask = os.umask(0)
    os.umask(umask)
    scratch.chmod(0o777 & ~umask)  # mkdtemp's folder is the owner's alone; the result is an ordinary folder
    try:
        _fill(archive, scratch)
        shutil.move(scratch, dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest


def _fill(archive: Path, scratch: Path) -> None:
    """Extract ``archive`` into ``scratch`` and write its left-out initializers."""
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(scratch, filter="data")
    manifest = json.loads((scratch / MANIFEST).read_text())
    by_file: dict[str, list[dict]] = {}
    for entry in manifest["left_out"]:
        by_file.setdefault(entry["file"], []).append(entry)
    for name, entries in by_file.items():
        size = manifest["sizes"][name]
        kept_path = scratch / (name + ".kept")
        ranges = sorted((e["offset"], e["offset"] + e["length"]) for e in entries)
        with kept_path.open("rb") as kept, (scratch / name).open("wb") as out:
            out.truncate(size)
            position = 0
            for start, end in [*ranges, (size, size)]:
                if start > position:
                    out.seek(position)
                    out.write(kept.read(start - position))
                position = max(position, end)
            for entry in entries:
                dtype = _FLOAT_TYPES[entry["data_type"]]
                count = entry["length"] // dtype.itemsize
                rng = np.random.default_rng(_seed(entry["name"]))
                out.seek(entry["offset"])
                for start in range(0, count, _CHUNK):
                    values = rng.standard_normal(min(_CHUNK, count - start), dtype=np.float32)
                    values = values * np.float32(entry["std"]) + np.float32(entry["mean"])
                    out.write(_from_float32(values, entry["data_type"]).tobytes())
        kept_path.unlink()
    (scratch / MANIFEST).unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._weightless", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="FOLDER -> ARCHIVE without its large float weights")
    packing.add_argument("folder", type=Path)
    packing.add_argument("archive", type=Path)
    packing.add_argument("--min-bytes", type=int, default=1 << 20, help="leave out initializers this large (1 MiB)")
    unpacking = commands.add_parser("unpack", help="ARCHIVE -> DEST with seeded weights of the packed scale")
    unpacking.add_argument("archive", type=Path)
    unpacking.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "pack":
            manifest = pack(args.folder, args.archive, args.min_bytes)
            left = sum(entry["length"] for entry in manifest["left_out"])
            print(
                f"{args.archive}: {args.archive.stat().st_size / 1e6:.1f} MB, {len(manifest['left_out'])} "
                f"initializers ({left / 1e9:.2f} GB) left out"
            )
        else:
            print(unpack(args.archive, args.dest))
    except (OSError, ValueError, EOFError, KeyError, lzma.LZMAError, tarfile.TarError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
