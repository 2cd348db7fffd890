"""torch.save files behind the one read interface (formats/torch_save.py): safe, memory-mapped loads."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from shardckpt.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, ReadRequest
from shardckpt.formats.detect import open_reader
from shardckpt.formats.torch_save import TorchSaveReader, _boxes
from shardckpt.regions import Box, FlatRange, full_region


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _state():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=g)
    return {
        "model": {"w": w, "b": torch.randn(10, generator=g).to(torch.bfloat16), "wt": w.t()},  # wt: a strided view
        "optim": {"state": {0: {"exp_avg": torch.randn(6, 10, generator=g), "step": 5}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "list": [torch.arange(12, dtype=torch.int64).reshape(3, 4), 3, "s", (torch.tensor(True), 2.5, None)],
        "cube": torch.randn(5, 8, 3, generator=g),
        "name": "run-1",
    }


@pytest.fixture()
def saved(tmp_path):
    state = _state()
    path = tmp_path / "ck.pt"
    torch.save(state, path)
    return state, TorchSaveReader(path)


def test_the_nesting_with_tensors_as_references(saved):
    state, reader = saved
    assert isinstance(reader, CheckpointReader)
    assert reader.tree() == {
        "model": {"w": TensorRef("model.w"), "b": TensorRef("model.b"), "wt": TensorRef("model.wt")},
        "optim": {"state": {0: {"exp_avg": TensorRef("optim.state.0.exp_avg"), "step": 5}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
        "list": [TensorRef("list.0"), 3, "s", (TensorRef("list.3.0"), 2.5, None)],
        "cube": TensorRef("cube"),
        "name": "run-1",
    }
    infos = reader.tensors()
    assert {n: (i.dtype, i.shape, i.crc32c) for n, i in infos.items()} == {
        "model.w": (torch.float32, (6, 10), None), "model.b": (torch.bfloat16, (10,), None),
        "model.wt": (torch.float32, (10, 6), None), "optim.state.0.exp_avg": (torch.float32, (6, 10), None),
        "list.0": (torch.int64, (3, 4), None), "list.3.0": (torch.bool, (), None),
        "cube": (torch.float32, (5, 8, 3), None),
    }


def _tensor(state, name):
    node = state
    for key in name.split("."):
        node = node[int(key)] if isinstance(node, (list, tuple)) or (isinstance(node, dict) and key.isdigit()
                                                                     and int(key) in node) else node[key]
    return node


@pytest.mark.parametrize("name", ["model.w", "model.wt", "optim.state.0.exp_avg", "cube"])
@pytest.mark.parametrize("region, want", [
    pytest.param(lambda s: Box((1, 2) + (0,) * (len(s) - 2), (3, 4) + tuple(s[2:])),
                 lambda t: t[1:4, 2:6], id="box"),
    pytest.param(lambda s: FlatRange(7, 43), lambda t: t.reshape(-1)[7:43], id="flat-mid-row"),
    pytest.param(lambda s: full_region(s), lambda t: t, id="full"),
])
def test_reads_any_region_bit_exact_and_cast(saved, name, region, want):
    state, reader = saved
    src = _tensor(state, name)
    r = region(tuple(src.shape))
    exact, cast = torch.empty(r.numel, dtype=src.dtype), torch.empty(r.numel, dtype=torch.float64)
    reader.read([ReadRequest(name, r, exact), ReadRequest(name, r, cast)])
    assert torch.equal(_bytes(exact), _bytes(want(src)))
    assert torch.equal(cast, want(src).reshape(-1).double())


def test_flat_ranges_as_boxes_cover_exactly_the_range():
    shape = (3, 4, 5)
    for lo in range(0, 61, 7):
        for hi in range(lo, 61, 5):
            seen = []
            for offsets, sizes in _boxes(lo, hi, shape):
                idx = torch.arange(60).reshape(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                seen.extend(idx.reshape(-1).tolist())
            assert seen == list(range(lo, hi)), (lo, hi)


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64] + \
    [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 2, (5, 7), generator=g).bool() if dtype == torch.bool else \
        torch.randint(0, 256, (5 * 7 * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype).reshape(5, 7)
    torch.save({"x": src}, tmp_path / "ck.pt")
    reader = TorchSaveReader(tmp_path / "ck.pt")
    for region, want in [(Box((1, 2), (3, 4)), src[1:4, 2:6]), (FlatRange(9, 26), src.reshape(-1)[9:26]),
                         (full_region((5, 7)), src)]:
        dest = torch.empty(region.numel, dtype=dtype)
        reader.read([ReadRequest("x", region, dest)])
        assert torch.equal(_bytes(dest), _bytes(want))


def test_0d_empty_and_a_lone_tensor(tmp_path):
    torch.save({"s": torch.tensor(2.5, dtype=torch.bfloat16), "e": torch.empty(0, 3)}, tmp_path / "a.pt")
    reader = TorchSaveReader(tmp_path / "a.pt")
    s, s_box, e = torch.empty((), dtype=torch.bfloat16), torch.empty(1), torch.empty(0, 3)
    reader.read([ReadRequest("s", full_region(()), s), ReadRequest("s", Box((), ()), s_box),
                 ReadRequest("e", full_region((0, 3)), e), ReadRequest("e", Box((0, 1), (0, 2)), torch.empty(0))])
    assert s.item() == 2.5 and s_box.item() == 2.5
    torch.save(torch.arange(4.0), tmp_path / "lone.pt")
    lone = TorchSaveReader(tmp_path / "lone.pt")
    assert lone.tree() == TensorRef("") and lone.tensors()[""].shape == (4,)
    dest = torch.empty(2)
    lone.read([ReadRequest("", FlatRange(1, 3), dest)])
    assert dest.tolist() == [1.0, 2.0]


def test_the_legacy_format_loads_without_mmap(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": 1}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert (tmp_path / "old.pt").read_bytes()[:2] == b"\x80\x02"
    reader = TorchSaveReader(tmp_path / "old.pt")
    dest = torch.empty(3)
    reader.read([ReadRequest("w", Box((1, 0), (1, 3)), dest)])
    assert dest.tolist() == [3.0, 4.0, 5.0] and reader.tree()["n"] == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_tensors_stay_memory_mapped(saved):
    _, reader = saved
    ptr = reader._tensors["model.w"].data_ptr()  # the bytes live in a mapping of the file, not in a copy
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and os.path.exists(parts[5]) and os.path.samefile(parts[5], reader.path):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
    assert any(lo <= ptr < hi for lo, hi in spans), spans


class _Payload:
    """Unpickling this runs ``eval``, which creates the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').close()",)


