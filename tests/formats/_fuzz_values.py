"""What the reader fuzzer (``_reader_fuzz.py``) puts into checkpoints: hostile values, and mutations of bytes and of
unpickled structures, all drawn from a seeded ``random.Random`` so that every run makes the same cases.

A structure is walked as a tree of dicts, lists, tuples and objects with a ``__dict__`` (DCP's metadata records);
a *place* is a path of keys, indices and ``("attr", name)`` steps. ``mutate_structure`` replaces the value at a
random place (a random depth, then a place at it) with a hostile one, removes it, or duplicates it (tuples and
``torch.Size`` are rebuilt).
"""
from __future__ import annotations

import random
import reprlib
import sys
from typing import Any, Callable

import torch

DEEP = 5_000  # nesting levels of a deep value (Python's recursion limit is 1,000)
BOMB = 64  # levels of a value that shares each level twice: 2**64 leaves as a tree, a few hundred bytes pickled


def deep_list(depth: int = DEEP) -> list:
    """A list nested ``depth`` levels deep (built without recursion)."""
    root: list = []
    node = root
    for _ in range(depth):
        child: list = []
        node.append(child)
        node = child
    return root


def dag_bomb(levels: int = BOMB, leaf: Any = 0) -> list:
    """``[x, x]`` of ``[y, y]``... ``levels`` deep: tiny as a pickle (shared references), 2**levels as a tree."""
    node: Any = [leaf, leaf]
    for _ in range(levels):
        node = [node, node]
    return node


def big_string_bomb(copies: int = 1_000) -> list:
    """One 64 KiB string referred to ``copies`` times: ~66 KiB pickled, 64 MiB as a tree's text."""
    s = "s" * (64 << 10)
    return [s] * copies


SHARED = (7, 13)  # the picks below whose values are graphs: small pickled, huge as trees (or as JSON text)


def hostile_values(rng: random.Random, extra: Callable[[random.Random], Any] | None = None, *,
                   shared: bool = True) -> Any:
    """One hostile value: huge or negative ints, wrong types, deep or shared nesting, odd strings and sizes;
    ``extra`` draws a value of the caller's kind now and then; ``shared``: graphs too (not for JSON)."""
    pick = rng.randrange(15 if extra is None else 16)
    while not shared and pick in SHARED:
        pick = rng.randrange(15 if extra is None else 16)
    if pick == 0:
        return rng.choice([2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**12, 10**18, 10**30, 10**100])
    if pick == 1:
        return rng.choice([-1, -2**63, -10**30, 0, 1, 2, 3])
    if pick == 2:
        return rng.choice([None, True, False, 1.5, float("nan"), float("inf"), -0.0])
    if pick == 3:
        return rng.choice(["", "x", "../../etc/passwd", "/abs", "a\0b", "é" * 3, "float32", "torch.strided"])
    if pick == 4:
        return rng.choice([b"", b"\x00" * 8, bytearray(b"ab")])
    if pick == 5:
        return rng.choice([[], {}, (), [1, 2], {"a": 1}, (1, 2, 3), {1: 2}, {(1, 2): 3}, [[[]]]])
    if pick == 6:
        return deep_list(rng.choice([200, DEEP]))
    if pick == 7:
        return dag_bomb(rng.choice([20, BOMB]))
    if pick == 8:
        return torch.Size([rng.choice([10**12, 2**40, 0, 3])] * rng.randrange(1, 4))
    if pick == 9:
        return [rng.choice([10**12, -1, 2**63, 0])] * rng.randrange(1, 5)
    if pick == 10:
        return torch.zeros(rng.choice([0, 1, 3]), dtype=rng.choice([torch.float32, torch.int64, torch.bool]))
    if pick == 11:
        return torch.tensor(rng.choice([0.5, 10**6, -1]))
    if pick == 12:
        return list(range(rng.choice([100, 20_000])))
    if pick == 13:
        return big_string_bomb(rng.choice([10, 1_000]))
    if pick == 14:
        return {str(i): i for i in range(rng.choice([10, 5_000]))}
    return extra(rng)


def flat_tensors(tree: Any, path: tuple = ()) -> dict[str, torch.Tensor]:
    """The tensors in a loaded tree, by their path's keys joined by dots."""
    if isinstance(tree, torch.Tensor):
        return {".".join(map(str, path)): tree}
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat_tensors(v, path + (k,)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat_tensors(v, path + (i,)))
    return out


# --- places in a structure -------------------------------------------------------------------------------------

