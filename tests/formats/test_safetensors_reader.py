"""safetensors files and Hugging Face directories behind the one read interface (formats/safetensors.py)."""
from __future__ import annotations

import json
import struct
import uuid

import fsspec
import pytest
import safetensors.torch
import torch

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, ReadRequest
from shardckpt.formats.safetensors import SafetensorsReader, open_safetensors
from shardckpt.formats.safetensors_header import DTYPES, INDEX_NAME, MAX_HEADER_SIZE, METADATA_KEY
from shardckpt.io import FsspecStorage, LocalStorage
from shardckpt.regions import Box, FlatRange, full_region


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bit-exact comparisons (NaN payloads included)."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _file(tensors: dict, metadata: dict | None = None, *, header: bytes | None = None, data: bytes = b"",
          length: int | None = None) -> bytes:
    """A safetensors file written by hand: ``tensors`` maps names to header entries; or a raw ``header``."""
    if header is None:
        obj = dict(tensors)
        if metadata is not None:
            obj[METADATA_KEY] = metadata
        header = json.dumps(obj).encode()
    return struct.pack("<Q", len(header) if length is None else length) + header + data


REGIONS = [
    pytest.param(Box((1, 2), (3, 4)), lambda t: t[1:4, 2:6], id="box"),
    pytest.param(FlatRange(9, 26), lambda t: t.reshape(-1)[9:26], id="flat-mid-row"),
    pytest.param(full_region((5, 7)), lambda t: t, id="full"),
]


@pytest.mark.parametrize("st_name", sorted(DTYPES))
@pytest.mark.parametrize("region, want", REGIONS)
def test_every_dtype_reads_bit_exact(tmp_path, st_name, region, want):
    dtype = DTYPES[st_name]
    src = _random(dtype, (5, 7), seed=len(st_name))
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"x": src, "y": _random(dtype, (3,), seed=1)}, str(path))
    reader = open_safetensors(path)
    assert isinstance(reader, CheckpointReader)
    info = reader.tensors()["x"]
    assert (info.dtype, info.shape, info.crc32c) == (dtype, (5, 7), None)
    header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert header["x"]["dtype"] == st_name
    dest = torch.zeros(region.numel, dtype=dtype)
    reader.read([ReadRequest("x", region, dest)])
    assert torch.equal(_bytes(dest), _bytes(want(src)))


def test_headers_agree_with_the_safetensors_package(tmp_path):
    tensors = {f"t{i}": _random(d, (3, i + 1), seed=i) for i, d in enumerate([torch.float32, torch.bfloat16,
                                                                            torch.int64, torch.bool, torch.uint8])}
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt", "note": "hi"})
    reader = open_safetensors(path)
    theirs = safetensors.torch.load_file(str(path))
    assert set(reader.tensors()) == set(theirs)
    for name, t in theirs.items():
        dest = torch.empty(t.shape, dtype=t.dtype)
        reader.read([ReadRequest(name, full_region(t.shape), dest)])
        assert torch.equal(_bytes(dest), _bytes(t))
    tree = reader.tree()
    assert tree[METADATA_KEY] == {"format": "pt", "note": "hi"}
    assert {k: v for k, v in tree.items() if k != METADATA_KEY} == {n: TensorRef(n) for n in tensors}


@pytest.mark.parametrize("region, want", REGIONS)
def test_reads_cast_into_another_dtype(tmp_path, region, want):
    src = {"bf": (torch.arange(35, dtype=torch.float32) / 3).to(torch.bfloat16).reshape(5, 7),
           "i": torch.arange(35, dtype=torch.int32).reshape(5, 7) - 17,
           "f": torch.linspace(-2, 2, 35).reshape(5, 7)}
    safetensors.torch.save_file(src, str(tmp_path / "m.safetensors"))
    reader = open_safetensors(tmp_path / "m.safetensors")
    into = {"bf": torch.float32, "i": torch.float64, "f": torch.bfloat16}
    dests = {n: torch.empty(region.numel, dtype=into[n]) for n in src}
    reader.read([ReadRequest(n, region, dests[n]) for n in src])
    for n in src:
        assert torch.equal(dests[n], want(src[n]).reshape(-1).to(into[n]))


