"""The per-tensor fast paths of issue 38's last stop, each held to the general path it stands beside: ``@record``
classes to ``@dataclass(frozen=True)``, the index's plain rows to the checked ones, the journal of a file whose small
chunks are gathered to the bytes in the file, small local saves and loads in one thread, a tensor of one chunk's
checksum to the combined one."""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import os
import pickle
import random
import threading

import pytest
import torch

import shardckpt
from shardckpt.checkpoint import writer
from shardckpt.checkpoint.collect import LocalPiece
from shardckpt.checkpoint.save_plan import WriteTask
from shardckpt.checkpoint.writer import Followed, StreamedPiece, write_data_file
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import index as index_module
from shardckpt.format.checksum import crc32c
from shardckpt.format.chunks import ExplicitChunks, RegularChunks
from shardckpt.format.index import ChunkRecord, index_to_bytes, parse_index
from shardckpt.format.manifest import MANIFEST_NAME, TensorEntry, manifest_generation, parse_manifest, seal
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.formats.detect import open_reader
from shardckpt.io import LocalStorage
from shardckpt.io import local as local_io
from shardckpt.offline.resume import _region_text
from shardckpt.records import record
from shardckpt.tensor_views import as_bytes, host_memory
from shardckpt.regions import Box, FlatRange, Run

RECORDS = [
    (FlatRange, (2, 9)), (Box, ((1, 0), (2, 3))), (Run, ("w", 4, 0, 5)),
    (RegularChunks, (4, 2, (0, 1), True)), (ExplicitChunks, ((FlatRange(0, 3), FlatRange(3, 6)), (0, 1))),
    (TensorEntry, ("w", torch.float32, (2, 3), 5, RegularChunks(6, 1, (0,), False))),
    (TensorInfo, ("w", torch.float32, (2, 3), None)),
]


@record
class _Plain:
    a: int
    b: tuple = ()


@dataclasses.dataclass(frozen=True)
class _Reference:
    a: int
    b: tuple = ()


@pytest.mark.parametrize("cls,args", RECORDS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_record_is_what_a_frozen_dataclass_would_be(cls, args):
    made = cls(*args)
    names = [f.name for f in dataclasses.fields(cls)]
    assert tuple(getattr(made, name) for name in names[:len(args)]) == tuple(args)
    assert made == cls(*args) and hash(made) == hash(cls(*args))
    assert made == dataclasses.replace(made) and pickle.loads(pickle.dumps(made)) == made
    assert made == cls(**dict(zip(names, args)))  # by keyword, as dataclasses.replace calls it
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, names[0], args[0])
    for change in (lambda: setattr(made, "note", 1), lambda: delattr(made, "note"), lambda: delattr(made, names[0])):
        with pytest.raises(dataclasses.FrozenInstanceError):  # (not super()'s TypeError: helper-45)
            change()
    assert not hasattr(made, "__dict__") and getattr(made, names[0]) == args[0]


