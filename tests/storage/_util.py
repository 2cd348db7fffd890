"""Helpers shared by the storage tests (importable by worker processes too)."""
from __future__ import annotations

import json

import torch

from shardckpt.tensor_views import as_bytes


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a.contiguous()), as_bytes(b.contiguous()))


def assert_tree_equal(got, want, path: str = "") -> None:
    """Bit-exact equality of nested state dicts (tensors by bytes, NaNs included)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert same_bits(got, want), f"{path}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_tree_equal(got[k], want[k], f"{path}.{k}" if path else str(k))
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_tree_equal(g, w, f"{path}.{i}")
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} != {want!r}"


def zeros_like_tree(tree):
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v) for k, v in tree.items()}
    return tree


def index_rows(data: bytes) -> list[list]:
    """``[name, chunk, offset, length, crc32c, codec, block_crcs]`` rows of a chunk index file."""
    return json.loads(data)["chunks"]


def manifest_doc(data: bytes) -> dict:
    """A manifest's JSON object without its checksum field (edit it, then write ``sealed(doc)``)."""
    doc = json.loads(data)
    doc.pop("crc32c", None)
    return doc


def sealed(doc: dict) -> bytes:
    """Manifest bytes with a valid checksum: edits made this way test validation, not the checksum."""
    from shardckpt.format.manifest import seal

    return seal(json.dumps(doc, separators=(",", ":")).encode())
