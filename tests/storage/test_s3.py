"""S3 specifics (moto or radosgw on 127.0.0.1): multi-rank save and resharding load, and s3fs's listing cache."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import CheckpointExistsError, ShardedTensor
from tests._dist import run_ranks
from tests.checkpoint.cases import check_equal, empty_like_state, reference, sharded_state
from tests.storage._util import assert_tree_equal


# The workers get the storage options (with credentials) as an argument: they may predate the test's
# environment.
def _rank_save(url: str, options: dict, rotate: int) -> list[str]:
    sd = sharded_state(dist.get_rank(), dist.get_world_size(), rotate)
    shardckpt.save(sd, url, storage_options=options)
    return sorted(shardckpt.load_full(url, storage_options=options))


def _rank_load(url: str, options: dict, rotate: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = empty_like_state(rank, world, rotate)
    shardckpt.load(sd, url, storage_options=options)
    check_equal(sd, rank, world, rotate)


def test_multi_rank_save_ws3_load_ws2_bit_exact(s3_bucket):
    server, bucket = s3_bucket
    url = f"s3://{bucket}/dist"
    assert run_ranks(3, _rank_save, url, server.options(), 0, timeout=120) == [["meta", "model", "step"]] * 3
    files = sorted(p.split("/")[-1] for p in server.raw_fs.find(f"{bucket}/dist") if p.endswith(".bin"))
    assert len(files) >= 2, files  # several ranks wrote data
    run_ranks(2, _rank_load, url, server.options(), 1, timeout=120)  # other sharding kinds, other world size
    assert_tree_equal(shardckpt.load_full(url, storage_options=server.options()), reference())


def test_commit_point_is_not_answered_from_a_stale_listing_cache(s3_bucket):
    # Regression: FsspecStorage.exists answered from s3fs's listing cache of a shared instance: load saw
    # no checkpoint, and save(overwrite=False) replaced another process's checkpoint.
    import fsspec

    server, bucket = s3_bucket
    url = f"s3://{bucket}/run/ckpt"
    # The user's own code lists the run directory with the same storage options (so the same
    # cached S3FileSystem instance that shardckpt gets) ...
    shared = fsspec.filesystem("s3", **server.options())
    server.raw_fs.pipe_file(f"{bucket}/run/ckpt/README", b"notes")
    assert shared.ls(f"{bucket}/run/ckpt") == [f"{bucket}/run/ckpt/README"]
    # ... then another process (another instance: another job, a trainer) commits a checkpoint there.
    shardckpt.save(reference(), url, storage_options=server.options(skip_instance_cache=True))
    found_error = None
    try:
        assert_tree_equal(shardckpt.load_full(url, storage_options=server.options()), reference())
    except shardckpt.CheckpointNotFoundError as e:
        found_error = e
    # Saving without overwrite must not replace the other process's checkpoint.
    with pytest.raises(CheckpointExistsError):
        shardckpt.save({"x": reference()["model"]["tiny"]}, url, storage_options=server.options())
    assert found_error is None, found_error


def test_the_loopback_guard_is_active():
    """conftest's autouse guard: any connection off 127.0.0.1 (e.g. EC2 metadata, real AWS) fails the test."""
    import socket

    s = socket.socket()
    try:
        with pytest.raises(AssertionError, match="127.0.0.1"):
            s.connect(("169.254.169.254", 80))
    finally:
        s.close()


def test_cli_reaches_a_custom_endpoint_with_storage_options(s3_bucket, capsys):
    from shardckpt.cli.main import main

    server, bucket = s3_bucket
    url = f"s3://{bucket}/cli"
    shardckpt.save(reference(), url, storage_options=server.options())
    opts = ["-o", f"endpoint_url={server.endpoint}", "-o", f"key={server.key}", "-o", f"secret={server.secret}",
            "-o", "client_kwargs.region_name=us-east-1"]
    assert main(["verify", url, "--quiet", *opts]) == 0
    assert capsys.readouterr().out.startswith(f"OK {url}")
    assert main(["inspect", url, "--json", *opts]) == 0
    assert '"model.cube"' in capsys.readouterr().out


def test_a_few_hundred_mib_go_up_in_concurrent_parts_and_come_back_bit_exact(s3_bucket):
    server, bucket = s3_bucket
    g = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(40 << 20, generator=g),  # 160 MiB: one chunk over many parts
             "mid": torch.randn(6 << 20, generator=g).to(torch.bfloat16), "step": 3}
    url = f"s3://{bucket}/big"
    shardckpt.save(state, url, storage_options=server.options())
    fs = server.raw_fs
    data = [p for p in fs.find(f"{bucket}/big") if p.endswith(".bin")]
    etags = [fs.info(p)["ETag"].strip('"') for p in data]
    assert any(e.endswith(f"-{n}") for e in etags for n in range(10, 40)), etags  # multipart, 8 MiB parts
    target = {"big": torch.empty(40 << 20), "mid": torch.empty(6 << 20, dtype=torch.bfloat16), "step": None}
    shardckpt.load(target, url, storage_options=server.options())  # whole files: streamed GETs
    assert_tree_equal(target, state)
    part = {"big": ShardedTensor.from_full(torch.empty(40 << 20), 1, 3)}  # a third: ranged GETs
    shardckpt.load(part, url, storage_options=server.options(), strict=False)
    assert torch.equal(part["big"].local, state["big"].chunk(3)[1])


