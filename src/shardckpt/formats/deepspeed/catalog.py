"""What a DeepSpeed reader presents, and where each of its tensors lies in the files it opened.

A presented tensor is a list of pieces, ``regions.Run``s of source ``(file, tensor)``: elements ``[at, at + count)``
of the presented tensor (row-major) are elements ``[start, start + count)`` of stored tensor ``tensor`` (flattened)
of ``files[file]`` (a ``TorchSaveReader``); the pieces tile it in order. ``Catalog.read`` turns read requests on
presented tensors into read requests on the files. ``value`` presents the plain values a pickle holds (a param group's
hyper-parameters, an optimizer's scalars), with any tensor among them presented whole under its path.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections import defaultdict
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.tree import TensorRef, path_name
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.formats.deepspeed.fields import SCALARS
from shardckpt.formats.deepspeed.unpickle import SAFE_GLOBALS
from shardckpt.formats.requests import check_requests
from shardckpt.formats.torch_save import TorchSaveReader
from shardckpt.formats.untrusted import shown
from shardckpt.regions import Run, contiguous_runs, runs_within


class Catalog:
    """The files opened from DeepSpeed checkpoint directory ``path`` and the tensors presented from them."""

    def __init__(self, path: str):
        self.path = path
        self.files: list[TorchSaveReader] = []
        self._index: dict[int, int] = {}  # id(file reader) -> its place in files
        self._file_infos: list[Mapping[str, TensorInfo]] = []  # each file's tensors, listed once
        self.infos: dict[str, TensorInfo] = {}
        self.pieces: dict[str, list[Run]] = {}  # source: (file, stored tensor)

    def open(self, name: str) -> TorchSaveReader:
        full = os.path.join(self.path, name)
        if not os.path.isfile(full):
            raise CorruptCheckpointError(f"{full}: missing (the DeepSpeed checkpoint in {self.path} needs it)")
        reader = TorchSaveReader(full, safe_globals=SAFE_GLOBALS)
        self._index[id(reader)] = len(self.files)
        self.files.append(reader)
        self._file_infos.append(reader.tensors())
        return reader

    def number(self, f: TorchSaveReader) -> int:
        """``f``'s place in ``files`` (what a piece's source names)."""
        return self._index[id(f)]

    def piece(self, segment: Run, f: TorchSaveReader, tensor: str) -> Run:
        """A run of a rank's flat tensor (``partitions``' segment) as the piece of ``f``'s stored ``tensor`` holding it."""
        return dataclasses.replace(segment, source=(self.number(f), tensor))

    def infos_of(self, f: TorchSaveReader) -> Mapping[str, TensorInfo]:
        return self._file_infos[self._index[id(f)]]

    def numel(self, f: TorchSaveReader, tensor: str) -> int:
        """The elements of 1-D stored tensor ``tensor`` (a flat partition)."""
        info = self.infos_of(f)[tensor]
        if len(info.shape) != 1:
            raise CorruptCheckpointError(f"{f.path}: {tensor!r} has shape {list(info.shape)}; a flat partition is 1-D")
        return info.shape[0]

    def present(self, name: str, shape: tuple[int, ...], pieces: list[Run], dtype: torch.dtype) -> TensorRef:
        """Present tensor ``name`` of ``shape`` and ``dtype`` as ``pieces``, which must tile it in order."""
        if name in self.infos:
            raise CorruptCheckpointError(f"{self.path}: two tensors would both be named {name!r}")
        covered = 0
        for p in pieces:
            file, tensor = p.source
            stored = self._file_infos[file][tensor]
            if stored.dtype != dtype or p.at != covered or p.start + p.count > math.prod(stored.shape):
                raise CorruptCheckpointError(f"{self.files[file].path}: {tensor!r} ({stored.dtype}, "
                                             f"{math.prod(stored.shape)} elements) cannot hold elements [{p.at}, "
                                             f"{p.at + p.count}) of {name!r} ({dtype})")
            covered += p.count
        if covered != math.prod(shape):
            raise CorruptCheckpointError(f"{self.path}: {name!r} (shape {list(shape)}) has {covered} elements saved")
        self.infos[name] = TensorInfo(name, dtype, shape, None)
        self.pieces[name] = pieces
        return TensorRef(name)

    def whole(self, f: TorchSaveReader, ref: TensorRef) -> tuple[list[Run], tuple[int, ...], torch.dtype]:
        """A stored tensor presented whole: its pieces, shape and dtype."""
        info = self.infos_of(f)[ref.name]
        n = math.prod(info.shape)
        return ([Run((self.number(f), ref.name), 0, 0, n)] if n else []), info.shape, info.dtype

    def alias(self, name: str, target: str) -> TensorRef:
        """Present ``name`` as the same tensor as presented ``target`` (a tied parameter)."""
        info = self.infos[target]
        return self.present(name, info.shape, self.pieces[target], info.dtype)

    def value(self, node: Any, path: tuple, f: TorchSaveReader) -> Any:
        """A plain value of file ``f`` as presented at ``path``: scalars and containers as they are, a stored tensor
        presented whole under its path's name; anything else (an object of a DeepSpeed class) is refused."""
        if isinstance(node, TensorRef):
            pieces, shape, dtype = self.whole(f, node)
            return self.present(path_name(path), shape, pieces, dtype)
        if isinstance(node, dict):
            if not all(isinstance(k, SCALARS) for k in node):
                raise CorruptCheckpointError(f"{f.path}: {path_name(path)!r} has keys that are not plain: "
                                             f"{shown(list(node))}")
            return {k: self.value(v, path + (k,), f) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [self.value(v, path + (i,), f) for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        if not isinstance(node, SCALARS):
            raise CorruptCheckpointError(f"{f.path}: {path_name(path)!r} holds {shown(node)}, which is not plain data")
        return node

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self.infos, requests, self.path)
        per_file: dict[int, list[ReadRequest]] = defaultdict(list)
        for c in checked:
            pieces, flat = self.pieces[c.info.name], c.flat
            for start, local, count in contiguous_runs(c.region, c.info.shape):
                for p in runs_within(pieces, start, start + count):
                    file, tensor = p.source
                    per_file[file].append(ReadRequest(tensor, p.there, flat[local + p.at - start:
                                                                            local + p.at - start + p.count]))
        for f, reqs in per_file.items():
            self.files[f].read(reqs)
