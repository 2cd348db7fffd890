"""Where each parameter's elements lie in DeepSpeed ZeRO's per-rank fp32 partitions (pure: no I/O).

The two layouts, as DeepSpeed writes them and its ``zero_to_fp32`` reads them back:

- **ZeRO-1 and -2**: per param group, the parameters (``param_shapes[g]``, in order) are laid end to end in
  one flat vector, each followed by its alignment padding (``param_alignment_paddings[g][i]``, where recorded),
  the group padded at its end; the vector is cut into ``world_size`` consecutive partitions, rank ``r``
  keeping the ``r``-th (``single_partition_of_fp32_groups[g]``). A parameter may span ranks.
- **ZeRO-3**: every parameter is cut on its own into ``world_size`` pieces of ``ceil(numel / world_size)``
  elements (the last padded); rank ``r`` keeps piece ``r`` of every parameter, end to end in parameter order,
  in its flat sub-groups (``fp32_flat_groups``, the same sizes on every rank), which a parameter may span.

A parameter's segments are ``regions.Run``s: elements ``[at, at + count)`` of the parameter (row-major) are
elements ``[start, start + count)`` of source ``(rank, flat)``, rank ``rank``'s flat tensor ``flat`` (a param
group's partition, or a sub-group). Optimizer state (``exp_avg``...) has the partitions' layout, so the same
segments locate it. A layout that does not add up (a parameter running past
the partitions, elements left over) is a ``CorruptCheckpointError``, as ``zero_to_fp32`` refuses it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping, Sequence

from shardckpt.errors import CorruptCheckpointError
from shardckpt.regions import Run, cut

Shapes = Mapping[str, tuple[int, ...]]


def zero12_segments(group_shapes: Sequence[Shapes], partition_sizes: Sequence[Sequence[int]],
                    paddings: Sequence[Sequence[int]] | None, where: str) -> dict[str, list[Run]]:
    """ZeRO-1/2: ``partition_sizes[r][g]`` is rank ``r``'s partition of group ``g``; ``paddings[g][i]`` the
    alignment padding after parameter ``i`` of group ``g`` (None: not recorded, none)."""
    out: dict[str, list[Run]] = {}
    world = len(partition_sizes)
    if paddings is not None and len(paddings) != len(group_shapes):
        raise CorruptCheckpointError(f"{where}: alignment paddings for {len(paddings)} param groups, "
                                     f"{len(group_shapes)} groups of parameters")
    for g, shapes in enumerate(group_shapes):
        sizes = [partition_sizes[r][g] for r in range(world)]
        starts = [0] + list(itertools.accumulate(sizes))
        total = starts[-1]
        pads = paddings[g] if paddings is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise CorruptCheckpointError(f"{where}: param group {g} records {len(pads)} alignment paddings for "
                                         f"{len(shapes)} parameters")
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            numel = math.prod(shape)
            if offset + numel > total:
                raise CorruptCheckpointError(f"{where}: parameter {name!r} (shape {list(shape)}) runs past the "
                                             f"{total} elements of param group {g}'s partitions")
            # the group's partitions, rank after rank, are one vector: part r is rank r's
            _add(out, name, [dataclasses.replace(run, source=(run.source, g))
                             for run in cut(offset, offset + numel, starts)], where)
            offset += numel + pad
        align = 2 * world  # DeepSpeed pads a group to this multiple (zero_to_fp32 checks the same)
        if -(-offset // align) != -(-total // align):
            raise CorruptCheckpointError(f"{where}: param group {g}'s parameters fill {offset} of its {total} "
                                         "partitioned elements: the shapes do not match the partitions")
    return out


def zero3_segments(shapes: Shapes, flat_sizes: Sequence[int], world: int, where: str) -> dict[str, list[Run]]:
    """ZeRO-3: ``flat_sizes`` are the sizes of each rank's flat sub-groups (the same on every rank)."""
    starts = [0] + list(itertools.accumulate(flat_sizes))
    total = starts[-1]
    out: dict[str, list[Run]] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = -(-numel // world)
        if offset + part > total:
            raise CorruptCheckpointError(f"{where}: parameter {name!r} (shape {list(shape)}) runs past the {total} "
                                         "elements of each rank's partitions")
        segments = []
        for r in range(world):  # rank r's piece of the parameter, at ``offset`` of its sub-groups end to end
            at, stop = r * part, min((r + 1) * part, numel)
            segments += [dataclasses.replace(run, source=(r, run.source))
                         for run in cut(offset, offset + max(0, stop - at), starts, at)]
        _add(out, name, segments, where)
        offset += part
    if offset != total:
        raise CorruptCheckpointError(f"{where}: the parameters fill {offset} of each rank's {total} partitioned "
                                     "elements: the shapes do not match the partitions")
    return out


def zero3_pieces(name: str, shape: tuple[int, ...], piece_sizes: Sequence[int], where: str) -> list[Run]:
    """ZeRO-3's per-parameter pieces (frozen parameters: ``frozen_param_fragments``, one per rank, rank ``r``'s
    in its own tensor, source ``(r, name)``): ``piece_sizes[r]`` elements each, ``ceil(numel / world)``."""
    numel, world = math.prod(shape), len(piece_sizes)
    part = -(-numel // world)
    segments = []
    for r, size in enumerate(piece_sizes):
        at, stop = r * part, min((r + 1) * part, numel)
        if size != part:
            raise CorruptCheckpointError(f"{where}: rank {r}'s piece of {name!r} (shape {list(shape)}) has {size} "
                                         f"elements, {part} expected at world size {world}")
        if at < stop:
            segments.append(Run((r, name), 0, at, stop - at))
    return segments


def _add(out: dict[str, list[Run]], name: str, segments: list[Run], where: str) -> None:
    if name in out:
        raise CorruptCheckpointError(f"{where}: parameter {name!r} is listed twice in param_shapes")
    out[name] = segments