def test_export_to_s3_stages_nothing_locally_and_verifies_against_its_source(s3_bucket, tmp_path, monkeypatch):
    import tempfile

    from safetensors.torch import load as load_bytes

    from shardckpt.offline.export import INDEX_NAME, export
    from shardckpt.io import open_storage
    from shardckpt.offline.verify_export import verify_export

    server, bucket = s3_bucket
    g = torch.Generator().manual_seed(9)
    model = {"embed": torch.randn(6 << 20, generator=g), "norm": torch.randn(64, generator=g)}  # 12 MiB in bf16: 2 parts
    src = str(tmp_path / "src")
    shardckpt.save({"model": model, "step": 1}, src)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for var in ("TMPDIR", "TEMP", "TMP"):
        monkeypatch.setenv(var, str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    url = f"s3://{bucket}/hf"
    report = export(src, url, dtype="bfloat16", max_shard_size="8MiB", dst_storage_options=server.options())
    assert list(scratch.iterdir()) == []  # nothing staged on local disk
    assert len(report.files) == 2
    fs = server.raw_fs
    got = {}
    for name in report.files:
        got.update(load_bytes(fs.cat_file(f"{bucket}/hf/{name}")))  # safetensors itself reads them
    assert sorted(got) == ["embed", "norm"] and all(torch.equal(got[k], model[k].to(torch.bfloat16)) for k in got)
    assert fs.exists(f"{bucket}/hf/{INDEX_NAME}")
    check = verify_export(open_storage(url, server.options()), against=src)
    assert check.ok and check.values.tensors == 2


def test_botocore_hashes_no_body_by_default_but_a_callers_config_wins(s3_bucket):
    # Issue 38: botocore's SHA256 (payload signing over http) and CRC32 of every part ran on s3fs's one
    # event-loop thread, in series with the upload; shardckpt's CRC32C already covers every byte.
    import boto3
    import botocore.config

    from shardckpt import StorageOptions
    from shardckpt.io.s3 import S3Tuning

    server, bucket = s3_bucket
    _, options = S3Tuning.resolve(StorageOptions())
    config = options["config_kwargs"]
    assert config["request_checksum_calculation"] == config["response_checksum_validation"] == "when_required"
    sent = []
    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.key,
                          aws_secret_access_key=server.secret, region_name="us-east-1",
                          config=botocore.config.Config(**config))
    client.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request.headers))
    client.put_object(Bucket=bucket, Key="hashing/a", Body=b"x" * 100_000)
    assert sent[0]["X-Amz-Content-SHA256"] == b"UNSIGNED-PAYLOAD", dict(sent[0])
    assert not any(k.lower().startswith("x-amz-checksum") for k in sent[0]), dict(sent[0])
    # The caller's own choices are kept.
    options = {"config_kwargs": {"request_checksum_calculation": "when_supported",
                                 "s3": {"payload_signing_enabled": True, "addressing_style": "path"}}}
    _, options = S3Tuning.resolve(StorageOptions(options))
    assert options["config_kwargs"]["request_checksum_calculation"] == "when_supported"
    assert options["config_kwargs"]["s3"] == {"payload_signing_enabled": True, "addressing_style": "path"}


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_s3_corrupt_object_refused_on_load(s3_bucket, where):
    # Without botocore's own checksums, shardckpt's CRC32C must still refuse any byte changed on the server.
    server, bucket = s3_bucket
    state = {"big": torch.randn(5 << 20, generator=torch.Generator().manual_seed(1))}  # 20 MiB: multipart
    url = f"s3://{bucket}/corrupt-{where}"
    shardckpt.save(state, url, storage_options=server.options())
    fs = server.raw_fs
    files = fs.find(f"{bucket}/corrupt-{where}")
    victim = max((p for p in files if p.endswith(".bin")), key=fs.size) if where == "data" else \
        next(p for p in files if p.rsplit("/", 1)[-1].startswith("manifest"))
    data = bytearray(fs.cat_file(victim))
    data[len(data) * 2 // 3] ^= 0x10  # one bit, in a later part
    fs.pipe_file(victim, bytes(data))
    with pytest.raises(shardckpt.CorruptCheckpointError):
        shardckpt.load({"big": torch.empty(5 << 20)}, url, storage_options=server.options())
