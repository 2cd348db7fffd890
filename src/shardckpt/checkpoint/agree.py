"""What the ranks of a save must agree on, checked in ``plan`` before anything is written (pure: no I/O, no
collectives).

The checkpoint stores one tree: rank 0's nesting and plain values, with each ``PerRank`` entry holding every
rank's own value. So every rank must hold the same keys, nesting, kinds of leaf (tensor, plain value,
``PerRank``) and plain values; a rank whose tree differs would otherwise lose its entry or its value, or
give the manifest a tensor the tree does not name. Each rank sends ``plan`` a digest of its encoded tree
(``PerRank`` entries as markers, since their values differ by design), and its ``PerRank`` parts. Only
when digests differ does rank 0 send its tree to the ranks that differ, which name the first key where
theirs differs. Dict order does not count (loads match by name); the type of a plain value does (1, 1.0
and True are different values).

Tensors are compared by ``save_plan`` (every rank's shape and dtype, and sharded or plain, by name). A plain
tensor's values are not compared: it is replicated, and one rank stores it (per-rank tensors go in a
``PerRank``).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator

from shardckpt.errors import UnsupportedValueError
from shardckpt.format.tree import Path, decode, path_name

_TAG = "$per_rank"  # a PerRank's marker in a rank's own tree: {"$per_rank": "<its name>"}


def marker(name: str) -> dict:
    return {_TAG: name}


def digest(encoded: Any) -> bytes:
    """A digest of an encoded tree that does not depend on the order of dict entries."""
    text = json.dumps(_canonical(encoded), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).digest()


def _canonical(node: Any) -> Any:
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1 and isinstance(node.get("$dict"), list):
        pairs = [[_canonical(k), _canonical(v)] for k, v in node["$dict"]]
        return {"$dict": sorted(pairs, key=lambda p: json.dumps(p[0], sort_keys=True))}
    return {k: _canonical(v) for k, v in node.items()}


def refuse_difference(first: Any, mine: Any, rank: int) -> None:
    """Raise ``UnsupportedValueError`` naming the first key where ``mine`` (this rank's encoded tree) differs
    from ``first`` (rank 0's)."""
    found = _first_difference(first, mine, ())
    if found is None:
        return
    path, theirs, ours = found
    where = f"at {path_name(path)!r}" if path else "at the root"
    raise UnsupportedValueError(
        f"cannot save: the state dicts differ between ranks {where}: rank 0 {theirs}, rank {rank} {ours}. Every "
        "rank must give the same keys, nesting and plain values (the checkpoint stores one); put a value that differs by rank in shardckpt.PerRank(value) under the same key on every rank")


def _first_difference(a: Any, b: Any, path: Path) -> tuple[Path, str, str] | None:
    ka, kb = _kind(a), _kind(b)
    if ka != kb or ka not in ("a list", "a tuple", "a dict"):
        same = ka == kb and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        return None if same else (path, _describe(a), _describe(b))
    items_a, items_b = dict(_items(a)), dict(_items(b))
    for token, (key, value) in items_a.items():
        if token not in items_b:
            return path + (key,), _describe(value), _NONE
        found = _first_difference(value, items_b[token][1], path + (key,))
        if found is not None:
            return found
    for token, (key, value) in items_b.items():
        if token not in items_a:
            return path + (key,), _NONE, _describe(value)
    return None


def _kind(node: Any) -> str:
    if isinstance(node, list):
        return "a list"
    if isinstance(node, dict) and len(node) == 1:
        tag = next(iter(node))
        kinds = {"$tuple": "a tuple", "$dict": "a dict", "$tensor": "a tensor", _TAG: "a PerRank value",
                 "$float": "a float"}
        if tag in kinds:
            return kinds[tag]
    return "a dict" if isinstance(node, dict) else "a plain value"


def _items(node: Any) -> Iterator[tuple[tuple, tuple[Any, Any]]]:
    """``(token, (key, child))`` of an encoded container; tokens tell 1, 1.0 and True apart."""
    if isinstance(node, list):
        pairs = enumerate(node)
    elif _kind(node) == "a tuple":
        pairs = enumerate(node["$tuple"])
    elif _kind(node) == "a dict" and "$dict" in node:
        pairs = ((decode(k, "a state dict key"), v) for k, v in node["$dict"])
    else:
        pairs = node.items()
    for key, value in pairs:
        yield (type(key).__name__, repr(key)), (key, value)


_NONE = "has no entry"


def _describe(node: Any) -> str:
    kind = _kind(node)
    if kind != "a plain value" and kind != "a float":
        return f"holds {kind}"
    text = repr(decode(node, "a plain value"))
    return f"holds {text if len(text) <= 60 else text[:57] + '...'}"


def fill_per_rank(encoded: Any, parts: list[dict[str, Any]]) -> Any:
    """Rank 0's encoded tree with each ``PerRank`` marker replaced by every rank's part, by rank."""
    if not parts or not parts[0]:
        return encoded
    if isinstance(encoded, list):
        return [fill_per_rank(v, parts) for v in encoded]
    if not isinstance(encoded, dict):
        return encoded
    if len(encoded) == 1 and isinstance(encoded.get(_TAG), str):
        return {_TAG: [rank_parts[encoded[_TAG]] for rank_parts in parts]}
    if len(encoded) == 1 and isinstance(encoded.get("$dict"), list):
        return {"$dict": [[k, fill_per_rank(v, parts)] for k, v in encoded["$dict"]]}
    return {k: fill_per_rank(v, parts) for k, v in encoded.items()}


def encoded_holds_per_rank(encoded: Any) -> bool:
    """Whether an encoded tree holds per-rank values (markers, or stored ``PerRankValues`` saved again)."""
    stack = [encoded]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1:
                if _TAG in node:
                    return True
                if "$tensor" in node:  # a tensor's marker, its value a name (skipped: a tree of 100k tensors)
                    continue
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def per_rank_names(encoded: Any, path: Path = ()) -> list[str]:
    """The names of the per-rank entries of an encoded tree, in order."""
    kind = _kind(encoded)
    if kind == "a PerRank value":
        return [path_name(path)]
    if kind not in ("a list", "a tuple", "a dict"):
        return []
    return [name for _, (key, value) in _items(encoded) for name in per_rank_names(value, path + (key,))]
