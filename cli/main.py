"""The ``shardckpt`` command: a thin argparse root; each subcommand lives in its own module."""
from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

from shardckpt.cli import convert_cmd, demo_cmd, diff_cmd, export_cmd, gc_cmd, inspect_cmd, verify_cmd

from shardckpt._version import __version__
from shardckpt.errors import CheckpointError

SUBCOMMANDS = (inspect_cmd, verify_cmd, convert_cmd, export_cmd, diff_cmd, gc_cmd, demo_cmd)

EXIT_OK, EXIT_FAILED_CHECK, EXIT_USAGE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardckpt", description="Distributed checkpoints for sharded PyTorch models.",
        epilog="Exit codes: 0 success, 1 a failed check (corruption, mismatch), 2 bad usage or unreadable input.")
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


def _show_warning(command: str, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line that names the command (not the source line that raised it)."""
    print(f"shardckpt {command}: warning: {message}", file=sys.stderr if file is None else file)


if __name__ == "__main__":
    sys.exit(main())
