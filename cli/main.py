"""The ``shardckpt`` command: a thin argparse root; each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

from shardckpt.cli import convert_cmd, demo_cmd, diff_cmd, export_cmd, gc_cmd, inspect_cmd, ls_cmd, verify_cmd

from shardckpt._version import __version__
from shardckpt.errors import CheckpointError

SUBCOMMANDS = (inspect_cmd, ls_cmd, verify_cmd, convert_cmd, export_cmd, diff_cmd, gc_cmd, demo_cmd)

EXIT_OK, EXIT_FAILED_CHECK, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
TRACEBACK_ENV = "SHARDCKPT_TRACEBACK"  # set to 1 to see an internal error's traceback


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt", description="Distributed checkpoints for sharded PyTorch models.",
        epilog="Exit codes: 0 success, 1 a failed check (corruption, mismatch), 2 bad usage or unreadable input, "
               f"3 an internal error (a bug in shardckpt: {TRACEBACK_ENV}=1 shows its traceback).")
    parser.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = functools.partial(_show_warning, args.command)
            return args.run(args)
    except (CheckpointError, argparse.ArgumentTypeError) as e:
        print(f"shardckpt {args.command}: error: {e}", file=sys.stderr)
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
