"""The ``shardckpt`` command: a thin argparse root. Each verb is a function of ``shardckpt.api`` whose
signature is its spec (``cli/verbs.py`` builds the command from it); its module here prints its result.
Building the parser imports no torch: ``--help`` answers at once."""
from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

from shardckpt.api.spec import VERBS
from shardckpt.cli import (
    convert_cmd, demo_cmd, diff_cmd, export_cmd, gc_cmd, inspect_cmd, latest_cmd, ls_cmd, rm_cmd, verify_cmd)
from shardckpt.cli.verbs import add_verb, in_cli_words

from shardckpt._version import __version__
from shardckpt.errors import CheckpointError

PRINTERS = {"inspect": inspect_cmd, "verify": verify_cmd, "convert": convert_cmd, "export": export_cmd,
            "diff": diff_cmd, "gc": gc_cmd, "rm": rm_cmd, "ls": ls_cmd, "latest": latest_cmd}  # verb -> the module that prints its result

EXIT_OK, EXIT_FAILED_CHECK, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
TRACEBACK_ENV = "SHARDCKPT_TRACEBACK"  # set to 1 to see an internal error's traceback


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt", description="Distributed checkpoints for sharded PyTorch models. Every command is "
                                      "also a Python function: shardckpt.convert(...), shardckpt.verify(...), ...",
        epilog="Exit codes: 0 success, 1 a failed check (corruption, mismatch), 2 bad usage or unreadable input, "
               f"3 an internal error (a bug in shardckpt: {TRACEBACK_ENV}=1 shows its traceback).")
    parser.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for verb in VERBS:
        add_verb(sub, verb, PRINTERS[verb.name])
    demo_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = functools.partial(_show_warning, args.command)
            return args.run(args)
    except (CheckpointError, argparse.ArgumentTypeError) as e:
        print(f"shardckpt {args.command}: error: {in_cli_words(str(e), getattr(args, 'spec', []))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `shardckpt inspect X --json | head`: the reader left, not an error
        sys.stdout = open(os.devnull, "w")
        return EXIT_OK
    except OSError as e:  # the system's answer (no space, no permission, not a directory) names the path
        print(f"shardckpt {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"shardckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: still one line, and the way to its traceback
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        print(f"shardckpt {args.command}: internal error: {type(e).__name__}: {e} (a bug in shardckpt, please "
              f"report it with the output of the same command run with {TRACEBACK_ENV}=1)", file=sys.stderr)
        return EXIT_INTERNAL


def _show_warning(command: str, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line that names the command (not the source line that raised it)."""
    print(f"shardckpt {command}: warning: {message}", file=sys.stderr if file is None else file)


if __name__ == "__main__":
    sys.exit(main())
