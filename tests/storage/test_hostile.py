"""Hostile manifests and indexes: every one must raise a CheckpointError subclass that names the file, and
nothing outside the checkpoint directory may be read into a tensor, written or removed."""
from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest

import shardckpt
from shardckpt import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.checksum import crc32c
from shardckpt.format.manifest import FORMAT_VERSION, seal
from tests.checkpoint.cases import reference
from tests.storage._util import assert_tree_equal, manifest_doc, sealed, zeros_like_tree

MANIFEST = "manifest.json"


class Ckpt:
    """A valid checkpoint at ``<tmp>/area/ckpt``, with bait files around it."""

    def __init__(self, tmp: Path, compress: str | None = None):
        self.tmp = tmp
        self.dir = tmp / "area" / "ckpt"
        # One file: "the" file of the cases.
        shardckpt.save(reference(), str(self.dir), files_per_rank=1, compress=compress)
        self.raw = (self.dir / MANIFEST).read_bytes()
        self.doc = manifest_doc(self.raw)
        self.body = b"{" + self.raw[len(b'{"crc32c":"00000000",'):]  # the JSON without its checksum field
        (self.file,) = self.doc["files"]
        self.index_rel = self.file["index"]["path"]
        self.index_raw = (self.dir / self.index_rel).read_bytes()
        self.index_doc = json.loads(self.index_raw)
        # Bait: files a path escaping the root would reach, and a directory a bad generation could remove.
        (tmp / "area" / "x").write_bytes(b"\0" * 4096)
        (tmp / "victim").mkdir()
        (tmp / "victim" / "keep.bin").write_bytes(os.urandom(4096))
        (self.dir / "data-x").mkdir()  # makes "data-x/../../../victim" resolve outside on a real file system

    def doc_copy(self) -> dict:
        return copy.deepcopy(self.doc)

    def write_manifest(self, data: bytes | dict) -> None:
        """A dict is written with a valid checksum, so that what is tested is the validation behind it."""
        if isinstance(data, dict):
            data = sealed(data)
        (self.dir / MANIFEST).write_bytes(data)

    def write_index(self, index_doc: dict, fix_manifest: bool = True) -> None:
        """Replace the index; with ``fix_manifest`` also record its new size and CRC (so that it is trusted)."""
        data = json.dumps(index_doc, separators=(",", ":")).encode()
        (self.dir / self.index_rel).write_bytes(data)
        if fix_manifest:
            doc = self.doc_copy()
            doc["files"][0]["index"].update(size=len(data), crc32c=crc32c(data))
            self.write_manifest(doc)

    def outside(self) -> dict[str, str]:
        """Digest of every file under the temp dir but outside the checkpoint directory."""
        out = {}
        for p in sorted(self.tmp.rglob("*")):
            if self.dir in p.parents or p == self.dir:
                continue
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        return out

    def inside(self) -> dict[str, str]:
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(self.dir.rglob("*"))
                if p.is_file()}


@pytest.fixture
def ckpt(tmp_path):
    return Ckpt(tmp_path)


def _set(path: list, value):
    def edit(doc: dict) -> dict:
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return doc
    return edit


def _del(path: list):
    def edit(doc: dict) -> dict:
        node = doc
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
        return doc
    return edit


