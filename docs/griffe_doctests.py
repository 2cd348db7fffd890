"""A griffe extension for the API reference: a docstring's doctest lines (``>>> ...`` and the output below
them) become a fenced ``pycon`` block; markdown would read the ``>>>`` as three nested quotes."""
from __future__ import annotations

import re

import griffe

DOCTEST = re.compile(r"^([ \t]*)>>> .*(?:\n\1(?!\s*$).*)*", re.MULTILINE)  # a >>> line and the lines up to a blank


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>> " in obj.docstring.value:
            obj.docstring.value = DOCTEST.sub(_fenced, obj.docstring.value)


def _fenced(match: re.Match) -> str:
    indent = match.group(1)
    body = "\n".join(line[len(indent):] for line in match.group(0).splitlines())
    body = body.replace("  # doctest: +SKIP", "")
    return f"{indent}```pycon\n" + "\n".join(indent + line for line in body.splitlines()) + f"\n{indent}```"
