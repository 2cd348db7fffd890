"""Incremental saves (issue 39): ``save(..., incremental=True)`` writes format v5 into the run directory's chunk
pool, referencing the units whose bytes did not change; every pooled step reads on its own through every verb."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import shardckpt
from shardckpt import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.checkpoint.describe import describe
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import BadArgumentError
from shardckpt.format.manifest import MANIFEST_NAME, POOL_DIR, parse_manifest
from shardckpt.tensor_views import as_bytes
from tests._dist import run_ranks

UNIT = 64 << 10  # small units: a few tensors of a few hundred KiB give many


def manifest(path) -> object:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return parse_manifest(f.read(), str(path))


def new_files(path) -> list[str]:
    """The pool files a pooled step's own save wrote (its generation's)."""
    m = manifest(path)
    return [f.path for f in m.files if f.path.startswith(f"data-{m.generation}/")]


def new_bytes(path) -> int:
    m = manifest(path)
    return sum(f.size for f in m.files if f.path.startswith(f"data-{m.generation}/"))


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"base": torch.randn(256, 1024, generator=g), "emb": torch.randn(512, 256, generator=g),
                      "lora": torch.randn(16, 8, generator=g)},
            "mask": torch.arange(1000) % 3 == 0, "ids": torch.arange(5000, dtype=torch.int64), "step": 1}


def assert_bits(got, want) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_bits(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(as_bytes(got.contiguous()), as_bytes(want.contiguous()))
    else:
        assert got == want


def save(sd, path, **kw) -> None:
    shardckpt.save(sd, path, incremental=True, incremental_unit=UNIT, **kw)


def test_second_save_writes_only_what_changed_and_both_load_bit_for_bit(tmp_path):
    sd = state()
    save(sd, tmp_path / "step-1")
    first = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd["model"].items()}
    sd["model"]["lora"].add_(1)
    sd["model"]["emb"][3] += 1  # one row: one unit of emb
    sd["step"] = 2
    save(sd, tmp_path / "step-2")
    m1, m2 = manifest(tmp_path / "step-1"), manifest(tmp_path / "step-2")
    assert m1.version == m2.version == 5 and m1.pool == m2.pool
    assert os.listdir(tmp_path / "step-2") == [MANIFEST_NAME]
    changed = sd["model"]["lora"].nbytes + UNIT
    assert new_bytes(tmp_path / "step-2") <= 1.1 * changed + 4096
    assert any(f.path.startswith(f"data-{m1.generation}/") for f in m2.files)  # references step-1's files
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), sd)
    got1 = shardckpt.load_full(tmp_path / "step-1")
    assert_bits(got1["model"], first) and got1["step"] == 1
    for step in ("step-1", "step-2"):
        assert verify(tmp_path / step).ok


def test_unchanged_save_writes_no_data(tmp_path):
    sd = state()
    save(sd, tmp_path / "step-1")
    save(sd, tmp_path / "step-2")
    assert new_files(tmp_path / "step-2") == []
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), sd)


def test_without_the_option_the_current_version_is_written(tmp_path):
    shardckpt.save(state(), tmp_path / "plain")
    assert manifest(tmp_path / "plain").version == 2 and not (tmp_path / POOL_DIR).exists()


def test_load_into_a_state_dict_and_describe(tmp_path):
    sd = state()
    save(sd, tmp_path / "step-1")
    sd["model"]["lora"].mul_(2)
    save(sd, tmp_path / "step-2")
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in sd["model"].items()}
    shardckpt.load({"model": target}, tmp_path / "step-2", strict=False)
    assert_bits(target, sd["model"])
    info = describe(tmp_path / "step-2")
    assert info["version"] == 5
    assert {t["name"] for t in info["tensors"]} >= {"model.base", "model.lora"}


def test_convert_and_export_read_through_references_and_write_standalone(tmp_path):
    sd = state()
    save(sd, tmp_path / "run" / "step-1")
    sd["model"]["lora"].add_(3)
    save(sd, tmp_path / "run" / "step-2")
    shardckpt.convert(tmp_path / "run" / "step-2", tmp_path / "copy")
    assert manifest(tmp_path / "copy").pool is None
    shutil.rmtree(tmp_path / "run" / "step-1")  # the copy stands alone, and so does step-2 without step-1
    assert_bits(shardckpt.load_full(tmp_path / "copy"), sd)
    assert_bits(shardckpt.load_full(tmp_path / "run" / "step-2"), sd)
    shardckpt.export(tmp_path / "run" / "step-2", tmp_path / "hf")
    assert any(n.endswith(".safetensors") for n in os.listdir(tmp_path / "hf"))
    assert shardckpt.diff(tmp_path / "run" / "step-2", tmp_path / "copy").equal


def test_diff_of_two_pooled_steps_names_what_changed(tmp_path):
    sd = state()
    save(sd, tmp_path / "step-1")
    sd["model"]["lora"].add_(1)
    save(sd, tmp_path / "step-2")
    result = shardckpt.diff(tmp_path / "step-1", tmp_path / "step-2")
    assert not result.equal
    assert "model.lora" in json.dumps(result.to_json()) and "model.base" not in json.dumps(
        [d for d in result.to_json().get("differences", []) if "base" in str(d)])


def test_async_save_incremental(tmp_path):
    sd = state()
    shardckpt.async_save(sd, tmp_path / "step-1", incremental=True, incremental_unit=UNIT).wait()
    sd["model"]["lora"].add_(1)
    shardckpt.async_save(sd, tmp_path / "step-2", incremental=True, incremental_unit=UNIT).wait()
    assert new_bytes(tmp_path / "step-2") < sd["model"]["base"].nbytes / 4
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), sd)


def test_a_step_copied_without_its_pool_is_refused_by_name(tmp_path):
    save(state(), tmp_path / "run" / "step-1")
    shutil.copytree(tmp_path / "run" / "step-1", tmp_path / "alone" / "step-1")
    with pytest.raises(CheckpointNotFoundError, match="pool"):
        shardckpt.load_full(tmp_path / "alone" / "step-1")


def test_a_replaced_pool_is_refused(tmp_path):
    save(state(), tmp_path / "step-1")
    pool_json = tmp_path / POOL_DIR / "pool.json"
    doc = json.loads(pool_json.read_text())
    doc["id"] = "0" * 32
    pool_json.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="not the one it was written into"):
        shardckpt.load_full(tmp_path / "step-1")
    assert not verify_ok(tmp_path / "step-1")


def verify_ok(path) -> bool:
    try:
        return verify(path).ok
    except CorruptCheckpointError:
        return False


def test_a_pool_elsewhere_is_refused(tmp_path):
    with pytest.raises(BadArgumentError, match="parent"):
        shardckpt.save(state(), tmp_path / "run" / "step-1", incremental=str(tmp_path / "other"))
    shardckpt.save(state(), tmp_path / "run" / "step-1", incremental=str(tmp_path / "run"))
    assert manifest(tmp_path / "run" / "step-1").pool is not None


@pytest.mark.parametrize("bad", [{"incremental": True, "incremental_unit": 1024},
                                 {"incremental": True, "keep_last": 0}, {"keep_last": 2}, "elsewhere"])
def test_async_save_refuses_bad_incremental_options_in_its_call(tmp_path, bad):
    # from helper-22: they were raised by wait(), or by the next call when the caller did not wait
    bad = {"incremental": str(tmp_path / "elsewhere")} if bad == "elsewhere" else bad  # not the step's parent
    with pytest.raises(BadArgumentError):
        shardckpt.async_save(state(), tmp_path / "step-1", **bad)
    shardckpt.async_save(state(), tmp_path / "step-2", incremental=True, incremental_unit=UNIT).wait()  # unharmed
    assert not (tmp_path / "step-1").exists() and manifest(tmp_path / "step-2").pool is not None


def test_compressed_incremental_saves(tmp_path):
    sd = state()
    save(sd, tmp_path / "step-1", compress="zstd")
    sd["model"]["lora"].add_(1)
    save(sd, tmp_path / "step-2", compress="zstd")
    assert new_bytes(tmp_path / "step-2") < 64 << 10
    assert_bits(shardckpt.load_full(tmp_path / "step-2"), sd)
    assert verify(tmp_path / "step-2").ok


def test_overwrite_of_a_pooled_step(tmp_path):
    sd = state()
    save(sd, tmp_path / "step-1")
    sd["model"]["lora"].add_(1)
    save(sd, tmp_path / "step-1", overwrite=True)
    assert_bits(shardckpt.load_full(tmp_path / "step-1"), sd)


def _sharded_saves(root: str, step: int, scale: float) -> None:
    import torch.distributed as dist

    from shardckpt import ShardedTensor
    from shardckpt.regions import FlatRange

    full = torch.arange(40_000, dtype=torch.float32) * scale
    full[:100] = step  # the first unit changes every step
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * len(full) // world, (rank + 1) * len(full) // world
    sd = {"w": ShardedTensor(full[lo:hi].clone(), (len(full),), FlatRange(lo, hi)), "rep": torch.ones(3000)}
    shardckpt.save(sd, os.path.join(root, f"step-{step}"), incremental=True, incremental_unit=16 << 10)


def test_reshard_between_saves_ws2_3_2(tmp_path):
    """Units are cut at the tensor's own multiples, and every step loads bit for bit at any world size. A unit is
    referenced under its (name, chunk number) key, so after a reshard only the units before the first new shard
    boundary keep their numbers: those are referenced, the later ones written again (correct, not minimal)."""
    for step, world in ((1, 2), (2, 3), (3, 2)):
        run_ranks(world, _sharded_saves, str(tmp_path), step, 1.0)
    for step in (1, 2, 3):
        got = shardckpt.load_full(tmp_path / f"step-{step}")
        want = torch.arange(40_000, dtype=torch.float32)
        want[:100] = step
        assert torch.equal(got["w"], want) and torch.equal(got["rep"], torch.ones(3000))
        assert verify(tmp_path / f"step-{step}").ok
    full = 40_000 * 4 + 3000 * 4
    assert new_bytes(tmp_path / "step-2") < 0.75 * full  # rep and w's units before rank 1's new start: referenced
    assert new_bytes(tmp_path / "step-3") < 0.75 * full


def test_verify_reports_shared_bytes_and_with_which_steps(tmp_path):
    sd = state()
    for step in (1, 2, 3):
        sd["model"]["lora"].add_(1)
        save(sd, tmp_path / f"step-{step}")
    sharing = verify(tmp_path / "step-3").sharing
    by = {s["written_by"]: s for s in sharing["shared"]}
    assert by["step-1"]["also_used_by"] == ["step-2"] and by["step-1"]["bytes"] >= sd["model"]["base"].nbytes
    assert sharing["own_bytes"] == sd["model"]["lora"].nbytes
    assert sharing["shared_bytes"] + sharing["own_bytes"] == sharing["total_bytes"]
    result = shardckpt.verify(tmp_path / "step-3")
    assert result.ok and result.sharing == sharing


def test_verify_deep_recomputes_every_pooled_digest(tmp_path, monkeypatch):
    """A digest the writer got wrong (bytes and CRCs sound) is invisible to loads and to verify, and would only cost
    dedup; --deep hashes every pooled chunk with the pool's key and names the rows that disagree."""
    from shardckpt.checkpoint import incremental, writer
    from shardckpt.format.content_hash import ChunkHasher

    class Wrong(ChunkHasher):
        def digest(self) -> bytes:
            good = super().digest()
            return bytes([good[0] ^ 1]) + good[1:]

    sd = state()
    save(sd, tmp_path / "step-1")
    sound = shardckpt.verify(tmp_path / "step-1", deep=True)
    assert sound.ok and sound.digests_checked == sound.chunks  # every chunk of a pooled step has its digest
    sd["model"]["lora"].add_(1)
    with monkeypatch.context() as m:
        m.setattr(writer, "ChunkHasher", Wrong)  # a writer bug: every digest it writes is off by one bit
        m.setattr(incremental, "_check_unmoved", lambda *a: None)
        save(sd, tmp_path / "step-2")
    assert shardckpt.verify(tmp_path / "step-2").ok  # the bytes and their CRCs are sound
    deep = shardckpt.verify(tmp_path / "step-2", deep=True)
    assert not deep.ok and any("model.lora" == p.tensor and "hash to" in p.message for p in deep.problems)
    assert not any(p.tensor == "model.base" for p in deep.problems)  # referenced from step-1: its digests are right
    run = shardckpt.verify(tmp_path, deep=True)
    assert not run.ok and {c["name"]: c["ok"] for c in run.checkpoints} == {"step-1": True, "step-2": False}
    assert run.digests_checked == sound.digests_checked + deep.digests_checked
    standalone = tmp_path / "plain"
    shardckpt.save(sd, standalone)
    plain = shardckpt.verify(standalone, deep=True)
    assert plain.ok and plain.digests_checked == 0
    with pytest.raises(BadArgumentError, match="deep"):
        shardckpt.verify(standalone, against=tmp_path / "step-1", deep=True)


