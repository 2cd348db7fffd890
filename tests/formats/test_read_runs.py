"""Chunks back to back in one file and in one destination (an incremental checkpoint's units of a tensor) are read
with one ranged read, then checked chunk by chunk (``formats/native/reader.py``: ``_read_batch``): the values are
those of the chunks, a damaged unit is named, and whatever cannot go straight to its destination is read alone."""
from __future__ import annotations

import json

import pytest
import torch

import shardckpt
from shardckpt import CorruptCheckpointError
from shardckpt.io.local import LocalStorage
from tests.checkpoint.test_incremental import manifest

UNIT = 512 << 10  # above the reader's small chunks (read in spans of their own)
N = 400_000  # elements of "i": int64, so 7 units, the last one partial


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(512, 1024, generator=g), "h": torch.randn(700_000, generator=g).half(),
            "flags": torch.rand(1_200_000, generator=g) > 0.5, "i": torch.arange(N, dtype=torch.int64)}


def pooled(root) -> dict:
    sd = state()
    shardckpt.save(sd, root / "step-1", incremental=True, incremental_unit=UNIT)
    return sd


def count_reads(monkeypatch) -> list:
    calls = []
    real = LocalStorage.read_into

    def counted(self, path, offset, out):
        calls.append(len(out))
        return real(self, path, offset, out)

    monkeypatch.setattr(LocalStorage, "read_into", counted)
    return calls


def test_units_are_read_in_runs_bit_for_bit(tmp_path, monkeypatch):
    sd = pooled(tmp_path)
    calls = count_reads(monkeypatch)
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    shardckpt.load(target, tmp_path / "step-1", io_threads=1)  # tasks of half the bytes: runs of units
    for k in sd:
        assert torch.equal(target[k], sd[k]), k
    units = sum(len(e.chunks) for e in manifest(tmp_path / "step-1").tensors.values())
    data_reads = [n for n in calls if n >= UNIT]
    assert units == 17 and len(data_reads) <= 8  # one read per run of units, not one per unit
    got = shardckpt.load_full(tmp_path / "step-1")
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_a_strided_destination_or_a_part_is_read_chunk_by_chunk(tmp_path):
    sd = pooled(tmp_path)
    wide = torch.empty(512, 2048)
    target = {**{k: torch.empty_like(v) for k, v in sd.items()}, "w": wide[:, ::2]}  # not contiguous
    shardckpt.load(target, tmp_path / "step-1")
    assert torch.equal(target["w"], sd["w"])
    from shardckpt.regions import FlatRange
    from shardckpt.sharded_tensor import ShardedTensor

    part = ShardedTensor(torch.empty(300_001, dtype=torch.half), (700_000,), FlatRange(100_000, 400_001))
    shardckpt.load({"h": part}, tmp_path / "step-1", strict=False)
    assert torch.equal(part.local, sd["h"][100_000:400_001])


def _flip(root, tensor: str, chunk: int, at: int = 7) -> None:
    m = manifest(root / "step-1")
    f = m.tensors[tensor].chunks.file(chunk)
    pool = root / "shardckpt-pool"
    rows = json.loads(open(pool / m.files[f].index_path, "rb").read())["chunks"]
    offset = next(r[2] for r in rows if r[0] == tensor and r[1] == chunk)
    with open(pool / m.files[f].path, "r+b") as out:
        out.seek(offset + at)
        byte = out.read(1)
        out.seek(offset + at)
        out.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("chunk", [0, 3, -1])
@pytest.mark.parametrize("threads", [1, 4])  # 1: runs of units; 4: more tasks, a unit each here
def test_a_damaged_unit_inside_a_run_is_named(tmp_path, chunk, threads):
    sd = pooled(tmp_path)
    k = -(-N * 8 // UNIT) - 1 if chunk == -1 else chunk
    _flip(tmp_path, "i", k)
    with pytest.raises(CorruptCheckpointError, match=rf"tensor 'i' chunk {k} fails its checksum"):
        shardckpt.load({name: torch.empty_like(v) for name, v in sd.items()}, tmp_path / "step-1", io_threads=threads)


def test_a_bool_unit_holding_another_byte_is_refused(tmp_path, monkeypatch):
    """A bool byte other than 0 or 1 whose CRCs match (a writer's bug, or a crafted file): refused by name."""
    from shardckpt.checkpoint import incremental, writer
    from shardckpt.regions import flat_bounds

    from shardckpt.tensor_views import as_bytes

    real = writer._staged

    def two(piece):  # the writer stores a 2 for the first true flag of the second unit
        raw = real(piece)
        if piece.name == "flags" and flat_bounds(piece.region, piece.shape)[0] == UNIT:
            raw = as_bytes(raw).clone()
            raw[int(raw.argmax())] = 2
        return raw

    monkeypatch.setattr(writer, "_staged", two)
    monkeypatch.setattr(incremental, "_check_unmoved", lambda *a: None)  # it would see the 2 as a change
    sd = pooled(tmp_path)
    monkeypatch.undo()
    with pytest.raises(CorruptCheckpointError, match="'flags' chunk 1 holds a bool byte other than 0 or 1"):
        shardckpt.load({k: torch.empty_like(v) for k, v in sd.items()}, tmp_path / "step-1", io_threads=1)


def test_destinations_in_two_storages_that_start_at_one_address(tmp_path):
    """Found by review: numpy-backed targets whose storages are different objects starting at the same address
    looked like one storage; the run's read was clipped to the first one's size and the second target's bytes
    never read (stale values with verify_checksums=False)."""
    import numpy as np

    n = 1 << 18  # 1 MiB each: two units of 512 KiB
    sd = {k: torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, k in enumerate("abcd")}
    shardckpt.save(sd, tmp_path / "step-1", incremental=True, incremental_unit=UNIT)
    for verify in (True, False):
        memory = np.full(2 * n, 7.0, dtype=np.float32)
        target = {"a": torch.from_numpy(memory[:n]), "c": torch.from_numpy(memory)[n:], "b": torch.empty(n),
                  "d": torch.empty(n)}
        assert target["a"].untyped_storage().data_ptr() == target["c"].untyped_storage().data_ptr()
        shardckpt.load(target, tmp_path / "step-1", io_threads=1, verify_checksums=verify)
        assert all(torch.equal(target[k], sd[k]) for k in sd)
