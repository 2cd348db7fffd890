"""The parallel read of files read (nearly) whole (``formats/native/lanes.py``), on a local storage that streams
as an object store does: big reads cut at block boundaries, lanes of about equal bytes each read in file order
through a stream of its own, and every region, cast, codec and damaged block read as the ranged path reads it."""
from __future__ import annotations

import threading

import pytest
import torch

import shardckpt
from shardckpt import Box, CorruptCheckpointError, FlatRange
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.native import NativeReader, lanes, read_manifest
from shardckpt.formats.native.plan import plan_reads
from shardckpt.formats.native.reader import read_index
from shardckpt.formats.requests import check_request
from shardckpt.io import open_storage
from shardckpt.regions import full_region
from tests._helpers import flip_byte
from tests.checkpoint.cases import block_size

BLOCK = 256


class _Stream:
    """One lane's stream: every read must lie in ``[start, stop)`` at or after the previous one."""

    def __init__(self, storage: StreamingLocal, path: str, start: int, stop: int):
        self._s, self.path, self.start, self.stop, self.pos = storage, path, start, stop, start

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        assert path == self.path and self.pos <= offset and offset + len(out) <= self.stop, (offset, len(out), self)
        self.pos = offset + len(out)
        self._s.inner.read_into(path, offset, out)

    def url(self, path: str) -> str:
        return self._s.url(path)

    def __enter__(self) -> _Stream:
        with self._s.lock:
            self._s.streams.append((self.path, self.start, self.stop))
            first = len(self._s.streams) <= self._s.meet.parties
        if first:
            self._s.meet.wait()  # the first lanes are open at once, or this times out
        return self

    def __exit__(self, *exc) -> None:
        pass


class StreamingLocal:
    """Local storage that says it streams whole files, through ``stream_lanes`` streams at once."""

    streams_whole_files = True

    def __init__(self, path: str, lanes: int, meet: int = 1):
        self.inner, self.stream_lanes = open_storage(path), lanes
        self.streams: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.meet = threading.Barrier(meet, timeout=30)

    def stream(self, path: str, start: int, stop: int) -> _Stream:
        return _Stream(self, path, start, stop)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(lanes, "PIECE_BYTES", 4 * BLOCK)
    monkeypatch.setattr(lanes, "LANE_BYTES", 4 * BLOCK)


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(64, 97, generator=g), "mid": torch.randn(1500, generator=g).to(torch.bfloat16),
            "small": torch.randn(7, generator=g), "flags": torch.rand(3000, generator=g) > 0.5,
            "odd": torch.randn(333, 3, generator=g).double()}


def _saved(tmp_path, compress=None) -> tuple[dict, str]:
    state = _state()
    with block_size(BLOCK):
        shardckpt.save(state, tmp_path / "ck", compress=compress, files_per_rank=2)
    return state, str(tmp_path / "ck")


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_a_whole_load_goes_through_lanes_and_is_exact(tmp_path, small_pieces, compress):
    state, path = _saved(tmp_path, compress)
    storage = StreamingLocal(path, 4, meet=3)
    reader = NativeReader(storage, read_manifest(storage))
    got = {k: torch.empty_like(v) for k, v in state.items()}
    reader.read([ReadRequest(k, full_region(tuple(v.shape)), got[k]) for k, v in state.items()])
    assert all(torch.equal(got[k], state[k]) for k in state)
    per_file: dict[str, list] = {}
    for p, a, z in storage.streams:
        per_file.setdefault(p, []).append((a, z))
    assert len(per_file) == 2 and 3 <= len(storage.streams) <= 5, storage.streams  # 4 lanes shared by 2 files
    for spans in per_file.values():
        spans.sort()
        assert all(z <= a2 for (_, z), (a2, _) in zip(spans, spans[1:]))  # lanes do not overlap


@pytest.mark.parametrize("region, want", [
    (FlatRange(5, 6100), lambda t: t.reshape(-1)[5:6100]),
    (Box((3, 10), (60, 80)), lambda t: t[3:63, 10:90]),
    (Box((1, 0), (62, 97)), lambda t: t[1:63]),
])
def test_regions_and_casts_are_exact(tmp_path, small_pieces, region, want):
    state, path = _saved(tmp_path)
    storage = StreamingLocal(path, 3)
    reader = NativeReader(storage, read_manifest(storage))
    exact = torch.empty(region.numel)
    cast = torch.empty(region.numel, dtype=torch.float64)
    reader.read([ReadRequest("big", region, exact), ReadRequest("big", region, cast)])
    assert torch.equal(exact, want(state["big"]).reshape(-1))
    assert torch.equal(cast, want(state["big"]).reshape(-1).double())


def test_a_damaged_block_in_a_cut_read_names_the_file_and_tensor(tmp_path, small_pieces):
    state, path = _saved(tmp_path)
    storage = StreamingLocal(path, 4)
    manifest = read_manifest(storage)
    file = manifest.files[manifest.tensors["big"].chunks.file(0)].path
    flip_byte(f"{path}/{file}", 17 * BLOCK + 3)  # "big" is the file's first chunk: a later piece of it
    got = torch.empty(64, 97)
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: tensor 'big' chunk 0 fails its checksum .* \(block 17"):
        NativeReader(storage, manifest).read([ReadRequest("big", full_region((64, 97)), got)])


@pytest.mark.parametrize("region", [full_region((64, 97)), FlatRange(100, 5000), Box((2, 5), (50, 90))])
def test_cut_pieces_are_whole_blocks_and_fill_each_copy_once(tmp_path, small_pieces, region):
    _, path = _saved(tmp_path)
    storage = open_storage(path)
    manifest = read_manifest(storage)
    target = check_request(manifest.tensors, ReadRequest("big", region, torch.empty(region.numel)), path)
    (read,) = plan_reads([target])
    index = read_index(storage, manifest.files[read.file], manifest.version)
    rec = index[("big", 0)]
    pieces = lanes.cut_read(read, rec, 4 * BLOCK)
    assert len(pieces) > 3
    assert [p.lo for p in pieces[1:]] == [p.hi for p in pieces[:-1]] and (pieces[0].lo, pieces[-1].hi) == (read.lo, read.hi)
    assert all(p.lo * 4 % BLOCK == 0 for p in pieces[1:]) and all(p.hi - p.lo <= BLOCK for p in pieces)
    assert sum(sub.numel for p in pieces for sub, _ in p.copies) == sum(piece.numel for piece, _ in read.copies)
    spans = [lanes.stored_span(p, rec) for p in pieces]
    assert spans[0][0] <= rec.offset + read.lo * 4 and spans[-1][1] >= rec.offset + read.hi * 4
    assert all(z == a for (_, z), (a, _) in zip(spans, spans[1:]))  # one stream runs through them, no gap
    runs = lanes.lanes([lanes.Piece(p, rec, *span) for p, span in zip(pieces, spans)], 3)
    assert len(runs) == 3 and [p for run in runs for p in run] == [lanes.Piece(p, rec, *s) for p, s in zip(pieces, spans)]
    sizes = [sum(p.stop - p.start for p in run) for run in runs]
    assert max(sizes) - min(sizes) <= 4 * BLOCK


def test_a_file_gets_no_more_lanes_than_its_bytes_allow():
    piece = lanes.Piece(None, None, 0, 5 << 20)  # type: ignore[arg-type]
    assert len(lanes.lanes([piece] * 8, 8)) == 2  # 40 MiB: two lanes of 16 MiB
    assert len(lanes.lanes([piece], 8)) == 1
    assert lanes.share({0: 300, 1: 100, 2: 1}, 8) == {0: 6, 1: 2, 2: 1}