F0 = ["files", 0]
TINY = ["tensors", "model.tiny"]
# name -> edit of the parsed manifest (a dict)
MANIFEST_EDITS = {
    "data path ../x": _set(F0 + ["path"], "../x"),
    "data path ../../victim/keep.bin": _set(F0 + ["path"], "../../victim/keep.bin"),
    "data path /etc/passwd": _set(F0 + ["path"], "/etc/passwd"),
    "data path through data-x/..": _set(F0 + ["path"], "data-x/../../../victim/keep.bin"),
    "data path with dot segment": _set(F0 + ["path"], "./manifest.json"),
    "data path empty": _set(F0 + ["path"], ""),
    "data path backslashes": _set(F0 + ["path"], "..\\..\\victim\\keep.bin"),
    "data path file url": _set(F0 + ["path"], "file:///etc/passwd"),
    "data path not a string": _set(F0 + ["path"], ["a"]),
    "index path ../../etc/passwd": _set(F0 + ["index", "path"], "../../etc/passwd"),
    "index path absolute": _set(F0 + ["index", "path"], "/etc/hostname"),
    "generation ../../etc": _set(["generation"], "../../etc"),
    "generation x/../../../victim": _set(["generation"], "x/../../../victim"),
    "generation empty": _set(["generation"], ""),
    "generation not a string": _set(["generation"], 7),
    "shape of 2**60 elements": _set(TINY + ["shape"], [2 ** 30, 2 ** 30]),
    "dimension 2**60": _set(TINY + ["shape"], [2 ** 60]),
    "negative dimension": _set(TINY + ["shape"], [-2, -5]),
    "float dimension": _set(TINY + ["shape"], [2.0, 5]),
    "bool dimension": _set(TINY + ["shape"], [True, 10]),
    "65 dimensions": _set(TINY + ["shape"], [1] * 65),
    "negative file size": _set(F0 + ["size"], -1),
    "file size 2**80": _set(F0 + ["size"], 2 ** 80),
    "negative index size": _set(F0 + ["index", "size"], -5),
    "index crc out of range": _set(F0 + ["index", "crc32c"], 2 ** 32),
    "tensor crc negative": _set(TINY + ["crc32c"], -1),
    "chunk size not tiling": _set(TINY + ["chunks", "size"], 3),
    "chunk count negative": _set(TINY + ["chunks", "count"], -1),
    "chunk file index past the files": _set(TINY + ["chunks", "files"], {"first": 5, "step": 1}),
    "chunk file list past the files": _set(TINY + ["chunks", "files"], [3]),
    "explicit chunk out of bounds": _set(TINY + ["chunks"], [{"flat": [0, 11], "file": 0}]),
    "explicit chunks overlapping": _set(TINY + ["chunks"], [{"flat": [0, 10], "file": 0},
                                                            {"flat": [5, 10], "file": 0}]),
    "explicit chunk box of wrong rank": _set(TINY + ["chunks"], [{"box": {"offsets": [0], "sizes": [10]},
                                                                  "file": 0}]),
    "explicit chunk garbage": _set(TINY + ["chunks"], [{"flat": "ab"}]),
    "unknown dtype": _set(TINY + ["dtype"], "float128"),
    "dtype not a string": _set(TINY + ["dtype"], {"$tensor": "x"}),
    "dtype python object": _set(TINY + ["dtype"], "object"),
    "tensor ref to a nonexistent tensor": _set(["tree", "model", "tiny"], {"$tensor": "model.nope"}),
    "tensor entry without ref": _set(["tree", "model", "tiny"], 3),
    "tensor referenced twice": _set(["tree", "model", "scalar"], {"$tensor": "model.tiny"}),
    "tensor ref not a string": _set(["tree", "model", "tiny"], {"$tensor": 5}),
    "unknown tag in tree": _set(["tree", "model", "tiny"], {"$pickle": "cos\nsystem\n"}),
    "tensors is a list": _set(["tensors"], []),
    "files is an object": _set(["files"], {}),
    "missing files": _del(["files"]),
    "missing tree": _del(["tree"]),
    "missing tensor chunks": _del(TINY + ["chunks"]),
    "format name wrong": _set(["format"], "safetensors"),
    "version 0": _set(["version"], 0),
    "version string": _set(["version"], "1"),
    "version huge": _set(["version"], 2 ** 64),
    "world size 0": _set(["world_size"], 0),
    "metadata a list": _set(["metadata"], [1]),
    # Format v2: objects carry exactly the fields FORMAT.md lists; integers are JSON integers.
    "unknown top-level field": _set(["extra"], 1),
    "missing world_size": _del(["world_size"]),
    "unknown field in files[0]": _set(F0 + ["mtime"], 0),
    "unknown field in files[0].index": _set(F0 + ["index", "sha256"], "00"),
    "unknown field in a tensor": _set(TINY + ["stride"], [5, 1]),
    "integer written 1.0": _set(["world_size"], 1.0),
    "integer written 1e3": _set(F0 + ["size"], 1e3),
    "data path outside the generation": _set(F0 + ["path"], "data-0123/rank-00000-0.bin"),
    "regular chunk size 0": _set(TINY + ["chunks", "size"], 0),
    "empty explicit chunk": _set(TINY + ["chunks"], [{"flat": [0, 0], "file": 0}, {"flat": [0, 10], "file": 0}]),
    "unknown field in a chunk": _set(TINY + ["chunks"], [{"flat": [0, 10], "file": 0, "codec": "raw"}]),
    "flat chunk past numel": _set(TINY + ["chunks"], [{"flat": [0, 11], "file": 0}]),
    "box chunk past the shape": _set(TINY + ["chunks"], [{"box": {"offsets": [0, 1], "sizes": [2, 5]}, "file": 0}]),
    "$dict keys 1 and true collide": _set(["tree", "meta"], {"$dict": [[1, "a"], [True, "b"]]}),
    "tagged object with an extra key": _set(["tree", "step"], {"$float": "nan", "x": 1}),
    "two leaves named alike": _set(["tree", "model.tiny"], 5),
    "tensor not named by its path": lambda doc: _rename_tensor(doc, "model.tiny", "model.small"),
    "tree not an object": lambda doc: dict(doc, tree=5, tensors={}),
    "$dict of plain string keys": _set(["tree", "meta"], {"$dict": [["a", 1]]}),
    "a data file listed twice (found by the fuzzer)": lambda doc: dict(doc, files=doc["files"] + doc["files"][:1]),
    "regular chunks count 2**40 in one file": _set(TINY, {"dtype": "float32", "shape": [2 ** 40], "crc32c": 0,
                                                         "chunks": {"size": 1, "count": 2 ** 40,
                                                                    "files": {"first": 0, "step": 0}}}),
}


