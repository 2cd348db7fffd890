"""``torch.save`` files behind the one read interface, loaded safely and memory-mapped.

The file is loaded once, with ``torch.load(path, map_location="cpu", weights_only=True, mmap=True)``: torch's
restricted unpickler admits tensors, plain containers and torch's own few types, nothing else, so a file
that names any other class or callable (a pickle that would run code) is refused with a
``CorruptCheckpointError`` naming the file, and nothing in it is executed. What it loaded must be a tree no
bigger than its pickle could hold without shared references, and at most ``MAX_DEPTH`` deep
(``formats.untrusted.check_expansion``: a few bytes of pickle can describe a tree of 2**100 values), checked
before anything walks it. ``mmap`` keeps the tensors' bytes
in the file: ``read`` copies just the requested region, so only the pages it touches are read from disk.
Files in torch's legacy (pre-1.6, non-zip) format cannot be memory-mapped; they are loaded whole, still with
``weights_only``. ``safe_globals`` admits a few more classes by name (``formats.deepspeed.unpickle``): each is
given as ``(stand_in, "module.Name")``, so the pickle's class is built as a harmless stand-in and its module is
never imported.

Memory: the pages of the mapped file a ``read`` touches are given back to the kernel after the copy
(``madvise(MADV_DONTNEED)`` on the file's own mapping, which nothing writes to: a later read maps them again
from the file), so reading a file of any size keeps resident only what the caller's destinations hold.

Only local files (and ``file://``) are read: ``torch.load`` needs a seekable local file to map. A URL is refused
with a ``CheckpointError`` that says to copy the file to local disk first (downloading it here would read the
whole file whatever the caller asks for).

Tensors are named by their path in the loaded nesting, keys joined by ``.`` (``format.tree.path_name``: the
``state_dict`` key for a flat state dict, ``"state.0.exp_avg"`` inside an optimizer's). ``tree()`` is the loaded
nesting (dicts, lists, tuples) with every tensor replaced by ``TensorRef(name)`` and every other value kept as
loaded; a file that holds a single tensor has the tree ``TensorRef("")``. ``crc32c`` is ``None``: torch.save
stores no per-tensor checksum. But its zip archive keeps a CRC32 of every member, which ``torch.load`` never
checks: a ``read`` checks the records of the tensors it reads, each record once (and, at the first read, the
small records that hold no tensor: ``data.pkl`` and kin), so that no flipped byte reaches a caller and a read
of some tensors reads no others (an export of a DeepSpeed checkpoint: the weights, not the optimizer state);
``tensors()`` and ``tree()`` alone read nothing. Where the records cannot be located (no mapping known), the
first read checks the whole archive. The legacy format has no checksum at all.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import pickle
import struct
import sys
import zipfile
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import MAX_DEPTH, TensorRef, depth_exceeds, path_name
from shardckpt.formats.api import Facts, ReadRequest, TensorInfo
from shardckpt.formats.requests import check_requests
from shardckpt.formats.untrusted import check_expansion
from shardckpt.regions import Box, FlatRange
from shardckpt.tensor_views import copy_into

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default format since torch 1.6 (a zip archive)
RELEASE_BYTES = 1 << 20  # the mapped bytes a read copies before giving their pages back
PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # the legacy format: pickles, protocol 2+


def is_torch_save(head: bytes) -> bool:
    """Whether a file's first bytes look like a ``torch.save`` file (a zip archive or a pickle)."""
    return head.startswith(ZIP_MAGIC) or head[:2] in PICKLE_MAGIC


def local_path(path: str | os.PathLike) -> str:
    """``path`` as a local file path; a URL other than ``file://`` raises ``CheckpointError``."""
    path = os.fspath(path)
    if path.startswith("file://"):
        return path[len("file://"):]
    if "://" in path:
        raise CheckpointError(f"{path}: a torch.save file is read from local disk only (torch.load memory-maps "
                              "it); copy it to a local file first")
    return path


