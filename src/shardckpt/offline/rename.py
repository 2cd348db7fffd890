"""``Renames``: the rename rules of ``export --rename-map`` (and ``verify --against``): regular expressions matched
against whole names, in order; the first match renames (its groups usable in the new name), ``None`` leaves
the tensor out. A rule that matches nothing is reported (``check_all_used``): a typo must not pass silently.
``read_rename_map``: the rules of a JSON file (``--rename-map FILE``). Light (no torch): the CLI parses with it."""
from __future__ import annotations

import json
import re
from typing import Mapping

from shardckpt.errors import IncompatibleCheckpointError


class Renames:
    """The rename rules of ``rename``: compiled, in order, each remembering whether it matched."""

    def __init__(self, rules: Mapping[str, str | None]):
        if not isinstance(rules, Mapping):
            raise ValueError(f"rename must map regular expressions to new names, got {type(rules).__name__}")
        self.rules = []
        for pattern, replacement in rules.items():
            if not isinstance(pattern, str) or not (replacement is None or isinstance(replacement, str)):
                raise ValueError(f"rename rule {pattern!r}: {replacement!r}: expected a pattern and a new name "
                                 "(a string) or null")
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"rename rule {pattern!r}: not a regular expression: {e}") from None
            if replacement is not None:
                try:  # the new name's group references (\9, \g<x>) are checked here, not first at a match
                    compiled.sub(replacement, "")
                except (re.error, IndexError) as e:
                    raise ValueError(f"rename rule {pattern!r}: {replacement!r}: not a valid new name: {e}") from None
            self.rules.append((compiled, replacement))
        self.used: set[int] = set()

    def __call__(self, name: str) -> str | None:
        for i, (pattern, replacement) in enumerate(self.rules):
            match = pattern.fullmatch(name)
            if match:
                self.used.add(i)
                return None if replacement is None else match.expand(replacement)
        return name

    def check_all_used(self) -> None:
        unused = [pattern.pattern for i, (pattern, _) in enumerate(self.rules) if i not in self.used]
        if unused:
            raise IncompatibleCheckpointError(f"rename rules that match no exported tensor: {unused} (names are "
                                              "matched whole, after the model prefix and wrappers are removed)")


def read_rename_map(path: str) -> dict:
    """The rename rules in JSON file ``path`` (a ValueError naming the file if unreadable or not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            rules = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--rename-map {path}: {e}") from None
    if not isinstance(rules, dict):
        raise ValueError(f"--rename-map {path}: expected a JSON object of pattern -> new name, got "
                         f"{type(rules).__name__}")
    try:
        Renames(rules)  # every pattern compiles, every new name is a string or null
    except ValueError as e:
        raise ValueError(f"--rename-map {path}: {e}") from None
    return rules