def test_a_pickle_that_would_run_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    # The payload is live: a plain unpickling runs it (here, with a marker of its own).
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(str(proof))))
    assert proof.exists()

    zipped, raw = tmp_path / "evil.pt", tmp_path / "evil.pkl"
    torch.save({"w": torch.ones(2), "x": _Payload(str(marker))}, zipped)
    raw.write_bytes(pickle.dumps({"x": _Payload(str(marker))}, protocol=2))
    for path in (zipped, raw):
        for opener in (TorchSaveReader, open_reader):
            with pytest.raises(CorruptCheckpointError) as info:
                opener(path)
            assert str(path) in str(info.value) and "refused" in str(info.value)
            assert not marker.exists()
    assert not marker.exists()


def test_a_damaged_file_is_refused_naming_it(tmp_path):
    torch.save({"w": torch.ones(100)}, tmp_path / "ck.pt")
    data = (tmp_path / "ck.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=str(tmp_path / "cut.pt")):
        TorchSaveReader(tmp_path / "cut.pt")
    with pytest.raises(CorruptCheckpointError, match="no such file"):
        TorchSaveReader(tmp_path / "missing.pt")


def test_a_url_is_refused_with_advice(tmp_path):
    with pytest.raises(CheckpointError, match="copy it to a local file"):
        TorchSaveReader("s3://bucket/ck.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "ck.pt")
    assert set(TorchSaveReader(f"file://{tmp_path / 'ck.pt'}").tensors()) == {"w"}


def test_names_that_collide_and_sparse_tensors_are_refused(tmp_path):
    torch.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path / "clash.pt")
    with pytest.raises(IncompatibleCheckpointError, match="'a.b'"):
        TorchSaveReader(tmp_path / "clash.pt")
    torch.save({"s": torch.eye(3).to_sparse()}, tmp_path / "sparse.pt")
    with pytest.raises(IncompatibleCheckpointError, match="'s'.*sparse"):
        TorchSaveReader(tmp_path / "sparse.pt")


def test_bad_requests_are_refused_before_anything_is_read(saved):
    _, reader = saved
    good = torch.full((3,), -1.0)
    for bad, error, message in [
        (ReadRequest("nope", FlatRange(0, 1), torch.empty(1)), IncompatibleCheckpointError, "no tensor 'nope'"),
        (ReadRequest("model.w", FlatRange(50, 61), torch.empty(11)), IncompatibleCheckpointError, "'model.w'"),
        (ReadRequest("model.w", FlatRange(0, 4), torch.empty(5)), ValueError, "4 elements"),
        (ReadRequest("model.w", FlatRange(0, 4), torch.empty(4, 2)[:, 0]), ValueError, "contiguous"),
    ]:
        with pytest.raises(error, match=message):
            reader.read([ReadRequest("model.w", FlatRange(0, 3), good), bad])
    assert torch.equal(good, torch.full((3,), -1.0))


def test_a_flipped_data_byte_is_caught_by_the_archive_crc(tmp_path):
    # Regression (found by tests/storage/test_fuzz.py): torch.load does not check the zip CRCs, so a flipped
    # byte in a tensor's data loaded wrong values without an error. The first read checks every member.
    import shardckpt

    path = tmp_path / "m.pt"
    w = torch.arange(4096, dtype=torch.float32)
    torch.save({"w": w}, path)
    raw = bytearray(path.read_bytes())
    at = raw.find(w[1000:1004].numpy().tobytes())
    assert at > 0
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    reader = TorchSaveReader(path)
    assert reader.tensors()["w"].shape == (4096,)  # describing it reads nothing
    dest = torch.empty(4096)
    with pytest.raises(CorruptCheckpointError, match="m.pt: the archive is damaged"):
        reader.read([ReadRequest("w", full_region((4096,)), dest)])
    with pytest.raises(CorruptCheckpointError):
        shardckpt.load_full(path)


def test_a_read_checks_the_records_it_reads_and_only_those(tmp_path):
    """Each tensor's storage record is checked when a read first touches it: a flipped byte in one tensor does
    not stop reads of the others, and is caught on the read of its own, wherever in the record it is."""
    path = tmp_path / "m.pt"
    state = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.arange(4096, dtype=torch.float32) + 0.5,
             "c": torch.ones(3, dtype=torch.int64)}
    torch.save(state, path)
    raw = bytearray(path.read_bytes())
    at = raw.find(state["b"][4000:4004].numpy().tobytes())
    raw[at + 1] ^= 0x01
    path.write_bytes(bytes(raw))
    reader = TorchSaveReader(path)
    for name in ("a", "c"):
        dest = torch.empty_like(state[name])
        reader.read([ReadRequest(name, full_region(dest.shape), dest)])
        assert torch.equal(dest, state[name])
    dest = torch.empty(2)
    with pytest.raises(CorruptCheckpointError, match="m.pt: the archive is damaged"):
        reader.read([ReadRequest("b", FlatRange(0, 2), dest)])  # far from the flipped byte: the record fails


