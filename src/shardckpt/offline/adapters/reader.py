"""``adapted``: a checkpoint presented through an ``Adapter``, as a ``CheckpointReader`` (export and convert read
it as they read any source).

What is adapted is the model weights: the source's ``model`` entry (names relative to it), else every tensor
outside a top-level ``optim`` / ``optimizer`` entry; wrapper prefixes (``module.``, ``_orig_mod.``) are
removed before the rules match. A weight no rule matches, two outputs of one name, or an incomplete merge
raise ``IncompatibleCheckpointError`` naming the tensor, before anything is read.

The view holds the adapted weights under ``model`` (``model.<name>``), whatever the source's nesting: export
writes them by their names, and what ``convert`` makes of the view is a checkpoint a run starts from
(``load_state(model, None, path)``, or ``load({"model": model.state_dict()}, path)``).

A read of a region of an output tensor becomes reads of runs of source rows: a piece in order is one read
straight into its part of the caller's buffer; a reordered one is read a group (a head) at a time, its
source rows one contiguous span into the group's place in the caller's buffer, then reordered there cycle by
cycle (one row held aside). A part of a group (at a slice's edge) is staged in a buffer of one group. So memory
is the caller's buffers, whatever the model's size, and every source read is a long contiguous span (a read
per row would make the source check a whole checksum block per row).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef, leaves, path_name
from shardckpt.formats.api import CheckpointReader, Facts, ReadRequest, TensorInfo
from shardckpt.formats.requests import check_requests
from shardckpt.offline.adapters.base import Adapter, Opts, Part, Piece, Planned
from shardckpt.regions import FlatRange, contiguous_runs

OPTIMIZER_ENTRIES = ("optim", "optimizer")
WRAPPERS = ("module.", "_orig_mod.")


class AdaptedReader:
    """``base``'s model weights as ``planned`` presents them (see the module)."""

    def __init__(self, base: CheckpointReader, planned: Sequence[Planned], infos: Mapping[str, TensorInfo],
                 key: str = ""):
        """``key``: the adapter and the options it ran with, resolved (``adapter_key``)."""
        self.base, self.adapter_key, prefix = base, key, "model."
        self._planned = {prefix + p.name: p for p in planned}
        self._starts = {name: _starts(p) for name, p in self._planned.items()}
        self._infos: dict[str, TensorInfo] = {}
        for name, p in self._planned.items():
            first = infos[p.pieces[0].source]
            whole = len(p.pieces) == 1 and p.pieces[0].order is None and tuple(first.shape) == p.shape
            self._infos[name] = TensorInfo(name, first.dtype, p.shape, first.crc32c if whole else None)
        refs = {p.name: TensorRef(prefix + p.name) for p in planned}
        self._tree = {"model": refs}
        self.where = base.facts().location

    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._infos

    def facts(self) -> Facts:
        return self.base.facts()

    def tree(self) -> Any:
        return self._tree

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self._infos, requests, self.where)  # every request, before any read
        direct: list[ReadRequest] = []
        staged: list[Staged] = []
        for request, c in zip(requests, checked):
            planned = self._planned[request.tensor]
            row, flat = math.prod(planned.shape[1:]), c.flat
            for start, local, count in contiguous_runs(request.region, planned.shape):
                runs(planned, self._starts[request.tensor], row, start, count, flat[local:local + count],
                     direct, staged)
        if direct:
            self.base.read(direct)
        for job in staged:  # one group of source rows (a head) at a time
            job.execute(self.base)


