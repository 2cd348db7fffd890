"""griffe extensions for the API reference (mkdocs.yml loads every Extension in this file).

``DoctestFences``: a docstring's doctest lines (``>>> ...`` and the output below them) become a fenced ``pycon``
block; markdown would read the ``>>>`` as three nested quotes.

``OptionHelp``: a verb function's parameters (``shardckpt.api``) are described by their command-line help,
the ``Opt`` in their annotation (``shardckpt/api/spec.py``): one text for ``--help``, docs/cli.md and here.
A function whose options are a spec dataclass's fields (``shardckpt.options.takes``: ``convert``, ``export``,
``save``) is shown with the signature users call it with, not its ``**options``."""
from __future__ import annotations

import importlib
import inspect
import re
import typing

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


class OptionHelp(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        if pkg.path != "shardckpt":
            return
        from shardckpt.api.spec import params  # imported once griffe has read the package: it then imports modules

        _runtime_signature(pkg["checkpoint"]["save"].functions["save"], "shardckpt.checkpoint.save")
        for module in pkg["api"].modules.values():
            for obj in module.functions.values():
                function = getattr(importlib.import_module(module.path), obj.name)
                _runtime_signature(obj, module.path)
                lines = [f":param {p.name}: {' '.join(p.opt.help.split())} (command line: "
                         f"{p.name.upper() if p.positional else '``' + p.flags[0] + '``'})" for p in params(function)]
                if lines and obj.docstring is not None:
                    obj.docstring.value = obj.docstring.value.rstrip() + "\n\n" + "\n".join(lines)


def _runtime_signature(obj: griffe.Function, module: str) -> None:
    """``obj``'s parameters from the function's ``__signature__``, where ``options.takes`` gave it one."""
    function = getattr(importlib.import_module(module), obj.name)
    if "__signature__" not in vars(function):
        return
    obj.parameters = griffe.Parameters(*[
        griffe.Parameter(p.name, annotation=_shown(p.annotation), kind=griffe.ParameterKind(p.kind.description),
                         default=None if p.default is inspect.Parameter.empty else repr(p.default))
        for p in inspect.signature(function).parameters.values()])


def _shown(annotation) -> str | None:
    """An annotation as the signature shows it: its type without the ``Opt`` (``Annotated[int, Opt(...)]``: int)."""
    if annotation is inspect.Parameter.empty:
        return None
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return inspect.formatannotation(annotation).replace("typing.", "")
