"""FORMAT.md's worked example is true: writing that checkpoint gives exactly the bytes and numbers shown."""
from __future__ import annotations

import os
import re
import types

import torch

import shardckpt
from shardckpt.checkpoint import commit as commit_module, save as save_module
from shardckpt.format.checksum import crc32c, crc32c_shift

FORMAT_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "FORMAT.md")
GENERATION = "0123456789abcdef"
SEAL_LEN = len('{"crc32c":"00000000",')


def example(tmp: str, monkeypatch) -> dict[str, str]:
    """The example checkpoint's files and checksum steps, as FORMAT.md shows them."""
    monkeypatch.setattr(save_module.uuid, "uuid4", lambda: types.SimpleNamespace(hex=GENERATION + "0" * 16))
    monkeypatch.setattr(commit_module, "__version__", "0.1.0")  # the example names a fixed writer version
    path = os.path.join(tmp, "example")
    shardckpt.save({"w": torch.tensor([[1.0, 2.0], [3.0, -0.5]]), "lr": 0.5, "step": 7}, path, files_per_rank=1)
    data_dir = os.path.join(path, f"data-{GENERATION}")
    data = open(os.path.join(data_dir, "rank-00000-0.bin"), "rb").read()
    rows = [data[:8], data[8:16]]
    crcs = [crc32c(r) for r in rows]
    term0 = crc32c_shift(crcs[0], 8)
    manifest = open(os.path.join(path, "manifest.json"), "rb").read().decode()
    return {
        "manifest": manifest,
        "manifest size": f"`manifest.json` (one line; {len(manifest.encode())} bytes)",
        "index": open(os.path.join(data_dir, "rank-00000-0.index.json"), "rb").read().decode(),
        "data": " ".join(f"{b:02x}" for b in data),
        "row0": f"crc(row 0) = 0x{crcs[0]:08x}",
        "row1": f"crc(row 1) = 0x{crcs[1]:08x}",
        "term0": f"shift(0x{crcs[0]:08x}, 8) = 0x{term0:08x}",
        "tensor": f"0x{term0:08x} xor 0x{crcs[1]:08x} = 0x{term0 ^ crcs[1]:08x}",
        "whole": f"crc32c(all 16 bytes) = 0x{crc32c(data):08x}",
        "manifest_crc": f"crc32c(manifest bytes 21..end) = 0x{crc32c(manifest.encode()[SEAL_LEN:]):08x}",
    }


def test_worked_example_matches_what_shardckpt_writes(tmp_path, monkeypatch):
    doc = open(FORMAT_MD).read()
    shown = example(str(tmp_path), monkeypatch)
    for what, text in shown.items():
        assert text in doc, f"FORMAT.md's worked example is out of date ({what}): expected to find\n{text}"
    # The combined tensor checksum is the one the manifest records, and the direct CRC of the bytes.
    whole = re.search(r"0x([0-9a-f]{8})$", shown["whole"]).group(1)
    assert shown["tensor"].endswith(whole) and str(int(whole, 16)) in shown["manifest"]