def test_verify_deep_without_blake3_or_on_what_it_cannot_check(tmp_path, monkeypatch):
    """Found by review: a run's steps were each reported damaged when blake3 was missing, a missing pool.json was
    reported as corruption instead of the missing pool, and --deep on an export was silently ignored."""
    from shardckpt.format import content_hash
    from shardckpt.format.content_hash import HashUnavailableError

    sd = state()
    save(sd, tmp_path / "run" / "step-1")
    with monkeypatch.context() as m:
        def missing():
            raise HashUnavailableError("no blake3")

        m.setattr(content_hash, "_blake3", missing)
        for path in (tmp_path / "run", tmp_path / "run" / "step-1"):
            with pytest.raises(HashUnavailableError, match="verify --deep"):
                shardckpt.verify(path, deep=True)
        assert shardckpt.verify(tmp_path / "run").ok  # a plain verify needs no hash
    os.rename(tmp_path / "run" / POOL_DIR / "pool.json", tmp_path / "pool.json")
    with pytest.raises(CheckpointNotFoundError, match="pool beside it, which is missing"):
        shardckpt.verify(tmp_path / "run" / "step-1", deep=True)
    from safetensors.torch import save_file

    os.makedirs(tmp_path / "st")
    save_file({"w": torch.ones(3)}, str(tmp_path / "st" / "model.safetensors"))
    with pytest.raises(BadArgumentError, match="deep"):
        shardckpt.verify(tmp_path / "st", deep=True)


