"""The one load lane (``checkpoint.lane``): ``open_checkpoint`` pins one committed generation for every rank, and
its reader's ``run`` starts over on the generation a concurrent overwrite committed, raises what any rank raised
on every rank, and never runs more than ``ATTEMPTS`` times; ``load``'s plan reads through the view it is given."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardckpt
from shardckpt.checkpoint.lane import ATTEMPTS, open_checkpoint, read_planned
from shardckpt.checkpoint.load import matched
from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.local_view import by_parameter_unless_local
from shardckpt.io import open_storage
from shardckpt.regions import FlatRange
from tests._dist import run_ranks

LOCAL_FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "fixtures", "local")


def _read_w(reader) -> torch.Tensor:
    out = torch.empty(4)
    reader.read([ReadRequest("w", FlatRange(0, 4), out)])
    return out


def test_a_pinned_reader_starts_over_on_the_generation_an_overwrite_committed(tmp_path):
    path = tmp_path / "ck"
    shardckpt.save({"w": torch.zeros(4)}, path)
    pinned = open_checkpoint(path)
    pinned_first = pinned.facts().identity
    shardckpt.save({"w": torch.ones(4)}, path, overwrite=True)  # removes the data files of the generation pinned
    seen = []

    def work(reader):
        seen.append(reader.facts().identity)
        return _read_w(reader)

    assert torch.equal(pinned.run(work), torch.ones(4))
    assert seen == [pinned_first, pinned.facts().identity] and seen[0] != seen[1]


def test_a_failure_without_a_new_generation_is_raised_after_one_run(tmp_path):
    shardckpt.save({"w": torch.zeros(4)}, tmp_path / "ck")
    pinned, runs = open_checkpoint(tmp_path / "ck"), []

    def work(reader):
        runs.append(reader)
        raise IncompatibleCheckpointError("refused here")

    with pytest.raises(IncompatibleCheckpointError, match="refused here"):
        pinned.run(work)
    assert len(runs) == 1


def test_overwrites_that_never_stop_end_after_so_many_runs(tmp_path):
    path = tmp_path / "ck"
    shardckpt.save({"w": torch.zeros(4)}, path)
    pinned, runs = open_checkpoint(path), []

    def work(reader):
        runs.append(reader.facts().identity)
        shardckpt.save({"w": torch.full((4,), float(len(runs)))}, path, overwrite=True)
        return _read_w(reader)

    with pytest.raises(CorruptCheckpointError):
        pinned.run(work)
    assert len(runs) == ATTEMPTS == len(set(runs))


def test_other_formats_and_storages_open_the_same_way(tmp_path):
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    shardckpt.save({"w": torch.arange(4.0)}, tmp_path / "ck")
    for where in (tmp_path / "dcp", open_storage(str(tmp_path / "dcp")), open_storage(str(tmp_path / "ck"))):
        pinned = open_checkpoint(where)
        assert torch.equal(pinned.run(_read_w), torch.arange(4.0))
    runs = []

    def fails(reader):
        runs.append(reader)
        raise CorruptCheckpointError("once")

    with pytest.raises(CorruptCheckpointError, match="once"):  # no generations: no second run
        open_checkpoint(tmp_path / "dcp").run(fails)
    assert len(runs) == 1
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(open_storage(str(tmp_path / "nothing")))


def test_load_reads_a_local_checkpoint_by_parameter_through_the_view_it_is_given():
    target = {"model": {"emb.weight": torch.zeros(7, 3), "blocks.0.fc.bias": torch.zeros(3)}}
    pinned = open_checkpoint(LOCAL_FIXTURE)
    read_planned(pinned, lambda reader: matched(reader, target, False, 0, view=None))
    assert not any(t.any() for t in target["model"].values())  # as stored: flat tensors only, nothing matches
    read_planned(pinned, lambda reader: matched(reader, target, False, 0, view=by_parameter_unless_local))
    want = shardckpt.load_full(LOCAL_FIXTURE, ["model._flat_param"])["model"]["_flat_param"]
    assert torch.equal(target["model"]["emb.weight"].reshape(-1), want[:21])  # the root group's first member


def _one_rank_refuses(path: str) -> tuple[str, str, list[str]]:
    pinned = open_checkpoint(path)

    def work(reader):
        if dist.get_rank() == 1:
            raise IncompatibleCheckpointError("rank 1 refuses")
        return _read_w(reader)

    try:
        pinned.run(work)
    except IncompatibleCheckpointError as e:
        return pinned.facts().identity, str(e), list(getattr(e, "__notes__", []))
    return pinned.facts().identity, "no error", []


def test_every_rank_reads_one_generation_and_raises_what_one_rank_raised(tmp_path):
    shardckpt.save({"w": torch.zeros(4)}, tmp_path / "ck")
    (gen0, err0, notes0), (gen1, err1, notes1) = run_ranks(2, _one_rank_refuses, str(tmp_path / "ck"), timeout=120)
    assert gen0 == gen1 and err0 == err1 == "rank 1 refuses"
    assert any("rank 1" in n for n in notes0) and any("rank 1" in n for n in notes1)
