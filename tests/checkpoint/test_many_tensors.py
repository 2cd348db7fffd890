"""Many small tensors (issue 38): small chunks read in runs of one file and written through one buffer, every
chunk still checked on its own; the manifest's common entry parsed by a fast path that refuses what the
general one refuses."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import ShardedTensor
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format.manifest import parse_manifest, seal
from shardckpt.formats.detect import open_reader
from shardckpt.formats.native import reader
from tests._dist import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool, torch.complex64)


def many_small(n: int = 600) -> dict:
    """``n`` small tensors of mixed dtypes and shapes (0-d, empty, one element), and one large one among them."""
    g = torch.Generator().manual_seed(38)
    shapes = [(), (0,), (1,), (3, 0), (5, 7), (2, 3, 4), (17,)]
    out = {}
    for i in range(n):
        dtype, shape = DTYPES[i % len(DTYPES)], shapes[i % len(shapes)]
        t = torch.randn(shape, generator=g) * 100
        out[f"layers.{i // 8}.experts.{i % 8}.w"] = t > 0 if dtype == torch.bool else t.to(dtype)
    out["layers.big"] = torch.randn(80_000, generator=g)  # above reader.SMALL_CHUNK: read on its own
    return out


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in b.items():
        assert a[k].dtype == v.dtype and a[k].shape == v.shape and torch.equal(a[k], v), k


@pytest.fixture
def counted_runs(monkeypatch):
    """How many runs of small chunks the reader read, and how many chunks they held."""
    seen = {"runs": 0, "chunks": 0}
    original = reader._read_small

    def counting(storage, manifest, reads, records, span, verify):
        seen["runs"] += 1
        seen["chunks"] += len(span)
        return original(storage, manifest, reads, records, span, verify)

    monkeypatch.setattr(reader, "_read_small", counting)
    return seen


def test_many_small_tensors_of_every_kind_round_trip_read_in_runs(tmp_path, counted_runs):
    sd = many_small()
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    _equal(shardckpt.load_full(path), sd)
    filled = {k: torch.empty_like(v) for k, v in sd.items()}
    shardckpt.load(filled, path)
    _equal(filled, sd)
    stored = sum(1 for v in sd.values() if v.numel())  # chunks; the large one is read apart
    # 2 loads x 2 files, each file's run split at most once by the large chunk's gap; a lone chunk is read apart
    assert counted_runs["chunks"] >= 2 * (stored - 1) - 8 and counted_runs["runs"] <= 2 * 2 * 2
    assert shardckpt.verify(path).ok


def test_a_partial_load_of_small_tensors_reads_only_what_it_needs_from_each_run(tmp_path, counted_runs):
    sd = many_small(64)
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    # Every other tensor, and halves of the 1-D ones: runs with gaps, and chunks read in part.
    wanted = {k: v for i, (k, v) in enumerate(sd.items()) if i % 2 and v.numel()}
    pieces = {k: ShardedTensor.from_full(torch.empty_like(v), 1, 2) if v.dim() == 1 and v.numel() > 1 else
              torch.empty_like(v) for k, v in wanted.items()}
    shardckpt.load(pieces, path, strict=False)
    for k, v in wanted.items():
        got = pieces[k]
        expected = ShardedTensor.from_full(v, 1, 2).local if isinstance(got, ShardedTensor) else v
        assert torch.equal(got.local if isinstance(got, ShardedTensor) else got, expected), k
    assert counted_runs["runs"] >= 1


def _flip_byte_of(path: str, name: str) -> None:
    for index_path in glob.glob(os.path.join(path, "data-*", "*.index.json")):
        with open(index_path) as f:
            rows = json.load(f)["chunks"]
        for row in rows:
            if row[0] == name:
                data_path = index_path.replace(".index.json", ".bin")
                with open(data_path, "r+b") as f:
                    f.seek(row[2] + row[3] // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0x5A]))
                return
    raise AssertionError(f"no chunk of {name}")


def test_a_corrupt_byte_inside_a_run_of_small_chunks_is_refused_naming_the_tensor(tmp_path):
    sd = many_small(200)
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    victim = "layers.12.experts.6.w"  # (5, 7) int64, in the middle of its file
    assert sd[victim].numel() == 35
    _flip_byte_of(path, victim)
    with pytest.raises(CorruptCheckpointError, match=rf"tensor '{victim}' chunk 0 fails its checksum"):
        shardckpt.load_full(path)
    with pytest.raises(CorruptCheckpointError, match=rf"tensor '{victim}'"):
        shardckpt.load({k: torch.empty_like(v) for k, v in sd.items()}, path)
    report = shardckpt.verify(path)
    assert not report.ok and any(victim in str(p) for p in report.problems)
    others = {k: torch.empty_like(v) for k, v in sd.items() if k != victim}
    shardckpt.load(others, path, strict=False)  # the other chunks of the same run are intact
    _equal(others, {k: v for k, v in sd.items() if k != victim})


def _save_many_sharded(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = {k: ShardedTensor.from_full(v, rank, world) if v.dim() and i % 3 else v
          for i, (k, v) in enumerate(many_small(300).items())}
    shardckpt.save(sd, path)


def _load_many_resharded(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = many_small(300)
    sd = {k: ShardedTensor.from_full(torch.empty_like(v), rank, world) if v.dim() and i % 2 else torch.empty_like(v)
          for i, (k, v) in enumerate(full.items())}
    shardckpt.load(sd, path)
    for i, (k, v) in enumerate(full.items()):
        got = sd[k]
        if isinstance(got, ShardedTensor):
            assert torch.equal(got.local, ShardedTensor.from_full(v, rank, world).local), k
        else:
            assert torch.equal(got, v), k


@pytest.mark.parametrize(("save_ws", "load_ws"), [(2, 3), (3, 2), (3, 1)])
def test_many_small_tensors_saved_at_one_world_size_load_resharded_at_another(tmp_path, save_ws, load_ws):
    path = str(tmp_path / "ck")
    run_ranks(save_ws, _save_many_sharded, path)
    run_ranks(load_ws, _load_many_resharded, path)
    _equal(shardckpt.load_full(path), many_small(300))


def _manifest_doc(tmp_path) -> tuple[dict, str]:
    path = str(tmp_path / "ck")
    shardckpt.save({"w": torch.ones(4, 2), "b": torch.zeros(3)}, path)
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        data = f.read()
    return json.loads(b"{" + data[len(b'{"crc32c":"00000000",'):]), path


@pytest.mark.parametrize("change", [
    lambda t: t.update(dtype=["float32"]), lambda t: t.update(dtype="float33"), lambda t: t.update(shape=[4.0, 2]),
    lambda t: t.update(shape=[True, 8]), lambda t: t.update(crc32c=-1), lambda t: t.update(crc32c=1 << 32),
    lambda t: t.update(extra=1), lambda t: t["chunks"].update(count=2), lambda t: t["chunks"].update(size=0),
    lambda t: t["chunks"]["files"].update(first=5), lambda t: t["chunks"]["files"].update(step=9),
    lambda t: t["chunks"]["files"].pop("step"), lambda t: t["chunks"].update(files={"first": 0, "step": 1, "x": 0}),
    lambda t: t.update(shape=[1 << 30, 1 << 30]),
])
def test_the_manifest_fast_path_refuses_what_the_format_refuses(tmp_path, change):
    doc, path = _manifest_doc(tmp_path)
    change(doc["tensors"]["w"])
    data = seal(json.dumps(doc, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'"):
        parse_manifest(data, "m")


def test_the_manifest_fast_path_gives_what_the_general_path_gives(tmp_path, monkeypatch):
    from shardckpt.format import manifest

    doc, _ = _manifest_doc(tmp_path)
    data = seal(json.dumps(doc, separators=(",", ":")).encode())
    fast = parse_manifest(data, "m")
    monkeypatch.setattr(manifest, "_fast_regular", lambda *a: None)
    assert parse_manifest(data, "m").tensors == fast.tensors


def _twins_doc(tmp_path) -> dict:
    """Two entries of one form (dtype, shape, placement), 'v' first: 'w' is checked through 'v''s form."""
    path = str(tmp_path / "twins")
    shardckpt.save({"v": torch.ones(4, 2), "w": torch.zeros(4, 2)}, path, files_per_rank=1)
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        data = f.read()
    doc = json.loads(b"{" + data[len(b'{"crc32c":"00000000",'):])
    v, w = doc["tensors"]["v"], doc["tensors"]["w"]
    assert (v["dtype"], v["shape"], v["chunks"]) == (w["dtype"], w["shape"], w["chunks"]) and v["crc32c"] != w["crc32c"]
    return doc