def test_the_parent_is_the_last_step_found_reading_only_its_manifest(tmp_path, monkeypatch):
    """A save reads the newest manifests only (a long run keeps hundreds of steps): steps by number, not by name; a
    damaged newest manifest is skipped; ``prefer`` (async_save's last step) first."""
    from shardckpt.checkpoint import pool as pool_module
    from shardckpt.io import open_storage

    sd = state()
    for step in (1, 2, 10, 3):
        sd["model"]["lora"].add_(1)
        save(sd, tmp_path / f"step-{step}")
    run = open_storage(str(tmp_path))
    pool_id = manifest(tmp_path / "step-1").pool["id"]
    read = []
    real = pool_module._pooled
    monkeypatch.setattr(pool_module, "_pooled",
                        lambda run, name, *a, **k: read.append(name) or real(run, name, *a, **k))
    assert pool_module.latest_pool_checkpoint(run, pool_id).name == "step-10" and read == ["step-10"]
    read.clear()
    assert pool_module.latest_pool_checkpoint(run, pool_id, prefer="step-2").name == "step-2" and read == ["step-2"]
    read.clear()
    assert pool_module.latest_pool_checkpoint(run, pool_id, skip="step-10").name == "step-3" and read == ["step-3"]
    (tmp_path / "step-10" / MANIFEST_NAME).write_bytes(b"{damaged")
    read.clear()
    assert pool_module.latest_pool_checkpoint(run, pool_id).name == "step-3" and read == ["step-10", "step-3"]
    assert pool_module.latest_pool_checkpoint(run, "another pool") is None
    # the save itself, past the damaged step: only the changed adapter written, every file it names step-3's or
    # its own, and it loads bit for bit
    sd["model"]["lora"].add_(1)
    save(sd, tmp_path / "step-11")
    own = set(new_files(tmp_path / "step-11"))
    assert new_bytes(tmp_path / "step-11") < 64 << 10 and own
    assert {f.path for f in manifest(tmp_path / "step-11").files} - own <= \
        {f.path for f in manifest(tmp_path / "step-3").files}
    assert_bits(shardckpt.load_full(tmp_path / "step-11"), sd)


