"""Matching a state dict's leaves to a checkpoint: one read request per tensor leaf, the saved plain values.

A ``PerRank`` leaf of rank ``r`` matches the value rank ``r`` saved under its key (``format.tree.PerRankValues``):
its own tensors and plain values, named as stored (``rng.1``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from shardckpt.checkpoint.collect import is_saved_leaf, is_tensor_like, to_piece
from shardckpt.errors import IncompatibleCheckpointError, key_mismatch
from shardckpt.format.tree import Path, PerRankValues, TensorRef, leaf_groups, leaf_path, leaves, path_name, set_at
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.regions import FlatRange
from shardckpt.sharded_tensor import PerRank
from shardckpt.tensor_views import copy_into


@dataclass
class Matched:
    requests: list[ReadRequest]
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # (caller's non-contiguous tensor, contiguous copy read into)
    values: list[tuple[Any, Path, Any]]  # (state dict or PerRank, path in it, saved plain value)

    def write_back(self) -> None:
        """Copy staged reads into the caller's tensors and set the plain values (after every read succeeded)."""
        with torch.no_grad():
            for dest, copy in self.staged:
                copy_into(dest, copy.view(dest.shape))
        for root, path, value in self.values:
            if isinstance(root, PerRank) and not path:
                root.value = value
            else:
                set_at(root.value if isinstance(root, PerRank) else root, path, value)


def _request(name: str, value: Any, entry: TensorInfo, strict: bool, staged: list) -> ReadRequest:
    """The request filling ``value``, the state dict's leaf named ``name``, from the saved ``entry``."""
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:  # the common case: no piece made
        # (detached only where autograd tracks it: a detach costs ~1 us, and the caller's own tensor is the one filled)
        dest = value.detach() if value.requires_grad else value
        shape, region = value.shape, FlatRange(0, value.numel())
    else:
        piece = to_piece(name, value)
        shape, region, dest = piece.shape, piece.region, piece.data
    if shape != entry.shape:
        raise IncompatibleCheckpointError(f"tensor {name!r}: the checkpoint holds shape {list(entry.shape)}, the "
                                          f"state dict expects {list(shape)}")
    if dest.dtype != entry.dtype and strict:
        raise IncompatibleCheckpointError(f"tensor {name!r}: the checkpoint holds {entry.dtype}, the state dict "
                                          f"expects {dest.dtype} (load with strict=False to cast)")
    if not dest.is_contiguous():
        if _shares_memory(dest):
            raise ValueError(f"tensor {name!r}: the state dict's tensor has elements that share memory (an expand()ed "
                             "or stride-0 view), so it cannot hold the saved values; give it memory of its own "
                             "(e.g. .clone())")
        staged.append((dest, dest.contiguous()))
        dest = staged[-1][1]
    return ReadRequest(entry.name, region, dest)


def _shares_memory(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one memory location (an ``expand``, an overlapping ``unfold`` or
    ``as_strided``): the write-back would leave one of their values, silently."""
    verdict = torch._debug_has_internal_overlap(t)  # 0: no, 1: yes, 2: torch cannot tell cheaply
    if verdict != 2 or t.numel() <= 1:
        return verdict == 1
    reach = 0  # dims by stride, smallest first: each steps past every offset the dims before it reach
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False  # (every slicing, transpose and channels_last layout)
    offsets = torch.zeros((), dtype=torch.int64)  # else count the distinct element offsets (rare layouts)
    for stride, size in zip(t.stride(), t.shape):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.unique().numel() != t.numel()


def _is_stored_leaf(value: Any) -> bool:
    return isinstance(value, (TensorRef, PerRankValues))


def match(tree: Any, tensors: Mapping[str, TensorInfo], state_dict: dict, strict: bool, rank: int = 0) -> Matched:
    """Requests for the tensors and where the saved plain values go; strict raises on any mismatch. ``rank``: the
    loading rank, whose ``PerRank`` leaves take the values the rank of that number saved.

    ``tree`` and ``tensors`` are a reader's (``CheckpointReader.tree()``/``tensors()``; for shardckpt's own
    format the manifest's tree and entries, which have the same fields)."""
    out = Matched([], [], [])
    saved: dict[str, Any] = {}
    for _, _, names, values in leaf_groups(tree, _is_stored_leaf):
        saved.update(zip(names, values))
    wanted = [(leaf_path(parent, keys, i), name, value)
              for parent, keys, names, values in leaf_groups(state_dict, is_saved_leaf)
              for i, (name, value) in enumerate(zip(names, values))]
    missing, unexpected = _match_leaves(saved, wanted, state_dict, 0, tensors, strict, rank, out)
    if strict and (missing or unexpected):
        raise key_mismatch("state dict and checkpoint do not match (missing: in the state dict, not the "
                           "checkpoint)", missing, unexpected, "Pass strict=False to load the keys both have.")
    return out


def _match_leaves(saved: dict[str, Any], wanted: list[tuple[Path, str, Any]], root: Any, skip: int,
                  tensors: Mapping[str, TensorInfo], strict: bool, rank: int, out: Matched) -> tuple[list, list]:
    """Match ``wanted`` leaves (``(path, name, value)``, paths from the top; ``root`` holds them below the first
    ``skip`` keys) to the ``saved`` leaves by name; returns the names missing and unexpected."""
    missing, unexpected = [], []
    names = set()
    for path, name, value in wanted:
        names.add(name)
        if name not in saved:
            missing.append(name)
            continue
        stored = saved[name]
        if isinstance(value, PerRank) or isinstance(stored, PerRankValues):
            more = _match_per_rank(path, value, stored, tensors, strict, rank, out)
            missing += more[0]
            unexpected += more[1]
        elif is_tensor_like(value) != isinstance(stored, TensorRef):
            kinds = ("a tensor", "a plain value")
            raise IncompatibleCheckpointError(
                f"{name!r}: the checkpoint holds {kinds[not isinstance(stored, TensorRef)]}, the state dict "
                f"{kinds[not is_tensor_like(value)]}")
        elif isinstance(stored, TensorRef):
            out.requests.append(_request(name, value, tensors[stored.name], strict, out.staged))
        else:
            out.values.append((root, path[skip:], stored))
    return missing, unexpected + sorted(set(saved) - names)


def _match_per_rank(path: Path, value: Any, stored: Any, tensors: Mapping[str, TensorInfo], strict: bool,
                    rank: int, out: Matched) -> tuple[list, list]:
    name = path_name(path)
    if not isinstance(value, PerRank):
        raise IncompatibleCheckpointError(
            f"{name!r}: the checkpoint holds per-rank values (one per saving rank, {len(stored)}): load this "
            "rank's into a shardckpt.PerRank(...) under that key, or every rank's with load_full")
    if not isinstance(stored, PerRankValues):
        raise IncompatibleCheckpointError(f"{name!r}: the checkpoint holds one value for all ranks, not per-rank "
                                          "values: load it without shardckpt.PerRank")
    if rank >= len(stored):
        if strict:
            raise IncompatibleCheckpointError(
                f"{name!r}: its per-rank values were saved by {len(stored)} ranks, so rank {rank} has none; load "
                "with strict=False to keep this rank's value as it is")
        return [], []
    mine = path + (rank,)
    saved = {path_name(p): v for p, v in leaves(stored[rank], lambda v: isinstance(v, TensorRef), mine)}
    wanted = [(p, path_name(p), v) for p, v in leaves(value.value, is_tensor_like, mine)]
    return _match_leaves(saved, wanted, value, len(mine), tensors, strict, rank, out)