@pytest.mark.parametrize("change", [
    lambda t: t.update(crc32c=-1), lambda t: t.update(crc32c=1 << 32), lambda t: t.update(crc32c=True),
    lambda t: t.update(crc32c=1.0), lambda t: t.update(crc32c="1"), lambda t: t.update(shape=[4.0, 2]),
    lambda t: t.update(shape=[True, 8]), lambda t: t["chunks"].update(size=8.0),
    lambda t: t["chunks"]["files"].update(step=True), lambda t: t.update(dtype="float33"),
    lambda t: t.update(extra=1), lambda t: t["chunks"].update(extra=1), lambda t: t["chunks"]["files"].update(x=0),
    lambda t: t.update(crc=t.pop("crc32c")), lambda t: t["chunks"].update(sizes=t["chunks"].pop("size")),
    lambda t: t.update(dtype=None),
])
def test_an_entry_of_a_form_already_checked_is_still_refused_when_it_differs(tmp_path, change):
    doc = _twins_doc(tmp_path)
    change(doc["tensors"]["w"])
    with pytest.raises(CorruptCheckpointError, match="tensor 'w'"):
        parse_manifest(seal(json.dumps(doc, separators=(",", ":")).encode()), "m")


def test_entries_checked_once_per_form_are_those_checked_one_by_one(tmp_path, monkeypatch):
    from shardckpt.format import manifest

    data = seal(json.dumps(_twins_doc(tmp_path), separators=(",", ":")).encode())
    shared = parse_manifest(data, "m").tensors
    monkeypatch.setattr(manifest, "_regular_form", lambda obj: None)
    assert parse_manifest(data, "m").tensors == shared and shared["v"].crc32c != shared["w"].crc32c


