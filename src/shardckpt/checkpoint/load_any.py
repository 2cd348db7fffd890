"""``load_full``'s plan: any ``formats.api.CheckpointReader``'s checkpoint, whole.

``whole_plan`` turns a reader's ``tree()`` into a plain nested value: every ``TensorRef`` leaf becomes a full
CPU tensor of the reader's dtype and shape, all of them filled by one read of whole-tensor ``ReadRequest``s;
plain values are kept as the reader gives them, and containers keep their types (dict, list, tuple). ``keys``
selects by dotted name: a tensor, or a maximal tensor-free subtree (e.g. ``optim.param_groups``), is kept when
its dotted name equals a key or starts with ``key + "."``; list positions before a kept one are ``None``.

Nothing is allocated before the sizes are checked. The readers of other formats check what a header claims
against the bytes present when they open (safetensors: the tensors tile the file's data exactly; torch DCP:
every chunk inside its file; torch.save: the tensors are the loaded file's own storages), shardckpt's own
before allocating (``check_stored``, which ``whole_plan`` is given), and ``check_fits_in_memory``
refuses, as a last guard, a total larger than this machine's memory and swap, which no load could hold
(a hostile header claiming a size that its reader cannot check, or a checkpoint too big for ``load_full``).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

import torch

from shardckpt.checkpoint.lane import Plan
from shardckpt.errors import CheckpointError, CorruptCheckpointError
from shardckpt.format.tree import PerRankValues, TensorRef, contains, path_name
from shardckpt.formats.api import CheckpointReader, ReadRequest, TensorInfo
from shardckpt.regions import FlatRange

_SKIP = object()  # a subtree that ``keys`` leaves out


def wanted_keys(keys: Iterable[str] | None) -> Callable[[str], bool]:
    """Whether a dotted name is selected by ``keys`` (``None``: everything)."""
    prefixes = None if keys is None else tuple(keys)

    def wanted(name: str) -> bool:
        return prefixes is None or any(name == k or name.startswith(k + ".") for k in prefixes)

    return wanted


def _is_ref(value: Any) -> bool:
    return isinstance(value, TensorRef)


def pick(node: Any, path: tuple, wanted: Callable[[str], bool]) -> Any:
    """``node`` with only the selected leaves (``format.tree.leaves``' leaves), or ``_SKIP`` if none is."""
    is_container = isinstance(node, (dict, list, tuple))
    if not is_container or (path and not contains(node, _is_ref)):
        return node if wanted(path_name(path)) else _SKIP
    if isinstance(node, dict):
        kept: Any = {k: v for k, child in node.items() if (v := pick(child, path + (k,), wanted)) is not _SKIP}
    else:
        picked = {i: v for i, child in enumerate(node) if (v := pick(child, path + (i,), wanted)) is not _SKIP}
        kept = _like(node, [picked.get(i) for i in range(max(picked) + 1 if picked else 0)])
    return _SKIP if path and not kept else kept


def _like(node: list | tuple, items: list) -> Any:
    """``items`` in a sequence of ``node``'s type (a tuple, a list, or stored per-rank values)."""
    return tuple(items) if isinstance(node, tuple) else PerRankValues(items) if isinstance(node, PerRankValues) \
        else items


def tensor_refs(node: Any) -> Iterable[str]:
    """The names of the tensors a (decoded) tree refers to."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, TensorRef):
            yield item.name
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def replace_refs(node: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(node, TensorRef):
        return tensors[node.name]
    if not isinstance(node, (dict, list, tuple)) or not contains(node, _is_ref):
        return node  # a plain value, exactly as the reader gave it
    if isinstance(node, dict):
        return {k: replace_refs(v, tensors) for k, v in node.items()}
    return _like(node, [replace_refs(v, tensors) for v in node])


def memory_limit() -> int | None:
    """This machine's physical memory plus swap, in bytes; ``None`` where the platform does not say."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    if total <= 0:
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return total


def check_fits_in_memory(infos: Iterable[TensorInfo], where: str) -> None:
    """Refuse, before allocating, tensors whose total exceeds this machine's memory and swap."""
    infos = list(infos)
    total = sum(_nbytes(i) for i in infos)
    limit = memory_limit()
    if limit is None or total <= limit:
        return
    largest = max(infos, key=_nbytes)
    raise CheckpointError(
        f"{where}: loading it whole needs {total:,} bytes ({len(infos)} tensors, the largest {largest.name!r} "
        f"of shape {largest.shape}: {_nbytes(largest):,} bytes), more than this machine's {limit:,} bytes of "
        "memory and swap; a damaged or hostile header can claim such sizes. Select fewer tensors (keys=...), "
        "or read regions through formats.detect.open_reader")


def _nbytes(info: TensorInfo) -> int:
    n = info.dtype.itemsize
    for d in info.shape:
        n *= d
    return n


def whole_plan(reader: CheckpointReader, keys: Iterable[str] | None,
               check_stored: Callable[[Iterable[str]], None]) -> Plan:
    """The plan reading the checkpoint behind ``reader`` as a plain nested value of full CPU tensors (see the
    module's docstring); ``check_stored(names)`` checks the stored bytes can hold the tensors before they are
    allocated.

    The result has the tree's shape: a dict for every format but a ``torch.save`` file of a list, a tuple
    or a single tensor. With nothing selected it is an empty container of the tree's type (``{}`` when the
    tree is a lone tensor).
    """
    # (everything selected: the tree as it is, which picking would copy, asking each leaf's dotted name)
    picked = reader.tree() if keys is None else pick(reader.tree(), (), wanted_keys(keys))
    if picked is _SKIP:  # a lone tensor (a torch.save file of one tensor) that ``keys`` leaves out
        return Plan(reader, [], dict)
    infos, where = reader.tensors(), reader.facts().location
    names = list(dict.fromkeys(tensor_refs(picked)))
    found = [infos.get(n) for n in names]
    if None in found:
        raise CorruptCheckpointError(f"{where}: the checkpoint's tree names tensor {names[found.index(None)]!r}, "
                                     "which it does not list")
    check_stored(names)
    check_fits_in_memory(found, where)
    # (``size=`` by keyword: torch parses it ~0.5 us faster than a positional shape, ~1.2 us a call here)
    tensors = {n: torch.empty(size=i.shape, dtype=i.dtype) for n, i in zip(names, found)}
    requests = [ReadRequest(n, FlatRange(0, t.numel()), t) for n, t in tensors.items()]  # (whole: the fast check)
    return Plan(reader, requests, lambda: replace_refs(picked, tensors))