def test_an_unreadable_newest_manifest_is_skipped_by_the_next_save(tmp_path):
    """From helper-27: a newest step whose manifest.json is a directory (or a symbolic link loop) failed every later
    incremental save of the run; a save skips it as damaged, and gc and ls name nothing as untyped."""
    sd = state()
    save(sd, tmp_path / "step-1")
    os.makedirs(tmp_path / "step-2" / MANIFEST_NAME)
    os.makedirs(tmp_path / "step-3")
    os.symlink(tmp_path / "step-3" / MANIFEST_NAME, tmp_path / "step-3" / MANIFEST_NAME)
    sd["model"]["lora"].add_(1)
    save(sd, tmp_path / "step-4")
    assert new_bytes(tmp_path / "step-4") < 64 << 10  # step-1 referenced
    assert_bits(shardckpt.load_full(tmp_path / "step-4"), sd)
    with pytest.raises(CorruptCheckpointError, match="step-2"):
        shardckpt.gc(tmp_path)  # a collector cannot know what it names: refused, typed and named
    shutil.rmtree(tmp_path / "step-2")
    assert shardckpt.gc(tmp_path).removed == ()
    assert [c["name"] for c in shardckpt.ls(tmp_path).checkpoints if c["state"] == "committed"] == ["step-1", "step-4"]