def _flat_parts(sd: dict, parts: int) -> tuple[list, dict]:
    """Requests for ``parts`` flat runs (uneven, some empty) of every tensor with elements, and their buffers."""
    from shardckpt.formats.api import ReadRequest
    from shardckpt.regions import FlatRange

    requests, got = [], {}
    for k, v in sd.items():
        n = v.numel()
        cuts = [min(n, n * i // parts + i % 2) for i in range(1, parts)]
        bounds = sorted({0, n, *cuts})
        for lo, hi in zip(bounds, bounds[1:]):
            if lo < hi:
                got[k, lo] = torch.empty(hi - lo, dtype=v.dtype)
                requests.append(ReadRequest(k, FlatRange(lo, hi), got[k, lo]))
    return requests, got


def test_flat_runs_of_small_chunks_are_read_from_the_run_bit_for_bit(tmp_path, counted_runs, monkeypatch):
    # convert's reshard reads flat runs of each small source chunk: served from the run's buffer, not chunk by chunk
    sd = many_small(300)
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    general = []
    original = reader.execute_read
    monkeypatch.setattr(reader, "execute_read", lambda *a, **k: (general.append(a[2].entry.name), original(*a, **k)))
    requests, got = _flat_parts(sd, 3)
    open_reader(path).read(requests)
    for (k, lo), t in got.items():
        assert torch.equal(t, sd[k].reshape(-1)[lo:lo + t.numel()]), (k, lo)
    assert counted_runs["chunks"] > 200
    assert set(general) <= {"layers.big"} | {k for k, v in sd.items() if v.dtype == torch.bool}


def test_a_corrupt_byte_anywhere_in_a_small_chunk_fails_a_read_of_any_run_of_it(tmp_path):
    sd = many_small(200)
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    victim = "layers.12.experts.6.w"  # (5, 7) int64; the byte flipped is in its middle, the run read is its start
    _flip_byte_of(path, victim)
    requests, got = _flat_parts({victim: sd[victim], "layers.12.experts.5.w": sd["layers.12.experts.5.w"]}, 3)
    with pytest.raises(CorruptCheckpointError, match=rf"tensor '{victim}' chunk 0 fails its checksum"):
        open_reader(path).read([r for r in requests if r.tensor == victim][:1])
    neighbour = [r for r in requests if r.tensor != victim]
    open_reader(path).read(neighbour)  # the chunk before it in the same run is intact
    for r in neighbour:
        assert torch.equal(r.dest, sd[r.tensor].reshape(-1)[r.region.start:r.region.stop])


@pytest.mark.parametrize("keep", [0, 16])  # storage bytes left: none (data_ptr 0), or fewer than the elements need
@pytest.mark.parametrize("part", [False, True])
def test_a_destination_whose_storage_was_shrunk_is_refused_before_any_read(tmp_path, keep, part):
    # from helper-20: the run's direct copy wrote past such a storage (a crash, or the heap corrupted)
    from shardckpt.formats.api import ReadRequest
    from shardckpt.regions import FlatRange

    sd = {f"t{i}": torch.arange(1000, dtype=torch.float32) + i for i in range(4)}
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    n = 500 if part else 1000
    dest = torch.zeros(n)
    dest.untyped_storage().resize_(keep)
    others = [ReadRequest(k, FlatRange(0, n), torch.empty(n)) for k in ("t0", "t2", "t3")]
    with pytest.raises(ValueError, match=r"destination for 't1': its storage holds"):
        open_reader(path).read(others[:1] + [ReadRequest("t1", FlatRange(0, n), dest)] + others[1:])
    target = {"t1": torch.zeros(1000)}
    target["t1"].untyped_storage().resize_(keep)
    with pytest.raises(ValueError, match=r"'t1': its storage holds"):
        shardckpt.load(target, path, strict=False)


@pytest.mark.parametrize("shape", [(6,), (2, 3)])
def test_a_destination_that_needs_grad_is_filled_in_place_and_keeps_needing_it(tmp_path, shape):
    # a 1-D destination outside autograd is read into as it is; one that needs grad is read through a detached view
    from shardckpt.formats.api import ReadRequest
    from shardckpt.regions import FlatRange

    sd = {"a": torch.arange(6.0), "b": torch.arange(6.0) * 2}
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    a, b = torch.zeros(shape, requires_grad=True), torch.zeros(shape)
    open_reader(path).read([ReadRequest("a", FlatRange(0, 6), a), ReadRequest("b", FlatRange(0, 6), b)])
    assert torch.equal(a.detach().reshape(-1), sd["a"]) and a.requires_grad and a.is_leaf
    assert torch.equal(b.reshape(-1), sd["b"])


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(1, 1).expand(3, 2),  # stride 0: torch says "overlaps"
    lambda: torch.zeros(8).as_strided((3, 2), (1, 2)),  # torch cannot tell (helper-35): offsets counted
    lambda: torch.zeros(10).unfold(0, 2, 1)[:3],
])
def test_a_target_whose_elements_share_memory_is_refused_before_any_read(tmp_path, make):
    # helper-34: an expand()ed target got torch's RuntimeError from the write-back, after every read; helper-35: an
    # overlapping unfold or as_strided, which torch's cheap check cannot judge, loaded with wrong values, silently
    sd = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.ones(3)}
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    target = {"a": make(), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"tensor 'a': .* share memory"):
        shardckpt.load(target, path)
    assert torch.equal(target["b"], torch.zeros(3))  # nothing was read into the others either


