"""How a verb's parameter appears on its command line (``Opt``), the options several verbs share, and the parsers of
their command-line text. Light (no torch) and at the base, so that the verbs' specs (``api``'s signatures,
``offline.spec``'s dataclasses) annotate their fields with it. A parser raises ``ValueError``; the CLI turns it
into a usage error (exit 2) naming the option."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable

from shardckpt.sizes import parse_size


@dataclass(frozen=True)
class Opt:
    """How a parameter appears on the command line."""

    help: str
    flags: tuple[str, ...] = ()  # default: ("--name-with-dashes",); a positional takes none
    parse: Callable[[str], Any] | None = None  # the text -> the value; its ValueError is a usage error
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # matched case-insensitively, passed on in lower case
    repeat: bool = False  # may be given several times (action="append"); the function gets a list
    collect: Callable[[list], Any] | None = None  # with repeat: the list -> the function's value


def takes(spec: type, **python_only: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A function whose options are the fields of dataclass ``spec`` (it takes them as ``**options`` and builds the
    spec): its signature becomes its own positional parameters, then the spec's fields (those without a default
    positional, the others keyword-only, with their annotations), then ``python_only`` (name -> default: what it
    takes besides the spec). Users, ``help()``, the docs and ``cli/verbs.py``'s parser see these keywords."""
    def signed(function: Callable[..., Any]) -> Callable[..., Any]:
        hints, own = typing.get_type_hints(spec, include_extras=True), typing.get_type_hints(function)
        keyword, positional = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
        fields = {f.name: f for f in dataclasses.fields(spec)}
        leading = [p.replace(annotation=own.get(name, p.annotation))
                   for name, p in inspect.signature(function).parameters.items()
                   if p.kind is positional and name not in fields]
        given = [inspect.Parameter(f.name, positional if f.default is dataclasses.MISSING else keyword,
                                   default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
                                   annotation=hints[f.name]) for f in fields.values()]
        extra = [inspect.Parameter(name, keyword, default=default, annotation=own.get(name, inspect.Parameter.empty))
                 for name, default in python_only.items()]
        function.__signature__ = inspect.Signature(leading + given + extra, return_annotation=own.get("return"))
        return function
    return signed


def integer(text: str) -> int:
    """An int, whatever its range (the spec that takes it checks that)."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def non_negative(text: str) -> float:
    """A finite number >= 0 (a tolerance, an age in seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"expected a finite number >= 0, got {text!r}")
    return value


def bounded_int(low: int, high: int):
    """A parser of an int in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise ValueError(f"expected an integer from {low} to {high}, got {text!r}")
        return value
    return parse


def _value(key: str, text: str) -> Any:
    """JSON where it parses; a plain string otherwise, unless it looks like a JSON object or list (a typo there
    would reach the backend as a string)."""
    try:
        return json.loads(text)
    except ValueError as e:
        if text.lstrip()[:1] in ("{", "["):
            raise ValueError(f"--storage-option {key}={text}: not valid JSON ({e})") from None
        return text


def storage_options_from(pairs: list[str]) -> dict | None:
    """``KEY=VALUE`` pairs (dotted keys nest) as fsspec storage options, or None when there are none."""
    out: dict = {}
    for item in pairs:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--storage-option {item!r}: {part!r} is already a value")
        node[leaf] = _value(key, text)
    return out or None


STORAGE = Opt("an fsspec storage option KEY=VALUE (repeatable; see below); in Python a dict",
              flags=("--storage-option", "-o"), metavar="KEY=VALUE", repeat=True, collect=storage_options_from)
SIZE_HELP = "bytes, or a size such as 2GiB, 500MB"


def size(text: str) -> int:
    return parse_size(text)


def prefixes(what: str) -> Opt:
    """``--only``/``--exclude``: repeatable, one prefix each (``--only model --only ema``), so that they never
    swallow the positional arguments that follow them."""
    return Opt(f"{what} (repeatable, one prefix each)", metavar="PREFIX", repeat=True)