def _rename_tensor(doc: dict, old: str, new: str) -> dict:
    """The tensor table and the tree's reference agree on a name that is not the tensor's path."""
    doc["tensors"][new] = doc["tensors"].pop(old)
    node = doc["tree"]
    for key in old.split(".")[:-1]:
        node = node[key]
    node[old.split(".")[-1]] = {"$tensor": new}
    return doc

# name -> raw manifest bytes from the valid ones (json.dumps cannot write these)
RAW_EDITS = {
    "duplicate tensor name": lambda raw, doc: raw.replace(
        b'"tensors":{', b'"tensors":{"model.tiny":' + json.dumps(doc["tensors"]["model.cube"],
                                                                 separators=(",", ":")).encode() + b",", 1),
    "duplicate tree key": lambda raw, doc: raw.replace(b'"tree":{', b'"tree":{"step":11,', 1),
    "duplicate top-level generation": lambda raw, doc: raw[:-1] + b',"generation":"00ff"}',
    "not JSON": lambda raw, doc: b"\x89PNG\r\n\x1a\n garbage \xff\xfe",
    "empty file": lambda raw, doc: b"",
    "truncated JSON": lambda raw, doc: raw[: len(raw) // 3],
    "JSON null": lambda raw, doc: b"null",
    "JSON list": lambda raw, doc: b"[1, 2]",
    "invalid UTF-8 in a key": lambda raw, doc: raw.replace(b'"model.tiny"', b'"model.\xff\xfe"'),
    "deeply nested": lambda raw, doc: b"[" * 200_000 + b"]" * 200_000,
    "deeply nested tree": lambda raw, doc: raw.replace(b'"step":10', b'"step":' + b'{"a":' * 5000 + b"1" + b"}" * 5000),
    "NaN as a size": lambda raw, doc: raw.replace(b'"size":%d' % doc["files"][0]["size"], b'"size":NaN', 1),
    "a non-finite number (1e400)": lambda raw, doc: raw.replace(b'"step":10', b'"step":1e400', 1),
    "a 5000-digit integer": lambda raw, doc: raw.replace(b'"size":%d' % doc["files"][0]["size"],
                                                        b'"size":' + b"9" * 5000, 1),
}


def _check_rejected(ckpt: Ckpt, names: tuple[str, ...], exc=CorruptCheckpointError) -> None:
    """load_full, strict load and non-strict load all raise ``exc`` naming one of ``names``; nothing changes."""
    outside, inside = ckpt.outside(), ckpt.inside()
    calls = {
        "load_full": lambda: shardckpt.load_full(str(ckpt.dir)),
        "load": lambda: shardckpt.load(zeros_like_tree(reference()), str(ckpt.dir)),
        "load strict=False": lambda: shardckpt.load(zeros_like_tree(reference()), str(ckpt.dir), strict=False),
    }
    for what, call in calls.items():
        with pytest.raises(CheckpointError) as info:
            call()
        assert isinstance(info.value, exc), f"{what}: {type(info.value).__name__}: {info.value}"
        assert any(n in str(info.value) for n in names), f"{what}: the message does not name {names}: {info.value}"
    assert ckpt.outside() == outside and ckpt.inside() == inside
    # Overwriting a checkpoint whose manifest is hostile removes nothing outside it and works.
    shardckpt.save(reference(), str(ckpt.dir), overwrite=True)
    assert ckpt.outside() == outside
    assert_tree_equal(shardckpt.load_full(str(ckpt.dir)), reference())


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_hostile_manifest_field(ckpt, case):
    ckpt.write_manifest(MANIFEST_EDITS[case](ckpt.doc_copy()))
    _check_rejected(ckpt, (str(ckpt.dir / MANIFEST),))


@pytest.mark.parametrize("case", sorted(RAW_EDITS))
def test_hostile_manifest_text(ckpt, case):
    data = RAW_EDITS[case](ckpt.body, ckpt.doc)
    assert data != ckpt.body
    # Sealed where it can be, so that the parser's own checks are what is tested.
    ckpt.write_manifest(seal(data) if data.startswith(b"{") else data)
    _check_rejected(ckpt, (str(ckpt.dir / MANIFEST),))


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 1000])
def test_newer_format_version_is_incompatible(ckpt, version):
    doc = ckpt.doc_copy()
    doc["version"] = version
    doc["tensors"]["model.tiny"]["dtype"] = "float4_future"  # a newer version may hold what v1 cannot parse
    ckpt.write_manifest(doc)
    _check_rejected(ckpt, (str(ckpt.dir / MANIFEST),), exc=IncompatibleCheckpointError)


