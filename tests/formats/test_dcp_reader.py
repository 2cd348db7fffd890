"""torch DCP directories behind the one read interface (``formats.dcp.DcpReader``), checked against torch's own
``dcp_to_torch_save`` of checkpoints that torch's own FSDP2 and FSDP1 code wrote on 2 gloo ranks."""
from __future__ import annotations

import builtins
import importlib.util
import os
import pickle
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardckpt
from shardckpt.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import CheckpointReader, ReadRequest
from shardckpt.formats.dcp import ADMITTED_GLOBALS, DcpReader, is_dcp_dir
from shardckpt.io import open_storage
from shardckpt.regions import Box, FlatRange, full_region
from tests._dist import run_ranks
from tests.formats._caps import address_space_cap

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                      "make_dcp_fixtures.py")


def _script():
    spec = importlib.util.spec_from_file_location("make_dcp_fixtures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_fixtures(out_dir: str) -> None:
    """On each of 2 pool ranks: the fixture script's FSDP2 and FSDP1 checkpoints (the RNG state is restored)."""
    rng = torch.random.get_rng_state()
    try:
        _script().write_on_rank(out_dir)
    finally:
        torch.random.set_rng_state(rng)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``{kind: (dcp_dir, reference)}``: the reference is ``dcp_to_torch_save``'s file, loaded (nested)."""
    root = tmp_path_factory.mktemp("dcp")
    run_ranks(2, _write_fixtures, str(root), timeout=300)
    out = {}
    for kind in ("fsdp2", "fsdp1"):
        path = str(root / kind)
        dcp_to_torch_save(path, str(root / f"{kind}.pt"))
        out[kind] = (path, torch.load(root / f"{kind}.pt", weights_only=True))
    return out


def _flat(reference: dict) -> dict:
    return flatten_state_dict(reference)[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t.to(torch.uint8)


def _read(reader, name: str, region, dtype=None) -> torch.Tensor:
    info = reader.tensors()[name]
    dest = torch.empty(region.numel, dtype=dtype or info.dtype)
    reader.read([ReadRequest(name, region, dest)])
    return dest


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_every_tensor_equals_dcp_to_torch_save_bit_for_bit(written, kind, verify):
    path, reference = written[kind]
    reader = DcpReader(open_storage(path), verify=verify)
    assert isinstance(reader, CheckpointReader)
    want = {k: v for k, v in _flat(reference).items() if isinstance(v, torch.Tensor)}
    info = reader.tensors()
    assert set(info) == set(want)
    dests = {name: torch.empty(i.shape, dtype=i.dtype) for name, i in info.items()}
    reader.read([ReadRequest(name, full_region(i.shape), dests[name]) for name, i in info.items()])
    for name, t in want.items():
        assert (info[name].dtype, info[name].shape, info[name].crc32c) == (t.dtype, tuple(t.shape), None), name
        assert torch.equal(_bits(dests[name]), _bits(t)), name
    if kind == "fsdp2":  # the awkward cases are there: uneven shards with an empty one, 0-d steps, replicated buffers
        assert {"model.head.weight", "optim.state.head.weight.step", "model.scale", "model.counts"} <= set(info)
        assert info["model.scale"].dtype == torch.bfloat16 and info["optim.state.embed.weight.step"].shape == ()


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_partial_regions_equal_slices_of_the_full_tensor(written, kind, verify):
    path, reference = written[kind]
    reader = DcpReader(open_storage(path), verify=verify, io_threads=3)
    full = _flat(reference)["model.embed.weight"]  # 5 x 6, stored as rows [0, 3) and [3, 5)
    cases = [
        (Box((2, 0), (2, 6)), full[2:4]),  # whole rows across the chunk boundary
        (Box((1, 2), (3, 3)), full[1:4, 2:5]),  # a block across it
        (FlatRange(13, 25), full.reshape(-1)[13:25]),  # mid-row to mid-row across it (row 3 starts at 18)
        (FlatRange(19, 20), full.reshape(-1)[19:20]),  # one element of the second chunk
        (Box((4, 5), (1, 1)), full[4:5, 5:6]),
    ]
    dests = [torch.full((region.numel,), float("nan")) for region, _ in cases]
    reader.read([ReadRequest("model.embed.weight", region, d) for (region, _), d in zip(cases, dests)])
    for (region, want), got in zip(cases, dests):
        assert torch.equal(got, want.reshape(-1)), region


def test_a_dest_of_another_dtype_is_cast(written):
    path, reference = written["fsdp2"]
    reader = DcpReader(open_storage(path))
    flat = _flat(reference)
    w, scale = flat["model.layers.1.weight"], flat["model.scale"]
    assert torch.equal(_read(reader, "model.layers.1.weight", full_region(w.shape), torch.float64),
                       w.double().reshape(-1))
    assert torch.equal(_read(reader, "model.layers.1.weight", Box((2, 1), (3, 2)), torch.bfloat16),
                       w[2:5, 1:3].bfloat16().reshape(-1))
    assert torch.equal(_read(reader, "model.scale", FlatRange(1, 4), torch.float32), scale[1:4].float())


def _with_refs(obj, path=()):
    if isinstance(obj, torch.Tensor):
        return TensorRef(".".join(map(str, path)))
    if isinstance(obj, dict):
        return {k: _with_refs(v, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_with_refs(v, path + (i,)) for i, v in enumerate(obj)]
    return obj


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_the_tree_is_the_saved_nesting_with_its_plain_values(written, kind):
    path, reference = written[kind]
    tree = DcpReader(open_storage(path)).tree()
    assert tree == _with_refs(reference)
    if kind == "fsdp2":
        assert tree["train_state"] == {"step": 1, "tokens_seen": 8, "note": "torchtitan-like", "losses": [0.5, 0.25]}
        group = tree["optim"]["param_groups"][0]
        assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-2, (0.8, 0.95), 0.01)
        assert tree["optim"]["state"]["embed.weight"]["step"] == TensorRef("optim.state.embed.weight.step")


def test_reads_are_ranged_without_verify(written, tmp_path):
    """With ``verify=False`` a partial read fetches the archive's small headers once, then only its own bytes."""
    path, reference = written["fsdp2"]
    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def read_into(self, p, offset, out):
            calls.append(len(out))
            return self.inner.read_into(p, offset, out)

    reader = DcpReader(Counting(open_storage(path)), verify=False)
    want = _flat(reference)["optim.state.layers.1.weight.exp_avg"].reshape(-1)  # 6 x 3 = 2 chunks of 9 floats
    assert torch.equal(_read(reader, "optim.state.layers.1.weight.exp_avg", FlatRange(10, 12)), want[10:12])
    calls.clear()
    assert torch.equal(_read(reader, "optim.state.layers.1.weight.exp_avg", FlatRange(11, 13)), want[11:13])
    assert calls == [8]  # two float32s, nothing else
    calls.clear()
    verified = DcpReader(Counting(open_storage(path)))
    _read(verified, "optim.state.layers.1.weight.exp_avg", FlatRange(11, 13))
    assert 36 in calls  # verifying reads the chunk's whole storage record (9 floats) to check its CRC-32


class _Payload:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("payload", ["system", "eval", "open"])
def test_a_metadata_that_would_run_code_is_refused(written, tmp_path, payload, nested):
    path, _ = written["fsdp1"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    marker = tmp_path / "pwned"
    evil = {"system": _Payload(os.system, f"touch {marker}"),
            "eval": _Payload(builtins.eval, f"open({str(marker)!r}, 'w')"),
            "open": _Payload(builtins.open, str(marker), "w")}[payload]
    if nested:  # inside a genuine Metadata, where the planner's data goes
        with open(os.path.join(path, ".metadata"), "rb") as f:
            md = pickle.load(f)  # trusted: torch wrote it in this test
        md.planner_data = {"model.scale": evil}
        evil = md
    (bad / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata: refused to unpickle the global") as e:
        DcpReader(open_storage(str(bad)))
    assert payload in str(e.value)
    assert not marker.exists()


def test_the_allow_list_is_exactly_dcp_metadata_and_torch_types():
    modules = {m for m, _ in ADMITTED_GLOBALS}
    assert modules == {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem", "torch",
                       "torch.serialization", "pathlib"}
    assert ("builtins", "getattr") not in ADMITTED_GLOBALS and ("torch", "load") not in ADMITTED_GLOBALS


def test_a_truncated_distcp_file_is_named(written, tmp_path):
    path, _ = written["fsdp2"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = bad / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp.*truncated"):
        DcpReader(open_storage(str(bad)))


def test_a_flipped_byte_fails_the_archive_crc(written, tmp_path):
    path, reference = written["fsdp1"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    rows = _flat(reference)["model.embed.weight"][:3].contiguous()  # rank 0's chunk
    data = (bad / "__0_0.distcp").read_bytes()
    at = data.index(_bits(rows).numpy().tobytes()) + 5
    (bad / "__0_0.distcp").write_bytes(data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:])
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp: tensor 'model.embed.weight'.*CRC-32"):
        _read(DcpReader(open_storage(str(bad))), "model.embed.weight", FlatRange(0, 2))
    unchecked = _read(DcpReader(open_storage(str(bad)), verify=False), "model.embed.weight", FlatRange(0, 2))
    assert not torch.equal(unchecked, rows.reshape(-1)[:2])


def _rewrite(path, tmp_path, change) -> str:
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    with open(os.path.join(bad, ".metadata"), "rb") as f:
        md = pickle.load(f)  # trusted: torch wrote it in this test
    change(md)
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return bad


def _storage_info(md, fqn, offsets):
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn and tuple(k.offset or ()) == offsets)


def _chunks(md, fqn):
    return md.state_dict_metadata[fqn].chunks


@pytest.mark.parametrize("change, error, match", [
    (lambda md: setattr(_chunks(md, "model.embed.weight")[0], "sizes", torch.Size([4, 6])), CorruptCheckpointError,
     r"'model.embed.weight': the chunks do not tile"),
    (lambda md: setattr(_chunks(md, "model.embed.weight")[1], "sizes", torch.Size([3, 6])), CorruptCheckpointError,
     r"'model.embed.weight': .*exceeds shape"),
    (lambda md: setattr(md.state_dict_metadata["model.counts"], "size", torch.Size([-3])), CorruptCheckpointError,
     r"'model.counts': size .* not a sequence of non-negative ints"),
    (lambda md: setattr(md.state_dict_metadata["model.counts"], "size", torch.Size([0, 2 ** 40, 2 ** 40])),
     CorruptCheckpointError, r"'model.counts': size .* is absurdly large"),
    (lambda md: setattr(_storage_info(md, "model.counts", (0,)), "length", 10**9), CorruptCheckpointError,
     r"distcp: data file has \d+ bytes, the metadata places 'model.counts'"),
    (lambda md: setattr(_storage_info(md, "model.counts", (0,)), "relative_path", "../elsewhere.distcp"),
     CorruptCheckpointError, r"not a plain relative path"),
    (lambda md: setattr(md.state_dict_metadata["model.counts"].properties, "dtype", torch.qint8),
     IncompatibleCheckpointError, r"'model.counts' has dtype torch.qint8"),
    (lambda md: md.storage_data.pop(next(k for k in md.storage_data if k.fqn == "model.scale")),
     CorruptCheckpointError, r"'model.scale': the chunk at offsets \(0,\) has no storage entry"),
])
def test_inconsistent_metadata_is_refused_at_open(written, tmp_path, change, error, match):
    bad = _rewrite(written["fsdp1"][0], tmp_path, change)
    with pytest.raises(error, match=match):
        DcpReader(open_storage(bad))


def test_stream_transforms_are_refused_when_read(written, tmp_path):
    bad = _rewrite(written["fsdp1"][0], tmp_path, lambda md: setattr(
        _storage_info(md, "model.embed.weight", (3, 0)), "transform_descriptors", ["stream.zstd"]))
    reader = DcpReader(open_storage(bad))
    assert reader.tensors()["model.embed.weight"].shape == (5, 6)  # listing still works
    _read(reader, "model.embed.weight", Box((0, 0), (3, 6)))  # the untransformed chunk too
    with pytest.raises(IncompatibleCheckpointError, match=r"__1_0\.distcp: tensor 'model.embed.weight'.*stream.zstd"):
        _read(reader, "model.embed.weight", Box((0, 0), (4, 6)))


@pytest.mark.parametrize("request_, error, message", [
    (ReadRequest("nope", FlatRange(0, 1), torch.empty(1)), IncompatibleCheckpointError, "no tensor 'nope'"),
    (ReadRequest("model.embed.weight", FlatRange(25, 31), torch.empty(6)), IncompatibleCheckpointError, "embed"),
    (ReadRequest("model.embed.weight", Box((0, 0), (6, 1)), torch.empty(6)), IncompatibleCheckpointError, "embed"),
    (ReadRequest("model.embed.weight", FlatRange(0, 4), torch.empty(5)), ValueError, "4 elements"),
    (ReadRequest("model.embed.weight", FlatRange(0, 4), torch.empty(4, 2)[:, 0]), ValueError, "contiguous"),
])
def test_bad_requests_are_refused_before_anything_is_read(written, request_, error, message):
    reader = DcpReader(open_storage(written["fsdp1"][0]))
    good = torch.full((3,), -1.0)
    with pytest.raises(error, match=message):
        reader.read([ReadRequest("model.embed.weight", FlatRange(0, 3), good), request_])
    assert torch.equal(good, torch.full((3,), -1.0))


def test_strided_new_dtype_and_conjugated_chunks(tmp_path):
    """Single-process dcp.save of what the FSDP fixtures lack: a transposed tensor (saved with its strides),
    dtypes torch.save pickles with ``_rebuild_tensor_v3``, bool, a lazily conjugated view (loaded whole)."""
    state = {"t": torch.arange(12.0).reshape(3, 4).t(),
             "f8": (torch.arange(6.0) / 4).to(torch.float8_e4m3fn).reshape(2, 3),
             "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
             "mask": torch.arange(5) % 2 == 0,
             "cj": torch.complex(torch.arange(3.0), torch.ones(3)).conj(),
             "extra": {"a": [1, {"b": None}]}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    for verify in (True, False):
        reader = DcpReader(open_storage(str(tmp_path / "ck")), verify=verify)
        for name, t in state.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(_bits(_read(reader, name, full_region(t.shape))), _bits(t.resolve_conj())), name
        assert torch.equal(_read(reader, "t", Box((1, 1), (2, 2))), state["t"][1:3, 1:3].reshape(-1))
        assert reader.tree()["extra"] == {"a": [1, {"b": None}]}


def test_is_dcp_dir(written, tmp_path):
    assert is_dcp_dir(open_storage(written["fsdp2"][0]))
    assert not is_dcp_dir(open_storage(str(tmp_path)))
    with pytest.raises(CheckpointError, match="no torch DCP checkpoint"):
        DcpReader(open_storage(str(tmp_path)))


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_open_reader_detects_it(written, kind):
    from shardckpt.formats.detect import open_reader

    path, reference = written[kind]
    reader = open_reader(path)
    assert isinstance(reader, DcpReader)
    assert set(reader.tensors()) == {k for k, v in _flat(reference).items() if torch.is_tensor(v)}


# --- list indices in planner_data: bounded by the bytes that name them (issue 34) ---------------------------

def _one_listed_tensor(tmp_path, index) -> str:
    """A DCP checkpoint of ``{"x": [tensor]}`` whose key and path name list index ``index`` instead of 0."""
    path = str(tmp_path / f"listed{index}")
    dcp.save({"x": [torch.arange(4.0)]}, checkpoint_id=path, no_dist=True)
    key = f"x.{index}"

    def rename(md):
        md.state_dict_metadata = {key: md.state_dict_metadata["x.0"]}
        md.storage_data = {type(i)(key, i.offset, i.index): v for i, v in md.storage_data.items()}
        md.planner_data = {key: ("x", index)}
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # trusted: torch wrote it in this test
    rename(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return path


@pytest.mark.parametrize("index", [10**8, 10**10])
def test_a_list_index_beyond_what_the_metadata_can_hold_is_refused_in_bounded_memory(tmp_path, index):
    path = _one_listed_tensor(tmp_path, index)
    with address_space_cap(512 << 20), pytest.raises(CorruptCheckpointError, match=rf"'x.{index}' at list index"):
        DcpReader(open_storage(path)).tree()


def test_list_holes_nest_as_dcp_fills_them_and_a_negative_index_is_flat(tmp_path):
    tree = DcpReader(open_storage(_one_listed_tensor(tmp_path, 5))).tree()
    assert tree == {"x": [None] * 5 + [TensorRef("x.5")]}  # as DCP's set_element pads a list
    assert DcpReader(open_storage(_one_listed_tensor(tmp_path, -1))).tree() == {"x.-1": TensorRef("x.-1")}


# --- values that are small as bytes and huge as trees (found by tests/formats/test_reader_fuzz.py) ---------------

def _small(tmp_path) -> str:
    path = str(tmp_path / "small")
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, checkpoint_id=path, no_dist=True)
    return path


def _bomb(levels: int) -> list:
    node: list = [0, 0]
    for _ in range(levels):
        node = [node, node]
    return node


def _deep(depth: int) -> list:
    root = node = []
    for _ in range(depth):
        node.append([])
        node = node[0]
    return root


def _deeply(fn):
    """``fn()`` with room on Python's stack to pickle a deep value."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        return fn()
    finally:
        sys.setrecursionlimit(old)


@pytest.mark.parametrize("value", [_deep(5_000), ["s" * (64 << 10)] * 20_000], ids=["deep", "shared-string"])
def test_a_hostile_metadata_field_is_named_without_showing_it_whole(tmp_path, value):
    """The error named the field by ``str(value)``: a RecursionError for a deep value, 1.3 GB for a string a small
    pickle refers to 20,000 times."""
    def change(md):
        next(iter(md.state_dict_metadata["w"].chunks)).offsets = value
    bad = _deeply(lambda: _rewrite(_small(tmp_path), tmp_path, change))
    with address_space_cap(512 << 20), pytest.raises(CorruptCheckpointError, match=r"'w': chunk offsets \["):
        DcpReader(open_storage(bad))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [_bomb(64), _deep(5_000)], ids=["shared", "deep"])
def test_a_value_that_expands_past_its_bytes_or_nests_too_deep_is_refused(tmp_path, value):
    """The value ``step`` stored as a ``torch.save`` of 2**65 values in a few hundred bytes (load_full walked it
    forever), or nested 5,000 deep (a RecursionError)."""
    archive = tmp_path / "archive"
    _deeply(lambda: torch.save(value, archive))

    def change(md):
        info = next(v for k, v in md.storage_data.items() if k.fqn == "step")
        info.relative_path, info.offset, info.length = "value.distcp", 0, archive.stat().st_size
    bad = _rewrite(_small(tmp_path), tmp_path, change)
    shutil.copy(archive, os.path.join(bad, "value.distcp"))
    with pytest.raises(CorruptCheckpointError, match="value 'step'"):
        shardckpt.load_full(bad)
