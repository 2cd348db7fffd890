"""Golden checkpoints of every released format version stay loadable, bit for bit."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt.checkpoint.describe import describe
from shardckpt.checkpoint.verify import verify
from shardckpt.format.checksum import crc32c
from shardckpt.format.manifest import FORMAT_VERSION
from shardckpt.format.tree import PerRankValues
from shardckpt.tensor_views import as_bytes
from tests._dist import run_ranks
from tests.storage._util import zeros_like_tree

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
VERSIONS = list(range(1, FORMAT_VERSION + 1))


def _fixture(version: int) -> str:
    """The checkpoint of version ``version``: for v5 the second step of a run directory of pooled saves."""
    return os.path.join(ROOT, f"v{version}", "step-2") if version == 5 else os.path.join(ROOT, f"v{version}")


def _make_fixture():
    spec = importlib.util.spec_from_file_location("make_fixture", os.path.join(ROOT, "make_fixture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected(version: int) -> dict:
    return _make_fixture().expected(version)


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, (dict, list)):  # lists: the per-rank values of v4
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


def _assert_bit_equal(got: dict, want: dict) -> None:
    got_t, want_t = dict(_tensors(got)), dict(_tensors(want))
    assert got_t.keys() == want_t.keys()
    for name, w in want_t.items():
        g = got_t[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(as_bytes(g.contiguous()), as_bytes(w.contiguous())), name


def test_every_format_version_has_a_fixture():
    assert all(os.path.exists(os.path.join(_fixture(v), "manifest.json")) for v in VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
def test_fixture_loads_bit_exact_and_verifies(version):
    want = _expected(version)
    got = shardckpt.load_full(_fixture(version))
    _assert_bit_equal(got, want)
    assert got["step"] == 42 and got["note"] == f"golden v{version}"
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    if version >= 4:
        assert isinstance(got["loader"], PerRankValues) and got["loader"] == want["loader"]
        assert [v["pos"] for v in got["mixed"]] == [0, 1, 2]
    report = verify(_fixture(version))
    assert report.ok and report.version == version and report.manifest_checksum == (version >= 2)


def test_v5_fixture_references_its_parent_and_both_steps_load():
    from shardckpt.format.manifest import parse_manifest

    parent, step = (os.path.join(ROOT, "v5", s) for s in ("step-1", "step-2"))
    m1, m2 = (parse_manifest(open(os.path.join(p, "manifest.json"), "rb").read(), p) for p in (parent, step))
    assert m1.pool == m2.pool and m2.pool["path"] == "../shardckpt-pool"
    assert any(f.path.startswith(f"data-{m1.generation}/") for f in m2.files)  # step 2 references step 1's data
    assert any(f.path.startswith(f"data-{m2.generation}/") for f in m2.files)  # and wrote model.cols
    want = _expected(5)
    want["model"]["cols"] = want["model"]["cols"] + 100
    got = shardckpt.load_full(parent)
    _assert_bit_equal(got["model"], want["model"])
    assert verify(parent).ok and verify(step).ok


@pytest.mark.parametrize("version", VERSIONS)
def test_fixture_tensor_checksums_are_crc32c_of_the_whole_tensor(version):
    info = {t["name"]: t["crc32c"] for t in describe(_fixture(version))["tensors"]}
    for name, tensor in _tensors(_expected(version)):
        assert info[name] == f"{crc32c(as_bytes(tensor.contiguous()).numpy()):08x}", name


def test_tensor_checksums_do_not_depend_on_sharding(tmp_path):
    shardckpt.save(_expected(1), str(tmp_path / "ws1"))
    a = {t["name"]: t["crc32c"] for t in describe(_fixture(1))["tensors"]}
    b = {t["name"]: t["crc32c"] for t in describe(str(tmp_path / "ws1"))["tensors"]}
    assert a == b


def _load_sharded(version: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    want = _expected(version)
    target = {"model": {k: shardckpt.ShardedTensor.from_full(torch.zeros_like(v), rank, world)
                        for k, v in want["model"].items()}}
    shardckpt.load(target, _fixture(version), strict=False)
    for k, v in want["model"].items():
        mine = shardckpt.ShardedTensor.from_full(v, rank, world).local
        assert torch.equal(as_bytes(target["model"][k].local.contiguous()), as_bytes(mine.contiguous())), k


@pytest.mark.parametrize("version", VERSIONS)
def test_fixture_reshards_on_load(version):
    # At ws 2 most reads are partial: v1 checks whole chunks, v2 its 16-byte blocks.
    run_ranks(2, _load_sharded, version)


def _per_rank_target(version: int) -> dict:
    """The whole v4 fixture as a target: zeros, and ``PerRank``s for its per-rank values."""
    target = zeros_like_tree(_expected(version))
    target.update(rng=shardckpt.PerRank(torch.zeros(5, dtype=torch.int64)), loader=shardckpt.PerRank(None),
                  mixed=shardckpt.PerRank({"pos": -1, "buf": torch.zeros(2, 3)}), step=0)
    return target


def _load_per_rank(version: int) -> str:
    """The v4 fixture's per-rank values (saved by 3 ranks) loaded into ``PerRank``s: rank r < 3 gets rank r's,
    bit for bit; at ws 4, rank 3 is refused (on every rank) with strict, and keeps its values without."""
    rank, strict = dist.get_rank(), dist.get_world_size() <= 3
    target = _per_rank_target(version)
    shardckpt.load(target, _fixture(version), strict=strict)
    got = {k: target[k].value for k in ("rng", "loader", "mixed")}
    if rank >= 3:
        assert got["loader"] is None and got["mixed"]["pos"] == -1
        assert not got["rng"].any() and not got["mixed"]["buf"].any()
    else:
        mine = _make_fixture().per_rank(rank)
        _assert_bit_equal(got, mine)
        assert got["loader"] == mine["loader"] and got["mixed"]["pos"] == rank
    assert target["step"] == 42
    if not strict:
        with pytest.raises(shardckpt.IncompatibleCheckpointError, match="'rng'.*saved by 3 ranks, so rank 3"):
            shardckpt.load(_per_rank_target(version), _fixture(version))
    return "ok"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_v4_per_rank_values_load_by_rank(world):
    assert run_ranks(world, _load_per_rank, 4) == ["ok"] * world
