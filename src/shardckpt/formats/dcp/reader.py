"""``DcpReader``: a torch DCP directory behind the one read interface, and ``is_dcp_dir`` for detection.

At open, the ``.metadata`` is parsed (``metadata.parse_metadata``) and every item is checked to lie inside its
file (one size query per file, so a truncated ``.distcp`` is caught here). A read groups its requests by the
chunks they overlap (by bisection where the chunks are dim-0 shards) and reads the chunks on ``io_threads``
threads, biggest first, each chunk's archive located once (``archive.archive_layout``, cached). With
``verify=True`` (the default) every chunk a read touches is read whole once and checked against its CRC-32;
``verify=False`` reads just the needed span of a row-major chunk.

**Plain values** (``tree()``): loaded on first call (``archive.load_value``). The tree is the saved nesting
rebuilt from ``planner_data`` (dicts, and lists for integer path components, as DCP itself unflattens, holes as
None; the lists may hold no more slots in all than the ``.metadata`` has bytes, else it is refused), with
``TensorRef(key)`` for tensors; where ``planner_data`` is missing or inconsistent with the keys (a custom
planner, ``flatten_state_dict=False``), it is the flat dict key -> value.
"""
from __future__ import annotations

import bisect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import Facts, ReadRequest, TensorInfo
from shardckpt.formats.dcp.archive import ChunkLayout, archive_layout, load_value, read_span, read_whole
from shardckpt.formats.dcp.metadata import METADATA_NAME, Chunk, StoredTensor, parse_metadata
from shardckpt.formats.requests import CheckedRequest, check_requests
from shardckpt.io import DEFAULT_IO_THREADS, Storage
from shardckpt.regions import Region, flat_bounds, intersect, local_span, strided_view
from shardckpt.tensor_views import copy_into, view_of


def is_dcp_dir(storage: Storage) -> bool:
    """Whether ``storage`` holds a torch DCP checkpoint (a ``.metadata`` file), for format detection."""
    return storage.exists(METADATA_NAME)


_HOLE = object()  # a list slot no path filled (None in the result, as DCP pads lists)


def _nest(paths: dict[str, tuple], leaf: Mapping[str, Any]) -> Any:
    """Rebuild the nesting as DCP's ``set_element`` does (int path components make lists); None on a conflict."""
    root: dict = {}
    made = {id(root)}  # containers built here; a path may not descend into a leaf value
    lists: list[list] = []
    for key, path in paths.items():
        node: Any = root
        for i, part in enumerate(path):
            if isinstance(node, list):
                if type(part) is not int:
                    return None
                node.extend([_HOLE] * (part + 1 - len(node)))
                current = node[part]
            else:
                if type(part) is not str:
                    return None
                current = node.get(part, _HOLE)
            if i == len(path) - 1:
                if current is not _HOLE:
                    return None
                node[part] = leaf[key]
                break
            want_list = type(path[i + 1]) is int
            if current is _HOLE:
                current = [] if want_list else {}
                made.add(id(current))
                if want_list:
                    lists.append(current)
                node[part] = current
            elif id(current) not in made or isinstance(current, list) != want_list:
                return None
            node = current
    for lst in lists:
        lst[:] = [None if v is _HOLE else v for v in lst]
    return root


