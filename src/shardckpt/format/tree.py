"""The nested structure of a state dict, as JSON, with tensors replaced by references.

Encoding (FORMAT.md, "tree"):
- ``None``, ``bool``, ``int``, ``str`` and finite ``float`` are themselves; other floats are
  ``{"$float": "nan" | "inf" | "-inf"}``.
- a list is a JSON array; a tuple is ``{"$tuple": [...]}``.
- a dict whose keys are all strings not starting with ``$`` is a JSON object; any other dict is
  ``{"$dict": [[key, value], ...]}`` (keys are scalars, e.g. the int parameter IDs of optimizer state).
- a tensor is ``{"$tensor": name}``, where ``name`` is its path's keys joined by ``.``.
- a v6 manifest writes a dict of tensors, each named by its path, as ``{"$tensors": [key, ...]}``
  (``compact_tensor_dicts``; ``decode`` takes it back when ``tables``).
- per-rank values (format v4) are ``{"$per_rank": [value of rank 0, value of rank 1, ...]}``, named like
  a list's items (``rng.1``); decoded as ``PerRankValues``. ``save`` builds them from every rank's
  ``PerRank`` (``encode``'s ``per_rank`` hook gives this rank's part).

Leaves are tensors and tensor-free subtrees: a tensor-free subtree (e.g. ``param_groups``) is one value.
Nesting is limited to ``MAX_DEPTH`` levels, checked without recursion before any recursive walk, on save
and on load alike, so that no walk can overflow Python's stack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from shardckpt.errors import CorruptCheckpointError, UnsupportedValueError
from shardckpt.format.validate import first_repeat
from shardckpt.sharded_tensor import PerRank
from shardckpt.records import record

Path = tuple[Any, ...]
_SCALARS = (type(None), bool, int, str)
_KEY_TYPES = (type(None), bool, int, float, str)
_CONTAINERS = (dict, list, tuple)
_STR_ONLY = frozenset((str,))
_NESTING = (*_CONTAINERS, PerRank)  # what counts towards the depth limit
MAX_DEPTH = 100  # levels of containers; real state dicts use fewer than 10


def depth_exceeds(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """True if containers nest more than ``limit`` deep in ``obj`` (iterative: safe at any depth)."""
    # Level by level, containers only: a flat dict of 100k tensors is one pass over its values in C-speed loops.
    # A PerRank is a level too (saved, it is per-rank values: a list of each rank's value).
    level = [obj] if isinstance(obj, _NESTING) else []
    depth = 0
    while level:
        if depth >= limit:
            return True
        below: list = []
        for node in level:
            kids = node.values() if isinstance(node, dict) else (node.value,) if isinstance(node, PerRank) else node
            below += [k for k in kids if isinstance(k, _NESTING)]
        level, depth = below, depth + 1
    return False


class PerRankValues(list):
    """Stored per-rank values: the value each saving rank put under one key in a ``PerRank``, by rank. A list
    (``load_full`` gives it); ``save`` stores one as per-rank values again."""

    def __repr__(self) -> str:
        return f"PerRankValues({list.__repr__(self)})"


@record
class TensorRef:
    """A tensor's place in a decoded tree: the name of its entry in the manifest."""

    name: str


def path_name(path: Path) -> str:
    return ".".join(map(str, path))


def _children(obj: Any) -> Iterator[tuple[Any, Any]] | None:
    if isinstance(obj, dict):
        return iter(obj.items())
    if isinstance(obj, (list, tuple)):
        return iter(enumerate(obj))
    return None


