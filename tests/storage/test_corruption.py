"""Damaged bytes on every backend: flipped bytes, truncated data files, damaged chunk indexes."""
from __future__ import annotations

import json
import re

import pytest

import shardckpt
from shardckpt import CorruptCheckpointError
from tests._helpers import flipped
from tests.checkpoint.cases import empty_like_state, reference
from tests.storage._util import assert_tree_equal, index_rows


def _setup(backend):
    # One data file, so that each test can damage "the" file at a known chunk.
    shardckpt.save(reference(), backend.url, storage_options=backend.options, files_per_rank=1)
    (data,) = backend.data_files()
    (index,) = backend.index_files()
    return data, index


def _load_full(backend, **kw):
    return shardckpt.load_full(backend.url, storage_options=backend.options, **kw)


def _flip(backend, rel: str, offset: int) -> None:
    backend.write(rel, flipped(backend.read(rel), offset))


def test_flipped_byte_names_the_tensor(backend):
    data, index = _setup(backend)
    rows = {row[0]: row for row in index_rows(backend.read(index))}
    name, _, offset, length, *_ = rows["model.cube"]
    _flip(backend, data, offset + length // 2)
    with pytest.raises(CorruptCheckpointError, match=r"'model\.cube'.*checksum") as info:
        _load_full(backend)
    assert data.split("/")[-1] in str(info.value)
    with pytest.raises(CorruptCheckpointError, match=r"'model\.cube'"):
        shardckpt.load(empty_like_state(0, 1, 0), backend.url, storage_options=backend.options)
    # The other tensors still load on their own; without verification the damaged one loads too.
    assert_tree_equal(_load_full(backend, keys=["model.tiny"])["model"]["tiny"], reference()["model"]["tiny"])
    loose = _load_full(backend, verify_checksums=False)
    assert not loose["model"]["cube"].equal(reference()["model"]["cube"])


@pytest.mark.parametrize("backend", ["local"], indirect=True)  # one backend is enough for the sweep
def test_every_tensor_detects_a_flip_in_its_first_and_last_byte(backend):
    data, index = _setup(backend)
    pristine = backend.read(data)
    rows = [r for r in index_rows(backend.read(index)) if r[3] > 0]
    assert len(rows) == 8  # every non-empty tensor of the reference
    for name, _, offset, length, *_ in rows:
        for at in (offset, offset + length - 1):
            _flip(backend, data, at)
            with pytest.raises(CorruptCheckpointError, match=re.escape(repr(name))):
                _load_full(backend)
            backend.write(data, pristine)
    assert_tree_equal(_load_full(backend), reference())


def test_flip_in_alignment_padding_is_harmless(backend):
    """Bytes between chunks belong to no tensor: the checkpoint still loads bit-exact."""
    data, index = _setup(backend)
    rows = sorted(index_rows(backend.read(index)), key=lambda r: r[2])
    gaps = [(a[2] + a[3], b[2]) for a, b in zip(rows, rows[1:]) if b[2] > a[2] + a[3]]
    assert gaps
    _flip(backend, data, gaps[0][0])
    assert_tree_equal(_load_full(backend), reference())


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_truncated_data_file(backend, keep):
    data, _ = _setup(backend)
    content = backend.read(data)
    backend.write(data, content[:int(len(content) * keep)])
    with pytest.raises(CorruptCheckpointError, match=re.escape(data.split("/")[-1])):
        _load_full(backend)
    with pytest.raises(CorruptCheckpointError, match=re.escape(data.split("/")[-1])):
        shardckpt.load(empty_like_state(0, 1, 0), backend.url, storage_options=backend.options)


def test_truncated_by_one_byte(backend):
    data, _ = _setup(backend)
    backend.write(data, backend.read(data)[:-1])
    with pytest.raises(CorruptCheckpointError, match=re.escape(data.split("/")[-1])):
        _load_full(backend)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "rewritten"])
def test_damaged_index(backend, damage):
    data, index = _setup(backend)
    content = backend.read(index)
    if damage == "flip":
        # A digit of an offset: still valid JSON, so only the manifest's CRC of the index catches it.
        doc = content.decode()
        at = doc.index('"model.cube"') + len('"model.cube",0,')
        assert doc[at].isdigit()
        damaged = (doc[:at] + str((int(doc[at]) + 1) % 10) + doc[at + 1:]).encode()
    elif damage == "truncate":
        damaged = content[:-7]
    elif damage == "empty":
        damaged = b""
    else:
        # A well-formed index of the same length with two rows' offsets swapped.
        doc = json.loads(content)
        rows = doc["chunks"]
        rows[0][2], rows[1][2] = rows[1][2], rows[0][2]
        damaged = json.dumps(doc, separators=(",", ":")).encode()
        assert len(damaged) == len(content) and damaged != content
    backend.write(index, damaged)
    with pytest.raises(CorruptCheckpointError, match=re.escape(index.split("/")[-1])):
        _load_full(backend)
    with pytest.raises(CorruptCheckpointError, match=re.escape(index.split("/")[-1])):
        shardckpt.load(empty_like_state(0, 1, 0), backend.url, storage_options=backend.options)


def test_damaged_manifest_is_corrupt(backend):
    _setup(backend)
    content = backend.read("manifest.json")
    backend.write("manifest.json", content[: len(content) // 2])
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        _load_full(backend)