def test_0d_and_empty_tensors(tmp_path):
    src = {"s": torch.tensor(2.5, dtype=torch.bfloat16), "e": torch.empty(0, 3),
           "z": torch.empty(3, 0, dtype=torch.int8),
           "w": torch.arange(6.0)}
    safetensors.torch.save_file(src, str(tmp_path / "m.safetensors"))
    reader = open_safetensors(tmp_path / "m.safetensors")
    assert reader.tensors()["s"].shape == () and reader.tensors()["e"].shape == (0, 3)
    s, s_box, s64 = torch.empty((), dtype=torch.bfloat16), torch.empty(1, dtype=torch.bfloat16), torch.empty(())
    e, z = torch.empty(0, 3), torch.empty(0, dtype=torch.int8)
    reader.read([ReadRequest("s", full_region(()), s), ReadRequest("s", Box((), ()), s_box),
                 ReadRequest("s", FlatRange(0, 1), s64), ReadRequest("e", full_region((0, 3)), e),
                 ReadRequest("z", Box((1, 0), (2, 0)), z), ReadRequest("w", FlatRange(3, 3), torch.empty(0))])
    assert s.item() == 2.5 and s_box.item() == 2.5 and s64.item() == 2.5


def _hf_directory(root, tensors: dict[str, torch.Tensor], files: int = 3) -> dict[str, str]:
    """A Hugging Face sharded directory: ``files`` safetensors files and a hand-written index."""
    names = list(tensors)
    weight_map = {}
    for k in range(files):
        part = {n: tensors[n] for n in names[k::files]}
        fname = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        safetensors.torch.save_file(part, str(root / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return weight_map


def _model() -> dict[str, torch.Tensor]:
    return {"embed.weight": _random(torch.bfloat16, (16, 8), 1),
            "layers.0.attn.q.weight": _random(torch.float32, (8, 8), 2),
            "layers.0.attn.q.bias": _random(torch.float32, (8,), 3),
            "layers.0.mlp.weight": _random(torch.float16, (12, 8), 4),
            "layers.1.norm.weight": torch.ones(8), "lm_head.weight": _random(torch.bfloat16, (16, 8), 5),
            "step": torch.tensor(7)}


def _check_model(reader, model):
    assert {n: (i.dtype, i.shape) for n, i in reader.tensors().items()} == \
        {n: (t.dtype, tuple(t.shape)) for n, t in model.items()}
    requests, wants = [], []
    for name, t in model.items():
        requests.append(ReadRequest(name, full_region(t.shape), torch.empty(t.shape, dtype=t.dtype)))
        wants.append(t)
        if t.dim() == 2:
            requests.append(ReadRequest(name, Box((2, 1), (3, 5)), torch.empty(15, dtype=t.dtype)))
            wants.append(t[2:5, 1:6])
            requests.append(ReadRequest(name, FlatRange(5, 21), torch.empty(16, dtype=torch.float64)))
            wants.append(t.reshape(-1)[5:21].double())
    reader.read(requests)  # one call across all the files
    for r, want in zip(requests, wants):
        assert torch.equal(_bytes(r.dest), _bytes(want)), r.tensor


def test_hugging_face_sharded_directory(tmp_path):
    model = _model()
    weight_map = _hf_directory(tmp_path, model)
    reader = open_safetensors(tmp_path)
    assert len(set(weight_map.values())) == 3
    _check_model(reader, model)
    tree = reader.tree()
    assert tree[METADATA_KEY] == {"format": "pt"} and tree["step"] == TensorRef("step")
    assert reader.index_metadata["total_size"] > 0 and set(reader.metadata) == set(weight_map.values())


def test_an_exports_id_is_not_presented_as_a_value(tmp_path):
    """``export_id`` ties an export's files to its index (a commit token, random for a source without identity):
    the reader keeps it per file but presents only the user's metadata, so two exports of one source hold the
    same values."""
    weight_map = _hf_directory(tmp_path, _model())
    for file in set(weight_map.values()):
        safetensors.torch.save_file(safetensors.torch.load_file(str(tmp_path / file)), str(tmp_path / file),
                                    metadata={"format": "pt", "export_id": "0123456789abcdef"})
    reader = open_safetensors(tmp_path)
    assert reader.tree()[METADATA_KEY] == {"format": "pt"}
    assert all(m["export_id"] == "0123456789abcdef" for m in reader.metadata.values())


def test_directory_with_one_file_and_no_index(tmp_path):
    model = _model()
    safetensors.torch.save_file(model, str(tmp_path / "weights.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    _check_model(open_safetensors(tmp_path), model)


def test_directory_with_several_files_and_no_index_is_refused(tmp_path):
    safetensors.torch.save_file({"a": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    safetensors.torch.save_file({"b": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointNotFoundError, match="exactly one"):
        open_safetensors(tmp_path)


def test_a_shard_without_its_index_is_refused_by_name(tmp_path):
    """Shard i of N > 1 alone is part of a checkpoint: what an export killed before its index leaves. Refused by
    name as a directory and as the file itself, unless the index beside it names it (issue 34, item 1)."""
    weight_map = _hf_directory(tmp_path, _model())
    first = tmp_path / "model-00001-of-00003.safetensors"
    held = {n for n, f in weight_map.items() if f == first.name}
    assert sorted(open_safetensors(first).tensors()) == sorted(held)  # the index names it: one shard, as asked
    (tmp_path / INDEX_NAME).unlink()
    for name in ("model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"):
        (tmp_path / name).unlink()
    for path in (tmp_path, first):
        with pytest.raises(CorruptCheckpointError, match=r"model-00001-of-00003.safetensors: shard 1 of 3 .*"
                                                         r"index model.safetensors.index.json is missing.*incomplete"):
            open_safetensors(path)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "model-00002-of-00003.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="shard 1 of 3 .* does not name: left from another export"):
        open_safetensors(first)
    (tmp_path / INDEX_NAME).unlink()
    first.rename(tmp_path / "model-00001-of-00001.safetensors")  # one of one: a whole checkpoint
    assert sorted(open_safetensors(tmp_path).tensors()) == sorted(held)
    first = tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors"  # another prefix, its own index name
    (tmp_path / "model-00001-of-00001.safetensors").rename(first)
    with pytest.raises(CorruptCheckpointError, match="its index diffusion_pytorch_model.safetensors.index.json"):
        open_safetensors(first)


def test_a_directory_of_shards_without_their_index_says_so(tmp_path):
    _hf_directory(tmp_path, _model())
    (tmp_path / INDEX_NAME).unlink()
    with pytest.raises(CorruptCheckpointError, match="shard 1 of 3 .*index .* is missing"):
        open_safetensors(tmp_path)


@pytest.fixture()
def memory_root():
    root = f"memory://shardckpt-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_the_storage_path_memory_filesystem(tmp_path, memory_root):
    model = _model()
    _hf_directory(tmp_path, model)
    fs = fsspec.filesystem("memory")
    for f in tmp_path.iterdir():
        fs.pipe_file(f"{memory_root}/hf/{f.name}", f.read_bytes())
    reader = open_safetensors(f"{memory_root}/hf")
    assert isinstance(reader.storage, FsspecStorage)
    _check_model(reader, model)
    single = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    fs.pipe_file(f"{memory_root}/one/m.safetensors", safetensors.torch.save({"x": single}))
    for path in (f"{memory_root}/one/m.safetensors", f"{memory_root}/one"):
        reader = open_safetensors(path)
        dest = torch.empty(8)
        reader.read([ReadRequest("x", Box((1, 1), (2, 4)), dest)])
        assert torch.equal(dest, single[1:3, 1:5].reshape(-1))


class _Counter:
    def __init__(self, read_into):
        self.read_into, self.calls = read_into, []

    def __call__(self, *args):  # (path, offset, out), after the storage where read_into is the class's
        path, offset, out = args[-3:]
        self.calls.append((path, offset, out.nbytes))
        return self.read_into(*args)

    @property
    def total(self) -> int:
        return sum(n for _, _, n in self.calls)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_only_the_requested_bytes_are_read(tmp_path, memory_root, monkeypatch, where):
    big = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))
    small = torch.arange(10, dtype=torch.int16)
    data = safetensors.torch.save({"big": big, "small": small})
    if where == "local":
        (tmp_path / "m.safetensors").write_bytes(data)
        path, cls = tmp_path / "m.safetensors", LocalStorage
    else:
        fsspec.filesystem("memory").pipe_file(f"{memory_root}/m.safetensors", data)
        path, cls = f"{memory_root}/m.safetensors", FsspecStorage
    opening = _Counter(cls.read_into)
    monkeypatch.setattr(cls, "read_into", lambda self, *a: opening(self, *a))
    monkeypatch.setattr(cls, "read_bytes", lambda self, p: pytest.fail("whole-file read"))
    reader = open_safetensors(path)
    n = struct.unpack("<Q", data[:8])[0]
    assert opening.total == 8 + n and len(opening.calls) == 2  # the header length, then the header: nothing else
    monkeypatch.undo()
    counter = _Counter(reader.storage.read_into)
    monkeypatch.setattr(reader.storage, "read_into", counter)

    row = torch.empty(1024)
    reader.read([ReadRequest("big", Box((100, 0), (1, 1024)), row)])
    assert torch.equal(row, big[100]) and counter.total == 4096 and len(counter.calls) == 1
    assert counter.calls[0][1] == 8 + n + 100 * 4096  # the row's own bytes, where the header says they are

    counter.calls.clear()
    column = torch.empty(256, dtype=torch.float64)  # cast: through a buffer, still only those bytes
    reader.read([ReadRequest("big", Box((0, 5), (256, 1)), column)])
    assert torch.equal(column, big[:, 5].double()) and counter.total == 256 * 4 and len(counter.calls) == 256

    counter.calls.clear()
    mid = torch.empty(1500)
    reader.read([ReadRequest("big", FlatRange(1000, 2500), mid), ReadRequest("small", FlatRange(3, 4),
                                                                            torch.empty(1, dtype=torch.int16))])
    assert torch.equal(mid, big.reshape(-1)[1000:2500]) and counter.total == 1500 * 4 + 2


def test_long_runs_are_split_into_pieces_and_read_on_threads(tmp_path, monkeypatch):
    import shardckpt.formats.safetensors as st_module
    monkeypatch.setattr(st_module, "READ_PIECE", 1000)
    big = torch.randn(64, 33, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    safetensors.torch.save_file({"big": big}, str(tmp_path / "m.safetensors"))
    reader = open_safetensors(tmp_path / "m.safetensors", io_threads=4)
    counter = _Counter(reader.storage.read_into)
    monkeypatch.setattr(reader.storage, "read_into", counter)
    dest = torch.empty(64 * 33 - 10, dtype=torch.float64)
    reader.read([ReadRequest("big", FlatRange(3, 64 * 33 - 7), dest)])
    assert torch.equal(dest, big.reshape(-1)[3:-7])
    assert counter.total == dest.numel() * 8 and max(n for _, _, n in counter.calls) <= 1000


def test_bad_requests_are_refused_before_anything_is_read(tmp_path, monkeypatch):
    w = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    safetensors.torch.save_file({"w": w}, str(tmp_path / "m.safetensors"))
    reader = open_safetensors(tmp_path / "m.safetensors")
    counter = _Counter(reader.storage.read_into)
    monkeypatch.setattr(reader.storage, "read_into", counter)
    good = torch.full((3,), -1.0)
    for bad, error, message in [
        (ReadRequest("nope", FlatRange(0, 1), torch.empty(1)), IncompatibleCheckpointError, "no tensor 'nope'"),
        (ReadRequest("w", FlatRange(50, 61), torch.empty(11)), IncompatibleCheckpointError, "'w'"),
        (ReadRequest("w", Box((0, 0), (7, 1)), torch.empty(7)), IncompatibleCheckpointError, "'w'"),
        (ReadRequest("w", Box((0,), (1,)), torch.empty(1)), IncompatibleCheckpointError, "rank"),
        (ReadRequest("w", FlatRange(0, 4), torch.empty(5)), ValueError, "4 elements"),
        (ReadRequest("w", FlatRange(0, 4), torch.empty(4, 2)[:, 0]), ValueError, "contiguous"),
    ]:
        with pytest.raises(error, match=message):
            reader.read([ReadRequest("w", FlatRange(0, 3), good), bad])
    assert torch.equal(good, torch.full((3,), -1.0)) and counter.calls == []


def test_a_bool_byte_other_than_0_or_1_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(_file({"b": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]}}, data=b"\x00\x01\x02\x01"))
    reader = open_safetensors(path)
    ok = torch.empty(2, dtype=torch.bool)
    reader.read([ReadRequest("b", FlatRange(0, 2), ok)])
    assert ok.tolist() == [False, True]
    for dest in (torch.empty(4, dtype=torch.bool), torch.empty(4)):
        with pytest.raises(CorruptCheckpointError, match=rf"{path}.*'b'.*bool byte"):
            reader.read([ReadRequest("b", full_region((4,)), dest)])


def _t(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


D16 = bytes(range(16))
HOSTILE = [
    ("file shorter than 8 bytes", b"\x01\x02\x03", "too few", False),
    ("header length past the end", _file({}, header=b"{}", length=1000), "runs past the end", False),
    ("absurd header length", _file({}, header=b"{}", length=2 ** 63), f"{MAX_HEADER_SIZE}-byte limit", False),
    ("header length just over the cap", _file({}, header=b"{}", length=MAX_HEADER_SIZE + 1), "limit", False),
    ("not JSON", _file({}, header=b"{not json", data=D16), "not valid JSON", False),
    ("not UTF-8", _file({}, header=b'{"\xff\xfe": 1}'), "not UTF-8", False),
    ("not a JSON object", _file({}, header=b"[1, 2]"), "not a JSON object", False),
    ("empty header", _file({}, header=b""), "not valid JSON", False),
    ("duplicate keys", _file({}, header=b'{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}, '
                             b'"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}', data=D16),
     "key 'w' twice", False),
    ("duplicate keys inside an entry", _file({}, header=b'{"w": {"dtype": "F32", "dtype": "F32", "shape": [2, 2], '
                                             b'"data_offsets": [0, 16]}}', data=D16), "twice", False),
    ("NaN in the header", _file({}, header=b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 16]}}',
                                data=D16), "not valid JSON", False),
    ("nesting deeper than the stack", _file({}, header=b'{"w": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
     "not valid JSON", False),
    ("unknown dtype", _file({"w": _t(dtype="F31")}, data=D16), "unknown dtype 'F31'", True),
    ("dtype not a string", _file({"w": _t(dtype=4)}, data=D16), "unknown dtype", True),
    ("negative dim", _file({"w": _t(shape=(-2, -2))}, data=D16), "non-negative", True),
    ("float dim", _file({"w": _t(shape=(2.0, 2))}, data=D16), "non-negative integers", True),
    ("bool dim", _file({"w": _t(shape=(True, 4))}, data=D16), "non-negative integers", True),
    ("shape not a list", _file({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}, data=D16),
     "non-negative integers", True),
    ("entry not an object", _file({"w": 3}, data=D16), "not a JSON object", True),
    ("missing data_offsets", _file({"w": {"dtype": "F32", "shape": [4]}}, data=D16), "data_offsets", True),
    ("three offsets", _file({"w": _t(offsets=(0, 8, 16))}, data=D16), "data_offsets", True),
    ("begin after end", _file({"w": _t(offsets=(16, 0))}, data=D16), "begin <= end", True),
    ("negative offset", _file({"w": _t(offsets=(-16, 0))}, data=D16), "begin <= end", True),
    ("byte size differs from the shape", _file({"w": _t(shape=(2, 3))}, data=D16), "need 24", True),
    ("huge dims", _file({"w": _t(shape=(2 ** 62, 2 ** 62))}, data=D16), "up to", True),
    ("huge dims beside a zero", _file({"w": _t(shape=(0, 2 ** 40, 2 ** 40), offsets=(0, 0))}, data=D16),
     "absurdly large", True),
    ("offsets past the file", _file({"w": _t(shape=(2, 4), offsets=(0, 32))}, data=D16), "past the end", True),
    ("overlapping tensors", _file({"w": _t(), "v": _t(offsets=(8, 24))}, data=bytes(24)), "overlaps", True),
    ("the same bytes twice", _file({"w": _t(), "v": _t()}, data=D16), "overlaps", True),
    ("a hole between tensors", _file({"w": _t(shape=(2,), offsets=(0, 8)), "v": _t(shape=(2,), offsets=(16, 24))},
                                     data=bytes(24)), "no tensor", True),
    ("trailing bytes", _file({"w": _t()}, data=D16 + b"evil"), "belong to no tensor", False),
    ("metadata not strings", _file({"w": _t()}, metadata={"a": 1}, data=D16), "__metadata__", False),
    ("metadata not an object", _file({"w": _t()}, metadata=["a"], data=D16), "__metadata__", False),
]


@pytest.mark.parametrize("data, message, names_tensor", [pytest.param(d, m, t, id=i) for i, d, m, t in HOSTILE])
def test_hostile_headers_are_refused_naming_the_file(tmp_path, data, message, names_tensor):
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpointError) as info:
        open_safetensors(path)
    text = str(info.value)
    assert str(path) in text and message in text, text
    if names_tensor:
        assert "tensor 'w'" in text or "tensor 'v'" in text, text


def test_a_dtype_torch_cannot_hold_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(_file({"w": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, data=bytes(3)))
    with pytest.raises(IncompatibleCheckpointError, match=rf"{path}.*tensor 'w'.*F6_E2M3"):
        open_safetensors(path)


def _index(root, weight_map, **extra) -> None:
    (root / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map, **extra}))


def _two_files(root) -> None:
    safetensors.torch.save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(root / "one.safetensors"))
    safetensors.torch.save_file({"c": torch.ones(4)}, str(root / "two.safetensors"))


