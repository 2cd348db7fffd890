"""S3 loads of files larger than a part (issue 38): a file read (nearly) whole goes through several streaming
GETs at once (``formats/native/lanes.py``), every byte checked against its block CRC32C, each GET retried where
it broke, a short object refused, and the memory beside the targets bounded by the lanes, not the file."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import shardckpt
from shardckpt import CorruptCheckpointError, ShardedTensor
from shardckpt.formats.native import lanes
from tests.storage.faulty_proxy import FaultyProxy

MIB = 1 << 20
PART = 5 << 20


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"big": torch.randn(12 * MIB, generator=g),  # 48 MiB: one chunk over many parts and pieces
            "mid": torch.randn(3 * MIB, generator=g).to(torch.bfloat16), "step": 4}


def _options(server, **extra) -> dict:
    return server.options(**{"default_block_size": PART, "max_concurrency": 4, "skip_instance_cache": True, **extra})


def _data_file(server, bucket: str, prefix: str, tensor: str = "big") -> str:
    """The key of the data file holding ``tensor`` (the larger file: ``big`` is most of the bytes)."""
    fs = server.raw_fs
    files = [p for p in fs.find(f"{bucket}/{prefix}") if p.endswith(".bin")]
    return max(files, key=fs.size)


@pytest.fixture
def proxy(s3_bucket):
    made: list[FaultyProxy] = []

    def make(**kw) -> FaultyProxy:
        made.append(FaultyProxy(s3_bucket[0].endpoint, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_file_larger_than_a_part_is_read_whole_through_parallel_gets_and_in_ranges(s3_bucket, proxy):
    server, bucket = s3_bucket
    url = f"s3://{bucket}/whole"
    state = _state()
    shardckpt.save(state, url, storage_options=_options(server))
    counting = proxy()
    options = _options(server, endpoint_url=counting.endpoint)
    target = {"big": torch.empty(12 * MIB), "mid": torch.empty(3 * MIB, dtype=torch.bfloat16), "step": None}
    shardckpt.load(target, url, storage_options=options)
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["mid"], state["mid"])
    data = _data_file(server, bucket, "whole").split("/", 1)[1]
    gets = [p for m, p in counting.log if m == "GET" and p.split("?")[0].endswith(data)]
    assert len(gets) >= 2, counting.log  # lanes: several GETs of the one big file
    # In ranges: a third of it (ranged GETs, split into parts), and every value through load_full.
    third = {"big": ShardedTensor.from_full(torch.empty(12 * MIB), 2, 3)}
    shardckpt.load(third, url, storage_options=options, strict=False)
    assert torch.equal(third["big"].local, state["big"].chunk(3)[2])
    full = shardckpt.load_full(url, storage_options=options)
    assert torch.equal(full["big"], state["big"]) and full["step"] == 4


def test_a_flipped_bit_in_a_later_part_is_refused_naming_the_file_and_tensor(s3_bucket):
    server, bucket = s3_bucket
    url = f"s3://{bucket}/flipped"
    shardckpt.save(_state(), url, storage_options=_options(server))
    victim = _data_file(server, bucket, "flipped")
    data = bytearray(server.raw_fs.cat_file(victim))
    data[len(data) * 3 // 4] ^= 0x04
    server.raw_fs.pipe_file(victim, bytes(data))
    target = {"big": torch.empty(12 * MIB), "mid": torch.empty(3 * MIB, dtype=torch.bfloat16), "step": None}
    name = victim.rsplit("/", 1)[1]
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(name)}: tensor 'big' chunk 0 fails its checksum"):
        shardckpt.load(target, url, storage_options=_options(server))


@pytest.mark.parametrize("fault", ["cut", "reset", "503"])
def test_a_get_failing_mid_way_is_retried_where_it_broke(s3_bucket, proxy, fault):
    server, bucket = s3_bucket
    url = f"s3://{bucket}/retried"
    state = _state()
    shardckpt.save(state, url, storage_options=_options(server))
    faulty = proxy(script=(fault, fault), only=".bin")  # the first two GETs of data files fail (cut: mid-body)
    target = {"big": torch.empty(12 * MIB), "mid": torch.empty(3 * MIB, dtype=torch.bfloat16), "step": None}
    shardckpt.load(target, url, storage_options=_options(server, endpoint_url=faulty.endpoint))
    assert faulty.injected[fault] == 2
    assert torch.equal(target["big"], state["big"]) and torch.equal(target["mid"], state["mid"])


def test_a_truncated_object_is_refused_naming_it(s3_bucket, monkeypatch):
    from shardckpt.formats.native import reader

    server, bucket = s3_bucket
    url = f"s3://{bucket}/short"
    shardckpt.save(_state(), url, storage_options=_options(server))
    victim = _data_file(server, bucket, "short")
    server.raw_fs.pipe_file(victim, server.raw_fs.cat_file(victim)[:30 * MIB])
    name = victim.rsplit("/", 1)[1]
    target = {"big": torch.empty(12 * MIB), "mid": torch.empty(3 * MIB, dtype=torch.bfloat16), "step": None}
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(name)}: data file has {30 * MIB} bytes"):
        shardckpt.load(target, url, storage_options=_options(server))
    # Shortened after its size was checked (a concurrent overwrite): the lanes' GETs end early.
    monkeypatch.setattr(reader, "check_data_file", lambda storage, file: None)
    with pytest.raises(CorruptCheckpointError, match=rf"{re.escape(name)}: file (is truncated|missing)"):
        shardckpt.load(target, url, storage_options=_options(server))


_MEASURE = """
import json, sys, torch, shardckpt
url, options, dtype = sys.argv[1], json.loads(sys.argv[2]), getattr(torch, sys.argv[3])
def field(name):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(name + ":"))
shardckpt.load_full(url + "-warm", storage_options=options)  # every import and the client made beforehand
target = {"big": torch.zeros(48 << 20, dtype=dtype)}
before = field("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
shardckpt.load(target, url, storage_options=options, strict=False)
print(json.dumps({"peak": field("VmHWM") - before, "sum": float(target["big"].double().sum())}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_beside_the_targets_is_bounded_by_the_lanes_not_the_file(s3_bucket, dtype):
    # 192 MiB in one chunk. Into fp32 targets the lanes read in place; into bf16 each piece goes through a
    # buffer of at most PIECE_BYTES (before: one buffer of the whole chunk).
    server, bucket = s3_bucket
    url = f"s3://{bucket}/mem"
    big = torch.randn(48 << 20, generator=torch.Generator().manual_seed(2))
    options = _options(server, max_concurrency=2)
    shardckpt.save({"big": big}, url, storage_options=options)
    shardckpt.save({"tiny": torch.ones(3)}, url + "-warm", storage_options=options)
    out = subprocess.run([sys.executable, "-c", _MEASURE, url, json.dumps(options), dtype], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sum"] == pytest.approx(float(big.to(getattr(torch, dtype)).double().sum()), rel=1e-6)
    # 2 lanes' buffers, and the client's own (on radosgw, faster than moto, botocore holds more in flight: a CI
    # rehearsal there failed the 32 MiB allowance); still well below one buffer of the whole 192 MiB chunk
    bound = 2 * lanes.PIECE_BYTES + 96 * MIB
    assert got["peak"] < bound, f"peak RSS +{got['peak'] / MIB:.0f} MiB for a 192 MiB chunk"