def test_reading_a_big_file_in_slices_keeps_only_the_slice_resident(tmp_path):
    """The mapped pages a read touched are given back: reading 96 MiB through one 4 MiB buffer stays near 4 MiB
    (without it, every page read stays in the process's resident set)."""
    from shardckpt.offline.memory import resident_bytes

    big = torch.arange(24 << 20, dtype=torch.int32)  # 96 MiB
    torch.save({"big": big}, tmp_path / "big.pt")
    del big
    reader = TorchSaveReader(tmp_path / "big.pt")
    dest = torch.empty(1 << 20, dtype=torch.int32)
    reader.read([ReadRequest("big", FlatRange(0, 1 << 20), dest)])  # zip CRCs checked, buffers warmed
    before = resident_bytes()
    for start in range(0, 24 << 20, 1 << 20):
        reader.read([ReadRequest("big", FlatRange(start, start + (1 << 20)), dest)])
        assert dest[0].item() == start and dest[-1].item() == start + (1 << 20) - 1
    assert resident_bytes() - before < 24 << 20, (resident_bytes() - before) >> 20


def _bomb(levels: int) -> list:
    node: list = [0, 0]
    for _ in range(levels):
        node = [node, node]  # each level refers to the one below twice: 2**levels leaves as a tree
    return node


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [_bomb(64), ["s" * (64 << 10)] * 1000])
def test_a_pickle_that_expands_far_past_its_bytes_is_refused_at_once(tmp_path, value):
    """A few hundred bytes of pickle describing 2**65 values (every walk of the tree took forever), or one 64 KiB
    string referred to 1000 times (a 64 MiB tree of text from 66 KiB)."""
    torch.save({"w": torch.ones(2), "bomb": value}, tmp_path / "bomb.pt")
    with pytest.raises(CorruptCheckpointError, match="refers to the same objects over and over"):
        TorchSaveReader(tmp_path / "bomb.pt")


def test_values_shared_as_real_state_dicts_share_them_still_load(tmp_path):
    betas = (0.9, 0.99)  # one tuple in every group, as torch's optimizers share their defaults
    state = {"param_groups": [{"lr": 0.1 * i, "betas": betas, "params": [i]} for i in range(2000)],
             "w": torch.ones(3)}
    torch.save(state, tmp_path / "shared.pt")
    assert TorchSaveReader(tmp_path / "shared.pt").tree()["param_groups"][1999]["betas"] == betas


def test_a_name_repeated_a_million_times_still_loads(tmp_path):
    """One string object in many places (``[name] * n``) is two bytes a place in the pickle: it is no bomb."""
    torch.save({"files": ["shard-00001-of-00064.bin"] * 1_000_000, "w": torch.ones(1)}, tmp_path / "names.pt")
    assert len(TorchSaveReader(tmp_path / "names.pt").tree()["files"]) == 1_000_000
