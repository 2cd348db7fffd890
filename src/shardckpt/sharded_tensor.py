"""The wrappers ``shardckpt.save`` and ``load`` understand around a rank's values: ``ShardedTensor`` (one rank's
piece of a global tensor) and ``PerRank`` (a value of this rank's own, one per rank under one key)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shardckpt.regions import Box, FlatRange, Region, check_region, even_flat_shard


@dataclass(frozen=True)
class ShardedTensor:
    """A rank's local data plus the region of the global tensor it holds.

    - ``local``: the rank's elements. For a ``Box`` region its shape is the box's sizes; for a
      ``FlatRange`` it is 1-D, the region's elements in row-major order (a flat shard may start and
      end mid-row, as the runtime's flat parameters do).
    - ``global_shape``: the shape of the whole tensor.
    - ``region``: which elements ``local`` holds (see ``shardckpt.regions``).

    The regions of all ranks' ShardedTensors under one key must tile the tensor exactly (no gap, no
    partial overlap): ``save`` checks this. Ranks holding the very same region are replicas (e.g. the
    replica groups of HYBRID_SHARD); it is stored once. ``load`` fills ``local`` in place.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    region: Region

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(s) for s in self.global_shape))
        if not isinstance(self.local, torch.Tensor):
            raise TypeError(f"ShardedTensor.local must be a torch.Tensor, got {type(self.local).__name__}")
        check_region(self.region, self.global_shape)
        want = (self.region.numel,) if isinstance(self.region, FlatRange) else self.region.sizes
        if tuple(self.local.shape) != tuple(want):
            raise ValueError(f"ShardedTensor local shape {tuple(self.local.shape)} does not match its "
                             f"region {self.region} (expected {tuple(want)})")

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @classmethod
    def dim0_chunk(cls, local: torch.Tensor, global_shape: Sequence[int], index: int, count: int) -> ShardedTensor:
        """Chunk ``index`` of ``count`` along dim 0 with ``torch.chunk`` semantics (the last chunks may be empty)."""
        shape = tuple(global_shape)
        if not shape:
            return cls(local, shape, Box((), ()) if index == 0 else FlatRange(0, 0))
        rows = -(-shape[0] // count)
        first, last = min(index * rows, shape[0]), min((index + 1) * rows, shape[0])
        return cls(local, shape, Box((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:]))

    @classmethod
    def from_full(cls, full: torch.Tensor, index: int, count: int) -> ShardedTensor:
        """The dim-0 chunk ``index`` of ``count`` of a full tensor (a view, no copy)."""
        shape = tuple(full.shape)
        if not shape:
            return cls.dim0_chunk(full if index == 0 else full.reshape(-1)[:0], shape, index, count)
        rows = -(-shape[0] // count)
        return cls.dim0_chunk(full[index * rows:(index + 1) * rows], shape, index, count)

    @classmethod
    def flat(cls, local: torch.Tensor, global_shape: Sequence[int], start: int) -> ShardedTensor:
        """Elements ``[start, start + local.numel())`` of the global tensor in row-major order."""
        return cls(local, tuple(global_shape), FlatRange(start, start + local.numel()))

    @classmethod
    def even_flat_shard(cls, full: torch.Tensor, index: int, count: int) -> ShardedTensor:
        """Shard ``index`` of ``count`` equal flat shards of a full tensor (a view, no copy)."""
        region = even_flat_shard(full.numel(), index, count)
        return cls(full.reshape(-1)[region.start:region.stop], tuple(full.shape), region)


@dataclass
class PerRank:
    """This rank's own value under a key whose value differs from rank to rank (RNG state, a data loader's
    position). Every rank puts a ``PerRank`` under the same key; ``value`` is any savable value of this rank
    (whole tensors, JSON-able values, nested containers of both; no ``ShardedTensor``/DTensor, no nested
    ``PerRank``). The checkpoint stores one value per saving rank.

    ``load`` into a ``PerRank`` gives rank ``r`` the value saved by rank ``r`` (tensors filled in place, plain
    values replaced in ``value``), whatever the world size: a smaller world leaves the values of the missing
    ranks unread; in a larger one, a rank the save did not have raises ``IncompatibleCheckpointError`` unless
    ``strict=False``, which leaves its ``value`` as it is. ``load_full`` gives every rank's value, as a list
    by rank.
    """

    value: Any
