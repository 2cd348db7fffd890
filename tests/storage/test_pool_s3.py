"""Incremental (pooled) checkpoints on S3 (moto server on 127.0.0.1, tests/storage/conftest.py): saves reference
unchanged units in ``s3://bucket/run/shardckpt-pool/``, every step loads and verifies through its references, rm
removes one step without breaking another. (The object-store collector's leases and sweep markers are not built:
a sweep there deletes nothing.)"""
from __future__ import annotations

import torch

import shardckpt
from shardckpt.checkpoint.pool_gc import sweep_pool
from shardckpt.checkpoint.verify import verify
from shardckpt.io import open_storage
from tests.checkpoint.test_incremental import assert_bits, state


def test_pooled_saves_load_verify_and_rm_on_s3(s3_bucket):
    server, bucket = s3_bucket
    options = server.options()
    run = f"s3://{bucket}/run"
    sd = state()
    saved = {}
    for step in (1, 2, 3):
        sd["model"]["lora"].fill_(step)
        shardckpt.save(sd, f"{run}/step-{step}", incremental=True, incremental_unit=64 << 10, storage_options=options)
        saved[step] = {k: v.clone() for k, v in sd["model"].items()}
    storage = open_storage(f"{run}/shardckpt-pool", options)
    generations = storage.list_dirs("")
    assert len(generations) == 3
    assert sorted(len(storage.list_files(g)) for g in generations) == [2, 2, 4]  # later saves: lora's file only
    shardckpt.rm(f"{run}/step-1", storage_options=options)
    for step in (2, 3):
        got = shardckpt.load_full(f"{run}/step-{step}", storage_options=options)
        assert_bits(got["model"], saved[step])
        report = verify(open_storage(f"{run}/step-{step}", options))
        assert report.ok and report.sharing["shared_bytes"] >= sd["model"]["base"].nbytes
    assert sweep_pool(open_storage(run, options)) == []  # nothing deleted without leases
    torch.testing.assert_close(shardckpt.load_full(f"{run}/step-3", storage_options=options)["model"]["lora"],
                               saved[3]["lora"])