@dataclass
class Staged:
    """Output elements ``[lo, hi)`` (into ``dest``), all of them in group ``group`` of ``piece``."""

    piece: Piece
    first_row: int  # the piece's first output row
    group: int
    row: int
    lo: int
    hi: int
    dest: torch.Tensor

    def execute(self, base: CheckpointReader) -> None:
        size, row = self.piece.group, self.row
        top = self.piece.start + self.group * size  # the group's first source row
        first = (self.first_row + self.group * size) * row  # the group's first output element
        source = FlatRange(top * row, (top + size) * row)
        if (self.lo, self.hi) == (first, first + size * row):  # the whole group: read in place, then reorder
            base.read([ReadRequest(self.piece.source, source, self.dest)])
            self._reorder(self.dest.view(size, row))
            return
        stage = torch.empty(size * row, dtype=self.dest.dtype)  # part of a group (a slice's edge): staged
        base.read([ReadRequest(self.piece.source, source, stage)])
        pos = self.lo
        while pos < self.hi:
            r = pos // row
            stop = min(self.hi, (r + 1) * row)
            src = (self.piece.order(r - self.first_row) - self.group * size) * row + pos % row
            self.dest[pos - self.lo:stop - self.lo] = stage[src:src + stop - pos]
            pos = stop

    def _reorder(self, rows: torch.Tensor) -> None:
        """``rows`` (the group's source rows in source order) reordered in place, cycle by cycle: one row's copy."""
        base = self.group * self.piece.group
        done = [False] * len(rows)
        for start in range(len(rows)):
            if done[start]:
                continue
            held, i = rows[start].clone(), start
            while True:
                done[i] = True
                j = self.piece.order(base + i) - base  # output row i holds source row j
                if j == start:
                    rows[i] = held
                    break
                rows[i] = rows[j]
                i = j


def runs(planned: Planned, starts: list[int], row: int, start: int, count: int, dest: torch.Tensor,
         direct: list[ReadRequest], staged: list[Staged]) -> None:
    """The reads filling ``dest`` with output elements ``[start, start + count)``: a piece in order as
    ``direct`` requests (one per contiguous source run), a reordered one as a ``Staged`` job per group."""
    pos, end = start, start + count
    while pos < end:
        r = pos // row if row else 0
        i = bisect.bisect_right(starts, r) - 1
        piece, within = planned.pieces[i], r - starts[i]
        if piece.order is None:  # the rest of this piece in one run
            stop = min(end, (starts[i] + piece.rows) * row)
            src = (piece.start + within) * row + pos % row
            direct.append(ReadRequest(piece.source, FlatRange(src, src + stop - pos),
                                      dest[pos - start:stop - start]))
        else:
            group = within // piece.group
            stop = min(end, (starts[i] + (group + 1) * piece.group) * row)
            staged.append(Staged(piece, starts[i], group, row, pos, stop, dest[pos - start:stop - start]))
        pos = stop


def _starts(planned: Planned) -> list[int]:
    starts, at = [], 0
    for piece in planned.pieces:
        starts.append(at)
        at += piece.rows
    return starts


def adapted(base: CheckpointReader, adapter: Adapter, opts: Opts) -> AdaptedReader:
    """``base`` presented through ``adapter`` with options ``opts`` (see the module)."""
    tree = base.tree()
    refs = [(path, leaf) for path, leaf in leaves(tree, lambda v: isinstance(v, TensorRef))
            if isinstance(leaf, TensorRef)]
    if isinstance(tree, dict) and isinstance(tree.get("model"), dict):
        chosen = [(path_name(p[1:]), leaf.name) for p, leaf in refs if p and p[0] == "model"]
    else:
        chosen = [(path_name(p), leaf.name) for p, leaf in refs if not (p and p[0] in OPTIMIZER_ENTRIES)]
    infos = base.tensors()
    sources = [(strip_wrappers(name), stored, tuple(infos[stored].shape)) for name, stored in chosen]
    return AdaptedReader(base, plan(adapter, sources, opts, infos), infos, adapter_key(adapter, opts))


def adapter_key(adapter: Adapter, opts: Opts) -> str:
    """The adapter with the option values it runs with (those read from a ``config=`` file included): what shapes the
    bytes it presents, so what a resumed export or convert must match (the spec's text may name a file whose
    contents changed)."""
    return ",".join([adapter.name, *(f"{k}={opts[k]!r}" for k in sorted(opts))])


