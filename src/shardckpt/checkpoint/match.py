"""Matching a state dict's leaves to a checkpoint: one read request per tensor leaf, the saved plain values."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from shardckpt.checkpoint.collect import is_tensor_like, to_piece
from shardckpt.errors import IncompatibleCheckpointError, key_mismatch
from shardckpt.format.tree import Path, TensorRef, leaves, path_name
from shardckpt.formats.api import ReadRequest, TensorInfo


@dataclass
class Matched:
    requests: list[ReadRequest]
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # (caller's non-contiguous tensor, contiguous copy read into)
    values: list[tuple[Path, Any]]  # where the saved plain values go

    def write_back(self) -> None:
        """Copy staged reads into the caller's tensors (after every read succeeded)."""
        with torch.no_grad():
            for dest, copy in self.staged:
                dest.copy_(copy.view(dest.shape))


def _request(path: Path, value: Any, entry: TensorInfo, strict: bool, staged: list) -> ReadRequest:
    piece = to_piece(path, value)
    name = piece.name
    if piece.shape != entry.shape:
        raise IncompatibleCheckpointError(f"tensor {name!r}: the checkpoint holds shape {list(entry.shape)}, the "
                                          f"state dict expects {list(piece.shape)}")
    dest = piece.data.detach()
    if dest.dtype != entry.dtype and strict:
        raise IncompatibleCheckpointError(f"tensor {name!r}: the checkpoint holds {entry.dtype}, the state dict "
                                          f"expects {dest.dtype} (load with strict=False to cast)")
    if not dest.is_contiguous():
        staged.append((dest, dest.contiguous()))
        dest = staged[-1][1]
    return ReadRequest(entry.name, piece.region, dest)


def match(tree: Any, tensors: Mapping[str, TensorInfo], state_dict: dict, strict: bool) -> Matched:
    """Requests for the tensors and ``(path, saved value)`` for the plain values; strict raises on any mismatch.

    ``tree`` and ``tensors`` are a reader's (``CheckpointReader.tree()``/``tensors()``; for shardckpt's own
    format the manifest's tree and entries, which have the same fields)."""
    saved = {path_name(p): v for p, v in leaves(tree, lambda v: isinstance(v, TensorRef))}
    wanted = list(leaves(state_dict, is_tensor_like))
    names = {path_name(p) for p, _ in wanted}
    out, missing = Matched([], [], []), []
    for path, value in wanted:
        name = path_name(path)
        if name not in saved:
            missing.append(name)
            continue
        stored = saved[name]
        if is_tensor_like(value) != isinstance(stored, TensorRef):
            kinds = ("a tensor", "a plain value")
            raise IncompatibleCheckpointError(
                f"{name!r}: the checkpoint holds {kinds[not isinstance(stored, TensorRef)]}, the state dict "
                f"{kinds[not is_tensor_like(value)]}")
        if isinstance(stored, TensorRef):
            out.requests.append(_request(path, value, tensors[stored.name], strict, out.staged))
        else:
            out.values.append((path, stored))
    unexpected = sorted(set(saved) - names)
    if strict and (missing or unexpected):
        raise key_mismatch("state dict and checkpoint do not match (missing: in the state dict, not the "
                           "checkpoint)", missing, unexpected, "Pass strict=False to load the keys both have.")
    return out