class DcpReader:
    """A ``CheckpointReader`` over a torch DCP directory (``storage``: local or any fsspec URL).

    ``verify`` (default True): every chunk a read touches is read whole and checked against the CRC-32 its
    ``torch.save`` archive stores; False: only the byte runs requested are read, unchecked.
    """

    def __init__(self, storage: Storage, *, io_threads: int = DEFAULT_IO_THREADS, verify: bool = True):
        self.storage, self.io_threads, self.verify = storage, io_threads, verify
        self.url = storage.url(METADATA_NAME)
        if not storage.exists(METADATA_NAME):
            raise CheckpointNotFoundError(f"{self.url}: no torch DCP checkpoint here (no {METADATA_NAME})")
        self.layout = parse_metadata(storage.read_bytes(METADATA_NAME), self.url)
        self._check_files()
        self._infos = {name: TensorInfo(name, t.dtype, t.shape, None) for name, t in self.layout.tensors.items()}
        self._layouts: dict[tuple[str, tuple[int, ...]], ChunkLayout] = {}
        self._last_whole = threading.local()  # (chunk key, its bytes read whole) per reading thread
        self._tree: Any = None
        self._lock = threading.Lock()

    def _check_files(self) -> None:
        """Every item lies inside its file (one size query per file): a truncated file is caught here."""
        ends: dict[str, tuple[int, str]] = {}
        items = [(c.item, t.name) for t in self.layout.tensors.values() for c in t.chunks] + \
            [(i, name) for name, i in self.layout.values.items()]
        for item, name in items:
            end = item.offset + item.length
            if end > ends.get(item.path, (-1, ""))[0]:
                ends[item.path] = (end, name)
        for path, (end, name) in sorted(ends.items()):
            size = self.storage.file_size(path)
            if size < end:
                raise CorruptCheckpointError(f"{self.storage.url(path)}: data file has {size} bytes, the metadata "
                                             f"places {name!r} up to byte {end} (truncated?)")

    # CheckpointReader

    def tensors(self) -> Mapping[str, TensorInfo]:
        return dict(self._infos)

    def facts(self) -> Facts:
        return Facts("torch DCP", self.storage.url(""))

    def tree(self) -> Any:
        with self._lock:
            if self._tree is None:
                leaf: dict[str, Any] = {name: TensorRef(name) for name in self.layout.tensors}
                leaf.update((name, load_value(self.storage, name, item, self.verify))
                            for name, item in self.layout.values.items())
                keys = list(self.layout.paths) if self.layout.paths is not None else list(leaf)
                leaf = {k: leaf[k] for k in keys}
                nested = _nest(self.layout.paths, leaf) if self.layout.paths is not None else None
                self._tree = nested if nested is not None else leaf
            return self._tree

    def read(self, requests: Sequence[ReadRequest]) -> None:
        work = self._by_chunk(check_requests(self._infos, requests, self.url))
        if not work:
            return
        if len(work) == 1 or self.io_threads <= 1:
            for g in work:
                self._read_chunk(*g)
            return
        with ThreadPoolExecutor(min(self.io_threads, len(work)), thread_name_prefix="shardckpt-dcp") as pool:
            list(pool.map(lambda g: self._read_chunk(*g), work))

    # requests -> chunks

    def _by_chunk(self, checked: list[CheckedRequest]) -> list[tuple[StoredTensor, Chunk, list]]:
        """The chunks the requests overlap, each with its (piece, request) pairs, biggest chunk first."""
        groups: dict[tuple[str, tuple[int, ...]], tuple[StoredTensor, Chunk, list]] = {}
        for target in checked:
            if not target.region.numel:
                continue
            t = self.layout.tensors[target.info.name]
            for chunk in self._overlapping(t, target.region):
                for piece in intersect(target.region, chunk.box, t.shape):
                    group = groups.setdefault((t.name, chunk.box.offsets), (t, chunk, []))
                    group[2].append((piece, target))
        return sorted(groups.values(), key=lambda g: -g[1].box.numel)  # biggest first: a short tail

    @staticmethod
    def _overlapping(t: StoredTensor, region: Region) -> Sequence[Chunk]:
        """The chunks that may overlap ``region``: by bisection where their flat bounds are disjoint."""
        if not t.disjoint:
            return t.live
        lo, hi = flat_bounds(region, t.shape)
        return t.live[bisect.bisect_right(t.ends, lo):bisect.bisect_left(t.starts, hi)]

    # chunks

    def _chunk_layout(self, t: StoredTensor, chunk: Chunk) -> ChunkLayout:
        key = (t.name, chunk.box.offsets)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = archive_layout(self.storage, t, chunk)
        return layout

    def _whole(self, t: StoredTensor, chunk: Chunk, layout: ChunkLayout) -> Any:
        """The chunk read whole (and checked): kept for this thread's next read, so that a caller reading a
        chunk slice by slice (``convert`` within its memory limit) reads and checks it once, not per slice."""
        key = (t.name, chunk.box.offsets)
        last = getattr(self._last_whole, "chunk", None)
        if last is not None and last[0] == key:
            return last[1]
        self._last_whole.chunk = None  # the previous one is dropped before the next is read
        whole = read_whole(self.storage, t, chunk, layout, self.verify)
        self._last_whole.chunk = (key, whole)
        return whole

    def _read_chunk(self, t: StoredTensor, chunk: Chunk, pieces: list) -> None:
        layout = self._chunk_layout(t, chunk)
        shape = t.shape
        whole = self._whole(t, chunk, layout) if self.verify or layout.kind != "raw" or not layout.row_major else None
        for piece, target in pieces:
            if whole is not None:
                src = view_of(whole, strided_view(piece, chunk.box, shape))
            else:
                lo, hi = local_span(piece, chunk.box, shape)
                src = view_of(read_span(self.storage, t, chunk, layout, lo, hi),
                              strided_view(piece, chunk.box, shape, base=lo))
            copy_into(view_of(target.flat, strided_view(piece, target.region, shape)), src)
