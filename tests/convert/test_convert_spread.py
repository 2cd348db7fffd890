"""``convert`` spread over the ranks of a process group (what ``torchrun ... convert`` does): each worker writes
its share of the output ranks, worker 0 commits; the result is the one-process result, and a worker's failure
fails every worker and leaves nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import shardckpt
from shardckpt.checkpoint.verify import verify
from shardckpt.offline import chunk_output
from shardckpt.offline.convert import convert
from shardckpt.offline.spec import ConvertSpec
from shardckpt.offline.workers import convert_in_workers
from shardckpt.offline.diff import diff
from shardckpt.formats.native import read_manifest
from shardckpt.io import open_storage
from tests._dist import run_ranks
from tests.convert.test_convert import _state


def _spread(src: str, dst: str, world_size: int, fail_on: int | None = None) -> list[int]:
    """Convert on every rank of the pool; returns the output ranks this worker wrote."""
    wrote = []
    real = chunk_output.write_file

    def recording(files, slot, data_path, *args, **kwargs):
        rank = int(data_path.rsplit("rank-", 1)[1].split("-")[0])
        if dist.get_rank() == fail_on:
            raise OSError(28, "No space left on device (injected)", data_path)
        wrote.extend([rank] if rank not in wrote else [])
        return real(files, slot, data_path, *args, **kwargs)

    chunk_output.write_file = recording
    try:
        convert(src, dst, world_size=world_size, spread_over=dist.group.WORLD)
    finally:
        chunk_output.write_file = real
    return wrote


@pytest.mark.parametrize("workers, world", [(2, 3), (3, 2), (2, 1)])
def test_workers_share_the_output_ranks_and_the_result_is_the_one_process_result(tmp_path, workers, world):
    src, dst, alone = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "alone")
    shardckpt.save(_state(), src)
    wrote = run_ranks(workers, _spread, src, dst, world)
    assert sorted(r for share in wrote for r in share) == list(range(world))
    assert all(all(r % workers == i for r in share) for i, share in enumerate(wrote)), wrote
    convert(src, alone, world_size=world)
    a, b = read_manifest(open_storage(dst)), read_manifest(open_storage(alone))
    assert a.world_size == world and a.tensors.keys() == b.tensors.keys()
    assert all(a.tensors[n].crc32c == b.tensors[n].crc32c for n in a.tensors)
    assert diff(src, dst).equal and verify(dst).ok


def test_a_failing_worker_fails_every_worker_and_commits_nothing(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shardckpt.save(_state(), src)
    with pytest.raises(Exception, match=r"(?s)rank 1.*No space left on device \(injected\).*rank 0.*No space left"):
        run_ranks(2, _spread, src, dst, 4, 1)
    assert not os.path.exists(os.path.join(dst, "manifest.json"))
    assert [d for d in os.listdir(dst) if d.startswith("data-")]  # what was written stays, for the rerun
    convert(src, dst, world_size=4)
    assert verify(dst).ok and diff(src, dst).equal
    committed = f"data-{read_manifest(open_storage(dst)).generation}"
    assert [d for d in os.listdir(dst) if d.startswith("data-")] == [committed]


def test_the_multinode_example_spreads_the_command_over_torchrun_workers(tmp_path):
    """examples/convert_multinode.sh as one node of 2 workers on 127.0.0.1 (the form every node runs)."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shardckpt.save(_state(), src)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], SRC=src, DST=dst,
               NNODES="1", NODE_RANK="0", NPROC="2", MASTER="127.0.0.1", WORLD_SIZE_OUT="3")
    done = subprocess.run(["bash", os.path.join(root, "examples", "convert_multinode.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_manifest(open_storage(dst)).world_size == 3 and diff(src, dst).equal


def test_worker_0_alone_reports(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    shardckpt.save(_state(), src)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "shardckpt.cli.main", "convert", src, dst, "--world-size", "3"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("written by 2 workers") == 1, done.stdout


def test_local_workers_give_the_one_process_result_and_sum_their_progress(tmp_path):
    src, dst, alone = str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "alone")
    shardckpt.save(_state(), src)
    seen: list[tuple[int, int]] = []
    report = convert_in_workers(ConvertSpec(src, dst, world_size=3, workers=2, optim_key="id"),
                                lambda d, t: seen.append((d, t)))
    assert report.world_size == 3 and report.type == "sharded" and report.kept_ranks == ()
    convert(src, alone, world_size=3, optim_key="id")
    a, b = read_manifest(open_storage(dst)), read_manifest(open_storage(alone))
    assert a.tree == b.tree
    assert {n: t.crc32c for n, t in a.tensors.items()} == {n: t.crc32c for n, t in b.tensors.items()}
    assert verify(dst).ok
    assert seen and seen[-1][0] == seen[-1][1] == report.bytes_written  # both workers' shares, summed


def test_local_workers_raise_the_failure_itself(tmp_path, capsys):
    from shardckpt.cli.main import main

    src = str(tmp_path / "src")
    shardckpt.save(_state(), src)
    with pytest.raises(shardckpt.CheckpointExistsError, match="overwrite"):
        convert_in_workers(ConvertSpec(src, src, workers=2))
    assert main(["convert", src, src, "--workers", "2", "--quiet"]) == 2
    assert "a checkpoint already exists" in capsys.readouterr().err
    with pytest.raises(ValueError, match="workers"):
        convert(src, str(tmp_path / "x"), workers=0)
