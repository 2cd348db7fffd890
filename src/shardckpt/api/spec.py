"""The one spec of every verb, shared by its Python function and its ``shardckpt VERB`` command.

A verb is a function whose parameters carry their command-line form in their annotations::

    def gc(path: Annotated[str, Opt("checkpoint directory or fsspec URL")], *,
           dry_run: Annotated[bool, Opt("list what would be removed, remove nothing")] = False) -> GcResult:

The function's signature is the spec: its names, its defaults, its types. ``Opt`` adds what a command line
needs besides (help, flags, a parser of the text). A parameter without a default is a positional argument,
``--name-with-dashes`` an option otherwise (``False`` defaults are flags); a parameter without ``Opt`` is
Python only (``progress``). The CLI builds its parser from ``VERBS`` (``cli/verbs.py``), leaving out every
option not given, so that the function's default applies: adding an option is one annotated parameter,
adding a verb one function and one ``Verb`` entry.

A verb with many options (``convert``, ``export``) keeps them in a frozen spec dataclass instead
(``offline.spec``), each field annotated as a parameter would be; its function takes ``**options``, builds the
spec from them, and is given the spec's fields as its signature (``options.takes``): users, ``help()`` and the parser
see the same keywords as before. Light: nothing here imports torch."""
from __future__ import annotations

import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable

from shardckpt.options import Opt


@dataclass(frozen=True)
class Param:
    name: str
    default: Any  # inspect.Parameter.empty: a positional argument
    opt: Opt

    @property
    def positional(self) -> bool:
        return self.default is inspect.Parameter.empty

    @property
    def flags(self) -> tuple[str, ...]:
        return self.opt.flags or ("--" + self.name.replace("_", "-"),)


@dataclass(frozen=True)
class Verb:
    name: str
    function: str  # "module:name", imported when the verb is used
    help: str  # one line, in `shardckpt --help`
    description: str

    def load(self) -> Callable[..., Any]:
        module, _, name = self.function.partition(":")
        return getattr(importlib.import_module(module), name)


def params(function: Callable[..., Any]) -> list[Param]:
    """The command-line parameters of ``function``, in its signature's order."""
    hints = typing.get_type_hints(function, include_extras=True)
    out = []
    for name, parameter in inspect.signature(function).parameters.items():
        hint = parameter.annotation  # a signature ``takes`` gave holds its annotations resolved
        if isinstance(hint, str) or hint is inspect.Parameter.empty:
            hint = hints.get(name)
        opts = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Opt)]
        if opts:
            out.append(Param(name, parameter.default, opts[0]))
    return out


def python_only(function: Callable[..., Any]) -> list[str]:
    """The parameters of ``function`` that the command line leaves out (no ``Opt``)."""
    cli = {p.name for p in params(function)}
    return [name for name in inspect.signature(function).parameters if name not in cli]


VERBS = (
    Verb("inspect", "shardckpt.api.check:inspect", "show a checkpoint's tensors, sizes and checksums",
         "Show format, world size, state-dict type, total bytes and one row per tensor. Also reads safetensors "
         "files and directories, torch DCP directories and torch.save files (format, tensors, bytes, plain values)."),
    Verb("verify", "shardckpt.api.check:verify", "check that a checkpoint is complete and uncorrupted",
         "Read every byte of a checkpoint and check it against its checksums. Exit 0 when sound, 1 when not "
         "(each bad tensor and file is named)."),
    Verb("convert", "shardckpt.api.transform:convert", "convert a checkpoint to another world size, type or dtype",
         "Write SRC (any readable format) as a shardckpt checkpoint at DST."),
    Verb("export", "shardckpt.api.transform:export", "export the model weights as Hugging Face style safetensors",
         "Write the model weights of SRC (any readable format) as safetensors files in DST."),
    Verb("diff", "shardckpt.api.check:diff", "compare two checkpoints of any readable formats",
         "Compare checkpoints A and B tensor by tensor, and their plain values."),
    Verb("gc", "shardckpt.api.tidy:gc", "remove what interrupted saves left behind",
         "Remove the debris of interrupted saves at PATH; the committed checkpoint and saves still running are "
         "never touched."),
    Verb("ls", "shardckpt.api.runs:ls", "list the checkpoints below a run directory",
         "List the checkpoints directly below RUN_DIR (e.g. the step-* directories a training loop writes): step, "
         "state, format, state-dict type, world size, size."),
    Verb("latest", "shardckpt.api.tidy:latest", "print the latest committed checkpoint under a run directory",
         "Print the committed checkpoint directly under RUN_DIR with the highest step in its name."),
)
