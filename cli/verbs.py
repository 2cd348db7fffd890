"""The ``shardckpt VERB`` commands, built from the verbs' own spec (``shardckpt.api.spec``): a verb's
positional and keyword parameters become its arguments and options; every verb also takes ``-q``, ``-v`` and
``--json``. Its module in ``cli/`` adds only what prints its result (``show``) and its examples (``EPILOG``).

Options not given are left out of the call, so the function's own defaults apply (one place for them)."""
from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import sys
from typing import Any

from shardckpt.options import size
from shardckpt.api.spec import Param, Verb, params, python_only
from shardckpt.cli.options import STORAGE_HELP, usage_error
from shardckpt.cli.progress import Progress
from shardckpt.sizes import format_bytes


def add_verb(sub, verb: Verb, module) -> None:
    function = verb.load()
    spec = params(function)
    storage = any(p.name == "storage_options" for p in spec)
    p = sub.add_parser(verb.name, help=verb.help, description=verb.description,
                       epilog=module.EPILOG + ("\n" + STORAGE_HELP if storage else ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    for param in spec:
        _add(p, param)
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar, no log, no summary (a check's verdict, problems and errors still print)")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="say what the library does: resumes, retries, removals (-vv: debug)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (docs/json.md)")
    getattr(module, "add_display_options", lambda parser: None)(p)
    p.set_defaults(run=lambda args: run(verb, module, spec, args), spec=spec)


def _add(p: argparse.ArgumentParser, param: Param) -> None:
    opt = param.opt
    if param.positional:
        p.add_argument(param.name, help=opt.help, metavar=opt.metavar)
        return
    common: dict[str, Any] = {"dest": param.name, "help": _with_default(param), "default": argparse.SUPPRESS}
    if param.default is False:
        p.add_argument(*param.flags, action="store_true", **common)
        return
    parse = usage_error(opt.parse) if opt.parse else str.lower if opt.choices else None
    p.add_argument(*param.flags, action="append" if opt.repeat else "store", type=parse, choices=opt.choices,
                   metavar=opt.metavar or (None if opt.choices else param.name.upper()), **common)


def _with_default(param: Param) -> str:
    """The help, with the function's default where the help does not say it."""
    default = param.default
    if "default" in param.opt.help or default in (None, False, (), ""):
        return param.opt.help
    shown = format_bytes(default) if param.opt.parse is size and isinstance(default, int) else default
    return f"{param.opt.help} (default {shown})"


def keyword_arguments(spec: list[Param], args: argparse.Namespace) -> dict[str, Any]:
    """The function's arguments from the parsed command line: only what was given."""
    out = {}
    for param in spec:
        if hasattr(args, param.name):
            value = getattr(args, param.name)
            out[param.name] = usage_error(param.opt.collect)(value) if param.opt.collect else value
    return out


def run(verb: Verb, module, spec: list[Param], args: argparse.Namespace) -> int:
    _log_to_stderr(verb.name, args)
    function = verb.load()
    kwargs = keyword_arguments(spec, args)
    progress = Progress(verb.name, quiet=args.quiet or args.json)
    if "progress" in python_only(function):
        kwargs["progress"] = progress
    # Python's and torch's objects of the start-up never die: frozen, no collection walks them again (each full
    # collection of a long copy did, ~6% of convert's CPU).
    gc.freeze()
    try:
        call = getattr(module, "call", None)
        result = call(function, kwargs, args) if call else function(**kwargs)
    finally:
        progress.close()
    if result is None:  # not this process's to report (a torchrun worker other than the first)
        return 0
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    module.show(result, args)
    return 0 if getattr(result, "ok", getattr(result, "equal", True)) else 1


def _log_to_stderr(verb: str, args: argparse.Namespace) -> None:
    """The library's ``shardckpt`` logger on stderr: warnings by default, -v info, -vv debug, -q errors only."""
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logger = logging.getLogger("shardckpt")
    logger.setLevel(level)
    if not any(getattr(h, "shardckpt_cli", False) for h in logger.handlers):
        handler = _Stderr()
        handler.shardckpt_cli = True
        logger.addHandler(handler)
    for handler in logger.handlers:
        if getattr(handler, "shardckpt_cli", False):
            handler.setFormatter(logging.Formatter(f"shardckpt {verb}: %(message)s"))


class _Stderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is at each record: ``main()`` may run again in one process (tests,
    notebooks) with another stderr, and the one a handler kept may be closed by then."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def in_cli_words(message: str, spec: list[Param]) -> str:
    """An error message as the command line says it: the library names its Python arguments (``pass
    overwrite=True``, ``type='sharded'``, ``only=['x']``), the command its flags (``--overwrite``,
    ``--type sharded``, ``--only x``)."""
    for param in spec:
        if not param.positional:
            pattern = rf"\b{param.name}=(True\b|'[^']*'|\[[^\]]*\]|(?=[\s,;:)]|$))"
            message = re.sub(pattern, lambda m, flag=param.flags[0]: _flag_with(flag, m.group(1)), message)
    return message


def _flag_with(flag: str, value: str) -> str:
    if value in ("True", ""):
        return flag
    if value.startswith("["):
        return " ".join(f"{flag} {item.strip().strip(chr(39))}" for item in value[1:-1].split(",") if item.strip())
    return f"{flag} {value.strip(chr(39))}"