def leaves(obj: Any, is_tensor: Callable[[Any], bool], path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for every tensor and every maximal tensor-free subtree under ``obj`` ("tensor":
    what ``is_tensor`` holds true, which may be a container, e.g. ``PerRankValues``)."""
    kids = _children(obj)
    if kids is None or is_tensor(obj) or (path and not contains(obj, is_tensor)):
        yield path, obj
        return
    for key, value in kids:
        if isinstance(value, _CONTAINERS) and not is_tensor(value):
            yield from leaves(value, is_tensor, path + (key,))
        else:  # a leaf yielded here, not by a generator of its own (a flat dict of 100k tensors: 100k fewer frames)
            yield path + (key,), value


def leaf_groups(obj: Any, is_tensor: Callable[[Any], bool], path: Path = ()
                ) -> Iterator[tuple[Path, Sequence, list[str], list]]:
    """The leaves of ``leaves``, in its order, a run of one container's direct leaves at a time:
    ``(parent, keys, names, values)``, leaf ``i`` at ``leaf_path(parent, keys, i)`` with dotted name ``names[i]``
    (``path_name``); a root that is itself a leaf comes as ``((), (), [""], [obj])``. A flat dict of 100k tensors is
    one run, its names made in one comprehension (checks of unique names then run in C over a run, not per leaf in
    Python)."""
    if not isinstance(obj, _CONTAINERS) or is_tensor(obj) or (path and not contains(obj, is_tensor)):
        yield path[:-1], path[-1:], [path_name(path)], [obj]  # (the root: ``(), ()``)
        return
    if type(obj) is dict:  # (C-speed; a subclass may iterate its keys or values in another order than its items)
        keys, values = list(obj), list(obj.values())
    elif isinstance(obj, dict):
        items = list(obj.items())  # what ``leaves`` and ``encode`` walk
        keys, values = [k for k, _ in items], [v for _, v in items]
    else:
        values = list(obj)
        keys = range(len(values))
    prefix = path_name(path) + "." if path else ""
    if isinstance(obj, dict) and _STR_ONLY.issuperset(map(type, keys)):
        names = list(keys) if not prefix else [prefix + k for k in keys]
    else:
        names = [prefix + str(k) for k in keys]
    nested = [i for i, v in enumerate(values) if isinstance(v, _CONTAINERS) and not is_tensor(v)]
    start = 0  # runs of direct leaves between the nested containers: the leaves come in the order of ``leaves``
    for i in [*nested, len(values)]:
        if i > start:
            yield path, keys[start:i], names[start:i], values[start:i]
        if i < len(values):
            yield from leaf_groups(values[i], is_tensor, path + (keys[i],))
        start = i + 1


def leaf_path(parent: Path, keys: Sequence, i: int) -> Path:
    """The path of leaf ``i`` of a run of ``leaf_groups``."""
    return parent + (keys[i],) if keys else parent


def contains(obj: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if is_tensor(obj):
        return True
    kids = _children(obj)
    return kids is not None and any(contains(v, is_tensor) for _, v in kids)


def get_at(obj: Any, path: Path) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def set_at(obj: Any, path: Path, value: Any) -> None:
    """Replace the leaf at ``path`` (its parent must be a dict or a list)."""
    parent = get_at(obj, path[:-1])
    if isinstance(parent, tuple):
        raise UnsupportedValueError(f"cannot load {path_name(path)!r} in place: its parent is a tuple")
    parent[path[-1]] = value


def check_savable_depth(obj: Any) -> None:
    if depth_exceeds(obj):
        raise UnsupportedValueError(f"the state dict nests containers more than {MAX_DEPTH} levels deep; "
                                    "flatten it")


PerRankHook = Callable[[PerRank, Path], Any]


def holds(obj: Any, found: Callable[[Any], bool]) -> bool:
    """Whether ``obj`` or a value nested in it is ``found`` (iterative: safe at any depth)."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if found(node):
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return False


def holds_per_rank(obj: Any) -> bool:
    """Whether ``obj`` is or holds a ``PerRank`` or ``PerRankValues``."""
    return holds(obj, lambda node: isinstance(node, (PerRank, PerRankValues)))


def encode(obj: Any, is_tensor: Callable[[Any], bool], path: Path = (), per_rank: PerRankHook | None = None) -> Any:
    """The JSON form of ``obj``; tensors become ``{"$tensor": name}``. Unsupported values raise, naming the key.
    A ``PerRank`` is encoded by ``per_rank(value, path)`` (``save``'s; without it, a ``PerRank`` is refused).

    Callers check the depth first (``check_savable_depth``)."""
    if is_tensor(obj):
        return {"$tensor": path_name(path)}
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, PerRank):
        if per_rank is None:
            raise UnsupportedValueError(f"{path_name(path)!r}: a PerRank may not hold another one, and belongs in "
                                        "a state dict given to save")
        return per_rank(obj, path)
    if isinstance(obj, PerRankValues):
        if any(holds_per_rank(v) for v in obj):
            raise UnsupportedValueError(f"{path_name(path)!r}: per-rank values may not hold per-rank values")
        return {"$per_rank": [encode(v, is_tensor, path + (i,)) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, is_tensor, path + (i,), per_rank) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, is_tensor, path + (i,), per_rank) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            prefix = path_name(path) + "." if path else ""  # a tensor's entry made here: no call per tensor
            return {k: {"$tensor": prefix + k} if is_tensor(v) else encode(v, is_tensor, path + (k,), per_rank)
                    for k, v in obj.items()}
        for k in obj:
            if not isinstance(k, _KEY_TYPES):
                raise UnsupportedValueError(
                    f"state dict key {path_name(path + (k,))!r} has type {type(k).__name__}; keys must be "
                    "str, int, float, bool or None")
        return {"$dict": [[encode(k, is_tensor), encode(v, is_tensor, path + (k,), per_rank)] for k, v in obj.items()]}
    raise UnsupportedValueError(
        f"state dict value {path_name(path)!r} has type {type(obj).__name__}; shardckpt stores tensors and "
        "plain values (None, bool, int, float, str, list, tuple, dict). Convert it first (e.g. to a dict).")


