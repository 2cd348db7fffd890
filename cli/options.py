"""What the verbs' command lines share beyond their spec (``shardckpt.options`` holds the shared
options themselves): the storage options' help, and ``usage_error`` (a parser's ``ValueError`` as a usage
error, exit 2)."""
from __future__ import annotations

import argparse

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
    def parse_argument(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse_argument
