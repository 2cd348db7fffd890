"""S3 under faults (issue 12), through a fault-injecting proxy on 127.0.0.1 in front of the test server:
throttling, 5xx, resets (before, after and in the middle of an answer) are retried and the data is exact;
a commit whose answer was lost still commits once; a server gone mid-save leaves the old checkpoint."""
from __future__ import annotations

import time

import pytest
import torch

import shardckpt
from shardckpt import StorageOptions, StorageTuning
from shardckpt import CheckpointExistsError, StorageError
from shardckpt.checkpoint.verify import verify
from shardckpt.io import open_storage
from tests.storage._util import assert_tree_equal
from tests.storage.faulty_proxy import FAULTS, FaultyProxy

PART = 5 << 20  # S3's smallest part: several parts per file from a modest state


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.randn(1000, generator=g).to(torch.bfloat16),
            "e": torch.empty(0, 3), "step": seed}


@pytest.fixture
def proxied(s3_bucket):
    made = []

    def make(**kw) -> tuple[FaultyProxy, dict]:
        server, _ = s3_bucket
        proxy = FaultyProxy(server.endpoint, **kw)
        made.append(proxy)
        return proxy, server.options(endpoint_url=proxy.endpoint, default_block_size=PART, max_concurrency=4,
                                     skip_instance_cache=True)

    yield s3_bucket, make
    for p in made:
        p.close()


def test_transient_faults_are_retried_and_the_data_is_exact(proxied):
    (server, bucket), make = proxied
    proxy, options = make(rate=0.3, seed=3, script=FAULTS)  # each kind once, then 30 % at random
    url = f"s3://{bucket}/faulty"
    shardckpt.save(_state(1), url, storage_options=options)
    got = shardckpt.load_full(url, storage_options=options)
    assert_tree_equal(got, _state(1))
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in _state(1).items()}
    shardckpt.load(target, url, storage_options=options)
    assert_tree_equal(target, _state(1))
    assert verify(open_storage(url, server.options())).ok  # checked without the proxy, too
    assert set(proxy.injected) == set(FAULTS), proxy.injected  # every kind of fault happened
    assert sum(proxy.injected.values()) >= 10, proxy.injected


def test_an_exclusive_commit_whose_answer_was_lost_commits_once(proxied):
    # The PUT reaches the store, then the connection breaks: the retry finds the object present. It
    # holds our bytes, so the commit stands; a second writer with other bytes still gets "exists".
    (server, bucket), make = proxied
    proxy, options = make(script=("reset-after",))
    storage = open_storage(f"s3://{bucket}/commit", options)
    storage.put_atomic("manifest.json", b"ours", exclusive=True)
    assert proxy.injected["reset-after"] == 1 and proxy.requests >= 2
    assert server.raw_fs.cat_file(f"{bucket}/commit/manifest.json") == b"ours"
    with pytest.raises(FileExistsError):
        storage.put_atomic("manifest.json", b"theirs", exclusive=True)
    shardckpt.save(_state(2), f"s3://{bucket}/whole", storage_options=options)
    with pytest.raises(CheckpointExistsError):
        shardckpt.save(_state(3), f"s3://{bucket}/whole", storage_options=options)
    assert_tree_equal(shardckpt.load_full(f"s3://{bucket}/whole", storage_options=server.options()), _state(2))


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.95])
def test_a_server_gone_mid_save_leaves_the_old_checkpoint_and_commits_nothing(proxied, fraction):
    (server, bucket), make = proxied
    url = f"s3://{bucket}/gone"
    shardckpt.save(_state(1), url, storage_options=server.options())
    before = server.raw_fs.cat_file(f"{bucket}/gone/manifest.json")
    # How many requests a save makes before its commit (the manifest's PUT), measured on another path.
    counting, options = make()
    shardckpt.save(_state(2), f"s3://{bucket}/counted", storage_options=options)
    commit = next(i for i, (m, p) in enumerate(counting.log) if m == "PUT" and "counted/manifest.json" in p)
    proxy, options = make(stop_after=int(fraction * commit))
    options = StorageOptions(options, StorageTuning(retry_deadline_s=2.0))
    start = time.monotonic()
    with pytest.raises(StorageError) as err:
        shardckpt.save(_state(2), url, storage_options=options, overwrite=True)
    assert time.monotonic() - start < 60  # bounded, whatever botocore and s3fs retry underneath
    assert f"{bucket}/gone/" in str(err.value)  # names the object
    assert server.raw_fs.cat_file(f"{bucket}/gone/manifest.json") == before  # nothing new committed
    assert_tree_equal(shardckpt.load_full(url, storage_options=server.options()), _state(1))
    assert verify(open_storage(url, server.options())).ok


def test_reading_from_a_server_gone_is_a_storage_error_naming_the_object(proxied):
    (server, bucket), make = proxied
    url = f"s3://{bucket}/read"
    shardckpt.save(_state(1), url, storage_options=server.options())
    proxy, options = make()
    options = StorageOptions(options, StorageTuning(retry_deadline_s=1.0))
    storage = open_storage(url, options)
    proxy.stop()
    data_file = next(p for p in server.raw_fs.find(f"{bucket}/read") if p.endswith(".bin"))
    out = memoryview(bytearray(1024))
    with pytest.raises(StorageError, match=data_file.rsplit("/", 1)[1]):
        storage.read_into(data_file[len(f"{bucket}/read/"):], 0, out)
