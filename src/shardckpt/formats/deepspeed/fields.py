"""Checked access to the fields of DeepSpeed's pickles: every value the reader uses is taken through ``take``,
which checks its kind before anything uses it, so a damaged or hostile file is a ``CorruptCheckpointError``
naming the file and the field, never an ``AttributeError``, ``TypeError`` or ``KeyError`` further on.

A ``Kind`` is a test and the words that say what it wants ("a mapping of names to names"); the kinds below
are the ones DeepSpeed's files hold. Values are shown in errors through ``formats.untrusted.shown`` (bounded in
length and depth, whatever the value).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.untrusted import shown

SCALARS = (str, int, float, bool, type(None))  # what plain data is made of, besides containers


@dataclass(frozen=True)
class Kind:
    """What a field must be: ``test`` says whether a value is one, ``wants`` says it in words."""

    wants: str
    test: Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def plain(value: Any) -> bool:
    """Whether ``value`` is plain data (scalars in dicts, lists and tuples; scalar keys), all the way down."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if not all(isinstance(k, SCALARS) for k in node):
                return False
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif not isinstance(node, SCALARS):
            return False
    return True


MAPPING = Kind("a mapping", lambda v: isinstance(v, dict))
NAMED = Kind("a mapping by name", lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v))
LIST = Kind("a list", lambda v: isinstance(v, (list, tuple)))
NAMES = Kind("a list of names", lambda v: isinstance(v, (list, tuple)) and all(isinstance(n, str) for n in v))
NAME_MAP = Kind("a mapping of names to names", lambda v: isinstance(v, dict) and all(
    isinstance(k, str) and isinstance(n, str) for k, n in v.items()))
TENSORS = Kind("a list of tensors", lambda v: isinstance(v, (list, tuple)) and all(isinstance(t, TensorRef) for t in v))
TENSOR_MAP = Kind("a mapping of names to tensors", lambda v: isinstance(v, dict) and all(
    isinstance(k, str) and isinstance(t, TensorRef) for k, t in v.items()))
COUNTS = Kind("a positive count or a non-empty list of them", lambda v: (_int(v) and v > 0) or (
    isinstance(v, (list, tuple)) and len(v) > 0 and all(_int(c) and c > 0 for c in v)))
PADDINGS = Kind("a list of lists of counts", lambda v: isinstance(v, (list, tuple)) and all(
    isinstance(g, (list, tuple)) and all(_int(p) and p >= 0 for p in g) for g in v))

_REQUIRED = object()


def take(node: Mapping, key: str, kind: Kind, where: str, *, field: str | None = None,
         default: Any = _REQUIRED) -> Any:
    """``node[key]``, checked to be of ``kind``; absent or None gives ``default`` where one is given, else it
    is an error. ``where`` names the file, ``field`` the field (default: ``key``)."""
    value = node.get(key) if isinstance(node, dict) else None
    if value is None and default is not _REQUIRED:
        return default
    if not kind.test(value):
        state = "missing" if value is None else f"{shown(value)}"
        raise CorruptCheckpointError(f"{where}: {field or key} is {state}, not {kind.wants}")
    return value


def root(tree: Any, where: str) -> dict:
    """A DeepSpeed file's top level, which is a mapping by name."""
    if not NAMED.test(tree):
        raise CorruptCheckpointError(f"{where}: holds {shown(tree)}, not DeepSpeed's mapping of states by name")
    return tree
