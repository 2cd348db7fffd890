"""``tiers.copy.check_file``, the check every replica and upload passes: it must accept a compressed checkpoint's
files (byte-plane codecs decode with the tensor's item size) and refuse one flipped byte."""
from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt.format.manifest import MANIFEST_NAME, parse_manifest
from shardckpt.io import LocalStorage
from shardckpt.tiers.copy import check_file


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_check_file_accepts_each_file_and_refuses_a_flipped_byte(tmp_path, compress):
    torch.manual_seed(0)
    sd = {"w": torch.randn(64, 33).to(torch.bfloat16), "b": torch.zeros(1000, dtype=torch.float64),
          "i": torch.arange(300, dtype=torch.int32)}
    path = str(tmp_path / "ckpt")
    shardckpt.save(sd, path, compress=compress)
    storage = LocalStorage(path)
    manifest = parse_manifest(storage.read_bytes(MANIFEST_NAME), path)
    for file in manifest.files:
        check_file(storage, manifest, file)
    target = os.path.join(path, manifest.files[0].path)
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(target, "wb").write(bytes(data))
    with pytest.raises(shardckpt.CorruptCheckpointError, match=manifest.files[0].path):
        check_file(storage, manifest, manifest.files[0])