@pytest.mark.parametrize("weight_map, names", [
    pytest.param({"a": "one.safetensors", "c": "gone.safetensors"}, ["gone.safetensors", "'c'"], id="missing-file"),
    pytest.param({"a": "one.safetensors", "c": "one.safetensors"}, ["one.safetensors", "'c'", "not in it"],
                 id="tensor-not-in-its-file"),
    pytest.param({"a": "../one.safetensors"}, [INDEX_NAME, "'a'", "relative path"], id="parent-dir"),
    pytest.param({"a": "/etc/passwd"}, [INDEX_NAME, "'a'", "relative path"], id="absolute"),
    pytest.param({"a": "./one.safetensors"}, [INDEX_NAME, "'a'"], id="dot"),
    pytest.param({"a": 3}, [INDEX_NAME, "'a'"], id="not-a-string"),
    pytest.param({"a": "one.safetensors", "c": "bad.safetensors"}, ["bad.safetensors", "'c'", "too few"],
                 id="file-with-a-bad-header"),
])
def test_a_hostile_index_is_refused_naming_the_file_and_tensor(tmp_path, weight_map, names):
    _two_files(tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00")
    _index(tmp_path, weight_map)
    with pytest.raises(CorruptCheckpointError) as info:
        open_safetensors(tmp_path)
    for name in names:
        assert name in str(info.value), str(info.value)


@pytest.mark.parametrize("text, message", [
    ("not json", "not valid JSON"),
    ('{"metadata": {}}', "weight_map"),
    ('{"weight_map": ["a"]}', "weight_map"),
    ('{"weight_map": {"a": "one.safetensors", "a": "two.safetensors"}}', "twice"),
])
def test_an_index_that_is_not_one_is_refused(tmp_path, text, message):
    _two_files(tmp_path)
    (tmp_path / INDEX_NAME).write_text(text)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        open_safetensors(tmp_path)
    assert str(tmp_path / INDEX_NAME) in str(info.value)


def test_the_index_decides_which_tensors_there_are(tmp_path):
    _two_files(tmp_path)
    _index(tmp_path, {"a": "one.safetensors", "c": "two.safetensors"})
    reader = open_safetensors(tmp_path)
    assert set(reader.tensors()) == {"a", "c"}  # "b" is in one.safetensors, but the index does not name it
    dest = torch.empty(4)
    reader.read([ReadRequest("c", full_region((4,)), dest)])
    assert torch.equal(dest, torch.ones(4))


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path):
    safetensors.torch.save_file({"a": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    safetensors.torch.save_file({"a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    storage = LocalStorage(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="'a' is also in"):
        SafetensorsReader(storage, ["x.safetensors", "y.safetensors"])


def test_a_file_truncated_after_opening_names_the_file_and_tensor(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"w": torch.arange(100.0)}, str(path))
    reader = open_safetensors(path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CorruptCheckpointError, match=rf"{path}.*truncated.*'w'"):
        reader.read([ReadRequest("w", full_region((100,)), torch.empty(100))])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_reads_into_a_gpu_buffer(tmp_path):
    w = _random(torch.bfloat16, (6, 10))
    safetensors.torch.save_file({"w": w}, str(tmp_path / "m.safetensors"))
    reader = open_safetensors(tmp_path / "m.safetensors")
    same, cast = torch.empty(12, dtype=torch.bfloat16, device="cuda"), torch.empty(12, device="cuda")
    reader.read([ReadRequest("w", Box((1, 2), (3, 4)), same), ReadRequest("w", Box((1, 2), (3, 4)), cast)])
    assert torch.equal(_bytes(same.cpu()), _bytes(w[1:4, 2:6]))
    assert torch.equal(cast.cpu(), w[1:4, 2:6].float().reshape(-1))