def _table_after_each_save(root: str) -> list:
    """Rank 0: after each of a few sharded saves (the first unit changed each step), the table its commit remembered
    for the next save, beside the one read back from the pool's indexes."""
    import torch.distributed as dist

    from shardckpt.checkpoint import pool as pool_module
    from shardckpt.io import open_storage

    out = []
    for step in (1, 2, 3):
        _sharded_saves(root, step, 1.0)
        dist.barrier()
        if dist.get_rank() == 0:
            run = open_storage(root)
            parent = pool_module.latest_pool_checkpoint(run, None).manifest
            pool = pool_module.pool_storage(open_storage(os.path.join(root, f"step-{step}")))
            known = pool_module._remembered
            pool_module._remembered = None
            read = pool_module.parent_table(pool, parent)
            pool_module._remembered = known
            out.append((known[1] is parent, known[2] == read, len(read)))
    return out


def test_the_table_a_commit_remembers_is_the_one_its_indexes_give(tmp_path):
    """The next save's candidates come from what the last commit knew (no index parsed again): the same table, row
    for row, as reading the pool's indexes back, at ws 2 with units referenced and written on both ranks."""
    got = run_ranks(2, _table_after_each_save, str(tmp_path))[0]
    assert [(same, equal) for same, equal, _ in got] == [(True, True)] * 3
    assert all(n >= 10 for _, _, n in got)


def test_a_remembered_parent_with_a_damaged_index_is_read_again(tmp_path, monkeypatch):
    """A file of the remembered parent damaged after its commit: the table is read from the indexes again and the
    damaged file's units are written anew, as without the memory; every step loads bit for bit."""
    from shardckpt.checkpoint import pool as pool_module

    sd = state()
    save(sd, tmp_path / "step-1")
    sd["model"]["lora"].add_(1)
    save(sd, tmp_path / "step-2")
    assert pool_module._remembered is not None and pool_module._remembered[1].generation == \
        manifest(tmp_path / "step-2").generation
    damaged = manifest(tmp_path / "step-2").files[0]
    index = tmp_path / POOL_DIR / damaged.index_path
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0x01
    index.write_bytes(bytes(data))
    reads = []
    real = pool_module.read_index
    monkeypatch.setattr(pool_module, "read_index", lambda *a, **k: reads.append(1) or real(*a, **k))
    sd["model"]["lora"].add_(1)
    save(sd, tmp_path / "step-3")
    assert reads  # not the remembered table
    assert damaged.path not in {f.path for f in manifest(tmp_path / "step-3").files}
    assert_bits(shardckpt.load_full(tmp_path / "step-3"), sd)
    assert verify(tmp_path / "step-3").ok
