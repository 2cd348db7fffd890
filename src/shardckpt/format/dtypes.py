"""The dtypes a checkpoint may hold, by the names written in the manifest (torch's own names)."""
from __future__ import annotations

import torch

from shardckpt.errors import CorruptCheckpointError, UnsupportedValueError

# Every dtype safetensors knows (fp8 variants included), plus complex. Names are stable on-disk strings.
_NAMES = [
    "float64", "float32", "float16", "bfloat16",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex64", "complex128",
]
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _NAMES if hasattr(torch, n)}
_BY_DTYPE = {d: n for n, d in DTYPES.items()}


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """On-disk name of ``dtype``; ``key`` names the tensor in the error."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedValueError(f"tensor {key!r} has dtype {dtype}, which shardckpt cannot store") from None


def dtype_from_name(name: object, where: str) -> torch.dtype:
    """The torch dtype for an on-disk name; ``where`` says which file and tensor, for the error."""
    if not isinstance(name, str) or name not in DTYPES:
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r} (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