def plan(adapter: Adapter, sources: Sequence[tuple[str, str, tuple[int, ...]]], opts: Opts,
         infos: Mapping[str, TensorInfo]) -> list[Planned]:
    """The output tensors, in source order (a merge where its first part is), from ``(name, stored, shape)``."""
    rules = [(rule, rule.compiled()) for rule in adapter.rules]
    out: dict[str, Planned | dict[int, tuple[Piece, tuple[int, ...]]]] = {}
    counts: dict[str, int] = {}
    for name, stored, shape in sources:
        match = next(((rule, m) for rule, pattern in rules if (m := pattern.fullmatch(name))), None)
        if match is None:
            raise IncompatibleCheckpointError(f"tensor {name!r}: no rule of the adapter {adapter.name!r} matches "
                                              "it; is the checkpoint of this family?")
        rule, m = match
        if rule.target is None:
            continue
        targets = [rule.target] if isinstance(rule.target, str) else list(rule.target)
        names = [m.expand(t) for t in targets]
        if isinstance(rule.transform, Part):
            parts = out.setdefault(names[0], {})
            if not isinstance(parts, dict) or rule.transform.index in parts:
                raise IncompatibleCheckpointError(f"tensor {name!r}: its part of {names[0]!r} is there twice")
            counts[names[0]] = rule.transform.count
            parts[rule.transform.index] = (Piece(stored, 0, shape[0] if shape else 1), shape)
            continue
        for target, piece in zip(names, rule.transform.pieces(stored, shape, opts)):
            if target in out:
                raise IncompatibleCheckpointError(f"tensor {name!r}: a second tensor becomes {target!r}")
            out[target] = Planned(target, (piece.rows, *shape[1:]) if shape else (), (piece,))
    planned = [merged(name, value, counts.get(name, 0), infos) if isinstance(value, dict) else value
               for name, value in out.items()]
    return untied(planned, adapter, opts)


def merged(name: str, parts: dict[int, tuple[Piece, tuple[int, ...]]], count: int,
           infos: Mapping[str, TensorInfo]) -> Planned:
    """The output tensor ``name`` that parts ``0..count-1`` concatenate into along dim 0."""
    missing = [i for i in range(count) if i not in parts]
    if missing:
        raise IncompatibleCheckpointError(f"tensor {name!r}: parts {missing} of the {count} it merges are missing")
    pieces = [parts[i][0] for i in range(count)]
    shapes = [parts[i][1] for i in range(count)]
    if any(len(s) < 1 or s[1:] != shapes[0][1:] for s in shapes) or \
            len({infos[p.source].dtype for p in pieces}) > 1:
        raise IncompatibleCheckpointError(f"tensor {name!r}: its parts {[p.source for p in pieces]} (shapes "
                                          f"{[list(s) for s in shapes]}) differ in dtype or beyond dim 0")
    return Planned(name, (sum(p.rows for p in pieces), *shapes[0][1:]), tuple(pieces))


def untied(planned: list[Planned], adapter: Adapter, opts: Opts) -> list[Planned]:
    """Without the second of the adapter's tied pair when the weights are tied (HF re-ties it on load); from
    HF, with the second of its ``retied`` pair as the first, when tied and left out."""
    if not opts.get("tie_word_embeddings"):
        return planned
    if adapter.retied is not None:
        first, second = adapter.retied
        source = next((p for p in planned if p.name == first), None)
        if source is None or any(p.name == second for p in planned):
            return planned
        return planned + [Planned(second, source.shape, source.pieces)]
    if adapter.tied is None:
        return planned
    first, second = adapter.tied
    if not any(p.name == first for p in planned):
        raise IncompatibleCheckpointError(f"tie_word_embeddings: the checkpoint has no {first!r} to tie "
                                          f"{second!r} to")
    return [p for p in planned if p.name != second]


def strip_wrappers(name: str) -> str:
    """``name`` without leading ``module.`` / ``_orig_mod.`` prefixes and ``_orig_mod`` components."""
    while name.startswith(WRAPPERS):
        name = name[len(next(w for w in WRAPPERS if name.startswith(w))):]
    return ".".join(part for part in name.split(".") if part != "_orig_mod")
