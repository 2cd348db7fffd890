"""Options every verb that opens a checkpoint shares: ``--storage-option KEY=VALUE`` for fsspec backends."""
from __future__ import annotations

import argparse
import json
from typing import Any

STORAGE_HELP = """storage options (passed to the fsspec filesystem of s3://, gs://, ... URLs):
  --storage-option endpoint_url=http://127.0.0.1:9000   a custom S3 endpoint (MinIO, Ceph radosgw, ...)
  --storage-option anon=true                            values are JSON where they parse as JSON
  --storage-option client_kwargs.region_name=eu-west-1  dotted keys build nested options
  S3 credentials come from the usual AWS places (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
  AWS_SESSION_TOKEN, AWS_PROFILE, ~/.aws/credentials); key=... and secret=... options override them.
"""


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="an fsspec storage option (repeatable; see below)")


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


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
        node[leaf] = _value(text)
    return out or None
