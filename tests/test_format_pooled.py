"""A reader written from FORMAT.md alone (json, numpy, CRC32C; nothing of shardckpt's reader) follows a pooled
(version 5) checkpoint's references to the bytes shardckpt saved."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

import shardckpt
from shardckpt.format.checksum import crc32c

ITEM = {"float32": (np.float32, 4), "int64": (np.int64, 8), "bool": (np.bool_, 1)}


def _read_json(path: str, size: int | None = None, crc: int | None = None) -> dict:
    data = open(path, "rb").read()
    if size is not None:
        assert len(data) == size and crc32c(data) == crc, f"{path}: size or CRC differs from the manifest's"
    return json.loads(data)


def _chunks(entry: dict, numel: int) -> list[tuple[dict, int]]:
    chunks = entry["chunks"]
    if isinstance(chunks, list):
        return [({k: v for k, v in c.items() if k != "file"}, c["file"]) for c in chunks]
    size, count, files = chunks["size"], chunks["count"], chunks["files"]
    at = (lambda i: files[i]) if isinstance(files, list) else (lambda i: files["first"] + i * files["step"])
    return [({"flat": [i * size, min((i + 1) * size, numel)]}, at(i)) for i in range(count)]


def spec_read(step: str) -> dict[str, np.ndarray]:
    raw = open(os.path.join(step, "manifest.json"), "rb").read()
    assert raw[:11] == b'{"crc32c":"' and int(raw[11:19], 16) == crc32c(raw[21:])
    manifest = json.loads(raw)
    root = step
    if manifest["version"] >= 5:
        assert manifest["pool"]["path"] == "../shardckpt-pool"
        root = os.path.join(os.path.dirname(os.path.abspath(step)), "shardckpt-pool")
        pool = _read_json(os.path.join(root, "pool.json"))
        assert pool["format"] == "shardckpt-pool" and pool["id"] == manifest["pool"]["id"]
    out = {}
    for name, entry in manifest["tensors"].items():
        np_dtype, size = ITEM[entry["dtype"]]
        shape, numel = entry["shape"], math.prod(entry["shape"])
        flat = np.zeros(numel * size, np.uint8)
        for i, (region, f) in enumerate(_chunks(entry, numel)):
            file = manifest["files"][f]
            index = _read_json(os.path.join(root, file["index"]["path"]), file["index"]["size"], file["index"]["crc32c"])
            row = next(r for r in index["chunks"] if r[0] == name and r[1] == i)
            assert row[5] == "raw" and len(row) == (9 if manifest["version"] >= 5 else 8 if manifest["version"] >= 3 else 7)
            with open(os.path.join(root, file["path"]), "rb") as data:
                data.seek(row[2])
                chunk = data.read(row[3])
            assert crc32c(chunk) == row[4]
            _place(flat, np.frombuffer(chunk, np.uint8), region, shape, size)
        out[name] = flat.view(np_dtype).reshape(shape)
    return out


def _place(flat: np.ndarray, chunk: np.ndarray, region: dict, shape: list[int], size: int) -> None:
    if "flat" in region:
        lo, hi = region["flat"]
        flat[lo * size:hi * size] = chunk
        return
    offsets, sizes = region["box"]["offsets"], region["box"]["sizes"]
    whole = flat.reshape(*shape, size) if shape else flat
    whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = chunk.reshape(*sizes, size)


def test_a_reader_from_format_md_follows_pool_references(tmp_path):
    sd = {"base": torch.arange(30_000, dtype=torch.float32).reshape(300, 100), "ids": torch.arange(7),
          "mask": torch.arange(10) % 2 == 0, "lora": torch.ones(4, 4)}
    shardckpt.save(sd, tmp_path / "step-1", incremental=True, incremental_unit=16 << 10)
    sd["lora"].add_(1)
    sd["base"][0, 0] = -1  # one unit of base
    shardckpt.save(sd, tmp_path / "step-2", incremental=True, incremental_unit=16 << 10)
    got = spec_read(str(tmp_path / "step-2"))
    for name, value in sd.items():
        assert np.array_equal(got[name], value.numpy()), name
    manifest = json.loads(open(tmp_path / "step-2" / "manifest.json", "rb").read())
    generations = {f["path"].split("/")[0] for f in manifest["files"]}
    assert len(generations) == 2  # step 2's own data and step 1's, referenced