def compact_tensor_dicts(encoded: Any, path: Path = ()) -> Any:
    """An encoded tree as a v6 manifest writes it: every object whose values are all tensors, each named by its path
    (``{"k": {"$tensor": "<path>.k"}, ...}``), as ``{"$tensors": ["k", ...]}`` (FORMAT.md, ``tree``)."""
    if isinstance(encoded, list):
        return [compact_tensor_dicts(v, path + (i,)) for i, v in enumerate(encoded)]
    if not isinstance(encoded, dict):
        return encoded
    tag, body = next(iter(encoded.items())) if len(encoded) == 1 else (None, None)
    if tag in ("$tensor", "$float"):
        return encoded
    if tag in ("$tuple", "$per_rank"):
        return {tag: [compact_tensor_dicts(v, path + (i,)) for i, v in enumerate(body)]}
    if tag == "$dict":
        return {tag: [[k, compact_tensor_dicts(v, path + (_decoded_key(k),))] for k, v in body]}
    prefix = path_name(path) + "." if path else ""
    if encoded and all(type(v) is dict and len(v) == 1 and v.get("$tensor") == prefix + k for k, v in encoded.items()):
        return {"$tensors": list(encoded)}
    return {k: compact_tensor_dicts(v, path + (k,)) for k, v in encoded.items()}


def _decoded_key(key: Any) -> Any:
    """A ``$dict`` key as its path has it (``{"$float": "nan"}`` is the float)."""
    return float(key["$float"]) if isinstance(key, dict) else key


def decode(data: Any, where: str, per_rank: bool = False, tables: bool = False) -> Any:
    """Inverse of ``encode`` for untrusted input; tensors become ``TensorRef``. ``where`` names the file.
    ``per_rank``: whether ``$per_rank`` may occur (format v4 on; never inside another); ``tables``: whether
    ``$tensors`` may (format v6 on, ``compact_tensor_dicts``)."""
    value = _decode(data, where, _Allowed(per_rank, tables), 0, ())
    if depth_exceeds(value):
        raise CorruptCheckpointError(f"{where}: the state-dict tree is nested more than {MAX_DEPTH} levels deep")
    return value


@dataclass(frozen=True)
class _Allowed:
    """The tags a manifest's version admits beyond v2's."""

    per_rank: bool
    tables: bool


# The JSON form nests deeper than the value: a $dict level is three JSON levels (object, pairs, pair) and a tagged
# leaf ($tensor, $float) one more, so the deepest valid tree's JSON is this deep. Counted as the walk goes (a container
# deeper is refused before the walk goes below it), so no walk overflows Python's stack; the value's own depth
# (MAX_DEPTH) is checked after.
_MAX_JSON_DEPTH = 3 * MAX_DEPTH + 1


