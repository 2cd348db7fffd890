"""Options verbs share: ``--storage-option KEY=VALUE`` for fsspec backends, ``--rename-map FILE`` (export, verify),
parsers whose ``ValueError`` is a usage error (``usage_error``)."""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

from shardckpt.convert.rename import Renames

STORAGE_HELP = """storage options (passed to the fsspec filesystem of s3://, gs://, ... URLs):
  --storage-option endpoint_url=http://127.0.0.1:9000   a custom S3 endpoint (MinIO, Ceph radosgw, ...)
  --storage-option anon=true                            values are JSON where they parse as JSON
  --storage-option client_kwargs.region_name=eu-west-1  dotted keys build nested options
  --storage-option retry_deadline_s=120    seconds a request is retried (throttling, 5xx, timeouts, resets)
  --storage-option connect_deadline_s=3    seconds it is retried while the endpoint is unreachable (refused,
                                           unknown host); each retry is a warning on stderr
  S3 credentials come from the usual AWS places (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
  AWS_SESSION_TOKEN, AWS_PROFILE, ~/.aws/credentials); key=... and secret=... options override them.
"""


def usage_error(parse):
    """``parse`` as an argparse type: its ``ValueError`` becomes a usage error (exit 2) with its message."""
    def parse_argument(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse_argument


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="an fsspec storage option (repeatable; see below)")


def _value(key: str, text: str) -> Any:
    """JSON where it parses; a plain string otherwise, unless it looks like a JSON object or list (a typo there
    would reach the backend as a string)."""
    try:
        return json.loads(text)
    except ValueError as e:
        if text.lstrip()[:1] in ("{", "["):
            raise argparse.ArgumentTypeError(f"--storage-option {key}={text}: not valid JSON ({e})") from None
        return text


def non_negative(text: str) -> float:
    """An argparse type: a finite number >= 0 (a tolerance, an age in seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def bounded_int(low: int, high: int):
    """An argparse type: an int in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text!r}")
        return value
    return parse


def storage_options(args: argparse.Namespace) -> dict | None:
    """The ``--storage-option`` pairs as a (nested) dict, or None when none were given."""
    out: dict = {}
    for item in args.storage_option:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--storage-option {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise argparse.ArgumentTypeError(f"--storage-option {item!r}: {part!r} is already a value")
        node[leaf] = _value(key, text)
    return out or None


def add_rename_map(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--rename-map", metavar="FILE", type=read_rename_map,
                        help=f"{what}a JSON object of regular expressions -> new names (null: leave out); each name "
                             "is renamed by the first pattern matching it whole")


def read_rename_map(path: str) -> dict:
    """The rename rules in JSON file ``path`` (a usage error naming the file if unreadable or not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            rules = json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--rename-map {path}: {e}") from None
    if not isinstance(rules, dict):
        raise argparse.ArgumentTypeError(f"--rename-map {path}: expected a JSON object of pattern -> new name, "
                                         f"got {type(rules).__name__}")
    try:
        Renames(rules)  # every pattern compiles, every new name is a string or null
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--rename-map {path}: {e}") from None
    return rules