def _boxes(lo: int, hi: int, shape: tuple[int, ...]):
    """The flat range ``[lo, hi)`` of a row-major ``shape`` as consecutive boxes ``(offsets, sizes)``, in order."""
    if lo >= hi:
        return
    if not shape:
        yield (), ()
        return
    inner = 1
    for s in shape[1:]:
        inner *= s
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        for off, size in _boxes(lo - first * inner, hi - first * inner, shape[1:]):
            yield (first,) + off, (1,) + size
        return
    if lo % inner:
        for off, size in _boxes(lo - first * inner, inner, shape[1:]):
            yield (first,) + off, (1,) + size
        first += 1
    full = hi // inner
    if full > first:
        yield (first,) + (0,) * (len(shape) - 1), (full - first,) + tuple(shape[1:])
    if hi % inner:
        for off, size in _boxes(0, hi - full * inner, shape[1:]):
            yield (full,) + off, (1,) + size


class TorchSaveReader:
    """A ``CheckpointReader`` over one ``torch.save`` file (see the module's docstring)."""

    # What a read holds besides its destination (``offline.memory.read_reserve``): the folios around the step it
    # copies, not yet given back, and the torch code that copying and unpickling bring in (measured ~3 MiB).
    transient_read_bytes = 2 * RELEASE_BYTES + 2 * (2 << 20) + (2 << 20)

    def __init__(self, path: str | os.PathLike, *, safe_globals: Sequence[Any] = ()):
        self.path = os.path.abspath(local_path(path))
        if not os.path.isfile(self.path):
            raise CorruptCheckpointError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            head = f.read(4)
        self._mapped = head.startswith(ZIP_MAGIC)
        admitted = torch.serialization.safe_globals(list(safe_globals)) if safe_globals else contextlib.nullcontext()
        try:
            with admitted:
                obj = torch.load(self.path, map_location="cpu", weights_only=True, mmap=self._mapped)
        except pickle.UnpicklingError as e:
            raise CorruptCheckpointError(f"{self.path}: refused: torch.load(weights_only=True) found more than "
                                         f"tensors and plain containers, and shardckpt never unpickles arbitrary "
                                         f"objects ({str(e).splitlines()[0][:300] if str(e) else e!r})") from None
        except Exception as e:  # a damaged or truncated archive: torch raises RuntimeError, EOFError, ...
            raise CorruptCheckpointError(f"{self.path}: not a loadable torch.save file "
                                         f"({e.__class__.__name__}: {str(e)[:300]})") from None
        check_expansion(obj, self._pickle_bytes(), self.path)
        if depth_exceeds(obj):
            raise CorruptCheckpointError(f"{self.path}: the saved object nests more than {MAX_DEPTH} levels deep")
        self._tensors: dict[str, torch.Tensor] = {}
        self._tree, _ = self._walk(obj, ())
        self._infos = {n: TensorInfo(n, t.dtype, tuple(t.shape), None) for n, t in self._tensors.items()}
        self._crcs_checked = not self._mapped
        self._mapping = _file_mapping(self.path) if self._mapped else None
        self._records: tuple[list[int], list[zipfile.ZipInfo]] | None = None  # storage records by data offset
        self._checked: set[str] = set()  # records whose CRC-32 passed

    def _check_crcs(self, infos: Sequence[zipfile.ZipInfo] | None = None) -> None:
        """Archive members (default: all) against their zip CRC-32s (``zipfile`` raises at the end of a member
        that fails), each once."""
        try:
            with zipfile.ZipFile(self.path) as zf:
                for info in zf.infolist() if infos is None else infos:
                    if info.filename in self._checked:
                        continue
                    with zf.open(info) as member:
                        while member.read(1 << 20):  # small reads: a CRC pass adds no memory to speak of
                            pass
                    self._checked.add(info.filename)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise CorruptCheckpointError(f"{self.path}: the archive is damaged ({e}); torch.load does not check "
                                         "its CRCs, shardckpt does") from None
        if infos is None:
            self._crcs_checked = True

    def _check_tensor_records(self, names: set[str]) -> None:
        """The CRC-32s of the storage records holding tensors ``names`` (and, once, of the small records that
        are not storages: ``data.pkl`` and kin), so that a read checks what it reads and no more. Where the
        records cannot be told apart (no mapping known), the whole archive, once."""
        if self._mapping is None:
            return self._check_crcs()
        if self._records is None:
            self._records = self._storage_records()
            self._check_crcs([i for i in self._records[1] if "/data/" not in i.filename])
        starts, infos = self._records
        wanted = []
        for name in names:
            t = self._tensors[name]
            if not t.numel():
                continue
            offset = _file_offset(self._mapping, t.untyped_storage().data_ptr())
            i = bisect.bisect_right(starts, offset) - 1 if offset is not None else -1
            if i < 0 or offset >= starts[i] + infos[i].compress_size:
                return self._check_crcs()  # not where the records say: check everything rather than guess
            wanted.append(infos[i])
        self._check_crcs(wanted)

    def _storage_records(self) -> tuple[list[int], list[zipfile.ZipInfo]]:
        """Every archive record with the file offset of its first data byte, by offset (local headers read)."""
        found = []
        try:
            with open(self.path, "rb") as f, zipfile.ZipFile(f) as zf:
                for info in zf.infolist():
                    f.seek(info.header_offset)
                    local = f.read(30)
                    if len(local) != 30 or local[:4] != ZIP_MAGIC:
                        raise zipfile.BadZipFile(f"the local header of {info.filename!r} is damaged")
                    name_len, extra_len = struct.unpack("<HH", local[26:30])
                    found.append((info.header_offset + 30 + name_len + extra_len, info))
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error) as e:
            raise CorruptCheckpointError(f"{self.path}: the archive is damaged ({e})") from None
        found.sort(key=lambda x: x[0])
        return [start for start, _ in found], [info for _, info in found]

    def _pickle_bytes(self) -> int:
        """The bytes of the file's pickle (``data.pkl`` of a zip archive; a legacy file: the whole file)."""
        if self._mapped:
            try:
                with zipfile.ZipFile(self.path) as zf:
                    return sum(i.file_size for i in zf.infolist() if i.filename.endswith("data.pkl"))
            except (zipfile.BadZipFile, OSError, EOFError, ValueError):
                pass
        return os.path.getsize(self.path)

    def _walk(self, obj: Any, path: tuple) -> tuple[Any, bool]:
        """``obj`` with its tensors replaced by references (registered by name), and whether it held any; a
        container without tensors is returned as it is (one pass: ``obj`` is checked to be shallow)."""
        if isinstance(obj, torch.Tensor):
            name = path_name(path)
            if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
                raise IncompatibleCheckpointError(f"{self.path}: tensor {name!r} has layout {obj.layout}; only "
                                                  "dense tensors are read")
            if name in self._tensors:
                raise IncompatibleCheckpointError(f"{self.path}: two tensors are both named {name!r} (keys joined "
                                                  "by '.')")
            self._tensors[name] = obj.detach()
            return TensorRef(name), True
        if isinstance(obj, dict):
            walked = {k: self._walk(v, path + (k,)) for k, v in obj.items()}
            if not any(has for _, has in walked.values()):
                return obj, False
            return {k: v for k, (v, _) in walked.items()}, True
        if isinstance(obj, (list, tuple)):
            walked = [self._walk(v, path + (i,)) for i, v in enumerate(obj)]
            if not any(has for _, has in walked):
                return obj, False
            items = [v for v, _ in walked]
            return (items if isinstance(obj, list) else tuple(items)), True
        return obj, False

    def view_key(self, name: str) -> tuple | None:
        """What makes tensor ``name`` the tensor it is in the file: tensors with equal keys were one tensor saved
        under several names (``torch.save`` keeps shared storage shared; a view is its storage, offset, shape and
        strides). None for a 0-element view of a storage with bytes, which does not tell tensors apart."""
        t = self._tensors[name]
        storage = t.untyped_storage()
        if not t.numel() and storage.nbytes():
            return None
        return storage._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride())

    def tensors(self) -> Mapping[str, TensorInfo]:
        return dict(self._infos)

    def facts(self) -> Facts:
        return Facts("torch.save", self.path)

    def tree(self) -> Any:
        return self._tree

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self._infos, requests, self.path)
        if not self._crcs_checked:
            self._check_tensor_records({c.info.name for c in checked})
        for c in checked:
            src = self._tensors[c.info.name]
            region = c.region
            if isinstance(region, Box):
                pieces = [(region.offsets, region.sizes)] if region.numel else []
            else:
                assert isinstance(region, FlatRange)
                pieces = list(_boxes(region.start, region.stop, tuple(src.shape)))
            pos, flat = 0, c.flat
            for offsets, sizes in pieces:
                n = 1
                for s in sizes:
                    n *= s
                view = src[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                if view.dtype == torch.bool and n and int(view.view(torch.uint8).max()) > 1:
                    raise CorruptCheckpointError(f"{self.path}: tensor {c.info.name!r} holds a bool byte other "
                                                 "than 0 or 1")
                self._copy(view, flat[pos:pos + n].view(sizes))
                pos += n

    def _copy(self, view: torch.Tensor, dest: torch.Tensor) -> None:
        """``dest.copy_(view)``, a contiguous ``view`` in steps of ``RELEASE_BYTES`` whose pages are given back
        after each, so that no more than one step of the file's pages is resident at once (per thread)."""
        if self._mapping is None or not view.is_contiguous() or not dest.is_contiguous():
            copy_into(dest, view)
            self._release(view)
            return
        flat_view, flat_dest = view.reshape(-1), dest.reshape(-1)
        step = max(1, RELEASE_BYTES // view.element_size())
        for start in range(0, flat_view.numel(), step):
            part = flat_view[start:start + step]
            copy_into(flat_dest[start:start + step], part)
            self._release(part)

    def _release(self, view: torch.Tensor) -> None:
        """Give the mapped file pages under and around ``view`` back to the kernel (inside the file's mapping only:
        pages another read still needs map again from the file, as nothing writes to them)."""
        if self._mapping is None or not view.numel():
            return
        span = (sum((s - 1) * st for s, st in zip(view.shape, view.stride())) + 1) * view.element_size()
        # Outward to whole folios: a fault maps the page cache's large folio (up to 2 MiB) around the page touched.
        lo = view.data_ptr() // _FOLIO * _FOLIO
        hi = -(-(view.data_ptr() + span) // _FOLIO) * _FOLIO
        for start, stop, _ in self._mapping:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                _madvise(a, b - a, _MADV_DONTNEED)


_MADV_DONTNEED = 4
_FOLIO = 2 << 20  # the largest page-cache folio a fault maps at once (a PMD)
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _LIBC is not None:
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _madvise(address: int, length: int, advice: int) -> None:
    _LIBC.madvise(address, length, advice)  # advisory: a failure only leaves the pages resident


def _file_offset(mapping: list[tuple[int, int, int]], address: int) -> int | None:
    """The file offset that ``address`` maps (None: outside the mapping)."""
    for start, stop, offset in mapping:
        if start <= address < stop:
            return address - start + offset
    return None


def _file_mapping(path: str) -> list[tuple[int, int, int]] | None:
    """The address ranges (and file offsets) at which ``path`` is mapped into this process (Linux only; None
    elsewhere), so that
    pages are only ever released inside the file's mapping, never in memory torch allocated. torch maps the
    file private and writable; nothing here writes to it, so a released page maps again from the file."""
    if _LIBC is None:
        return None
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == path:
                    start, stop = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, stop, int(fields[2], 16)))
    except OSError:
        return None
    return ranges