def _decode(data: Any, where: str, allowed: _Allowed, depth: int, path: Path) -> Any:
    if isinstance(data, (list, dict)) and depth >= _MAX_JSON_DEPTH:
        raise CorruptCheckpointError(f"{where}: the state-dict tree is nested more than {MAX_DEPTH} levels deep")
    if isinstance(data, (list,)):
        return [_decode(v, where, allowed, depth + 1, path + (i,)) for i, v in enumerate(data)]
    if not isinstance(data, dict):
        if isinstance(data, float) and not math.isfinite(data):  # e.g. 1e400: must be written {"$float": "inf"}
            raise CorruptCheckpointError(f"{where}: the number {data!r} is not finite; non-finite floats are "
                                         '{"$float": ...}')
        if isinstance(data, (float,) + _SCALARS):
            return data
        raise CorruptCheckpointError(f"{where}: unexpected value {data!r} in the state-dict tree")
    if len(data) == 1:
        (tag, body), = data.items()
        if tag == "$tensor" and isinstance(body, str):
            return TensorRef(body)
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if isinstance(body, list) and depth + 1 >= _MAX_JSON_DEPTH:
            raise CorruptCheckpointError(f"{where}: the state-dict tree is nested more than {MAX_DEPTH} levels deep")
        if tag == "$tensors" and isinstance(body, list) and allowed.tables:
            return _tensor_dict(body, where, path)
        if tag == "$tuple" and isinstance(body, list):
            return tuple(_decode(v, where, allowed, depth + 2, path + (i,)) for i, v in enumerate(body))
        if tag == "$dict" and isinstance(body, list):
            return _decode_pairs(body, where, allowed, depth + 2, path)
        if tag == "$per_rank" and isinstance(body, list) and allowed.per_rank:
            inner = _Allowed(False, allowed.tables)  # never a $per_rank inside another
            return PerRankValues(_decode(v, where, inner, depth + 2, path + (i,)) for i, v in enumerate(body))
    if any(k.startswith("$") for k in data):
        raise CorruptCheckpointError(f"{where}: unknown tag in state-dict tree object {sorted(data)[:3]}")
    return {k: _decode(v, where, allowed, depth + 1, path + (k,)) for k, v in data.items()}


_STR = frozenset((str,))


def _tensor_dict(keys: list, where: str, path: Path) -> dict:
    """A ``$tensors`` object: a dict of one tensor per key, each named by its path (FORMAT.md, ``tree``)."""
    if not keys or not _STR.issuperset(map(type, keys)) or any(k.startswith("$") for k in keys):
        raise CorruptCheckpointError(f"{where}: a $tensors list at {path_name(path)!r} must hold one or more keys, "
                                     "each a string not starting with '$'")
    prefix = path_name(path) + "." if path else ""
    out = {k: TensorRef(prefix + k) for k in keys}
    if len(out) != len(keys):
        raise CorruptCheckpointError(f"{where}: the $tensors list at {path_name(path)!r} names {first_repeat(keys)!r} "
                                     "twice")
    return out


def _decode_pairs(pairs: list, where: str, allowed: _Allowed, depth: int, path: Path) -> dict:
    """The pairs of a ``$dict``, each a list at ``depth``."""
    out = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise CorruptCheckpointError(f"{where}: a $dict entry must be a [key, value] pair, got {pair!r}")
        if depth >= _MAX_JSON_DEPTH:
            raise CorruptCheckpointError(f"{where}: the state-dict tree is nested more than {MAX_DEPTH} levels deep")
        key = _decode(pair[0], where, _Allowed(False, False), depth + 1, path)
        if not isinstance(key, _KEY_TYPES):
            raise CorruptCheckpointError(f"{where}: a $dict key must be a scalar, got {str(key)[:40]}")
        if key in out:  # Python equality: 1, 1.0 and true are one key, so the saved dict cannot have held both
            raise CorruptCheckpointError(f"{where}: $dict keys {key!r} collide")
        out[key] = _decode(pair[1], where, allowed, depth + 1, path + (key,))
    if all(isinstance(k, str) and not k.startswith("$") for k in out):
        raise CorruptCheckpointError(f"{where}: a $dict whose keys are all plain strings must be a JSON object")
    return out
