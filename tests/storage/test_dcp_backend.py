"""shardckpt's DCP backend on every storage backend (local, memory://, S3 on moto): dcp.save writes through it,
verify and dcp.load read it back bit for bit, and a second save without overwrite leaves the first whole."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardckpt
from shardckpt.dcp import StorageReader, StorageWriter

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_dcp_save_and_load_through_the_backend_on_every_store(backend):
    sd = {"model": {"w": torch.randn(33, 5), "b": torch.arange(3, dtype=torch.bfloat16)}, "step": 4}
    dcp.save(sd, storage_writer=StorageWriter(backend.url, compress="zstd", storage_options=backend.options))
    assert "manifest.json" in backend.files() and backend.data_files()
    assert shardckpt.verify(backend.url, storage_options=backend.options).ok
    with pytest.raises(BaseException, match="already exists"):
        dcp.save({"model": {"w": torch.zeros(33, 5), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 5},
                 storage_writer=StorageWriter(backend.url, storage_options=backend.options))
    target = {"model": {"w": torch.zeros(33, 5), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(target, storage_reader=StorageReader(backend.url, storage_options=backend.options))
    assert torch.equal(target["model"]["w"], sd["model"]["w"]) and torch.equal(target["model"]["b"], sd["model"]["b"])
    assert target["step"] == 4