# --------------------------------------------------------------------------------------------- indexes


def _rows(ckpt: Ckpt) -> dict[str, list]:
    return {row[0]: row for row in ckpt.index_doc["chunks"]}


def _index_edit(ckpt: Ckpt, name: str, field: int, value) -> dict:
    doc = copy.deepcopy(ckpt.index_doc)
    for row in doc["chunks"]:
        if row[0] == name:
            row[field] = value
    return doc


INDEX_EDITS = {
    "offset+length past the end": lambda c: _index_edit(c, "model.cube", 2, c.file["size"] - 8),
    "offset past the end": lambda c: _index_edit(c, "model.cube", 2, c.file["size"] + 4096),
    "offset 2**62": lambda c: _index_edit(c, "model.cube", 2, 2 ** 62),
    "offset 2**80": lambda c: _index_edit(c, "model.cube", 2, 2 ** 80),
    "negative offset": lambda c: _index_edit(c, "model.cube", 2, -64),
    "length too long for the region": lambda c: _index_edit(c, "model.cube", 3, _rows(c)["model.cube"][3] + 4),
    "length too short for the region": lambda c: _index_edit(c, "model.cube", 3, 4),
    "negative length": lambda c: _index_edit(c, "model.cube", 3, -4),
    "unknown codec": lambda c: _index_edit(c, "model.cube", 5, "pickle"),
    "chunk number huge": lambda c: _index_edit(c, "model.cube", 1, 2 ** 70),
    "row too short": lambda c: dict(c.index_doc, chunks=c.index_doc["chunks"][:-1] + [["model.cube", 0, 0]]),
    "row is an object": lambda c: dict(c.index_doc, chunks=[{"name": "model.cube"}]),
    "duplicate row": lambda c: dict(c.index_doc, chunks=c.index_doc["chunks"] + [_rows(c)["model.cube"]]),
    "missing row": lambda c: dict(c.index_doc, chunks=[r for r in c.index_doc["chunks"] if r[0] != "model.cube"]),
    "wrong format name": lambda c: dict(c.index_doc, format="shardckpt"),
    "chunks not a list": lambda c: dict(c.index_doc, chunks={}),
    "overlapping chunks with right CRCs": lambda c: _index_edit(c, "model.cube", 2, _rows(c)["model.tiny"][2]),
    "index version 1 in a v2 checkpoint": lambda c: dict(c.index_doc, version=1),
    "unknown index field": lambda c: dict(c.index_doc, writer="x"),
    "block size 0": lambda c: dict(c.index_doc, block_size=0),
    "block CRCs missing": lambda c: _index_edit(c, "model.cube", 6, []),
    "block CRCs one too many": lambda c: _index_edit(c, "model.cube", 6, _rows(c)["model.cube"][6] * 2),
    "row of v1 width": lambda c: _index_edit_row(c, "model.cube", lambda row: row[:6]),
}


