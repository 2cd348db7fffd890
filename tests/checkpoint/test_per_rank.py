"""Per-rank values (``shardckpt.PerRank``, format v4) in one process, the digests and messages of the ranks'
tree agreement, and the guards that keep a checkpoint no load would read from being committed. The
multi-rank behaviour is in test_tree_agreement.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt import PerRank, ShardedTensor
from shardckpt.checkpoint.agree import digest, fill_per_rank, refuse_difference
from shardckpt.checkpoint.collect import is_tensor_like
from shardckpt.checkpoint.save import commit, persist, plan, stage
from shardckpt.checkpoint.verify import verify
from shardckpt.offline.diff import diff
from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError, UnsupportedValueError
from shardckpt.format.manifest import parse_manifest, seal
from shardckpt.format.tree import PerRankValues, encode
from tests._helpers import manifest_json
from tests.checkpoint.test_tree_agreement import assert_same


def _state() -> dict:
    return {"model": {"w": torch.arange(6.0)}, "step": 3,
            "rng": PerRank(torch.arange(5, dtype=torch.int64)),
            "loader": PerRank({"epoch": 1, "files": ("a", "b"), "buf": torch.ones(2, dtype=torch.bfloat16)}),
            "opt": {"state": {0: {"rng": PerRank(None)}}}}


def test_per_rank_values_round_trip_as_format_v4(tmp_path):
    path = str(tmp_path / "c")
    shardckpt.save(_state(), path)
    doc = manifest_json(path)
    assert doc["version"] == 4
    assert doc["tree"]["rng"] == {"$per_rank": [{"$tensor": "rng.0"}]}
    assert doc["tree"]["loader"]["$per_rank"][0]["buf"] == {"$tensor": "loader.0.buf"}
    target = {"model": {"w": torch.zeros(6)}, "step": 0, "rng": PerRank(torch.zeros(5, dtype=torch.int64)),
              "loader": PerRank({"epoch": 0, "files": None, "buf": torch.zeros(2, dtype=torch.bfloat16)}),
              "opt": {"state": {0: {"rng": PerRank(7)}}}}
    shardckpt.load(target, path)
    assert_same(target, _state())
    assert verify(path).ok and verify(path).version == 4


def test_load_full_gives_every_ranks_values_and_saving_them_again_keeps_them_per_rank(tmp_path):
    shardckpt.save(_state(), str(tmp_path / "a"))
    full = shardckpt.load_full(str(tmp_path / "a"))
    assert isinstance(full["rng"], PerRankValues) and isinstance(full["rng"], list)
    assert torch.equal(full["rng"][0], torch.arange(5)) and full["loader"][0]["files"] == ("a", "b")
    assert full["opt"]["state"][0]["rng"] == [None]
    only = shardckpt.load_full(str(tmp_path / "a"), keys=["loader.0.buf"])
    assert list(only) == ["loader"] and isinstance(only["loader"], PerRankValues)
    shardckpt.save(full, str(tmp_path / "b"))  # e.g. an offline edit: still one value per saving rank
    assert manifest_json(tmp_path / "b")["tree"] == manifest_json(tmp_path / "a")["tree"]
    assert diff(str(tmp_path / "a"), str(tmp_path / "b")).equal


def test_saves_without_per_rank_values_keep_their_older_format_version(tmp_path):
    shardckpt.save({"w": torch.arange(3.0)}, str(tmp_path / "plain"))
    shardckpt.save({"w": torch.arange(3.0)}, str(tmp_path / "zstd"), compress="zstd")
    shardckpt.save({"w": torch.arange(3.0), "r": PerRank(1)}, str(tmp_path / "both"), compress="zstd")
    assert [manifest_json(tmp_path / n)["version"] for n in ("plain", "zstd", "both")] == [2, 3, 4]


@pytest.mark.parametrize("value, what", [
    (PerRank({"t": ShardedTensor.from_full(torch.arange(4.0), 0, 1)}), "not a ShardedTensor"),
    (PerRank([PerRank(1)]), "may not hold per-rank values"),
    (PerRank({"x": PerRankValues([1, 2])}), "may not hold per-rank values"),
    (PerRank(object()), "has type object"),
])
def test_what_a_per_rank_value_may_not_hold_is_refused_by_name(tmp_path, value, what):
    with pytest.raises(UnsupportedValueError, match=what) as info:
        shardckpt.save({"w": torch.ones(2), "rng": value}, str(tmp_path / "c"))
    assert "'rng" in str(info.value)
    assert not os.path.exists(tmp_path / "c" / "manifest.json")


def test_a_per_rank_name_may_not_collide_with_another_entry(tmp_path):
    with pytest.raises(UnsupportedValueError, match="both named 'rng.0'"):
        shardckpt.save({"rng": PerRank(torch.ones(2)), "rng.0": 1}, str(tmp_path / "c"))


def test_load_refuses_a_per_rank_value_into_a_plain_target_and_the_reverse(tmp_path):
    path = str(tmp_path / "c")
    shardckpt.save(_state(), path)
    with pytest.raises(IncompatibleCheckpointError, match="'rng': the checkpoint holds per-rank values .*PerRank"):
        shardckpt.load({"rng": torch.zeros(5, dtype=torch.int64)}, path, strict=False)
    with pytest.raises(IncompatibleCheckpointError, match="'step': the checkpoint holds one value for all ranks"):
        shardckpt.load({"step": PerRank(0)}, path, strict=False)
    target = {"loader": PerRank({"epoch": 0, "buf": torch.zeros(2, dtype=torch.bfloat16)})}
    with pytest.raises(IncompatibleCheckpointError, match=r"unexpected \[.*'loader.0.files'"):
        shardckpt.load(target, path)
    shardckpt.load(target, path, strict=False)
    assert target["loader"].value["epoch"] == 1 and torch.equal(target["loader"].value["buf"], torch.ones(2))


def test_a_per_rank_value_the_save_did_not_have_is_refused_unless_not_strict(tmp_path):
    path = str(tmp_path / "c")
    shardckpt.save({"r": PerRank(5)}, path)  # saved by one rank
    from shardckpt.checkpoint.match import match
    from shardckpt.formats.native import NativeReader, read_manifest
    from shardckpt.io import open_storage

    storage = open_storage(path)
    reader = NativeReader(storage, read_manifest(storage))
    with pytest.raises(IncompatibleCheckpointError, match="'r': its per-rank values were saved by 1 ranks, so rank 1"):
        match(reader.tree(), reader.tensors(), {"r": PerRank(0)}, True, rank=1)
    target = {"r": PerRank(0)}
    matched = match(reader.tree(), reader.tensors(), target, False, rank=1)
    matched.write_back()
    assert target["r"].value == 0  # kept as it was
    matched = match(reader.tree(), reader.tensors(), target, True, rank=0)
    matched.write_back()
    assert target["r"].value == 5


def _tree_of(value) -> dict:
    return json.loads(json.dumps(encode(value, is_tensor_like, per_rank=lambda v, p: {"$per_rank": ".".join(p)})))


def test_the_digest_ignores_dict_order_and_nothing_else():
    a = _tree_of({"x": 1, "y": {0: "a", 1: "b"}, "t": torch.ones(1)})
    b = _tree_of({"t": torch.ones(1), "y": {1: "b", 0: "a"}, "x": 1})
    assert digest(a) == digest(b)
    refuse_difference(a, b, 1)  # no difference to name
    for other in (1.0, True, "1", None, [1], (1,), float("nan")):
        assert digest(_tree_of({"x": other})) != digest(_tree_of({"x": 1})), other
    assert digest(_tree_of({"x": -0.0})) != digest(_tree_of({"x": 0.0}))
    assert digest(_tree_of({"x": float("nan")})) == digest(_tree_of({"x": float("nan")}))


@pytest.mark.parametrize("mine, where, rank0, rank1", [
    ({"x": 1, "extra": torch.ones(1)}, "'extra'", "has no entry", "holds a tensor"),
    ({}, "'x'", "holds 1", "has no entry"),
    ({"x": 1.0}, "'x'", "holds 1", "holds 1.0"),
    ({"x": [1]}, "'x'", "holds 1", "holds a list"),
    ({"x": PerRank(1)}, "'x'", "holds 1", "holds a PerRank value"),
])
def test_the_first_difference_names_the_key_and_both_ranks(mine, where, rank0, rank1):
    with pytest.raises(UnsupportedValueError) as info:
        refuse_difference(_tree_of({"x": 1}), _tree_of(mine), 3)
    assert f"at {where}: rank 0 {rank0}, rank 3 {rank1}" in str(info.value) and "shardckpt.PerRank" in str(info.value)


def test_nested_differences_are_named_by_their_full_key():
    first = _tree_of({"opt": {"state": {0: {"step": 1, "buf": [1, 2]}}}})
    with pytest.raises(UnsupportedValueError, match=r"at 'opt.state.0.buf.2': rank 0 has no entry, rank 2 holds 3"):
        refuse_difference(first, _tree_of({"opt": {"state": {0: {"step": 1, "buf": [1, 2, 3]}}}}), 2)
    with pytest.raises(UnsupportedValueError, match=r"at 'opt.state.0': rank 0 holds a dict, rank 1 has no entry"):
        refuse_difference(first, _tree_of({"opt": {"state": {"0": {"step": 1, "buf": [1, 2]}}}}), 1)


def test_fill_per_rank_puts_every_ranks_part_in_rank_order():
    tree = {"a": {"$per_rank": "a"}, "b": {"$dict": [[1, {"$per_rank": "b.1"}]]}, "c": [1]}
    parts = [{"a": 10, "b.1": {"$tensor": "b.1.0"}}, {"a": 11, "b.1": None}]
    assert fill_per_rank(tree, parts) == {"a": {"$per_rank": [10, 11]},
                                          "b": {"$dict": [[1, {"$per_rank": [{"$tensor": "b.1.0"}, None]}]]},
                                          "c": [1]}


def test_nothing_is_committed_when_the_indexes_were_written_for_an_older_version(tmp_path):
    # A writer not told of per-rank values (convert, until it passes version=) wrote v2 indexes; the v4
    # manifest would make every load refuse them: refused by name, this generation's files removed.
    from shardckpt.checkpoint import save as save_module

    path = str(tmp_path / "c")
    staged = stage({"w": torch.arange(4.0), "rng": PerRank(torch.arange(2))})
    planned = plan(staged, path)
    real = save_module.write_rank_files
    save_module.write_rank_files = lambda *a, **kw: real(*a[:-1], **kw)  # drops version=
    try:
        with pytest.raises(shardckpt.CheckpointError, match=r"per-rank values \('rng'\), which need format v4, "
                                                            r"but the data files' indexes were written as v2"):
            persist(staged, planned)
    finally:
        save_module.write_rank_files = real
    assert os.listdir(path) == []


def test_commit_refuses_a_manifest_that_would_not_load(tmp_path):
    path = str(tmp_path / "c")
    staged = stage({"w": torch.arange(4.0)})
    planned = plan(staged, path)
    from shardckpt.checkpoint.save import _write

    result = _write(planned, staged, [])
    with pytest.raises(shardckpt.CheckpointError, match="would not load.*disagree on \\['x'\\]"):
        commit(planned.storage, planned.save_plan, planned.generation, [result],
               {"w": {"$tensor": "w"}, "x": {"$tensor": "x"}}, None, False)
    assert os.listdir(path) == []


@pytest.mark.parametrize("tree, version, what", [
    ({"r": {"$per_rank": [1]}}, 3, "unknown tag"),
    ({"r": {"$per_rank": [{"$per_rank": [1]}]}}, 4, "unknown tag"),
    ({"r": {"$per_rank": "r"}}, 4, "unknown tag"),
])
def test_readers_reject_per_rank_values_where_the_format_has_none(tree, version, what):
    doc = {"format": "shardckpt", "version": version, "world_size": 1, "generation": "ab", "tree": tree,
           "files": [], "tensors": {}}
    with pytest.raises(CorruptCheckpointError, match=what):
        parse_manifest(seal(json.dumps(doc).encode()), "m")
