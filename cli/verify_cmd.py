"""``shardckpt verify PATH``: prove a checkpoint complete and uncorrupted; ``verify DST --against SRC``: prove an
export holds the source's values (``shardckpt.verify``; this module prints its result)."""
from __future__ import annotations

import argparse
import sys

from shardckpt.api.results import VerifyResult
from shardckpt.sizes import format_bytes

EPILOG = """checks: the manifest's own checksum (format v2 on); every data file present with its recorded
size; every chunk index intact; chunks tile every tensor exactly once; every checksum block of every
chunk (a failure names its byte range); every tensor's sharding-independent checksum.

An exported safetensors directory (`shardckpt export`) is checked for its structure (headers within
their files, the index placing every tensor and naming every file, its total_size); with --against SRC
every value is compared with the source as export reads it (the same --only/--strip-prefix), bit for
bit after the export's cast.

--deep, for incremental (pooled) checkpoints: also hash every pooled chunk with the pool's key and compare
the digest its index row records (what the next incremental save compares against; a load never needs it).

examples:
  shardckpt verify /ckpt/step-1000
  shardckpt verify /ckpt/run --deep
  shardckpt verify s3://bucket/run/step-1000 --quiet && echo sound
  shardckpt verify ./hf-out --against /ckpt/step-1000
"""


def show(result: VerifyResult, args: argparse.Namespace) -> None:
    if args.json:
        return
    if not result.ok:
        lines = [str(p) for p in result.problems] + [f"{d.name}: {d.kind}: {d.detail}" for d in result.differences]
        if len(lines) == 1 and not result.tensors:  # nothing could be checked: the manifest, an unreadable export
            print(f"FAILED {result.path}: {lines[0]}", file=sys.stderr)
            return
        for line in lines:
            print(f"BAD {line}", file=sys.stderr)
        bad = [c["name"] for c in result.checkpoints if not c["ok"]]
        print(f"FAILED {result.path}: {len(lines)} problem(s) in {result.tensors} tensors" +
              (f" ({len(bad)} of {len(result.checkpoints)} checkpoints: {', '.join(bad)})" if result.kind == "run"
               else ""), file=sys.stderr)
        return
    deep = f", content digests of {result.digests_checked} pooled chunks checked" if result.digests_checked else \
        (", --deep: not pooled, no content digests to check" if getattr(args, "deep", False) else "")
    if result.kind == "run":
        print(f"OK {result.path}: {len(result.checkpoints)} checkpoints, {result.tensors} tensors, {result.chunks} "
              f"chunks, {format_bytes(result.tensor_bytes)} read (each chunk of the pool once){deep}")
        return
    if result.kind == "export":
        against = "" if result.against is None else f", every value equal to {result.against}'s"
        print(f"OK {result.path}: {result.files} files, {result.tensors} tensors, "
              f"{format_bytes(result.tensor_bytes)} of tensor data{against}")
        return
    manifest = ("manifest checksum OK" if result.manifest_checksum else
                f"format v{result.version}: its manifest has no checksum, not checked")
    print(f"OK {result.path}: {result.tensors} tensors, {result.chunks} chunks, "
          f"{format_bytes(result.tensor_bytes)} of tensor data checked, {manifest}{deep}")
    if result.sharing is not None:
        print(sharing_line(result.sharing))


def sharing_line(sharing: dict) -> str:
    """"1.00 GiB of 1.06 GiB shared: 1.00 GiB written by step-100 (also read by step-200), 61 MiB by this save"."""
    parts = [f"{format_bytes(s['bytes'])} written by {s['written_by'] or 'a removed step'}" +
             (f" (also read by {', '.join(s['also_used_by'])})" if s["also_used_by"] else "") for s in sharing["shared"]]
    parts.append(f"{format_bytes(sharing['own_bytes'])} by this save")
    return (f"pooled: {format_bytes(sharing['shared_bytes'])} of {format_bytes(sharing['total_bytes'])} shared: "
            + ", ".join(parts))
