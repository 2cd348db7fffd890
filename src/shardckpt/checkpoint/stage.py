"""Save step 1 of 3, ``stage``: what this rank will write, already on the host (local: no collectives, no I/O).

``stage`` turns a state dict into a ``Staged``: each tensor piece this rank may write as a contiguous CPU
tensor with its conjugate/negative bits resolved (its bytes are what goes into the data file), the
encoded tree of plain values (every rank's, which ``plan`` checks agree; rank 0's is committed), this
rank's ``PerRank`` values (encoded, their tensors named with the rank: ``rng.1``) and the metadata.
``plan`` and ``persist`` (``checkpoint/save.py``) then decide where the bytes go and write them; nothing
after ``stage`` reads the caller's state dict.

Copies, and what a ``Staged`` aliases:

- A CPU tensor that is already contiguous (and has no conj/neg bit) is *not* copied: its buffer is a view
  of the caller's tensor, so a save costs no extra memory and no memcpy. Such a snapshot aliases the
  caller's tensors: they must not be modified until ``persist`` returns. ``copy=True`` asks for a real
  snapshot (one host copy of each such tensor), after which the caller may change them at once (what a
  background ``persist`` of CPU tensors needs).
- A contiguous CUDA tensor whose region is one run of the saved tensor is, without ``copy`` or ``buffers``, kept on
  its device: the writer copies it to the host a slice at a time as it writes (``checkpoint.device_slices``), so it
  aliases the caller's tensor as a contiguous CPU tensor does. Any other device tensor is copied to (pageable)
  host memory, and a non-contiguous or lazily conjugated/negated CPU tensor is copied into a contiguous one: those
  buffers never alias the caller's tensors.
- Plain values (the tree) and the metadata are snapshots (encoded / deep-copied here).

Every tensor piece this rank holds is staged, except replicas that another rank stores (a DTensor's
non-owner replica): which rank stores a plain (replicated) tensor is decided later, by ``plan``, so every
rank stages its plain tensors. For device tensors copied to the host, the whole of this rank's share is on the host
at once.

``stage`` does not raise: a rank that raised here would leave the others waiting in ``plan``'s
collectives. Its error is kept in ``Staged.failure`` and ``plan`` raises it on every rank.
"""
from __future__ import annotations

import copy as copy_module
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shardckpt.checkpoint.agree import marker
from shardckpt.checkpoint.collect import LocalPiece, is_saved_leaf, is_tensor_like, local_pieces, per_rank_leaves
from shardckpt.checkpoint.device_slices import keeps_on_device
from shardckpt.checkpoint.save_plan import PieceInfo
from shardckpt.dist.group import Failure, attempt, resolve_group
from shardckpt.errors import UnsupportedValueError
from shardckpt.format.tree import Path, check_savable_depth, encode, leaf_groups, leaf_path, path_name
from shardckpt.format.validate import first_repeat
from shardckpt.gc_pause import gc_paused
from shardckpt.sharded_tensor import PerRank
from shardckpt.tensor_views import as_bytes


