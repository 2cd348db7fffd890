"""Reading untrusted JSON: strict parsing and typed field access whose errors name the file and the field.

FORMAT.md's rules live here: no duplicate keys in any object, integers are JSON integers (never ``1.0``
or ``1e2``), paths stay inside the checkpoint, and (from format v2) objects carry exactly the fields the
spec lists.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable

from shardckpt.errors import CorruptCheckpointError

MAX_NUMEL = 1 << 50  # far beyond any real tensor; larger is a hostile or broken manifest
MAX_BYTES = 1 << 62
# An empty tensor's non-zero dims multiplied: within int64, every stride and every running product of the sizes
# torch computes is (so it lays the tensor out, for every dtype); past 2**63 one may overflow ("Stride calculation
# overflowed"), depending on the order of the dims.
MAX_EMPTY_LAYOUT = (1 << 63) - 1
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def absurd_shape(shape: list | tuple, numel: int) -> bool:
    """Whether a shape of ``numel`` elements (``math.prod(shape)``, its dims each checked already) is more than a
    checkpoint can hold: more than ``MAX_NUMEL`` elements, or empty beside dims that torch cannot lay out
    (``[0, 2**50, 2**50]``: the rule is met for each dim and the product, but allocating it fails; helper-45)."""
    return numel > MAX_NUMEL or (not numel and math.prod(d or 1 for d in shape) > MAX_EMPTY_LAYOUT)


def get_int(value: Any, where: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """``value`` as an int in ``[lo, hi]``; floats (``1.0``), bools and big numbers are rejected."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptCheckpointError(f"{where}: expected an integer in [{lo}, {hi}], got {str(value)[:40]}")
    return value


def int_field(obj: Any, key: str, where: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    """Field ``key`` of ``obj`` as an int in ``[lo, hi]``; errors name the field."""
    return get_int(get_field(obj, key, where), f"{where} field {key!r}", lo, hi)


def get_field(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CorruptCheckpointError(f"{where}: missing field {key!r}")
    return obj[key]


def get_list(obj: Any, key: str, where: str) -> list:
    value = get_field(obj, key, where)
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{where}: {key!r} must be a list")
    return value


def check_fields(obj: Any, required: Iterable[str], optional: Iterable[str], where: str) -> None:
    """An object with every required field and no field outside the two lists (format v2 and later)."""
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: expected an object, got {type(obj).__name__}")
    required = set(required)
    missing = required - obj.keys()
    if missing:
        raise CorruptCheckpointError(f"{where}: missing field {sorted(missing)[0]!r}")
    unknown = obj.keys() - required - set(optional)
    if unknown:
        raise CorruptCheckpointError(f"{where}: unknown field {sorted(unknown)[0]!r} (this format version does not "
                                     "define it)")


def check_relative_path(path: Any, where: str) -> str:
    """A data path must stay inside the checkpoint: relative, no '..', a plain character set."""
    if not isinstance(path, str) or not _SAFE_PATH.match(path) or any(p in (".", "..") for p in path.split("/")):
        raise CorruptCheckpointError(f"{where}: unsafe or invalid file path {path!r} (it must stay inside the "
                                     "checkpoint directory)")
    return path


def first_repeat(items: Iterable) -> Any:
    """The first item equal to an earlier one (callers know there is one: a set of them came out shorter)."""
    seen: set = set()
    return next(x for x in items if x in seen or seen.add(x))


def _no_duplicates(where: str):
    def hook(pairs: list) -> dict:
        out = dict(pairs)  # in C: one call per object, not a Python loop per key (manifests of 100k tensors)
        if len(out) != len(pairs):
            raise CorruptCheckpointError(f"{where}: duplicate key {first_repeat(k for k, _ in pairs)!r}")
        return out
    return hook


def parse_json(data: bytes, where: str) -> Any:
    """Strict JSON: UTF-8 (no byte-order mark), no duplicate keys, no NaN/Infinity literals."""
    def no_constants(name: str) -> Any:
        raise CorruptCheckpointError(f"{where}: {name} is not valid JSON")

    if data[:3] == b"\xef\xbb\xbf":  # json.loads would skip it (and take UTF-16/32 too): the format is UTF-8 alone
        raise CorruptCheckpointError(f"{where}: starts with a byte-order mark; the format's JSON is UTF-8 without one")
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates(where), parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