@pytest.mark.parametrize("make", [lambda: torch.zeros(2, 3).t(), lambda: torch.zeros(3, 4)[:, ::2],
                                  lambda: torch.zeros(12).as_strided((3, 2), (4, 1)), lambda: torch.zeros(3, 2)[:, :]])
def test_a_strided_target_without_shared_elements_loads_bit_for_bit(tmp_path, make):
    sd = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.ones(3)}
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    target = {"a": make(), "b": torch.zeros(3)}
    shardckpt.load(target, path)
    assert torch.equal(target["a"], sd["a"]) and torch.equal(target["b"], sd["b"])


@pytest.mark.parametrize("shape", [(6,), ()])
def test_a_meta_destination_is_refused_not_left_unfilled(tmp_path, shape):
    # from helper-19: a load into meta targets filled nothing and raised nothing
    sd = {"a": torch.ones(6), "b": torch.full(shape, 2.0)}
    path = str(tmp_path / "ck")
    shardckpt.save(sd, path)
    target = {"a": torch.zeros(6), "b": torch.empty(shape, device="meta")}
    with pytest.raises(ValueError, match=r"'b' is on the meta device"):
        shardckpt.load(target, path)
    assert torch.equal(shardckpt.load_full(path)["b"], sd["b"])  # load_full makes its own tensors

    empty = {"a": torch.zeros(6), "b": torch.empty(0, 4, device="meta")}  # nothing to fill: loads, as before
    shardckpt.save({"a": torch.ones(6), "b": torch.empty(0, 4)}, str(tmp_path / "empty"))
    shardckpt.load(empty, str(tmp_path / "empty"))
    assert torch.equal(empty["a"], torch.ones(6))
