"""What ``convert --format dcp`` puts where, planned before anything is written (pure: no I/O, no torch.distributed).

torch DCP names each value by its flattened key: the path through nested dicts (keys as ``str``) and through the
lists and tuples that hold a tensor or a dict, joined by dots, as ``torch.distributed.checkpoint``'s
``flatten_state_dict`` does; any other value (a number, a list of numbers, a tuple of floats) is one bytes item.
Each output rank stores the dim-0 chunk of every tensor that ``convert``'s placement gives it (a replica: rank
0 only), cut into boxes of at most ``max_elements`` elements, each one contiguous run of the tensor (so that it
streams from the source as one slice) and one DCP chunk (a ``torch.save`` archive of exactly its elements).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from shardckpt.errors import UnsupportedValueError
from shardckpt.format.tree import TensorRef
from shardckpt.offline.streams import Output
from shardckpt.regions import FlatRange, Region, strides


@dataclass(frozen=True)
class DcpTensorItem:
    """One DCP chunk: ``box`` (offsets, sizes) of output tensor ``output``, the elements ``flat`` of it."""

    key: str
    output: Output
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: FlatRange


@dataclass(frozen=True)
class DcpBytesItem:
    """One value that is not a tensor, stored as DCP stores it: ``torch.save`` of the value, by rank 0."""

    key: str
    value: Any


def dcp_leaves(tree: dict) -> Iterator[tuple[tuple, Any]]:
    """``(path, leaf)`` for every value DCP stores as one item, in DCP's traversal order (tensors: ``TensorRef``)."""
    for key, value in tree.items():
        yield from _traverse((str(key),), value)


def _traverse(path: tuple, value: Any) -> Iterator[tuple[tuple, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _traverse(path + (str(k),), v)
    elif _is_terminal(value):
        yield path, value
    else:  # a list, or a tuple holding a tensor or a dict
        for i, v in enumerate(value):
            yield from _traverse(path + (i,), v)


def _is_terminal(value: Any) -> bool:
    """torch's ``traverse_state_dict``: a list is one item unless it holds a tensor or a dict (or a list that is
    not one item); a tuple always is (a tuple holding tensors is refused by ``flat_keys``)."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, TensorRef) or isinstance(v, dict) or (isinstance(v, list) and not _is_terminal(v))
                   for v in value)


def flat_keys(tree: dict) -> list[tuple[str, tuple, Any]]:
    """``(flattened key, path, leaf)`` per DCP item; a duplicated key or a tensor inside a tuple (which DCP would
    pickle whole) raises ``UnsupportedValueError`` naming it."""
    seen: set[str] = set()
    out = []
    for path, leaf in dcp_leaves(tree):
        key = ".".join(map(str, path))
        if key in seen:
            raise UnsupportedValueError(f"{key}: two entries flatten to this DCP key; rename one (convert --only / "
                                        "--exclude can leave one out)")
        if isinstance(leaf, tuple) and _holds_tensor(leaf):
            raise UnsupportedValueError(f"{key}: a tuple holding tensors, which DCP stores pickled whole; convert "
                                        "it to the shardckpt format instead")
        seen.add(key)
        out.append((key, path, leaf))
    return out


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, TensorRef):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def flat_boxes(shape: tuple[int, ...], start: int, stop: int,
               max_elements: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], FlatRange]]:
    """Boxes ``(offsets, sizes, flat range)`` covering the row-major elements ``[start, stop)`` of ``shape`` in
    order, each one contiguous run of at most ``max(1, max_elements)`` elements: whole rows (of the innermost
    dims that fit) where they fit, the partial rows at either end and rows too big for one box cut further."""
    if not shape:
        if stop > start:
            yield (), (), FlatRange(0, 1)
        return
    limit = max(1, max_elements)
    row = strides(shape)[0]  # elements per index of dim 0
    lo = start
    while lo < stop:
        index, within = divmod(lo, row)
        if within or stop - lo < row or row > limit:  # part of one row: recurse into it
            end = min(stop, (index + 1) * row)
            for offsets, sizes, flat in flat_boxes(shape[1:], within, end - index * row, limit):
                yield (index, *offsets), (1, *sizes), FlatRange(flat.start + index * row, flat.stop + index * row)
            lo = end
            continue
        rows = min(limit // row, (stop - lo) // row)
        yield (index, *(0,) * (len(shape) - 1)), (rows, *shape[1:]), FlatRange(lo, lo + rows * row)
        lo += rows * row


def rank_tensor_items(outputs: list[tuple[str, Output]], rank: int, place: Callable[[Output, int], tuple[Region, bool]],
                      max_elements: int) -> list[DcpTensorItem]:
    """The DCP chunks output rank ``rank`` writes: its placement of each tensor (a replica and an empty tensor:
    rank 0, so that every tensor has a chunk, as DCP's own save gives an empty one) cut into boxes."""
    items = []
    for key, output in outputs:
        shape = tuple(output.source.shape)
        if not math.prod(shape):
            if rank == 0:
                items.append(DcpTensorItem(key, output, (0,) * len(shape), shape, FlatRange(0, 0)))
            continue
        region, replica = place(output, rank)
        if replica and rank:
            continue
        if not isinstance(region, FlatRange):
            raise AssertionError(f"{key}: placement {region} is not a flat range")
        for offsets, sizes, flat in flat_boxes(shape, region.start, region.stop, max_elements):
            items.append(DcpTensorItem(key, output, offsets, sizes, flat))
    return items
