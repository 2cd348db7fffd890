"""Helpers the test directories share (importable by worker processes too): damaging one stored byte, reading a
committed manifest, naming a saved training state, and checking that one resumes exactly."""
from __future__ import annotations

import json
import os
from typing import Any

from shardckpt.format.manifest import MANIFEST_NAME, Manifest


def flipped(data: bytes, at: int, mask: int = 0x10) -> bytes:
    """``data`` with the bits ``mask`` of byte ``at`` flipped (``mask`` != 0, so the byte changes)."""
    out = bytearray(data)
    out[at] ^= mask
    return bytes(out)


def flip_byte(file: str | os.PathLike, at: int, mask: int = 0x10) -> None:
    """Flip the bits ``mask`` of byte ``at`` of a local file, in place."""
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(flipped(data, at, mask))


def manifest_of(path: str | os.PathLike) -> Manifest:
    """The checkpoint's committed manifest, parsed and validated."""
    from shardckpt.formats.native import read_manifest
    from shardckpt.io import open_storage

    return read_manifest(open_storage(path))


def manifest_json(path: str | os.PathLike) -> dict:
    """The checkpoint's committed manifest as plain JSON (its checksum field included)."""
    with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as f:
        return json.load(f)


def state_path(root: str, sd_type: Any, key: Any) -> str:
    """Where a test saves training state of ``sd_type`` with optimizer state keyed by ``key``."""
    return f"{root}/{sd_type.name}-{key.name}"


def load_state_matches(path: str, want: dict, where: str) -> None:
    """In a rank: a fresh run's ``load_state`` of ``path`` gives ``want`` (rank 0's full state), bit for bit."""
    import torch.distributed as dist

    import shardckpt
    from tests.state_dict._train import assert_same_state, full_state, new_run

    model, optim = new_run()
    shardckpt.load_state(model, optim, path)
    got = full_state(model, optim)  # on rank 0 only
    if dist.get_rank() == 0:
        assert_same_state(got, want, f"{where}, loaded at ws {dist.get_world_size()}")