def _index_edit_row(ckpt: Ckpt, name: str, edit) -> dict:
    doc = copy.deepcopy(ckpt.index_doc)
    doc["chunks"] = [edit(row) if row[0] == name else row for row in doc["chunks"]]
    return doc


@pytest.mark.parametrize("case", sorted(INDEX_EDITS))
def test_hostile_index_recorded_in_manifest(ckpt, case):
    """An index whose size and CRC the (equally hostile) manifest vouches for: its content is still checked."""
    ckpt.write_index(INDEX_EDITS[case](ckpt))
    # The index or the data file it describes (with the tensor) may be named.
    _check_rejected(ckpt, (str(ckpt.dir / ckpt.index_rel), str(ckpt.dir / ckpt.file["path"])))


def _framed(ckpt: Ckpt) -> list:
    """The first row of a compressed chunk (format v3: it has a frame table)."""
    return next(row for row in ckpt.index_doc["chunks"] if row[7])


def _frame_edit(ckpt: Ckpt, edit) -> dict:
    return _index_edit_row(ckpt, _framed(ckpt)[0], lambda row: edit(copy.deepcopy(row)) or row)


def _set_item(row: list, i: int, value) -> list:
    row[i] = value
    return row


FRAME_EDITS = {
    "frame table missing a frame": lambda c: _frame_edit(c, lambda r: _set_item(r, 7, [])),
    "frame table with an extra frame": lambda c: _frame_edit(c, lambda r: _set_item(r, 7, r[7] * 2)),
    "zero-length frame": lambda c: _frame_edit(c, lambda r: _set_item(r, 7, [0])),
    "frame longer than its block": lambda c: _frame_edit(c, lambda r: _set_item(r, 7, [r[3] + 1])),
    "frame table not a list": lambda c: _frame_edit(c, lambda r: _set_item(r, 7, {"0": 1})),
    "frame length a float": lambda c: _frame_edit(c, lambda r: _set_item(r, 7, [float(r[7][0])])),
    "raw codec with a frame table": lambda c: _frame_edit(c, lambda r: _set_item(r, 5, "raw")),
    "zstd codec on byte planes": lambda c: _frame_edit(c, lambda r: _set_item(r, 5, "zstd" if r[5] != "zstd" else "zstd-planes")),
    "frames shifted by one byte": lambda c: _frame_edit(c, lambda r: _set_item(r, 2, r[2] + 1)),
    "frames past the end": lambda c: _frame_edit(c, lambda r: _set_item(r, 2, c.file["size"] - 2)),
    "row of v2 width": lambda c: _frame_edit(c, lambda r: r[:7]),
    "v2 index in a v3 checkpoint": lambda c: dict(c.index_doc, version=2),
}