@dataclass(frozen=True)
class Staged:
    """One rank's snapshot of a state dict, ready for ``plan`` and ``persist``.

    ``pieces``: by name, what this rank may write; each ``data`` is a contiguous CPU tensor, or a CUDA tensor the
    writer streams (see the module docstring for when, and for when it aliases the caller's tensor). ``infos``: what ``plan`` tells rank 0 about every
    tensor leaf. ``tree``: the encoded tree, each ``PerRank`` as a marker (``checkpoint.agree``).
    ``per_rank``: by name, this rank's ``PerRank`` values, encoded. ``aliased``: the names whose buffer is a
    view of the caller's tensor (empty with ``copy=True``). ``failure``: this rank's staging error, raised on
    every rank by ``plan``. ``prehashed``: an incremental ``async_save``'s pieces left unstaged, and their
    digests (``checkpoint.window_hash``).
    """

    rank: int
    pieces: dict[str, LocalPiece]
    infos: list[PieceInfo]
    tree: Any
    metadata: dict | None
    aliased: frozenset[str]
    failure: Failure | None = None
    per_rank: dict[str, Any] = dataclasses.field(default_factory=dict)
    prehashed: Any = None

    def buffer(self, name: str) -> torch.Tensor:
        """The bytes that will be written for ``name``: a flat uint8 view of its staged tensor (no copy)."""
        return as_bytes(self.pieces[name].data)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data staged on this rank."""
        return sum(p.data.nbytes for p in self.pieces.values())


@gc_paused  # as save is: the step makes several objects per tensor (shardckpt.gc_pause)
def stage(state_dict: dict, *, process_group: Any = None, metadata: dict | None = None,
          copy: bool = False, buffers: StagingBuffers | None = None,
          skip: Callable[[LocalPiece], bool] | None = None) -> Staged:
    """Stage this rank's part of ``state_dict`` on the host (save step 1 of 3; local, no collectives).

    ``process_group`` only tells this rank its place (``PerRank`` values are stored as this rank's); it must be
    the group later given to ``plan``. ``metadata``: a JSON-able dict for the manifest (rank 0's is stored).
    ``copy``: also copy CPU tensors that could be shared (contiguous ones), so that the caller may modify them
    before ``persist`` returns. ``buffers``: copy every piece into these reused host buffers instead (a snapshot,
    like ``copy``, without allocating when shapes repeat; CUDA pieces are copied asynchronously: call
    ``buffers.synchronize()`` before ``persist``). ``skip(piece)``: true leaves that piece unstaged, its data the
    caller's tensor (``checkpoint.window_hash``: proven unchanged). Errors are returned in ``Staged.failure``
    (``plan`` raises them on every rank).
    """
    group = resolve_group(process_group)
    staged = attempt(group.rank, lambda: _stage(state_dict, group.rank, metadata, copy, buffers, skip))
    if isinstance(staged, Failure):
        return Staged(group.rank, {}, [], None, None, frozenset(), staged)
    return staged


def checked_metadata(metadata: dict | None, where: str) -> dict | None:
    """A copy of the user's manifest ``metadata``, refused (``UnsupportedValueError``) unless strict JSON (no NaN),
    so that a save fails before anything is written, not at its commit."""
    if metadata is None:
        return None
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedValueError(f"{where} must be JSON-able: {e}") from None
    return copy_module.deepcopy(metadata)


def _stage(state_dict: dict, rank: int, metadata: dict | None, copy: bool,
           buffers: StagingBuffers | None, skip: Callable[[LocalPiece], bool] | None = None) -> Staged:
    check_savable_depth(state_dict)
    check_unique_names(state_dict, rank)
    pieces = local_pieces(state_dict, rank, check_storable)
    infos = [PieceInfo.of(p) for p in pieces]
    parts: dict[str, Any] = {}

    def per_rank(value: PerRank, path: Path) -> dict:
        parts[path_name(path)] = encode(value.value, is_tensor_like, path + (rank,))
        return marker(path_name(path))

    tree = encode(state_dict, is_tensor_like, per_rank=per_rank)
    metadata = checked_metadata(metadata, "save(metadata=...)")
    host: dict[str, LocalPiece] = {}
    aliased = set()
    if buffers is not None:
        buffers.begin()
    on_device = set()
    for piece in pieces:
        if not piece.owner:  # a replica another rank stores: never written from here
            continue
        if skip is not None and skip(piece):
            data, shares = piece.data.detach(), True
        elif buffers is None and not copy and keeps_on_device(piece.data, piece.region, piece.shape):
            data, shares = piece.data.detach(), True
            on_device.add(data.device)
        else:
            data, shares = (buffers.copy_in(piece.name, piece.data), False) if buffers is not None else \
                host_tensor(piece.data, copy)
        host[piece.name] = piece if data is piece.data else \
            LocalPiece(piece.name, data, piece.shape, piece.region, piece.replicated, piece.owner)
        if shares:
            aliased.add(piece.name)
    if buffers is not None:
        buffers.end()
    for device in on_device:  # the writers' side streams then read the values the caller saw
        torch.cuda.synchronize(device)
    return Staged(rank, host, infos, tree, metadata, frozenset(aliased), per_rank=parts)


class StagingBuffers:
    """Host buffers reused from one staging to the next (async saves of a training state).

    One buffer per tensor name, reallocated only when its dtype or shape changes; a buffer whose name was
    not staged in the last two stagings is freed (one skip keeps it: an incremental save leaves unstaged a tensor
    that did not change, and one that changes every other save then reuses its buffer). CUDA tensors go to pinned buffers, copied on a side stream per device
    that first waits for the work already queued on the current stream; the current stream then waits for
    the copies, so that later in-place updates on it cannot overtake them, and the CPU does not wait at
    all (the GPU's current stream does, for the length of the copies). Work on other streams is not
    ordered: synchronise them before the call. ``synchronize()`` waits until the copies have landed (the
    writer calls it before reading the buffers). Pinned memory comes from torch's caching host allocator,
    which rounds sizes up and keeps freed blocks for reuse.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()
        self._idle: set[str] = set()  # not staged last time: freed if not staged this time either
        self._streams: dict[torch.device, Any] = {}
        self._events: list = []
        self.allocations = 0  # buffers allocated so far (a steady state allocates none)

    @property
    def nbytes(self) -> int:
        """Host memory held now."""
        return sum(b.nbytes for b in self._buffers.values())

    @property
    def copied_bytes(self) -> int:
        """Bytes the last staging copied in."""
        return sum(self._buffers[name].nbytes for name in self._used if name in self._buffers)

    def begin(self) -> None:
        self._used.clear()
        self._events.clear()

    def copy_in(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        pinned = t.device.type == "cuda"
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != t.dtype or buf.shape != t.shape or buf.is_pinned() != pinned:
            buf = self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            self.allocations += 1
        self._used.add(name)
        if pinned:
            self._copy_on_side_stream(buf, t)
        else:
            buf.copy_(t)  # resolves conj/neg bits and strides
        return buf

    def _copy_on_side_stream(self, buf: torch.Tensor, t: torch.Tensor) -> None:
        current = torch.cuda.current_stream(t.device)
        if t.device not in self._streams:
            self._streams[t.device] = torch.cuda.Stream(device=t.device)
        stream = self._streams[t.device]
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            # Resolved on the device first: a non-blocking copy of a conj/neg view would fix the bit up on
            # the host buffer before the transfer lands.
            buf.copy_(t.resolve_conj().resolve_neg(), non_blocking=True)
            self._events.append(torch.cuda.Event())
            self._events[-1].record(stream)
        t.record_stream(stream)  # the caller may free t; its memory is not reused before the copy ends
        current.wait_stream(stream)

    def end(self) -> None:
        unused = set(self._buffers) - self._used
        for name in unused & self._idle:
            del self._buffers[name]
        self._idle = unused - self._idle

    def synchronize(self) -> None:
        for event in self._events:
            event.synchronize()

    def release(self) -> None:
        """Free every buffer (the next staging allocates again)."""
        self.synchronize()
        self._buffers.clear()


def host_tensor(t: torch.Tensor, copy: bool = False) -> tuple[torch.Tensor, bool]:
    """``t``'s values as a contiguous CPU tensor without conj/neg bits, and whether it shares ``t``'s memory.

    Copied only when ``t`` is on a device, not contiguous, lazily conjugated/negated, or ``copy`` is set."""
    if t.is_cpu and not copy and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        # the common case, without the general path's calls (many small tensors); a piece's data is detached already
        # (``collect.to_piece``: a tensor object of its own), and is staged as it is
        return t if type(t) is torch.Tensor and not t.requires_grad else t.detach(), t.numel() > 0
    t = t.detach()
    if t.device.type != "cpu":
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        out.copy_(t.resolve_conj().resolve_neg())  # one copy, into a contiguous host tensor
        return out, False
    out = t.resolve_conj().resolve_neg().contiguous()  # each a no-op unless it has to copy
    shares = out.numel() > 0 and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    if shares and copy:
        out, shares = out.clone(memory_format=torch.contiguous_format), False
    return out, shares


def check_storable(name: str, t: torch.Tensor) -> None:
    """Refuse (``UnsupportedValueError``) a tensor with no dense data to store: sparse, nested, on the meta device."""
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if t.is_nested else f"{t.layout} (not dense)"
        raise UnsupportedValueError(f"tensor {name!r} is {kind}; shardckpt stores dense tensors: save its dense form "
                                    "(t.to_dense()) or its parts (indices, values) as tensors of their own")
    if t.is_meta:
        raise UnsupportedValueError(f"tensor {name!r} is on the meta device: it has no data to save (materialize "
                                    "the module first, e.g. to_empty(device=...) and initialize or load it)")


def check_unique_names(state_dict: dict, rank: int = 0) -> None:
    """Loads match entries by their keys joined with '.', so two entries may not share that name (this rank's
    ``PerRank`` values named as stored: ``rng.<rank>...``). Checked a container's leaves at a time."""
    seen: set[str] = set()
    for parent, keys, names, values in leaf_groups(state_dict, is_saved_leaf):
        for i in [i for i, v in enumerate(values) if isinstance(v, PerRank)]:
            names += [path_name(p) for p, _ in per_rank_leaves(leaf_path(parent, keys, i), values[i], rank)]
        if not seen.isdisjoint(names) or len(set(names)) != len(names):
            raise UnsupportedValueError(f"two state-dict entries are both named {first_repeat([*seen, *names])!r} "
                                        "once their keys are joined with '.' (e.g. a key 'a.b' beside 'a' -> 'b'); "
                                        "rename one")
        seen.update(names)
