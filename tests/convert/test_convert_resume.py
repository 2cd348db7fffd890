"""A killed ``convert`` resumes: rerun with the same source and options, it keeps the output ranks the killed run
had finished and writes the rest; the result is the one an uninterrupted run commits. Nothing partial loads."""
from __future__ import annotations

import json
import os
import shutil
import threading
import uuid

import pytest
import torch

import shardckpt
from shardckpt import CheckpointNotFoundError
from shardckpt.checkpoint import writer
from shardckpt.checkpoint.verify import verify
from shardckpt.offline import chunk_output, memory, resume, streams
from shardckpt.offline.convert import convert
from shardckpt.offline.spec import ConvertSpec
from shardckpt.offline.workers import convert_in_workers
from shardckpt.offline.diff import diff
from shardckpt.format.manifest import chunks_of
from shardckpt.io import LocalStorage
from tests._helpers import flip_byte, manifest_of
from tests.checkpoint.cases import block_size
from tests.convert._kill import killed_after


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(12, 5, generator=g) for i in range(4)} |
            {"bias": torch.randn(3, generator=g), "scale": torch.tensor(2.0)},
            "optim": {"state": {"bias": {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": ["bias"]}]},
            "step": 7}


def _killed_after(ranks: int, src, dst, **options) -> None:
    """convert killed (kill -9 style) once output ranks 0..``ranks - 1`` are written: as it starts a data file
    after their files (each rank has ``files_per_rank``)."""
    killed_after(ranks * options.get("files_per_rank", 2), chunk_output, "write_file",
                 lambda: convert(src, dst, **options))


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_a_killed_convert_keeps_its_finished_ranks_and_commits_what_an_uninterrupted_run_does(tmp_path, compress):
    src, dst, fresh = tmp_path / "src", tmp_path / "dst", tmp_path / "fresh"
    shardckpt.save(_state(), src)
    options = {"world_size": 4, "compress": compress}
    _killed_after(2, src, dst, **options)
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.load_full(dst)  # nothing partial loads
    report = convert(src, dst, **options)
    assert report.kept_ranks == (0, 1)
    convert(src, fresh, **options)
    got, want = manifest_of(dst), manifest_of(fresh)
    assert {n: t.crc32c for n, t in got.tensors.items()} == {n: t.crc32c for n, t in want.tensors.items()}
    assert verify(dst).ok and diff(src, dst).equal
    assert sorted(os.listdir(dst)) == ["data-" + got.generation, "manifest.json"]


def test_a_damaged_rank_of_the_killed_run_is_written_again(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    _killed_after(2, src, dst, world_size=4)
    data = next(os.path.join(dst, d) for d in os.listdir(dst) if d.startswith("data-"))
    index = os.path.join(data, "rank-00001-0.index.json")
    with open(index, "r+b") as f:
        f.truncate(os.path.getsize(index) // 2)  # as if the kill had come while the index was written
    report = convert(src, dst, world_size=4)
    assert report.kept_ranks == (0,)
    assert verify(dst).ok and diff(src, dst).equal


def test_other_options_or_a_source_saved_again_start_over(tmp_path):
    src, dst, dst2 = tmp_path / "src", tmp_path / "dst", tmp_path / "dst2"
    shardckpt.save(_state(), src)
    _killed_after(2, src, dst, world_size=4)
    report = convert(src, dst, world_size=4, dtype=torch.bfloat16)  # another output at the same place
    assert report.kept_ranks == () and verify(dst).ok
    assert sorted(os.listdir(dst)) == ["data-" + manifest_of(dst).generation, "manifest.json"]  # the debris gone
    _killed_after(2, src, dst2, world_size=4)
    shardckpt.save(_state(seed=1), src, overwrite=True)  # the same path, new values: a new identity
    report = convert(src, dst2, world_size=4)
    assert report.kept_ranks == () and diff(src, dst2).equal
    again = convert(src, dst2, world_size=4, overwrite=True)  # the same conversion once more, over its own commit
    assert again.kept_ranks == () and verify(dst2).ok and diff(src, dst2).equal


def test_a_second_run_of_the_same_conversion_while_one_is_writing_fails_at_once(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    real, second = chunk_output.write_file, []

    def with_a_second_run(*args, **kwargs):
        if not second:  # while the first run writes its first rank, the same command starts again
            second.append(1)
            with pytest.raises(shardckpt.CheckpointError, match="another live process is writing"):
                convert(src, dst, world_size=4)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunk_output, "write_file", with_a_second_run)
    convert(src, dst, world_size=4)
    assert second and verify(dst).ok and diff(src, dst).equal


def test_the_loser_of_two_identical_conversions_keeps_the_winners_files(tmp_path, monkeypatch):
    """Without locks (object stores), two runs of one conversion write the same files; the one that loses the
    commit must not remove the data directory the winner's manifest names."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    real_hold = LocalStorage.hold_dir
    monkeypatch.setattr(LocalStorage, "hold_dir", lambda self, path, exclusive=False: real_hold(self, path))
    real, second = chunk_output.write_file, []

    def with_a_second_run(*args, **kwargs):
        if not second:  # the same command, run to its commit while the first one writes
            second.append(1)
            convert(src, dst, world_size=4)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunk_output, "write_file", with_a_second_run)
    with pytest.raises(shardckpt.CheckpointExistsError):
        convert(src, dst, world_size=4)
    assert second and verify(dst).ok and diff(src, dst).equal


# ------------------------------------------------------------------ finer than ranks, and nothing unchecked kept


@pytest.fixture
def journal_every_write(monkeypatch):
    monkeypatch.setattr(resume, "JOURNAL_BYTES", 0)
    monkeypatch.setattr(writer, "COALESCE_BYTES", 0)  # nothing gathered: every write is in the file at once
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)  # SMALL's limit: slices of a few blocks
    with block_size(256):
        yield


SMALL = {"world_size": 3, "memory_limit": 4096, "files_per_rank": 1}  # one writer thread: exact kill points


def _small_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(60, 50, generator=g), "b": torch.randn(333, generator=g),
            "c": torch.randn(40, 7, generator=g).bfloat16(), "step": 4}


def _write_function(compress: str | None) -> str:
    return "_write_raw" if compress is None else "_write_frames"


def _writes(src, dst, **options) -> int:
    """How many slices an uninterrupted run writes (the kill points below are fractions of it)."""
    real, count = getattr(writer, _write_function(options.get("compress"))), []

    def counting(*args):
        count.append(1)
        return real(*args)

    setattr(writer, _write_function(options.get("compress")), counting)
    try:
        convert(src, dst, **options)
    finally:
        setattr(writer, _write_function(options.get("compress")), real)
    return len(count)


def _same_files(got, want) -> None:
    """The same data and index files, byte for byte (the same generation: the same conversion), no journals."""
    generation = manifest_of(want).generation
    assert manifest_of(got).generation == generation
    a, b = os.path.join(got, f"data-{generation}"), os.path.join(want, f"data-{generation}")
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))  # the journals are gone
    for name in os.listdir(b):
        with open(os.path.join(a, name), "rb") as x, open(os.path.join(b, name), "rb") as y:
            assert x.read() == y.read(), name


def _killed_writing(writes: int, src, dst, **options) -> None:
    killed_after(writes, writer, _write_function(options.get("compress")), lambda: convert(src, dst, **options))


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_a_kill_inside_the_files_keeps_what_was_written_and_commits_the_uninterrupted_result(
        tmp_path, journal_every_write, compress):
    src, fresh = tmp_path / "src", tmp_path / "fresh"
    shardckpt.save(_small_state(), src)
    options = {**SMALL, "compress": compress}
    total = _writes(src, fresh, **options)
    kept = []
    for i, at in enumerate((total // 4, total // 2, 3 * total // 4)):
        dst = tmp_path / f"dst{i}"
        _killed_writing(at, src, dst, **options)
        report = convert(src, dst, **options)
        kept.append(report.kept_bytes)
        _same_files(dst, fresh)
        assert verify(dst).ok and diff(src, dst).equal
    assert 0 < kept[0] < kept[1] < kept[2] < report.bytes_written, kept
    dst = tmp_path / "twice"  # killed, killed again while it resumes, then finished
    _killed_writing(total // 3, src, dst, **options)
    _killed_writing(total // 3, src, dst, **options)
    assert convert(src, dst, **options).kept_bytes > kept[1]
    _same_files(dst, fresh)


def _data(dst) -> str:
    return next(os.path.join(dst, d) for d in os.listdir(dst) if d.startswith("data-"))


def _truncate(path: str, by: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


DAMAGE = {
    "a flipped data byte": lambda data: flip_byte(os.path.join(data, "rank-00000-0.bin"), 100, mask=0x5A),
    "a truncated data file": lambda data: _truncate(os.path.join(data, "rank-00000-0.bin"), 8),
    "a flipped index byte": lambda data: flip_byte(os.path.join(data, "rank-00000-0.index.json"), 60, mask=0x5A),
    "the journal of another file": lambda data: shutil.copy(os.path.join(data, "resume", "rank-00001-0.bin.json"),
                                                            os.path.join(data, "resume", "rank-00000-0.bin.json")),
    "a torn journal": lambda data: _truncate(os.path.join(data, "resume", "rank-00000-0.bin.json"), 40),
    "a journal's chunk checksum": lambda data: _flip_journal_chunk_crc(os.path.join(data, "resume",
                                                                                    "rank-00000-0.bin.json")),
}


def _flip_journal_chunk_crc(path: str) -> None:
    """One bit of the first finished chunk's CRC32C in a journal that stays valid JSON (its blocks' CRCs intact)."""
    with open(path) as f:
        doc = json.load(f)
    doc["index"]["chunks"][0][4] ^= 1
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


@pytest.mark.parametrize("compress", [None, "zstd"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_to_a_finished_rank_of_the_killed_run_is_never_kept(tmp_path, journal_every_write, damage, compress):
    """Between the kill and the rerun, a finished rank's file is damaged: the rerun writes it again (from the
    damaged block on, where the journal is intact), and commits the uninterrupted result."""
    src, dst, fresh = tmp_path / "src", tmp_path / "dst", tmp_path / "fresh"
    shardckpt.save(_small_state(), src)
    options = {**SMALL, "files_per_rank": 2, "compress": compress}
    convert(src, fresh, **options)
    _killed_after(2, src, dst, **options)
    DAMAGE[damage](_data(dst))
    report = convert(src, dst, **options)
    assert report.kept_ranks == (1,) and report.kept_bytes > 0
    _same_files(dst, fresh)
    assert verify(dst).ok and diff(src, dst).equal


@pytest.mark.parametrize("damage", ["a flipped byte", "a truncation"])
def test_damage_inside_the_kept_part_of_a_partial_file_is_written_again(tmp_path, journal_every_write, damage):
    src, fresh = tmp_path / "src", tmp_path / "fresh"
    shardckpt.save(_small_state(), src)
    at = _writes(src, fresh, **SMALL) // 2
    kept = {}
    for case in ("intact", damage):
        dst = tmp_path / case
        _killed_writing(at, src, dst, **SMALL)
        partial = [os.path.join(_data(dst), f) for f in os.listdir(_data(dst))
                   if f.endswith(".bin") and not os.path.exists(os.path.join(_data(dst), f[:-4] + ".index.json"))]
        path = max(partial, key=os.path.getsize)  # the largest file the kill left without its index
        assert os.path.getsize(path) > 512
        if case == "a flipped byte":
            flip_byte(path, 300, mask=0x5A)  # in its second block
        elif case == "a truncation":
            _truncate(path, os.path.getsize(path) - 300)
        kept[case] = convert(src, dst, **SMALL).kept_bytes
        _same_files(dst, fresh)
        assert verify(dst).ok
    assert 0 < kept[damage] < kept["intact"], kept


def test_values_that_do_not_check_against_the_source_are_never_committed(tmp_path, monkeypatch):
    """Whatever goes wrong between the read and the commit (kept bytes included), a tensor whose combined checksum
    is not its source's fails the conversion, naming it, and nothing is committed."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    def wrong_slices(self, output, *args, real=streams.ReadOnDemand._slices):  # slices streamed
        for part in real(self, output, *args):
            if output.name == "model.layer2.weight":
                part.view(-1)[0] += 1
            yield part

    def wrong_held(self, name, real=streams.FileRuns._held):  # small chunks read in runs
        data = real(self, name)
        if name == "model.layer2.weight":
            data[0] ^= 1
        return data

    monkeypatch.setattr(streams.ReadOnDemand, "_slices", wrong_slices)
    monkeypatch.setattr(streams.FileRuns, "_held", wrong_held)
    with pytest.raises(shardckpt.CorruptCheckpointError, match=r"model\.layer2\.weight.*not the source's"):
        convert(src, dst, world_size=3)
    assert not os.path.exists(dst / "manifest.json") and not [d for d in os.listdir(dst) if d.startswith("data-")]


def test_local_workers_keep_what_a_killed_run_wrote_and_report_it_all(tmp_path):
    """Killed in one process, resumed by two workers: each keeps its own ranks; the report sums them."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    _killed_after(2, src, dst, world_size=3)
    report = convert_in_workers(ConvertSpec(src, dst, world_size=3, workers=2))
    manifest = manifest_of(dst)
    kept = sum(tensor.dtype.itemsize * region.numel for tensor in manifest.tensors.values()
               for _, region, file in chunks_of(tensor) if file // 2 < 2)  # two files a rank: ranks 0 and 1
    assert report.kept_ranks == (0, 1) and report.kept_bytes == kept > 0
    assert verify(dst).ok and diff(src, dst).equal


def test_a_failing_second_run_never_removes_what_the_first_committed(tmp_path, monkeypatch):
    """On an object store (no locks) two runs of one conversion share its data directory: A commits while B
    writes, then B fails (a store error) and must leave A's data alone (it removed the directory)."""
    src, dst = tmp_path / "src", f"memory://resume-{uuid.uuid4().hex[:8]}"
    shardckpt.save(_state(), src)
    real, b, lock = chunk_output.write_file, [], threading.Lock()

    def second_run_then_fail(files, *args, **kwargs):
        with lock:
            first = not b
            if first:
                b.append(files.plan)  # B's files are written with B's plan
        if first:
            convert(src, dst, world_size=4)  # A: the same command, to its commit (its files: other plans)
        elif files.plan is b[0]:
            raise OSError("connection reset (injected)")
        return real(files, *args, **kwargs)

    monkeypatch.setattr(chunk_output, "write_file", second_run_then_fail)
    with pytest.raises(OSError, match="injected"):
        convert(src, dst, world_size=4)
    assert verify(dst).ok and diff(src, dst).equal


@pytest.mark.parametrize("bad", [("crc", 1 << 32), ("crc", -1), ("crc", True), ("crc", 2.0), ("chunk", True),
                                 ("offset", False)])
def test_a_journal_block_crc_outside_32_bits_is_not_believed(tmp_path, journal_every_write, bad):
    # from helper-34: a CRC of 2**32 in the chunk in progress crashed the resumed run (and every rerun) with an
    # IndexError once that shift length had a lookup table; a CRC is 32 bits: such a journal is not this run's.
    # helper-35: a chunk number true (or an offset false) was believed, and its index row committed as written
    src, dst, fresh = tmp_path / "src", tmp_path / "dst", tmp_path / "fresh"
    shardckpt.save(_small_state(), src)
    convert(src, fresh, **SMALL)
    _killed_writing(_writes(src, tmp_path / "count", **SMALL) // 2, src, dst, **SMALL)
    path = os.path.join(_data(dst), "resume", "rank-00000-0.bin.json")
    with open(path) as f:
        doc = json.load(f)
    name, chunk, offset = doc["index"]["chunks"][-1][:3]
    digest = doc["digest"]
    storage = LocalStorage(str(dst))
    where = os.path.relpath(path, dst)
    field, value = bad
    for wrong, believed in ((False, True), (True, False)):
        current = {"chunk": chunk, "offset": offset, "crc": 5}
        if wrong:
            current[field] = value
        doc["current"] = [name, current["chunk"], current["offset"], [7, current["crc"]], []]
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        assert (resume.read_claim(storage, where, digest, doc["index"]["version"]) is not None) == believed, bad
    convert(src, dst, **SMALL)
    _same_files(dst, fresh)
    assert diff(src, dst).equal