@pytest.mark.parametrize("case", sorted(FRAME_EDITS))
def test_hostile_frame_table(tmp_path, case):
    """A compressed checkpoint's frame tables (format v3), vouched for by the manifest: still checked."""
    ckpt = Ckpt(tmp_path, compress="zstd")
    assert ckpt.doc["version"] == 3 and _framed(ckpt)
    ckpt.write_index(FRAME_EDITS[case](ckpt))
    _check_rejected(ckpt, (str(ckpt.dir / ckpt.index_rel), str(ckpt.dir / ckpt.file["path"])))


def test_index_not_matching_manifest_crc(ckpt):
    ckpt.write_index(INDEX_EDITS["offset past the end"](ckpt), fix_manifest=False)
    _check_rejected(ckpt, (str(ckpt.dir / ckpt.index_rel),))


def test_manifest_file_size_larger_than_the_file(ckpt):
    """The manifest claims a bigger data file and the index points into the claimed part."""
    index = INDEX_EDITS["offset past the end"](ckpt)
    data = json.dumps(index, separators=(",", ":")).encode()
    (ckpt.dir / ckpt.index_rel).write_bytes(data)
    doc = ckpt.doc_copy()
    doc["files"][0]["size"] = ckpt.file["size"] + 1 << 20
    doc["files"][0]["index"].update(size=len(data), crc32c=crc32c(data))
    ckpt.write_manifest(doc)
    _check_rejected(ckpt, (str(ckpt.dir / ckpt.file["path"]),))


# ------------------------------------------------------------------------------------ absurd but consistent


@pytest.mark.parametrize("claimed_file_size", ["as stored", "2**61"])
def test_absurd_but_self_consistent_shape(ckpt, claimed_file_size):
    # Regression: load_full allocated every tensor at the manifest's shape before checking the stored
    # bytes, so this got a RuntimeError from torch's allocator instead of CorruptCheckpointError.
    doc = ckpt.doc_copy()
    # 2**50 complex128 elements: 16 PiB, beyond any address space, so no allocator can succeed.
    doc["tensors"]["model.tiny"].update(dtype="complex128", shape=[2 ** 25, 2 ** 25],
                                        chunks={"size": 2 ** 50, "count": 1, "files": [0]})
    if claimed_file_size != "as stored":
        doc["files"][0]["size"] = 2 ** 61
    ckpt.write_manifest(doc)
    outside = ckpt.outside()
    with pytest.raises(CorruptCheckpointError) as info:
        shardckpt.load_full(str(ckpt.dir))
    assert any(n in str(info.value) for n in ("model.tiny", MANIFEST, ckpt.file["path"])), info.value
    assert ckpt.outside() == outside


def test_absurd_shape_is_refused_before_matching(ckpt):
    """A shape whose bytes the data files cannot hold is refused when the manifest is parsed: nothing is
    allocated, and it is reported as the corruption it is (before v2 it surfaced as a shape mismatch)."""
    doc = ckpt.doc_copy()
    doc["tensors"]["model.tiny"].update(shape=[2 ** 25, 2 ** 25], chunks={"size": 2 ** 50, "count": 1, "files": [0]})
    ckpt.write_manifest(doc)
    for strict in (True, False):
        with pytest.raises(CorruptCheckpointError, match="model.tiny.*claims"):
            shardckpt.load(zeros_like_tree(reference()), str(ckpt.dir), strict=strict)


# ------------------------------------------------------------------------------------------ symlinks


def test_overwrite_does_not_follow_a_symlinked_data_directory(ckpt):
    """The old generation's data directory replaced by a symlink to elsewhere: overwrite must not empty elsewhere."""
    gen_dir = ckpt.dir / f"data-{ckpt.doc['generation']}"
    elsewhere = ckpt.tmp / "elsewhere"
    gen_dir.rename(elsewhere)
    gen_dir.symlink_to(elsewhere, target_is_directory=True)
    before = sorted(p.name for p in elsewhere.iterdir())
    shardckpt.save(reference(), str(ckpt.dir), overwrite=True)
    assert sorted(p.name for p in elsewhere.iterdir()) == before
    assert_tree_equal(shardckpt.load_full(str(ckpt.dir)), reference())
