"""Byte counts as people write and read them: ``parse_size("5GB")``, ``format_bytes(1536) == "1.5 KiB"``.
Pure and light (no torch): the CLI parses its options with it before any verb runs."""
from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9), ``"500MiB"`` (2**20 * 500), ``"1.5GB"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).lower() if m else None
        if unit not in _SIZE_UNITS:
            raise ValueError(f"size {size!r}: expected a number of bytes with an optional unit (KB, MB, GB, TB; "
                             "KiB, MiB, GiB, TiB), e.g. 5GB")
        value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"size {size!r}: expected an int or a string such as '5GB'")
    if value < 1:
        raise ValueError(f"size {size!r}: must be at least 1 byte")
    return value


def format_bytes(n: int) -> str:
    """One way to print a byte count: ``"512 B"``, ``"1.5 KiB"``, ``"2.0 GiB"`` (binary units, one decimal)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes per safetensors file, huggingface_hub's default ("5GB")