@pytest.mark.parametrize("cls,args", RECORDS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_plain_subclass_of_a_record_keeps_attributes_of_its_own_and_its_fields_frozen(cls, args):
    sub = type("Sub", (cls,), {})(*args)
    sub.tag = "x"
    assert sub.tag == "x" and sub == sub
    del sub.tag
    assert not hasattr(sub, "tag")
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(sub, dataclasses.fields(cls)[0].name, args[0])


@pytest.mark.parametrize("args", [(0, 512, 7, "raw", 1 << 20, (7,)), (8, 30, 7, "zstd", 12, (1, 2, 3), (5, 6, 4)),
                                  (8, 30, 7, "zstd", 12, (1, 2, 3), (5, 6, 4), b"\x01" * 16)])
def test_a_chunk_record_compares_hashes_pickles_and_finds_its_frames_once(args):
    made = ChunkRecord(*args)
    assert made == ChunkRecord(*args) and hash(made) == hash(ChunkRecord(*args))
    starts = made.frame_starts  # found once, then kept (and never part of equality, hash or repr)
    assert starts == (0, *itertools.accumulate(made.frames)) and made.frame_starts is starts
    assert made.stored_length == (starts[-1] if made.frames else made.length)
    assert made == ChunkRecord(*args) and hash(made) == hash(ChunkRecord(*args)) and "_starts" not in repr(made)
    assert pickle.loads(pickle.dumps(made)) == made and dataclasses.replace(made) == made
    assert dataclasses.replace(made, offset=9).frame_starts == starts and ChunkRecord(9, *args[1:]) != made


def test_a_record_matches_a_frozen_dataclass_field_for_field():
    ours, theirs = _Plain(1), _Reference(1)
    assert ours.b == theirs.b == () and repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    assert _Plain(1, (2,)) != _Plain(1) and _Plain(1, (2,)) == _Plain(a=1, b=(2,))
    with pytest.raises(TypeError):
        _Plain()  # a field without a default is still required
    with pytest.raises(TypeError):
        _Plain(1, (), 3)


def test_a_record_still_runs_its_post_init_checks():
    with pytest.raises(ValueError, match="not a valid range"):
        FlatRange(5, 2)
    with pytest.raises(ValueError, match="differ in rank"):
        Box((0,), (1, 2))


def test_a_record_refuses_what_its_init_could_not_make_as_dataclasses_would():
    with pytest.raises(TypeError, match="plain defaults"):
        @record
        class _Factory:
            a: list = dataclasses.field(default_factory=list)
    with pytest.raises(TypeError, match="plain defaults"):
        @record
        class _KeywordOnly:
            a: int = dataclasses.field(kw_only=True)


def test_a_request_holds_its_tensor_by_reference():
    dest = torch.zeros(3)
    assert ReadRequest("w", FlatRange(0, 3), dest).dest is dest


@pytest.mark.parametrize("region", [FlatRange(0, 0), FlatRange(3, 1 << 40), Box((0, 1), (2, 3)), Box((), ())])
def test_the_region_text_of_a_journal_digest_is_the_regions_repr(region):
    assert _region_text(region) == repr(region)  # (a changed text would orphan a killed run's journals)


# ---- the index: plain rows read without their error texts, everything else as before ----

def _row(version: int, rng: random.Random) -> list:
    """A row that is well formed, or nearly (one field changed at random)."""
    length = rng.choice([1, 7, 512, 4096, 4097])
    row = ["t", rng.choice([0, 3]), rng.choice([0, 64, 4096]), length, rng.randrange(1 << 32), "raw",
           [rng.randrange(1 << 32) for _ in range(-(-length // 4096))], [], None][:index_module.ROW_WIDTH[version]]
    change = rng.randrange(1, 12)  # (not the name: a row without a string name is refused before either path)
    if change < len(row) and rng.random() < 0.6:
        row[change] = rng.choice([True, False, 1.0, -1, 1 << 33, None, "raw", "zstd", [], [1], [True], "x" * 40,
                                  [rng.randrange(1 << 32)], 0])
    return row


@pytest.mark.parametrize("version", [2, 3, 4, 5, 6])
def test_an_index_row_reads_as_the_checked_path_reads_it(version):
    rng = random.Random(version)
    for _ in range(4000):
        row = _row(version, rng)
        try:
            want = index_module._checked_record(row, version, 4096, "i")
        except CorruptCheckpointError as e:
            want = ("refused", str(e))
        try:
            got = index_module._record(row, version, 4096, 1 << 40, "i")[2]
        except CorruptCheckpointError as e:
            got = ("refused", str(e))
        assert got == want, row
        plain = index_module._plain_record(row, version, 4096)
        assert plain is None or plain == want, row  # the plain path reads only rows the checked path reads so


def test_a_row_of_the_wrong_shape_is_refused_before_either_path():
    with pytest.raises(CorruptCheckpointError, match="malformed chunk row"):
        index_module._record(["t", 0, 0], 6, 4096, 100, "i")


def test_a_plain_row_past_the_end_of_its_file_is_refused():
    data = index_to_bytes({("t", 0): ChunkRecord(64, 512, 9, "raw", 4096, (9,))}, 6, 4096)
    parse_index(data, 6, 576, "i")
    with pytest.raises(CorruptCheckpointError, match="runs past the end"):
        parse_index(data, 6, 575, "i")


# ---- the journal of a file whose small chunks are gathered ----

def _streamed(name: str, values: torch.Tensor) -> StreamedPiece:
    def slices(block: int, first: int):
        yield values.reshape(-1)[first:]
    return StreamedPiece(name, values.dtype, tuple(values.shape), FlatRange(0, values.numel()), slices)


def test_the_journal_never_claims_bytes_still_gathered(tmp_path, monkeypatch):
    """A resume reads back what the journal claims: each claim is in the file when it is made."""
    monkeypatch.setattr(writer, "COALESCE_BYTES", 8 << 10)
    storage = LocalStorage(str(tmp_path))
    pieces = {f"p{i}": _streamed(f"p{i}", torch.full((100 + i,), float(i))) for i in range(300)}
    pieces["big"] = _streamed("big", torch.arange(40_000, dtype=torch.float32))  # above SMALL_WRITE: written as is
    claims = []

    def journal(progress):
        claims.append((progress.size, os.path.getsize(tmp_path / "d.bin")))

    tasks = [WriteTask(name, 0) for name in pieces]
    through_cache = storage.open_writer("d.bin", direct=False)  # (as convert writes: a claim is in the file at once)
    entry, _ = write_data_file(storage, "d.bin", "d.index.json", tasks, pieces,
                               followed=Followed(writer=through_cache, journal=journal))
    assert len(claims) > 10 and all(claimed <= on_disk for claimed, on_disk in claims)
    assert claims[-1][0] <= entry.size == os.path.getsize(tmp_path / "d.bin")
    records = parse_index((tmp_path / "d.index.json").read_bytes(), 2, entry.size, "i")  # (the default version)
    data = (tmp_path / "d.bin").read_bytes()
    for name, piece in pieces.items():
        rec = records[(name, 0)]
        want = next(piece.slices(4096, 0)).numpy().tobytes()
        assert data[rec.offset:rec.offset + rec.length] == want, name


def _staged_pieces() -> dict[str, LocalPiece]:
    """Staged pieces of every kind the small-chunk batch meets: whole tensors of many dtypes, a 0-d and an empty one,
    a part of a tensor (a flat range not at its start: its checksum term is shifted), a box of several runs, and one
    past ``SMALL_WRITE`` between small ones (the general path, in the middle of a batch)."""
    g = torch.Generator().manual_seed(5)
    whole = {"f32": torch.randn(3, 5, generator=g), "f64": torch.tensor(2.5, dtype=torch.float64),
             "empty": torch.empty(0, 4), "bool": torch.rand(7, generator=g) > 0.5, "f16": torch.randn(9).half(),
             "c64": torch.randn(4, dtype=torch.complex64, generator=g), "i8": torch.arange(11, dtype=torch.int8),
             "big": torch.randn(40_000, generator=g), "bf16": torch.randn(2, 3, generator=g).bfloat16()}
    pieces = {n: LocalPiece(n, t, tuple(t.shape), FlatRange(0, t.numel()), True) for n, t in whole.items()}
    pieces["part"] = LocalPiece("part", torch.randn(6, generator=g), (4, 5), FlatRange(7, 13), False)
    pieces["box"] = LocalPiece("box", torch.randn(2, 3, generator=g), (4, 5), Box((1, 2), (2, 3)), False)
    pieces["first"] = LocalPiece("first", torch.randn(5, generator=g), (4, 5), FlatRange(0, 5), False)
    return pieces


def test_small_chunks_written_together_are_what_the_general_path_writes(tmp_path, monkeypatch):
    """``_write_small`` (consecutive small staged chunks in one loop) writes the bytes, records and checksum terms
    that ``_write_chunk`` writes for each, in any order of small and large chunks."""
    pieces = _staged_pieces()
    storage = LocalStorage(str(tmp_path))
    batched, write_small = [], writer._write_small
    monkeypatch.setattr(writer, "_write_small", lambda sink, small, terms: (
        batched.append(len(small)), write_small(sink, small, terms))[1])
    names = list(pieces)
    for order in (names, names[::-1]):
        tasks = [WriteTask(name, 0) for name in order if name != "empty"] + [WriteTask("empty", 0)]
        together = write_data_file(storage, "t.bin", "t.index.json", tasks, pieces)
        with monkeypatch.context() as apart:
            apart.setattr(writer, "SMALL_WRITE", 0)  # no chunk is small: each through the general path, unbatched
            separate = write_data_file(storage, "s.bin", "s.index.json", tasks, pieces)
        assert together[1] == separate[1]  # every tensor's checksum term
        assert (tmp_path / "t.bin").read_bytes() == (tmp_path / "s.bin").read_bytes()
        assert (tmp_path / "t.index.json").read_bytes() == (tmp_path / "s.index.json").read_bytes()
        assert together[0].size == separate[0].size and together[0].index_crc32c == separate[0].index_crc32c
    assert sum(batched) == 2 * (len(pieces) - 2) and len(batched) == 4  # all but 'big' and 'empty', around 'big'


def test_a_small_piece_not_on_the_host_is_not_written_with_the_staged_ones(tmp_path, monkeypatch):
    """A synchronous save keeps a CUDA tensor on its device (``checkpoint.device_slices``): however small, it goes
    through the general path, which copies it to the host a slice at a time (a meta tensor stands in here)."""
    batched, write_small = [], writer._write_small
    monkeypatch.setattr(writer, "_write_small", lambda sink, small, terms: (
        batched.extend(key[0] for key, _ in small), write_small(sink, small, terms))[1])
    on_host, elsewhere = torch.ones(3), torch.empty(3, device="meta")
    pieces = {n: LocalPiece(n, t, (3,), FlatRange(0, 3), True) for n, t in (("a", on_host), ("m", elsewhere))}
    with pytest.raises((NotImplementedError, RuntimeError, ValueError)):  # (meta has no bytes to copy)
        write_data_file(LocalStorage(str(tmp_path)), "d.bin", "d.index.json", [WriteTask("a", 0), WriteTask("m", 0)],
                        pieces)
    assert batched == ["a"]


@pytest.mark.parametrize("t", [torch.arange(24, dtype=torch.int16).reshape(4, 6)[1:3], torch.tensor(7.5),
                               torch.empty(0), torch.randn(3, 2).bfloat16(), torch.zeros(5, dtype=torch.bool)])
def test_host_memory_is_the_tensors_own_bytes_in_place(t):
    view = host_memory(t)
    assert (view.format, view.ndim, view.readonly, len(view)) == ("B", 1, False, t.nbytes)
    assert bytes(view) == as_bytes(t.contiguous()).numpy().tobytes()
    if t.nbytes:
        before = as_bytes(t)[0].item()
        view[0] ^= 0xFF  # written through: the tensor's memory itself
        assert as_bytes(t)[0].item() == before ^ 0xFF


def test_host_memory_keeps_its_length_whatever_others_set_on_ctypes_pythonapi(monkeypatch):
    """Packages set ``ctypes.pythonapi.PyMemoryView_FromMemory.argtypes`` with a 32-bit length (a process-wide
    object): a view of 2 GiB or more must still have its length (the view is made, never read, here)."""
    shared = ctypes.pythonapi.PyMemoryView_FromMemory
    monkeypatch.setattr(shared, "argtypes", (ctypes.c_void_p, ctypes.c_int, ctypes.c_int))
    monkeypatch.setattr(shared, "restype", ctypes.py_object)
    buffer = torch.zeros(8, dtype=torch.uint8)

    class Huge:  # an address and a length are all host_memory takes
        nbytes = (4 << 30) + 8

        def data_ptr(self) -> int:
            return buffer.data_ptr()

    assert len(host_memory(Huge())) == (4 << 30) + 8
    assert len(host_memory(buffer)) == 8


def test_a_progress_callback_that_is_falsy_is_still_told(tmp_path):
    class Recorder(list):  # empty, so falsy, until told
        def __call__(self, done: int, total: int) -> None:
            self.append((done, total))

    state = {f"t{i}": torch.full((10,), float(i)) for i in range(30)}
    saved, verified = Recorder(), Recorder()
    shardckpt.save(state, str(tmp_path / "c"), progress=saved)
    assert saved[0] == (0, 1200) and saved[-1] == (1200, 1200)
    assert all(a[0] <= b[0] for a, b in zip(saved, saved[1:]))
    assert not shardckpt.verify(str(tmp_path / "c"), progress=verified).problems
    assert verified and verified[-1] == (1200, 1200)


def test_a_save_of_small_tensors_written_together_loads_and_verifies(tmp_path):
    g = torch.Generator().manual_seed(6)
    state = {f"m.{i}": torch.randn(i % 7 + 1, 3, generator=g) for i in range(50)}
    state.update(scalar=torch.tensor(3.0), empty=torch.empty(0), flags=torch.tensor([True, False, True]),
                 big=torch.randn(20_000, generator=g), strided=torch.randn(5, 4, generator=g).t())
    shardckpt.save(state, str(tmp_path / "c"))
    loaded = shardckpt.load_full(str(tmp_path / "c"))
    assert set(loaded) == set(state)
    for name, value in state.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    assert not shardckpt.verify(str(tmp_path / "c")).problems


# ---- small local saves and loads in one thread; larger ones and object stores in several ----

def _threads_named(prefix: str, work) -> set[str]:
    seen: set[str] = set()
    original = threading.Thread.start

    def start(self):
        seen.add(self.name.split("_")[0])
        return original(self)

    threading.Thread.start = start
    try:
        work()
    finally:
        threading.Thread.start = original
    return {name for name in seen if name.startswith(prefix)}


def test_a_small_local_save_and_load_run_in_the_callers_thread(tmp_path):
    sd = {f"w{i}": torch.randn(16) for i in range(50)}
    path = str(tmp_path / "c")
    assert not _threads_named("shardckpt-write", lambda: shardckpt.save(sd, path, files_per_rank=2))
    assert not _threads_named("shardckpt-read", lambda: shardckpt.load_full(path))
    got = shardckpt.load_full(path)
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_a_larger_local_save_and_load_write_and_read_files_in_parallel(tmp_path, monkeypatch):
    monkeypatch.setattr(local_io, "SERIAL_BELOW", 1 << 10)  # (instead of 32 MiB of tensors)
    sd = {f"w{i}": torch.randn(4096) for i in range(8)}
    path = str(tmp_path / "c")
    assert _threads_named("shardckpt-write", lambda: shardckpt.save(sd, path, files_per_rank=2))
    assert _threads_named("shardckpt-read", lambda: shardckpt.load_full(path))
    got = shardckpt.load_full(path)
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_object_stores_keep_their_threads_whatever_the_size():
    assert local_io.one_thread_suits(LocalStorage("/tmp"), 1 << 20)
    assert not local_io.one_thread_suits(LocalStorage("/tmp"), local_io.SERIAL_BELOW)
    assert not local_io.one_thread_suits(object(), 1)


# ---- a tensor of one chunk: its checksum is the chunk's ----

def _reseal_crc(path: str, name: str, crc: int) -> None:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        doc = json.loads(f.read())
    doc.pop("crc32c")
    table = doc["tensors"]
    if "names" in table:  # format v6: columns
        table["crc32c"][table["names"].index(name)] = crc
    else:
        table[name]["crc32c"] = crc
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(seal(json.dumps(doc, separators=(",", ":")).encode()))


@pytest.mark.parametrize("count", [3, 1100])  # format v2 and v6
def test_a_resealed_checksum_of_a_one_chunk_tensor_is_refused_on_a_read_whole_or_in_part(tmp_path, count):
    sd = {f"w{i}": torch.randn(8) for i in range(count)}
    path = str(tmp_path / "c")
    shardckpt.save(sd, path)
    entry = parse_manifest(open(os.path.join(path, MANIFEST_NAME), "rb").read(), "m").tensors["w1"]
    _reseal_crc(path, "w1", entry.crc32c ^ 1)
    with pytest.raises(CorruptCheckpointError, match="'w1'.*combine to checksum"):
        shardckpt.load_full(path)
    part = {"w1": shardckpt.ShardedTensor(torch.zeros(4), (8,), FlatRange(0, 4))}
    with pytest.raises(CorruptCheckpointError, match="'w1'.*combine to checksum"):
        shardckpt.load(part, path, strict=False)  # part of its one block, which was read and checked whole
    part = {"w2": shardckpt.ShardedTensor(torch.zeros(4), (8,), FlatRange(0, 4))}
    shardckpt.load(part, path, strict=False)  # the others as before
    assert torch.equal(part["w2"].local, sd["w2"][:4])


def test_the_generation_read_alone_is_the_parsed_ones_and_refuses_what_parsing_refuses(tmp_path):
    path = str(tmp_path / "c")
    shardckpt.save({"w": torch.randn(3)}, path)
    data = open(os.path.join(path, MANIFEST_NAME), "rb").read()
    assert manifest_generation(data, "m") == parse_manifest(data, "m").generation
    flipped = data.replace(b'"generation":"', b'"generation":"G', 1)
    with pytest.raises(CorruptCheckpointError):
        manifest_generation(flipped, "m")
    doc = json.loads(data)
    doc.pop("crc32c")
    doc["generation"] = "NOT-HEX"
    with pytest.raises(CorruptCheckpointError, match="'generation'"):
        manifest_generation(seal(json.dumps(doc).encode()), "m")


def test_a_convert_of_small_chunks_killed_while_gathering_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    """Small chunks are gathered into larger writes (``COALESCE_BYTES``, here 16 KiB) and the journal claims only
    what reached the file: a rerun after a kill keeps a checked prefix and writes the rest, byte for byte the
    files of a run never killed."""
    from shardckpt.checkpoint.verify import verify
    from shardckpt.offline import resume
    from shardckpt.offline.diff import diff
    from tests.convert._kill import killed_after

    monkeypatch.setattr(writer, "COALESCE_BYTES", 16 << 10)
    monkeypatch.setattr(resume, "JOURNAL_BYTES", 0)  # a journal after every write the file holds
    sd = {f"layers.{i}.w": torch.randn(4, 33, generator=torch.Generator().manual_seed(i)) for i in range(400)}
    src, fresh, dst = tmp_path / "src", tmp_path / "fresh", tmp_path / "dst"
    shardckpt.save(sd, src)
    options = {"world_size": 2, "files_per_rank": 1}
    shardckpt.convert(src, fresh, **options)
    killed_after(3, writer._Coalesced, "_flush", lambda: shardckpt.convert(src, dst, **options))
    report = shardckpt.convert(src, dst, **options)
    assert report.kept_bytes > 0  # (three 16 KiB writes reached the file before the kill)
    generation = parse_manifest((fresh / MANIFEST_NAME).read_bytes(), "m").generation
    for name in os.listdir(fresh / f"data-{generation}"):
        assert (dst / f"data-{generation}" / name).read_bytes() == (fresh / f"data-{generation}" / name).read_bytes()
    assert verify(dst).ok and diff(src, dst).equal


def test_a_load_full_parses_each_index_once(tmp_path, monkeypatch):
    """The bytes check before allocation and the reads share the reader's indexes (a v6 checkpoint, whose rows
    are all checked before the tensors are made)."""
    from shardckpt.formats.native import reader as native_reader

    sd = {f"w{i}": torch.randn(8) for i in range(1100)}
    shardckpt.save(sd, tmp_path / "c", files_per_rank=2)
    parsed = []
    real = native_reader.parse_index
    monkeypatch.setattr(native_reader, "parse_index", lambda *a: parsed.append(a[-1]) or real(*a))
    got = shardckpt.load_full(tmp_path / "c")
    assert sorted(parsed) == sorted(set(parsed)) and len(parsed) == 2
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_a_record_refuses_a_class_with_its_own_init_or_pseudo_fields():
    """helper-39: dataclasses keep a class's own __init__ (ours replaced it) and pass InitVars to __post_init__
    (ours dropped them): such classes are refused where they are defined."""
    with pytest.raises(TypeError, match="its own __init__"):
        @record
        class _OwnInit:
            lo: int

            def __init__(self, n):
                object.__setattr__(self, "lo", n)
    with pytest.raises(TypeError, match="InitVar and ClassVar fields \\(scale\\)"):
        @record
        class _WithInitVar:
            a: int
            scale: dataclasses.InitVar[int] = 1


def test_a_damaged_v1_manifest_replaced_on_an_object_store_keeps_its_data_for_gc(tmp_path):
    """helper-39: a v1 manifest has no checksum, so only a full parse vouches for the generation it names; a damaged
    one names nothing to remove (the collector takes its data later, by age)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/v1-{os.getpid()}-{tmp_path.name}"
    src = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "v1")
    for folder, _, files in os.walk(src):
        for name in files:
            path = os.path.join(folder, name)
            fs.pipe(f"{root}/{os.path.relpath(path, src)}", open(path, "rb").read())
    data = fs.cat(f"{root}/manifest.json")
    generation = parse_manifest(data, "m").generation
    damaged = data.replace(b'"dtype":"float32"', b'"dtype":"flo@t32"', 1)
    assert damaged != data
    fs.pipe(f"{root}/manifest.json", damaged)
    with pytest.raises(CorruptCheckpointError):
        manifest_generation(damaged, "m")
    shardckpt.save({"w": torch.zeros(3)}, f"memory://{root}", overwrite=True)
    assert fs.exists(f"{root}/data-{generation}")
    assert torch.equal(shardckpt.load_full(f"memory://{root}")["w"], torch.zeros(3))
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("fault", ["row missing", "row too short", "row of another tensor"])
def test_a_v6_checkpoints_whole_tensor_rows_are_checked_before_allocating(tmp_path, fault):
    """A table checkpoint's whole-tensor chunks (check_stored's fast path) against rows edited in the index (its size
    and checksum resealed in the manifest): refused, naming the file, tensor and chunk."""
    from shardckpt.format.checksum import crc32c
    from tests.storage._util import manifest_doc, sealed

    state = {f"t{i}": torch.full((3,), float(i)) for i in range(1100)}
    path = tmp_path / "c"
    shardckpt.save(state, str(path))
    manifest = manifest_doc((path / "manifest.json").read_bytes())
    assert manifest["version"] == 6
    entry = manifest["files"][0]
    index_path = path / entry["index"]["path"]
    index = json.loads(index_path.read_bytes())
    rows = index["chunks"]
    victim, other = rows[5][0], rows[6][0]
    if fault == "row missing":
        del rows[5]
    elif fault == "row too short":
        rows[5][3] = 8
    else:
        rows[5][0], rows[6][0] = rows[6][0], rows[5][0]  # two tensors' rows swapped: same lengths, other names
    data = json.dumps(index, separators=(",", ":")).encode()
    index_path.write_bytes(data)
    entry["index"]["size"], entry["index"]["crc32c"] = len(data), crc32c(data)
    (path / "manifest.json").write_bytes(sealed(manifest))
    if fault == "row of another tensor":  # the rows are sound; the data is not theirs: the checksums say so
        with pytest.raises(CorruptCheckpointError, match=f"tensor '({victim}|{other})': its chunks combine"):
            shardckpt.load_full(str(path))
        return
    expected = "is missing from the file's index" if fault == "row missing" else "has 8 bytes, its region needs 12"
    with pytest.raises(CorruptCheckpointError, match=f"tensor '{victim}' chunk 0 {expected}"):
        shardckpt.load_full(str(path))
    from shardckpt.formats.native import NativeReader, read_manifest
    from shardckpt.io.local import LocalStorage

    storage = LocalStorage(str(path))
    reader = NativeReader(storage, read_manifest(storage))
    with pytest.raises(CorruptCheckpointError, match=f"tensor '{victim}' chunk 0 {expected}"):
        reader.check_stored(list(state))  # (what a load runs before it allocates a byte)


def _table_states() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    many = {f"layer{i // 8}.p{i % 8}": torch.randn(i % 5 + 1, 3, generator=g) for i in range(1100)}
    odd = {"empty": torch.empty(0, 4), "scalar": torch.tensor(3.0), "big": torch.randn(70_000, generator=g),
           "int": torch.arange(6, dtype=torch.int32).reshape(2, 3), "bf": torch.randn(5, generator=g).bfloat16()}
    return [many, {**many, "extra": odd}]


def _manifest_parts(path) -> tuple:
    from tests.storage._util import manifest_doc

    doc = manifest_doc((path / "manifest.json").read_bytes())
    return doc["version"], doc["tensors"], doc["tree"]


@pytest.mark.parametrize("which", [0, 1])
def test_the_commits_table_from_the_plan_is_the_table_of_its_entries(tmp_path, monkeypatch, which):
    """``SavePlan.table`` (a whole one-chunk tensor's form found by dtype, shape and file) writes the manifest the
    table of ``TensorEntry``s wrote (``table_to_json``), byte for byte in its tensors and tree."""
    import shardckpt.checkpoint.commit as commit

    state = _table_states()[which]
    shardckpt.save(state, str(tmp_path / "direct"), files_per_rank=3)
    monkeypatch.setattr(commit, "TABLE_VERSION", 1 << 30)  # the commit makes entries; to_bytes tables them
    shardckpt.save(state, str(tmp_path / "entries"), files_per_rank=3)
    direct, entries = _manifest_parts(tmp_path / "direct"), _manifest_parts(tmp_path / "entries")
    assert direct[0] == 6 and direct == entries
    assert_same = shardckpt.load_full(str(tmp_path / "direct"))
    assert all(torch.equal(assert_same["extra"][k] if isinstance(v, dict) else assert_same[k], v)
               for k, v in state.items() if not isinstance(v, dict))


def _save_sharded_table(path: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    from shardckpt import ShardedTensor

    state = {f"w{i}": ShardedTensor(torch.full((5,), float(i * 10 + rank)), (10,), FlatRange(5 * rank, 5 * rank + 5))
             for i in range(600)}
    state.update({f"r{i}": torch.full((3,), float(i)) for i in range(600)})
    shardckpt.save(state, path)


def _save_sharded_entries(path: str) -> None:
    import shardckpt.checkpoint.commit as commit

    real, commit.TABLE_VERSION = commit.TABLE_VERSION, 1 << 30
    try:
        _save_sharded_table(path)
    finally:
        commit.TABLE_VERSION = real


def test_the_commits_table_from_the_plan_holds_for_sharded_tensors_of_two_ranks(tmp_path):
    from tests._dist import run_ranks

    run_ranks(2, _save_sharded_table, str(tmp_path / "direct"))
    run_ranks(2, _save_sharded_entries, str(tmp_path / "entries"))
    direct, entries = _manifest_parts(tmp_path / "direct"), _manifest_parts(tmp_path / "entries")
    assert direct[0] == 6 and direct == entries
    back = shardckpt.load_full(str(tmp_path / "direct"))
    assert back["w7"].tolist() == [70.0] * 5 + [71.0] * 5 and back["r3"].tolist() == [3.0] * 3


def test_stage_stages_each_tensor_as_a_detached_view_of_its_memory(tmp_path):
    """Every tensor is staged as a detached view of its memory (a tensor object of its own, made once: the piece
    ``collect.to_piece`` made is the staged one), a Parameter or a tensor that requires grad too; all save and load
    bit for bit."""
    from shardckpt.checkpoint.save import stage

    plain, param = torch.arange(6.0), torch.nn.Parameter(torch.arange(4.0))
    grad = torch.arange(3.0).requires_grad_()
    staged = stage({"plain": plain, "param": param, "grad": grad})
    for name, t in (("plain", plain), ("param", param), ("grad", grad)):
        assert staged.pieces[name].data is not t
        data = staged.pieces[name].data
        assert type(data) is torch.Tensor and not data.requires_grad and data.data_ptr() == t.data_ptr()
    shardckpt.save({"plain": plain, "param": param, "grad": grad}, str(tmp_path / "c"))
    back = shardckpt.load_full(str(tmp_path / "c"))
    assert torch.equal(back["plain"], plain) and torch.equal(back["param"], param.detach())
    assert torch.equal(back["grad"], grad.detach()) and param.requires_grad and grad.requires_grad


@pytest.mark.parametrize("change", ["data", "set_", "t_", "resize_up", "resize_down", "unsqueeze_"])
@pytest.mark.parametrize("kind", ["plain", "parameter", "sharded", "per_rank"])
def test_a_change_to_the_callers_tensor_object_after_stage_does_not_reach_the_save(tmp_path, change, kind):
    """Between ``stage`` and ``persist`` the caller may rebind or reshape its tensor object (not the staged memory):
    the save holds the values and shape staged (helper-44: a plain tensor staged as itself saved zeros after
    ``t.data = zeros``, and failed after ``t.t_()`` or ``resize_``)."""
    from shardckpt import PerRank, ShardedTensor
    from shardckpt.checkpoint.save import persist, plan, stage

    t = torch.arange(6.0).reshape(2, 3)
    leaf = {"plain": lambda: t, "parameter": lambda: torch.nn.Parameter(t, requires_grad=False),
            "sharded": lambda: ShardedTensor(t, (2, 3), Box((0, 0), (2, 3))),
            "per_rank": lambda: PerRank({"x": t})}[kind]()
    staged = stage({"t": leaf})
    target = leaf.local if kind == "sharded" else leaf.value["x"] if kind == "per_rank" else leaf
    with torch.no_grad():
        {"data": lambda: setattr(target, "data", torch.zeros(2, 3)), "set_": lambda: target.set_(torch.zeros(2, 3)),
         "t_": lambda: target.t_(), "resize_up": lambda: target.resize_(4, 4), "resize_down": lambda: target.resize_(1),
         "unsqueeze_": lambda: target.unsqueeze_(0)}[change]()
    persist(staged, plan(staged, str(tmp_path / "c")))
    back = shardckpt.load_full(str(tmp_path / "c"))["t"]
    back = back[0]["x"] if kind == "per_rank" else back  # (per-rank values: one per saving rank)
    assert back.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


@pytest.mark.parametrize("count", [2, 1100])  # format v2 (an entry per tensor) and v6 (the tensor table's forms)
@pytest.mark.parametrize("shape", [[0, 2**50, 2**50], [2**50, 2**50, 0], [0] + [2**40] * 4])
def test_an_empty_tensor_whose_other_dims_torch_cannot_lay_out_is_refused_by_name(tmp_path, count, shape):
    """Every dim in range and no elements, but strides past 2**63 (helper-45: torch.empty raised a plain
    RuntimeError, 'Stride calculation overflowed', from load_full; convert called it a bug in shardckpt)."""
    path = str(tmp_path / "ck")
    shardckpt.save({f"e{i}": torch.zeros(0, 3) for i in range(count)}, path)
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        doc = json.loads(f.read())
    doc.pop("crc32c")
    table = doc["tensors"]
    (table["forms"][0] if "forms" in table else table["e0"])["shape"] = shape
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(seal(json.dumps(doc, separators=(",", ":")).encode()))
    with pytest.raises(CorruptCheckpointError, match="tensor 'e0'.*absurd shape"):
        shardckpt.load_full(path)


@pytest.mark.parametrize("shape", [[2**26, 2**26, 0], [2**31, 0, 2**31], [0, 2**50, 2**12], [0] * 64,
                                   [1, 2**50, 2**13 - 1, 0]])
def test_an_empty_tensor_that_torch_lays_out_saves_and_loads_however_large_its_other_dims(tmp_path, shape):
    """The bound above is torch's, not 2**50 over the non-zero dims (helper-46: that refused [2**26, 2**26, 0],
    which torch makes, and every checkpoint holding one). Its safetensors export reads back too."""
    path, exported = str(tmp_path / "ck"), str(tmp_path / "hf")
    state = {"w": torch.arange(3.0), "e": torch.empty(size=shape, dtype=torch.float64)}
    shardckpt.save(state, path)
    full = shardckpt.load_full(path)
    assert full["e"].shape == tuple(shape) and full["e"].dtype == torch.float64 and torch.equal(full["w"], state["w"])
    shardckpt.export(path, exported)
    back = shardckpt.load_full(exported)
    assert back["e"].shape == tuple(shape) and torch.equal(back["w"], state["w"])


@pytest.mark.parametrize("region", [FlatRange(0, 10), FlatRange(7, 30), FlatRange(0, 30)])
def test_rows_swapped_between_two_one_block_tensors_are_refused_on_a_read_of_part_too(tmp_path, region):
    """A resealed index whose rows of two same-sized tensors are swapped (each row's own CRCs agree with its bytes):
    a read of part of a one-block chunk checks that whole block, so the tensor's checksum is known and compared
    (helper-45: a read of a[0:10] returned b's bytes, silently)."""
    path = str(tmp_path / "ck")
    shardckpt.save({"a": torch.arange(30, dtype=torch.float32), "b": torch.arange(100, 130, dtype=torch.int32)}, path,
                   files_per_rank=1)
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        doc = json.loads(f.read())
    doc.pop("crc32c")
    (file,) = doc["files"]
    index_path = os.path.join(path, file["index"]["path"])
    with open(index_path, "rb") as f:
        index = json.loads(f.read())
    rows = {row[0]: row for row in index["chunks"]}
    rows["a"][2:], rows["b"][2:] = rows["b"][2:], rows["a"][2:]
    data = json.dumps(index, separators=(",", ":")).encode()
    with open(index_path, "wb") as f:
        f.write(data)
    file["index"]["size"], file["index"]["crc32c"] = len(data), crc32c(data)
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(seal(json.dumps(doc, separators=(",", ":")).encode()))
    with pytest.raises(CorruptCheckpointError, match="tensor 'a'.*the manifest and the data disagree"):
        open_reader(path).read([ReadRequest("a", region, torch.zeros(region.numel))])
