"""``convert --memory-limit``: chunks stream through the writers a slice at a time, bit for bit the chunks a
whole-chunk write gives, and the process's peak RSS stays within the limit whatever the checkpoint's size."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import shardckpt
from shardckpt.checkpoint import writer
from shardckpt.checkpoint.verify import verify
from shardckpt.offline import memory
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.demo.processes import run_measured
from shardckpt.formats.native import read_manifest
from shardckpt.io import open_storage
from tests.checkpoint.cases import block_size
from tests.convert._spy import read_sizes
from tests.formats._deepspeed_layout import write_like_deepspeed

MIB = 1 << 20
BLOCK = 256  # checksum block of these tests' saves and converts: many blocks, and slices, from small tensors


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"model": {"big": torch.randn(1000, 3, generator=g), "odd": torch.randn(777, generator=g),
                      "half": torch.randn(301, generator=g).half(), "s": torch.tensor(1.5), "e": torch.empty(0, 2)},
            "optim": {"state": {"big": {"step": torch.tensor(7.0), "exp_avg": torch.randn(1000, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": ["big"]}]}}


@pytest.fixture
def reads(monkeypatch):
    """The byte sizes of the source reads, with the whole limit counted as buffers (no resident baseline, and
    buffered file writers that gather nothing, which hold no buffer of their own)."""
    seen = read_sizes(monkeypatch)
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    monkeypatch.setattr(writer, "COALESCE_BYTES", 0)
    monkeypatch.setenv("SHARDCKPT_DIRECT_IO", "0")
    return seen


@pytest.mark.parametrize("compress", [None, "zstd"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_slices_write_the_same_chunks_as_whole_ones(tmp_path, reads, dtype, compress):
    with block_size(BLOCK):
        shardckpt.save(_state(), tmp_path / "src")
        convert(tmp_path / "src", tmp_path / "whole", world_size=3, dtype=dtype, compress=compress,
                memory_limit="64MiB")
        whole_reads = len(reads)
        reads.clear()
        # 2 writers, 1 KiB of buffers each: fp32 slices of 192 elements (3 blocks), or with the cast to bf16
        # (6 bytes per element) of 128 (one bf16 block)
        convert(tmp_path / "src", tmp_path / "sliced", world_size=3, dtype=dtype, compress=compress,
                memory_limit=2048)
    assert max(reads) == 768 and len(reads) > 2 * whole_reads if dtype is None else max(reads) == 512
    assert verify(tmp_path / "sliced").ok
    whole, sliced = (read_manifest(open_storage(tmp_path / d)) for d in ("whole", "sliced"))
    assert {n: t.crc32c for n, t in whole.tensors.items()} == {n: t.crc32c for n, t in sliced.tensors.items()}
    # the same bytes in the same places: every file's size, and its index (offsets, block CRCs, frames)
    assert [(f.size, f.index_crc32c) for f in whole.files] == [(f.size, f.index_crc32c) for f in sliced.files]
    expected = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
                for k, v in _state()["model"].items()}
    got = shardckpt.load_full(tmp_path / "sliced")["model"]
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    if dtype is None:
        assert diff(tmp_path / "src", tmp_path / "sliced").equal


def test_a_limit_below_what_the_process_holds_warns_and_uses_the_smallest_buffers(tmp_path, monkeypatch):
    shardckpt.save(_state(), tmp_path / "src")
    monkeypatch.setattr(memory, "resident_bytes", lambda: 300 * MIB)
    with pytest.warns(RuntimeWarning, match=r"memory limit 256 MiB for convert is below the 30\d MiB"):  # (+ the writers)
        convert(tmp_path / "src", tmp_path / "dst", world_size=2, memory_limit="256MiB")
    assert diff(tmp_path / "src", tmp_path / "dst").equal


def test_the_default_never_warns_whatever_the_process_holds(tmp_path, monkeypatch):
    # The default was a 512 MiB limit: any process already past it (a test run, a notebook) got the warning.
    shardckpt.save(_state(), tmp_path / "src")
    monkeypatch.setattr(memory, "resident_bytes", lambda: 64 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        convert(tmp_path / "src", tmp_path / "dst", world_size=2)
    assert memory.buffer_budget(None, "convert", reserve=1 << 30) == memory.DEFAULT_BUFFER_BYTES
    assert diff(tmp_path / "src", tmp_path / "dst").equal


def test_bad_limits_are_refused(tmp_path):
    shardckpt.save(_state(), tmp_path / "src")
    for bad in (0, "lots", -5):
        with pytest.raises(ValueError, match="size"):
            convert(tmp_path / "src", tmp_path / "dst", memory_limit=bad)


# What the command holds at start, before its buffers: torch and the modules convert runs (the command itself
# imports them only when a verb runs).
START = "import torch, shardckpt.cli.main, shardckpt.api, shardckpt.offline.convert"

def _peak_rss(cmd: list[str], tmp_path) -> int:
    with open(tmp_path / "out.log", "w+") as out:
        returncode, rss, _ = run_measured(cmd, out, subprocess.STDOUT)
        out.seek(0)
        assert returncode == 0, out.read()[-3000:]
    return rss


def test_peak_rss_stays_within_the_limit_for_a_checkpoint_several_times_larger(tmp_path):
    """The issue's memory test: a 144 MiB checkpoint of 48 MiB tensors converted (to 2 data files: 48 MiB chunks,
    each twice the buffers' share), with a limit of what the command holds at start plus 24 MiB of buffers.
    Whole chunks, two writers at a time, would take 96 MiB."""
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(6 * MIB // 2, 4, generator=g) for i in range(3)}}  # 3 x 48 MiB
    shardckpt.save(state, tmp_path / "src")
    del state
    baseline = _peak_rss([sys.executable, "-c", START], tmp_path)
    limit = baseline + 24 * MIB
    cli = [sys.executable, "-m", "shardckpt.cli.main"]
    peak = _peak_rss([*cli, "convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--world-size", "1", "--quiet",
                      "--memory-limit", str(limit)], tmp_path)
    # within the limit, but for what the plan and the reader hold beyond a bare start (~2 MiB here)
    assert peak <= limit + 8 * MIB, (peak / MIB, limit / MIB)
    assert diff(tmp_path / "src", tmp_path / "dst").equal


def test_a_deepspeed_checkpoint_converts_within_the_limit(tmp_path):
    """A ZeRO-3 checkpoint of 2 ranks (3 parameters of 16 MiB with Adam state: 144 MiB of memory-mapped rank files)
    converted to one rank within what the command holds at start plus 24 MiB: the pages each read touches are
    given back (``formats.torch_save``), else the mapped files would stay resident."""
    g = torch.Generator().manual_seed(0)
    groups = [{f"w{i}": torch.randn(4 * MIB, generator=g) for i in range(3)}]
    write_like_deepspeed(str(tmp_path / "src"), 3, 2, groups)
    del groups
    baseline = _peak_rss([sys.executable, "-c", START], tmp_path)
    limit = baseline + 24 * MIB
    peak = _peak_rss([sys.executable, "-m", "shardckpt.cli.main", "convert", str(tmp_path / "src"),
                      str(tmp_path / "dst"), "--world-size", "1", "--quiet", "--memory-limit", str(limit)], tmp_path)
    assert peak <= limit + 8 * MIB, (peak / MIB, limit / MIB)
    assert diff(tmp_path / "src", tmp_path / "dst").equal


def test_a_dcp_chunk_read_slice_by_slice_is_read_and_checked_once(tmp_path, monkeypatch):
    """torch DCP keeps no per-block checksums: its reader checks a stored chunk by reading it whole, and keeps
    it for the thread's next read, so that streaming it in slices does not read it once per slice."""
    import torch.distributed.checkpoint as dcp
    from shardckpt.formats.dcp import reader as dcp_reader

    w = torch.randn(1 << 18)  # 1 MiB: 8 slices of 128 KiB
    dcp.save({"w": w}, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    whole_reads = []
    real = dcp_reader.read_whole
    monkeypatch.setattr(dcp_reader, "read_whole", lambda *a, **k: whole_reads.append(1) or real(*a, **k))
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    convert(tmp_path / "src", tmp_path / "dst", memory_limit=512 << 10)
    assert len(whole_reads) == 1
    assert torch.equal(shardckpt.load_full(tmp_path / "dst")["w"], w)


def test_a_dcp_output_converts_within_the_limit(tmp_path):
    """``--format dcp``: 3 parameters of 16 MiB with Adam state (144 MiB) written as DCP chunks of at most the
    buffer, each ``torch.save``d from the slice buffer into its file, within the start plus 24 MiB."""
    g = torch.Generator().manual_seed(0)
    groups = [{f"w{i}": torch.randn(4 * MIB, generator=g) for i in range(3)}]
    write_like_deepspeed(str(tmp_path / "src"), 3, 2, groups)
    del groups
    baseline = _peak_rss([sys.executable, "-c", START], tmp_path)
    limit = baseline + 24 * MIB
    peak = _peak_rss([sys.executable, "-m", "shardckpt.cli.main", "convert", str(tmp_path / "src"),
                      str(tmp_path / "dst"), "--world-size", "2", "--format", "dcp", "--quiet", "--memory-limit",
                      str(limit)], tmp_path)
    assert peak <= limit + 8 * MIB, (peak / MIB, limit / MIB)
    assert diff(tmp_path / "src", tmp_path / "dst").equal
