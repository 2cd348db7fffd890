"""LOCAL's on-disk layout (FORMAT.md, "LOCAL checkpoints"): ``FlatLayout``, where each member parameter sits in a
flat parameter and which slice a rank holds, its JSON form, and the layouts a LOCAL checkpoint's tree stores.

This is the contract between the training runtime, which builds layouts (``build_layout``) and keeps its flat
parameters by them, and everything that reads LOCAL state (the state-dict code, the readers' by-parameter view,
offline conversion): plain data, JSON-able, identical on every rank. Pure: no I/O, no runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Hashable, Sequence

import torch

from shardckpt.errors import CorruptCheckpointError, ShardingError
from shardckpt.regions import Run

ALIGN_BYTES = 16
"""Every member starts at a multiple of 16 bytes of the master dtype, and every shard has a size that
is a multiple of it, so that a shard's start is aligned too."""
LAYOUTS_KEY = "_flat_layouts"
"""In a LOCAL model state dict (``tree.model`` of a LOCAL checkpoint): ``{flat key: FlatLayout.to_dict()}``."""
POSITIONS = "positions"
"""In each of them (optional): the members' places in the unsharded model's ``named_parameters()`` order."""


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the form layouts store."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShardingError(f"unknown dtype name {name!r} in a flat layout")
    return dtype


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one group's flat parameter.

    - `names`: FQNs of the member parameters relative to the ROOT module given to `shard`, as the
      unsharded model's `named_parameters()` gives them (a tied/shared parameter appears once, under
      its first name there).
    - `shapes`: each member's original shape.
    - `offsets`: each member's first element in the unsharded flat parameter; members follow one
      another in `names` order, each aligned up to `ALIGN_BYTES`; the gaps hold zeros.
    - `numel`: elements up to the end of the last member (alignment gaps included, tail padding not).
    - `padded_numel`: `numel` rounded up to a multiple of `world_size` alignment units; the tail holds zeros.
    - `world_size`: how many ranks the flat parameter is split across: the shard group's size
      (HYBRID_SHARD: the size of one replica's shard group; NO_SHARD: 1).
    - `shard_numel`: `padded_numel // world_size`. Shard-group rank r holds flat elements
      [r * shard_numel, (r + 1) * shard_numel); a shard may start or end inside a member.
    - `dtype`: the master dtype, as a string such as 'float32' (see `torch_dtype`).
    - `requires_grad`: False for a group of frozen parameters (they are never mixed with trainable ones).
    - `aliases`: per member, the other FQNs of the same (tied or shared) parameter, in
      `named_parameters(remove_duplicate=False)` order; usually empty tuples.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    padded_numel: int
    world_size: int
    shard_numel: int
    dtype: str
    requires_grad: bool = True
    aliases: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        count = len(self.names)
        if not self.aliases:
            object.__setattr__(self, "aliases", ((),) * count)
        if not (len(self.shapes) == len(self.offsets) == len(self.aliases) == count):
            raise ShardingError(f"flat layout has {count} names but {len(self.shapes)} shapes, "
                                f"{len(self.offsets)} offsets and {len(self.aliases)} alias lists")
        end = 0
        for name, shape, offset in zip(self.names, self.shapes, self.offsets):
            if offset < end or any(d < 0 for d in shape):
                raise ShardingError(f"flat layout member {name!r} overlaps the previous one or has a bad shape")
            end = offset + prod(shape)
        if self.world_size < 1 or self.numel < end or self.padded_numel < self.numel:
            raise ShardingError(f"flat layout sizes are inconsistent: members end at {end}, numel={self.numel}, "
                                f"padded_numel={self.padded_numel}, world_size={self.world_size}")
        if self.padded_numel != self.shard_numel * self.world_size:
            raise ShardingError(f"flat layout padded_numel={self.padded_numel} is not "
                                f"shard_numel={self.shard_numel} x world_size={self.world_size}")
        dtype_from_name(self.dtype)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(prod(shape) for shape in self.shapes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat [start, stop) held by shard-group rank `rank`."""
        if not 0 <= rank < self.world_size:
            raise ShardingError(f"rank {rank} is outside a flat layout of world size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def member(self, index: int, source: Hashable = None) -> Run:
        """Member `index` inside the flat parameter (named `source`): its elements [0, numel) are the flat
        parameter's [offset, offset + numel)."""
        return Run(source, self.offsets[index], 0, self.numels[index])

    def held(self, index: int, rank: int) -> Run | None:
        """The part of member `index` that shard-group rank `rank` holds: elements [at, at + count) of the
        member are elements [start, start + count) of the rank's flat shard; None where it holds none."""
        lo, hi = self.shard_range(rank)
        part = self.member(index).clip_source(lo, hi)
        return None if part is None else Run(None, part.start - lo, part.at, part.count)

    def at_world_size(self, world_size: int) -> FlatLayout:
        """The same members, offsets and dtype split across `world_size` ranks (only the tail padding changes)."""
        return build_layout(self.names, self.shapes, self.torch_dtype, world_size, requires_grad=self.requires_grad,
                            aliases=self.aliases)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (lists and strings only)."""
        return {
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "offsets": list(self.offsets),
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "world_size": self.world_size,
            "shard_numel": self.shard_numel,
            "dtype": self.dtype,
            "requires_grad": self.requires_grad,
            "aliases": [list(a) for a in self.aliases],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FlatLayout:
        """Inverse of `to_dict`; validates the result (raises ShardingError on inconsistent data)."""
        try:
            return cls(
                names=tuple(str(n) for n in data["names"]),
                shapes=tuple(tuple(int(d) for d in s) for s in data["shapes"]),
                offsets=tuple(int(o) for o in data["offsets"]),
                numel=int(data["numel"]),
                padded_numel=int(data["padded_numel"]),
                world_size=int(data["world_size"]),
                shard_numel=int(data["shard_numel"]),
                dtype=str(data["dtype"]),
                requires_grad=bool(data.get("requires_grad", True)),
                aliases=tuple(tuple(str(a) for a in al) for al in data.get("aliases", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardingError(f"malformed flat layout: {exc!r}") from exc


def build_layout(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    world_size: int,
    *,
    requires_grad: bool = True,
    aliases: Sequence[Sequence[str]] = (),
) -> FlatLayout:
    """Lay members out in order, each aligned to ALIGN_BYTES, and pad the tail for `world_size` equal shards."""
    align = max(1, ALIGN_BYTES // dtype.itemsize)
    offsets, end = [], 0
    for shape in shapes:
        offset = _round_up(end, align)
        offsets.append(offset)
        end = offset + prod(shape)
    padded = max(_round_up(end, align * world_size), align * world_size)
    return FlatLayout(
        names=tuple(names),
        shapes=tuple(tuple(int(d) for d in s) for s in shapes),
        offsets=tuple(offsets),
        numel=end,
        padded_numel=padded,
        world_size=world_size,
        shard_numel=padded // world_size,
        dtype=dtype_name(dtype),
        requires_grad=requires_grad,
        aliases=tuple(tuple(a) for a in aliases) if aliases else (),
    )


def is_local(tree: Any) -> bool:
    """Whether a checkpoint's tree is LOCAL state: its model entry stores flat layouts."""
    return isinstance(tree, dict) and isinstance(tree.get("model"), dict) and LAYOUTS_KEY in tree["model"]


def stored_layouts(tree: Any) -> dict[str, FlatLayout]:
    """The flat layouts a LOCAL checkpoint's tree stores (``model._flat_layouts``), by flat key, in stored
    order; {} when it stores none. One that is not a valid layout is a ``CorruptCheckpointError`` naming it."""
    model = tree.get("model") if isinstance(tree, dict) else None
    docs = model.get(LAYOUTS_KEY) if isinstance(model, dict) else None
    layouts = {}
    for key, doc in (docs.items() if isinstance(docs, dict) else ()):
        try:
            layouts[key] = FlatLayout.from_dict(doc)
        except ShardingError as e:
            raise CorruptCheckpointError(f"the checkpoint's model.{LAYOUTS_KEY}.{key} is not a valid flat "
                                         f"layout: {e}") from None
    return layouts


def param_order(local_model_state: dict, where: str = "a LOCAL model state dict") -> list[str] | None:
    """The unsharded model's ``named_parameters()`` names in order, from the places the flat layouts of a LOCAL
    model state dict record for their members (``positions``, by ``get_state_dict``); None if they record none
    (older state dicts). Places that do not number the members 0, 1, ... once each: ``CorruptCheckpointError``."""
    docs = local_model_state.get(LAYOUTS_KEY)
    if not isinstance(docs, dict) or not docs or not all(isinstance(d, dict) and POSITIONS in d for d in docs.values()):
        return None
    placed: dict[int, str] = {}
    count = 0
    for key, doc in docs.items():
        names, positions = doc.get("names"), doc[POSITIONS]
        if not (isinstance(names, list) and isinstance(positions, list) and len(positions) == len(names)
                and all(isinstance(p, int) and not isinstance(p, bool) for p in positions)):
            raise CorruptCheckpointError(f"{where}: {LAYOUTS_KEY}.{key}.{POSITIONS} is not one int per member")
        placed.update(zip(positions, names))
        count += len(names)
    if sorted(placed) != list(range(count)):
        raise CorruptCheckpointError(f"{where}: the {POSITIONS} of {LAYOUTS_KEY} do not number the parameters "
                                     "0, 1, ... once each")
    return [placed[i] for i in range(count)]
