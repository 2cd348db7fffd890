"""Values that come out of a checkpoint's pickles, as the readers show them and bound them.

- ``shown``: a value for an error message, bounded in length and depth whatever it is (``reprlib``; ``repr`` of
  a deeply nested list raises ``RecursionError``, and of a huge one is huge).
- ``check_expansion``: an unpickled object is a graph: a pickle refers to an object it already built in two
  bytes, so a few KiB can describe a tree of 2**100 nodes (a list of two references to a list of two...).
  Every walk over such an object (and every walk of the callers over the tree a reader gives them) visits the
  tree, not the graph. The tree is bounded here by the bytes of the pickle, before anything walks it.
"""
from __future__ import annotations

import reprlib
from typing import Any

from shardckpt.errors import CorruptCheckpointError

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40

# Nodes of the tree an unpickled object may expand to, per byte of its pickle, plus a few. Without shared
# references a pickle needs at least one byte (an opcode) per node; real state dicts share little (a tuple of
# defaults in each param group), so this is generous.
NODES_PER_BYTE = 4
EXTRA_NODES = 1 << 16


def shown(value: Any) -> str:
    """``value`` for an error message: bounded in length and depth."""
    return _REPR.repr(value)


def _size(value: Any) -> int:
    """What a value costs: one, and one more per 16 characters of a string (a pickle refers to a string it holds
    in two bytes too, and a name repeated is common; the text it expands to stays within 16 per cost)."""
    return 1 + len(value) // 16 if isinstance(value, (str, bytes, bytearray)) else 1


def check_expansion(obj: Any, pickle_bytes: int, where: str) -> None:
    """Refuse ``obj`` (unpickled from ``pickle_bytes`` bytes) if, as a tree of dicts, lists and tuples, it is
    bigger (in values, and the length of strings: ``_size``) than ``NODES_PER_BYTE`` per byte of its pickle
    (``CorruptCheckpointError``). Each value is charged when its container is visited, so the walk ends within
    the budget, whatever the graph."""
    limit = NODES_PER_BYTE * pickle_bytes + EXTRA_NODES
    budget = limit - _size(obj)
    stack = [obj] if isinstance(obj, (dict, list, tuple)) else []
    while stack and budget >= 0:
        node = stack.pop()
        if isinstance(node, dict):
            budget -= sum(_size(k) for k in node)
            node = node.values()
        for kid in node:
            budget -= _size(kid)
            if isinstance(kid, (dict, list, tuple)):
                stack.append(kid)
    if budget < 0:
        raise CorruptCheckpointError(f"{where}: its pickle of {pickle_bytes} bytes refers to the same objects over "
                                     f"and over: as a tree it would be bigger than {limit} values")
