"""``shardckpt inspect PATH``: what a checkpoint holds: shardckpt's own format from its manifest; a safetensors
file or directory, a torch DCP directory or a ``torch.save`` file as its tensors by name and its plain values.
A LOCAL checkpoint is shown by parameter (the logical model, through its flat layouts), its storage form
stated once; ``--stored`` lists the flat tensors as stored."""
from __future__ import annotations

import argparse
import json

from shardckpt.cli.options import STORAGE_HELP, add_storage_options, storage_options
from shardckpt.cli.run_dirs import add_latest, explaining_run_dirs, resolve

from shardckpt.checkpoint.describe import describe
from shardckpt.format.manifest import FORMAT_NAME
from shardckpt.formats.detect import open_reader
from shardckpt.state_dict.logical import is_local, logical_view

EPILOG = """examples:
  shardckpt inspect /ckpt/step-1000
  shardckpt inspect runs/example --latest   (the latest committed step-* below a run directory)
  shardckpt inspect ./Llama-3-8B            (safetensors; also torch DCP directories and torch.save files)
  shardckpt inspect s3://bucket/run/step-1000 --json | jq '.tensors[] | select(.dtype == "bfloat16")'
"""


def register(sub) -> None:
    p = sub.add_parser("inspect", help="show a checkpoint's tensors, sizes and checksums",
                       description="Show format, world size, state-dict type, total bytes and one row per tensor. "
                                   "Also reads safetensors files and directories, torch DCP directories and "
                                   "torch.save files (format, tensors, bytes, plain values).",
                       epilog=EPILOG + "\n" + STORAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="checkpoint directory, file or fsspec URL")
    add_storage_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (tensors: name, dtype, shape, ...)")
    add_latest(p)
    p.add_argument("--stored", action="store_true", help="a LOCAL checkpoint: list its flat tensors as stored "
                                                          "instead of its parameters")
    p.set_defaults(run=run)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    path = resolve(args, args.path)
    with explaining_run_dirs(args, path):
        info = describe(path, storage_options=storage_options(args))
    if info["format"] == FORMAT_NAME:
        info["parameters"] = _by_parameter(path, storage_options(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if info["format"] != FORMAT_NAME:
        return _print_foreign(info)
    print(f"{info['path']}: {info['format']} v{info['version']} ({info['created_by']}), world size "
          f"{info['world_size']}, state dict type {info['state_dict_type'] or '-'}, {len(info['tensors'])} tensors, "
          f"{_size(info['total_bytes'])} in {info['files']} files")
    codecs = sorted({c for t in info["tensors"] for c in t["codecs"] or ["?"]})
    if codecs not in ([], ["raw"]) and info["stored_bytes"]:
        print(f"  compressed: {_size(info['stored_bytes'])} stored, {info['total_bytes'] / info['stored_bytes']:.2f}x "
              f"smaller (codecs {', '.join(codecs)})")
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
    return 0


def _by_parameter(path: str, options: dict | None) -> list[dict] | None:
    """A LOCAL checkpoint's tensors by parameter name, through its flat layouts (None: not LOCAL)."""
    reader = open_reader(path, storage_options=options, verify=False)
    if not is_local(reader.tree()):
        return None
    view = logical_view(reader)
    return [{"name": t.name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
             "bytes": t.dtype.itemsize * _numel(t.shape), "crc32c": None if t.crc32c is None else f"{t.crc32c:08x}"}
            for t in view.tensors().values()]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _print_tensors(tensors: list[dict]) -> None:
    # Columns for compressed checkpoints only ("?": a damaged index; `verify` says what is wrong).
    stored = any(t.get("codecs", ["raw"]) not in ([], ["raw"]) for t in tensors)
    rows = [(t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _size(t["bytes"]), t["crc32c"] or "-")
            + ((_size(t["stored_bytes"]) if t["stored_bytes"] is not None else "?", "+".join(t["codecs"] or "?"))
               if stored else ()) for t in tensors]
    header = ("name", "dtype", "shape", "bytes", "crc32c") + (("stored", "codec") if stored else ())
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _print_foreign(info: dict) -> int:
    """A checkpoint of another format: what it is, then its tensors (the logical model), then its plain values."""
    print(f"{info['path']}: {info['description']}, {len(info['tensors'])} tensors, {_size(info['total_bytes'])}")
    if all(t["crc32c"] is None for t in info["tensors"]):
        print(f"  {info['format']} stores no per-tensor checksum")
    _print_tensors(info["tensors"])
    values = ", ".join(v or "(the whole checkpoint)" for v in info["values"])
    print(f"plain values: {values or 'none'}")
    return 0