def _children(node: Any) -> list[tuple[Any, Any]]:
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    if hasattr(node, "__dict__") and not isinstance(node, (type, torch.Tensor)) and \
            type(node).__module__.startswith(("torch.distributed", "shardckpt", "deepspeed")):
        return [(("attr", k), v) for k, v in vars(node).items()]
    return []


def places(obj: Any, limit: int = 5_000) -> list[tuple]:
    """Paths to the values in ``obj`` (breadth first, at most ``limit``; shared values once)."""
    out, queue, seen = [], [((), obj)], set()
    while queue and len(out) < limit:
        path, node = queue.pop(0)
        out.append(path)
        if id(node) in seen:
            continue
        seen.add(id(node))
        queue.extend((path + (k,), v) for k, v in _children(node))
    return out


def _get(node: Any, step: Any) -> Any:
    return getattr(node, step[1]) if isinstance(step, tuple) else node[step]


def _replaced(node: Any, step: Any, value: Any, remove: bool) -> Any:
    """``node`` with ``step`` set to ``value`` (or removed); a tuple is rebuilt, anything else changed in place."""
    if isinstance(step, tuple):
        if remove:
            delattr(node, step[1])
        else:
            setattr(node, step[1], value)
        return node
    if isinstance(node, tuple):
        items = list(node)
        if remove:
            del items[step]
        else:
            items[step] = value
        return tuple(items)
    if remove:
        del node[step]
    else:
        node[step] = value
    return node


def set_at(obj: Any, path: tuple, value: Any, remove: bool = False) -> Any:
    """``obj`` with the value at ``path`` replaced by ``value`` (or removed); returns the (new) root."""
    if not path:
        return value
    parents = [obj]
    for step in path[:-1]:
        parents.append(_get(parents[-1], step))
    new = _replaced(parents[-1], path[-1], value, remove)
    for parent, step in zip(reversed(parents[:-1]), reversed(path[:-1])):
        if new is _get(parent, step):
            break
        new = _replaced(parent, step, new, False)
    else:
        return new
    return obj


def mutate_structure(obj: Any, rng: random.Random, values: Callable[[random.Random], Any] = hostile_values
                     ) -> tuple[Any, str]:
    """``obj`` with one place replaced by a hostile value (drawn by ``values``), removed or duplicated; and what
    was done."""
    by_depth: dict[int, list[tuple]] = {}
    for place in places(obj)[1:]:
        by_depth.setdefault(len(place), []).append(place)
    # a depth first, then a place at it: the few fields near the top are hit as often as the many leaves below
    where = rng.choice(by_depth[rng.choice(sorted(by_depth))]) if by_depth else ()
    how = rng.choice(["replace", "replace", "replace", "remove", "duplicate"])
    if how == "remove" and where:
        try:
            return set_at(obj, where, None, remove=True), f"removed {list(where)}"
        except (TypeError, AttributeError, KeyError, IndexError):
            how = "replace"
    if how == "duplicate" and where:
        value = _walk(obj, where)
        return set_at(obj, where, [value, value]), f"doubled {list(where)}"
    value = values(rng)
    return set_at(obj, where, value), f"replaced {list(where)} with {short(value)}"


def _walk(obj: Any, path: tuple) -> Any:
    for step in path:
        obj = _get(obj, step)
    return obj


def short(value: Any) -> str:
    """``value`` in a few words (bounded whatever it is)."""
    return reprlib.repr(value)


# --- bytes -----------------------------------------------------------------------------------------------------

def mutate_bytes(raw: bytes, rng: random.Random, start: int = 0) -> tuple[bytes, str]:
    """``raw`` with 1-4 bytes flipped, runs cut or inserted (from ``start`` on), or truncated."""
    b = bytearray(raw)
    done = []
    for _ in range(rng.randrange(1, 5)):
        how = rng.choice(["flip", "flip", "cut", "insert", "truncate", "int"])
        pos = rng.randrange(start, max(len(b), start + 1))
        if how == "flip" and pos < len(b):
            b[pos] ^= 1 << rng.randrange(8)
        elif how == "cut":
            del b[pos:pos + rng.randrange(1, 64)]
        elif how == "insert":
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        elif how == "truncate":
            del b[pos:]
        elif pos + 8 <= len(b):
            b[pos:pos + 8] = rng.choice([2**63 - 1, 2**32, 10**15, 0]).to_bytes(8, "little")
        done.append(f"{how}@{pos}")
    return bytes(b), " ".join(done)


def with_recursion_limit(fn: Callable[[], Any], limit: int = 3 * DEEP) -> Any:
    """``fn()`` with a higher recursion limit (pickling a deep value recurses)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, limit))
    try:
        return fn()
    finally:
        sys.setrecursionlimit(old)
