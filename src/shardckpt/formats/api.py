"""The one read interface every checkpoint format is read through, and the one read request.

A reader presents a checkpoint as logical tensors by name (dtype, shape, the checksum where the format
keeps one) and a tree of plain values, says what it knows of the checkpoint as a whole (``Facts``), and fills
caller buffers from any region of any tensor. It reads nothing the caller did not ask for. shardckpt's own format (``formats/native``) is the first
implementation; readers of foreign formats (torch DCP, ``torch.save``, safetensors, ZeRO) come next.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from shardckpt.regions import Region
from shardckpt.records import record


@record
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32c: int | None  # of the whole tensor's bytes in row-major order (FORMAT.md); None: not stored


@record
class ReadRequest:
    """Fill ``dest`` with ``region`` of the saved tensor named ``tensor``.

    ``dest`` is contiguous and holds the region's elements in the region's local order (row-major
    within a box; a flat range in order), on any device; a dtype other than the saved one is cast.
    This is the whole read vocabulary: ``load``, ``load_full``, ``load_state`` and the offline tools
    all turn what they want into such requests.
    """

    tensor: str
    region: Region
    dest: torch.Tensor


@dataclass(frozen=True)
class Facts:
    """What a reader knows of its checkpoint as a whole, beside its tensors and tree."""

    format: str  # "shardckpt", "safetensors", "torch DCP", "torch.save", "DeepSpeed"
    location: str  # the checkpoint's path or URL, for messages
    world_size: int | None = None  # the ranks that saved it, where the format records them
    state_dict_type: str | None = None  # as shardckpt's metadata records it ("LOCAL_STATE_DICT"); None: not recorded
    metadata: Mapping[str, Any] = field(default_factory=dict)  # shardckpt's ``metadata`` (param_names, optim_key...)
    identity: str | None = None  # changes whenever the values may (a shardckpt generation); None: nothing does


@runtime_checkable
class CheckpointReader(Protocol):
    def tensors(self) -> Mapping[str, TensorInfo]:
        """Every tensor the checkpoint holds, by name."""

    def tree(self) -> Any:
        """The saved nesting: dicts and lists, with plain values and ``TensorRef`` leaves for tensors."""

    def facts(self) -> Facts:
        """What the reader knows of the checkpoint as a whole (format, world size, type, metadata, identity)."""

    def read(self, requests: Sequence[ReadRequest]) -> None:
        """Fill every request's ``dest``; every byte is checked where the format stores checksums.

        Bad requests (unknown tensor, region outside it, wrong ``dest`` size) raise before any read."""
