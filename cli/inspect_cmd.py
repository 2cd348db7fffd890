"""``shardckpt inspect PATH``: what a checkpoint holds (``shardckpt.inspect``; this module prints it):
shardckpt's own format from its manifest; a safetensors file or directory, a torch DCP directory or a
``torch.save`` file as its tensors by name and its plain values. A LOCAL checkpoint is shown by parameter (the
logical model, through its flat layouts), its storage form stated once; ``--stored`` lists the flat tensors as
stored."""
from __future__ import annotations

import argparse

from shardckpt.api.results import InspectResult
from shardckpt.sizes import format_bytes

FORMAT_NAME = "shardckpt"  # shardckpt.format.manifest.FORMAT_NAME (importing it imports torch)

EPILOG = """examples:
  shardckpt inspect /ckpt/step-1000
  shardckpt inspect runs/example --latest   (the latest committed step-* below a run directory)
  shardckpt inspect ./Llama-3-8B            (safetensors; also torch DCP directories and torch.save files)
  shardckpt inspect s3://bucket/run/step-1000 --json | jq '.tensors[] | select(.dtype == "bfloat16")'
"""


def add_display_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stored", action="store_true", help="a LOCAL checkpoint: list its flat tensors as stored "
                                                          "instead of its parameters")


def show(result: InspectResult, args: argparse.Namespace) -> None:
    if args.json or args.quiet:
        return
    info = {**result.details, "path": result.path, "format": result.format, "tensors": list(result.tensors)}
    if info["format"] != FORMAT_NAME:
        _print_foreign(info)
        return
    print(f"{info['path']}: {info['format']} v{info['version']} ({info['created_by']}), world size "
          f"{info['world_size']}, state dict type {info['state_dict_type'] or '-'}, {len(info['tensors'])} tensors, "
          f"{_size(info['total_bytes'])} of tensor data in {info['files']} files "
          f"({'?' if info['stored_bytes'] is None else _size(info['stored_bytes'])} on disk)")
    if info.get("pool"):
        print(f"  pooled (incremental): its files are in {info['pool']['path']} (id {info['pool']['id'][:12]}...), "
              f"from {info['pool']['generations']} generation{'s' if info['pool']['generations'] != 1 else ''}; "
              "`verify` says which steps wrote them")
    # codecs None: the index could not be read ("?"); []: an empty tensor, which has no chunks
    codecs = sorted({c for t in info["tensors"] for c in (["?"] if t["codecs"] is None else t["codecs"])})
    if codecs not in ([], ["raw"]) and info["stored_bytes"]:
        print(f"  compressed: {info['total_bytes'] / info['stored_bytes']:.2f}x smaller (codecs {', '.join(codecs)})")
    if info["manifest_checksum"]:
        print(f"  manifest checksummed; chunk checksums per {_size(info['block_size'] or 0)} block")
    else:
        print(f"  format v{info['version']}: no manifest checksum, one checksum per whole chunk (a partial read "
              "checks its whole chunk)")
    if info["parameters"] is not None and not args.stored:
        groups = [t["name"] for t in info["tensors"] if t["name"].startswith("model.") and t["name"].endswith("_flat_param")]
        print(f"  stored as LOCAL: {len(groups)} flat groups padded for world size {info['world_size']} "
              f"({', '.join(groups[:3])}{', ...' if len(groups) > 3 else ''}); shown by parameter "
              "(--stored: as stored)")
        _print_tensors(info["parameters"])
    else:
        _print_tensors(info["tensors"])


_size = format_bytes


def _print_tensors(tensors: list[dict]) -> None:
    # Columns for compressed checkpoints only ("?": a damaged index; `verify` says what is wrong).
    stored = any(t.get("codecs", ["raw"]) not in ([], ["raw"]) for t in tensors)
    rows = [(t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _size(t["bytes"]), t["crc32c"] or "-")
            + ((_size(t["stored_bytes"]) if t["stored_bytes"] is not None else "?", "?" if t["codecs"] is None else "+".join(t["codecs"]) or "-")
               if stored else ()) for t in tensors]
    header = ("name", "dtype", "shape", "tensor bytes", "crc32c") + (("stored bytes", "codec") if stored else ())
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _print_foreign(info: dict) -> None:
    """A checkpoint of another format: what it is, then its tensors (the logical model), then its plain values."""
    print(f"{info['path']}: {info['description']}, {len(info['tensors'])} tensors, {_size(info['total_bytes'])} "
          "of tensor data")
    if all(t["crc32c"] is None for t in info["tensors"]):
        print(f"  {info['format']} stores no per-tensor checksum")
    _print_tensors(info["tensors"])
    values = ", ".join(v or "(the whole checkpoint)" for v in info["values"])
    print(f"plain values: {values or 'none'}")
