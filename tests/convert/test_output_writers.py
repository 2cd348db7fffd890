"""Each output format is a writer behind ``checkpoint.persist``'s one seam: shardckpt chunks (a save's, a
conversion's), a torch DCP directory, safetensors files on local disk and on object stores. Each is driven here
by ``persist`` alone, from a source held in memory (no checkpoint on disk), and what it commits reads back."""
from __future__ import annotations

import json
import uuid

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardckpt
from shardckpt.checkpoint.persist import OutputWriter, persist
from shardckpt.checkpoint.save import _Saved
from shardckpt.dist.group import resolve_group
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import Facts, ReadRequest, TensorInfo
from shardckpt.formats.detect import open_reader
from shardckpt.formats.safetensors_header import INDEX_NAME
from shardckpt.io import open_storage
from shardckpt.offline.chunk_output import ConvertedChunks
from shardckpt.offline.convert_plan import plan_conversion
from shardckpt.offline.dcp_output import DcpOutput
from shardckpt.offline.export_commit import Beside, ExportFiles, LocalExport, PlannedFile, RemoteExport, index_bytes
from shardckpt.offline.memory import SliceBuffers
from shardckpt.offline.safetensors_files import header_bytes, write_file
from shardckpt.offline.spec import ConvertSpec
from shardckpt.offline.streams import Output, ReadOnDemand
from shardckpt.regions import contiguous_runs, full_region

VALUES = {"model.w": torch.arange(30.0).reshape(10, 3), "model.b": torch.tensor([1.0, -2.0, 3.0]),
          "model.ids": torch.arange(5)}


class MemoryReader:
    """A source held in memory: its tensors by name, read by region."""

    def tensors(self):
        return {name: TensorInfo(name, t.dtype, tuple(t.shape), None) for name, t in VALUES.items()}

    def tree(self):
        return {"model": {name.split(".", 1)[1]: TensorRef(name) for name in VALUES}, "step": 3}

    def facts(self):
        return Facts("memory", "memory")

    def read(self, requests):
        for r in requests:
            flat = VALUES[r.tensor].reshape(-1)
            parts = [flat[start:start + n] for start, _, n in contiguous_runs(r.region, VALUES[r.tensor].shape)]
            r.dest.reshape(-1).copy_(torch.cat(parts))


def test_every_format_is_a_writer_behind_the_one_seam():
    assert all(issubclass(w, OutputWriter) for w in (_Saved, ConvertedChunks, DcpOutput, LocalExport, RemoteExport))


def test_a_conversions_chunks(tmp_path):
    plan = plan_conversion(MemoryReader(), ConvertSpec("memory", tmp_path / "out", world_size=3))
    seen = []
    writer = ConvertedChunks(plan, open_storage(tmp_path / "out"), resolve_group(None), lambda d, t: seen.append(d))
    persist(writer)
    got = shardckpt.load_full(tmp_path / "out")
    assert all(torch.equal(got["model"][n.split(".", 1)[1]], v) for n, v in VALUES.items()) and got["step"] == 3
    assert writer.kept_ranks == () and seen[-1] == plan.tensor_bytes


def test_a_dcp_directory(tmp_path):
    plan = plan_conversion(MemoryReader(), ConvertSpec("memory", tmp_path / "dcp", world_size=2, format="dcp"))
    persist(DcpOutput(plan, open_storage(tmp_path / "dcp"), None))
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    assert all(torch.equal(got["model"][n.split(".", 1)[1]], v) for n, v in VALUES.items()) and got["step"] == 3


def _export_files(storage) -> tuple[ExportFiles, ReadOnDemand]:
    infos = MemoryReader().tensors()
    tensors = [Output(name, (), info, torch.bfloat16 if info.dtype.is_floating_point else info.dtype)
               for name, info in infos.items()]
    files = [PlannedFile(name, header_bytes(members, {"format": "pt", "export_id": "x"}), members)
             for name, members in (("model-00001-of-00002.safetensors", tensors[:2]),
                                   ("model-00002-of-00002.safetensors", tensors[2:]))]
    index = index_bytes(files, sum(t.nbytes for t in tensors), "x")
    pieces = ReadOnDemand(MemoryReader(), {t.name: t for t in tensors}, None, lambda n: None, SliceBuffers(1, 256))
    return ExportFiles(files, index, Beside({"config.json": b"{}"}), [], False, False), pieces


@pytest.mark.parametrize("where", ["local", "memory"])
def test_safetensors_files_index_last(tmp_path, where):
    url = str(tmp_path / "hf") if where == "local" else f"memory://writers-{uuid.uuid4().hex[:8]}"
    storage = open_storage(url)
    planned, pieces = _export_files(storage)
    skipped = []

    def write(storage, path, f):
        write_file(storage, path, f.header, f.members, pieces)

    writer = LocalExport(storage, planned, write, skipped.append, "t") if where == "local" else \
        RemoteExport(storage, planned, write, skipped.append)
    persist(writer)
    assert writer.kept == () and skipped == [] and storage.read_bytes("config.json") == b"{}"
    assert json.loads(storage.read_bytes(INDEX_NAME))["weight_map"] == {
        "model.w": "model-00001-of-00002.safetensors", "model.b": "model-00001-of-00002.safetensors",
        "model.ids": "model-00002-of-00002.safetensors"}
    reader = open_reader(url)
    for name, info in reader.tensors().items():
        got = torch.empty(info.shape, dtype=info.dtype)
        reader.read([ReadRequest(name, full_region(info.shape), got)])
        want = VALUES[name]
        assert torch.equal(got, want.to(torch.bfloat16) if want.is_floating_point() else want), name
