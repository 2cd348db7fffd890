"""The peer server and ``PeerStorage``: ranged reads of a node's tier 0, hostile paths and partial files refused,
a wrong token refused, a peer gone reported as an unusable copy; and tier 0's room on a tmpfs or a disk."""
from __future__ import annotations

import os

import pytest

from shardckpt.errors import CheckpointError, CorruptCheckpointError
from shardckpt.tiers import local
from shardckpt.tiers.peer import PeerServer, PeerStorage, servable


@pytest.fixture()
def served(tmp_path):
    step = tmp_path / "step-000000005" / "data-g"
    step.mkdir(parents=True)
    (step / "rank-00000-0.bin").write_bytes(bytes(range(256)) * 1000)
    (step / "rank-00000-0.bin.part-abc").write_bytes(b"partial")
    (tmp_path / "secret.txt").write_bytes(b"no")
    server = PeerServer(str(tmp_path), "tok")
    yield server
    server.close()


def test_ranged_reads_sizes_and_listings(served):
    peer = PeerStorage(served.address, "tok", "step-000000005")
    try:
        assert peer.file_size("data-g/rank-00000-0.bin") == 256000
        out = bytearray(300)
        peer.read_into("data-g/rank-00000-0.bin", 1000, memoryview(out))
        assert bytes(out) == (bytes(range(256)) * 1000)[1000:1300]
        assert peer.list_dirs() == ["data-g"]
        assert peer.list_files("data-g") == ["rank-00000-0.bin"]  # the .part file is never listed
        assert peer.exists("data-g/rank-00000-0.bin") and not peer.exists("data-g/nope.bin")
        with pytest.raises(CorruptCheckpointError):
            peer.read_into("data-g/rank-00000-0.bin", 255999, memoryview(bytearray(2)))  # past the end
        with pytest.raises(CheckpointError):
            peer.open_writer("x")
    finally:
        peer.close()


@pytest.mark.parametrize("path", ["../secret.txt", "step-000000005/../../secret.txt", "secret.txt",
                                  "step-000000005/data-g/rank-00000-0.bin.part-abc", "/etc/passwd",
                                  "step-000000005/data-g/a b"])
def test_hostile_paths_and_partial_files_are_refused(served, path):
    assert not servable(path)
    peer = PeerStorage(served.address, "tok", "")
    try:
        with pytest.raises(CheckpointError):
            peer.read_bytes(path)
    finally:
        peer.close()


def test_a_wrong_token_is_refused_and_a_gone_peer_is_an_unusable_copy(served):
    wrong = PeerStorage(served.address, "nope", "step-000000005")
    with pytest.raises(CheckpointError, match="refused"):
        wrong.file_size("data-g/rank-00000-0.bin")
    wrong.close()
    address = served.address
    served.close()
    gone = PeerStorage(address, "tok", "step-000000005", timeout_s=2)
    with pytest.raises(CorruptCheckpointError, match="unreachable"):
        gone.file_size("data-g/rank-00000-0.bin")


def test_room_counts_memory_on_a_tmpfs_only(tmp_path):
    disk = local.measure(str(tmp_path))
    assert disk.fs_free > 0
    if os.path.isdir("/dev/shm"):
        shm = local.measure("/dev/shm")
        assert shm.mem_available is not None and shm.mem_available > 0


def test_a_server_closes_promptly(tmp_path):
    # every manager's close stops its node's server: socketserver's default poll held each close up to 0.5 s
    import time

    closes = []
    for _ in range(5):
        server = PeerServer(str(tmp_path), "tok")
        time.sleep(0.05)
        t = time.perf_counter()
        server.close()
        closes.append(time.perf_counter() - t)
    assert sorted(closes)[2] < 0.25, closes
