"""open_reader: which format a path holds, for local paths and fsspec URLs (formats/detect.py)."""
from __future__ import annotations

import json
import uuid

import fsspec
import pytest
import safetensors.torch
import torch

import shardckpt
from shardckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.formats import detect
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.detect import DIRECTORY_DETECTORS, FILE_DETECTORS, open_reader
from shardckpt.formats.native import NativeReader
from shardckpt.formats.safetensors import SafetensorsReader
from shardckpt.formats.safetensors_header import INDEX_NAME
from shardckpt.formats.torch_save import TorchSaveReader
from shardckpt.regions import FlatRange

W = torch.arange(12, dtype=torch.float32).reshape(3, 4)


def _reads_w(reader, name="w"):
    dest = torch.empty(5)
    reader.read([ReadRequest(name, FlatRange(3, 8), dest)])
    assert torch.equal(dest, W.reshape(-1)[3:8])


def test_shardckpt_checkpoint(tmp_path):
    shardckpt.save({"w": W, "step": 3}, tmp_path / "ck")
    reader = open_reader(tmp_path / "ck", io_threads=2, verify=True)
    assert isinstance(reader, NativeReader) and reader.io_threads == 2 and reader.tree()["step"] == 3
    _reads_w(reader)


def test_safetensors_file_directory_and_index(tmp_path):
    safetensors.torch.save_file({"w": W}, str(tmp_path / "model.safetensors"))
    for path in (tmp_path / "model.safetensors", tmp_path, f"file://{tmp_path}"):
        reader = open_reader(path)
        assert isinstance(reader, SafetensorsReader)
        _reads_w(reader)
    sharded = tmp_path / "hf"
    sharded.mkdir()
    safetensors.torch.save_file({"w": W}, str(sharded / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file({"v": W * 2}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors",
                                                                 "v": "model-00002-of-00002.safetensors"}}))
    reader = open_reader(sharded)
    assert isinstance(reader, SafetensorsReader) and set(reader.tensors()) == {"w", "v"}
    _reads_w(reader)


def test_safetensors_without_its_suffix_is_recognised_by_its_header(tmp_path):
    safetensors.torch.save_file({"w": W}, str(tmp_path / "weights.bin"))
    reader = open_reader(tmp_path / "weights.bin")
    assert isinstance(reader, SafetensorsReader)
    _reads_w(reader)


def test_safetensors_on_a_memory_url(tmp_path):
    root = f"memory://detect-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        fs.pipe_file(f"{root}/hf/model.safetensors", safetensors.torch.save({"w": W}))
        for path in (f"{root}/hf", f"{root}/hf/model.safetensors"):
            reader = open_reader(path)
            assert isinstance(reader, SafetensorsReader)
            _reads_w(reader)
        fs.pipe_file(f"{root}/plain/notes.txt", b"hello")
        with pytest.raises(CheckpointNotFoundError, match="Looked for"):
            open_reader(f"{root}/plain")
        with pytest.raises(CheckpointNotFoundError, match="Looked for"):
            open_reader(f"{root}/plain/notes.txt")
        torch_file = tmp_path / "ck.pt"
        torch.save({"w": W}, torch_file)
        fs.pipe_file(f"{root}/ck.pt", torch_file.read_bytes())
        with pytest.raises(CheckpointError, match="copy it to a local file"):
            open_reader(f"{root}/ck.pt")
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize("legacy", [False, True])
def test_torch_save_files(tmp_path, legacy):
    path = tmp_path / "anything.bin"
    torch.save({"w": W, "nested": [W]}, path, _use_new_zipfile_serialization=not legacy)
    reader = open_reader(path)
    assert isinstance(reader, TorchSaveReader) and set(reader.tensors()) == {"w", "nested.0"}
    _reads_w(reader)


def test_a_directory_holding_a_checkpoint_file_is_not_that_checkpoint_unless_it_is_safetensors(tmp_path):
    torch.save({"w": W}, tmp_path / "ck.pt")
    with pytest.raises(CheckpointNotFoundError):
        open_reader(tmp_path)
    assert isinstance(open_reader(tmp_path / "ck.pt"), TorchSaveReader)


@pytest.mark.parametrize("make", [
    pytest.param(lambda p: (p / "x.txt").write_text("just text, no checkpoint"), id="text-file"),
    pytest.param(lambda p: (p / "x.txt").write_bytes(b""), id="empty-file"),
    pytest.param(lambda p: (p / "x.txt").write_bytes(b"PK\x05\x06" + bytes(18)), id="other-zip-record"),
    pytest.param(lambda p: (p / "x.txt").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]"), id="json-array"),
])
def test_an_unknown_file_is_refused_listing_what_was_looked_for(tmp_path, make):
    make(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as info:
        open_reader(tmp_path / "x.txt")
    text = str(info.value)
    assert str(tmp_path / "x.txt") in text
    for what in ("manifest.json", INDEX_NAME, ".safetensors", "torch.save"):
        assert what in text
    assert len(text.replace(str(tmp_path / "x.txt"), "")) < 250, text  # a short list (was 480 characters)


def test_missing_paths_and_empty_directories_are_not_checkpoints(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"missing: no such file or directory$"):
        open_reader(tmp_path / "missing")  # not the list of formats: there is nothing to look at
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint format"):
        open_reader(tmp_path / "empty")


def test_a_recognised_but_broken_file_reports_the_damage(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(CorruptCheckpointError, match="header length"):
        open_reader(tmp_path / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="header length"):
        open_reader(tmp_path)  # the directory's one safetensors file
    (tmp_path / "b.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(CheckpointNotFoundError, match="exactly one"):
        open_reader(tmp_path)


def test_the_detector_tables_take_a_new_format(tmp_path, monkeypatch):
    assert all(isinstance(what, str) and callable(fn) for what, fn in DIRECTORY_DETECTORS + FILE_DETECTORS)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "other.meta").write_bytes(b"...")
    sentinel = object()

    def other(place):
        return sentinel if place.storage.exists("other.meta") else None

    monkeypatch.setattr(detect, "DIRECTORY_DETECTORS", [*DIRECTORY_DETECTORS, ("another format", other)])
    assert open_reader(tmp_path / "other") is sentinel
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="another format"):
        open_reader(tmp_path / "nothing")


def test_a_dcp_directory_is_detected(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CorruptCheckpointError, match=".metadata"):  # recognised as DCP, reported as damaged
        open_reader(tmp_path / "dcp")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="torch DCP"):
        open_reader(tmp_path / "nothing")
