"""The corruption matrix extended to pooled chunks (issue 39): a flipped byte in a chunk several steps share is
reported by every step that uses it (naming the pool file and the tensor), and by no other; damaged or missing
pool files, indexes and pool.json are refused by name; hostile v5 manifests are refused."""
from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt import CheckpointNotFoundError, CorruptCheckpointError
from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import seal
from tests.checkpoint.test_incremental import manifest

UNIT = 64 << 10


def pooled_run(root) -> dict:
    sd = {"base": torch.arange(65_536, dtype=torch.float32), "lora": torch.zeros(64)}
    for step in (1, 2, 3):
        sd["lora"].fill_(step)
        shardckpt.save(sd, root / f"step-{step}", incremental=True, incremental_unit=UNIT)
    sd["lora"].fill_(9)
    shardckpt.save(sd, root / "alone")  # not pooled: never affected
    return sd


def base_file(root) -> tuple[str, int]:
    """The pool data file holding base's first unit (written by step 1), and that chunk's offset in it."""
    m = manifest(root / "step-1")
    f = m.tensors["base"].chunks.file(0)
    index = json.loads(open(root / "shardckpt-pool" / m.files[f].index_path, "rb").read())
    row = next(r for r in index["chunks"] if r[0] == "base" and r[1] == 0)
    return str(root / "shardckpt-pool" / m.files[f].path), row[2]


def flip_a_base_byte(root) -> str:
    """Flip one bit of base's first chunk, which steps 1-3 share; returns its pool file."""
    path, offset = base_file(root)
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    return path


def test_a_flipped_byte_in_a_shared_chunk_is_reported_for_every_step_using_it(tmp_path):
    pooled_run(tmp_path)
    path = flip_a_base_byte(tmp_path)
    for step in ("step-1", "step-2", "step-3"):
        report = verify(tmp_path / step)
        assert not report.ok, step
        assert any(p.tensor == "base" and os.path.basename(path) in (p.file or "") for p in report.problems), step
        with pytest.raises(CorruptCheckpointError, match="base"):
            shardckpt.load_full(tmp_path / step)
    assert verify(tmp_path / "alone").ok and shardckpt.load_full(tmp_path / "alone")["lora"][0] == 9
    target = {"lora": torch.zeros(64)}
    shardckpt.load(target, tmp_path / "step-3", strict=False)  # what does not read the damaged chunk still loads
    assert target["lora"][0] == 3


def test_verify_of_a_run_reads_each_shared_chunk_once_and_reports_it_for_every_step(tmp_path, capsys):
    pooled_run(tmp_path)
    alone = [verify(tmp_path / s) for s in ("step-1", "step-2", "step-3", "alone")]
    run = shardckpt.verify(tmp_path)
    assert run.ok and run.kind == "run" and [c["name"] for c in run.checkpoints] == ["step-1", "step-2", "step-3",
                                                                                     "alone"]
    assert run.tensors == sum(r.tensors for r in alone) and run.chunks == sum(r.chunks for r in alone)
    base = 65_536 * 4
    # base is read once for the three steps (and once for "alone", which is not pooled); lora once per step
    assert run.tensor_bytes == 2 * base + 4 * 64 * 4 < sum(r.bytes_checked for r in alone)
    flip_a_base_byte(tmp_path)
    run = shardckpt.verify(tmp_path)
    assert not run.ok
    assert [c["ok"] for c in run.checkpoints] == [False, False, False, True]
    for step in ("step-1", "step-2", "step-3"):  # the same problems as each step's own verify, named by the step
        assert {(p.tensor, p.file, f"{step}: {p.message}") for p in verify(tmp_path / step).problems} == \
            {(p.tensor, p.file, p.message) for p in run.problems if p.message.startswith(f"{step}: ")}
    from shardckpt.cli.main import main

    assert main(["verify", str(tmp_path)]) == 1
    assert "3 of 4 checkpoints: step-1, step-2, step-3" in capsys.readouterr().err
    assert shardckpt.verify(tmp_path / "step-1").kind == "checkpoint"
    (tmp_path / "step-2" / "manifest.json").write_bytes(b"{damaged")  # a step that cannot be read: said, by name
    run = shardckpt.verify(tmp_path)
    assert any(p.message.startswith("step-2: ") and "manifest" in p.message for p in run.problems)


def test_a_damaged_pool_index_truncated_or_missing_file(tmp_path):
    pooled_run(tmp_path)
    path, _ = base_file(tmp_path)
    index = path.replace(".bin", ".index.json")
    original = open(index, "rb").read()
    open(index, "wb").write(original.replace(b'"base"', b'"bass"', 1))
    for step in ("step-1", "step-2", "step-3"):
        assert not verify(tmp_path / step).ok
    open(index, "wb").write(original)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    for step in ("step-1", "step-2", "step-3"):
        with pytest.raises(CorruptCheckpointError):
            shardckpt.load_full(tmp_path / step)
    os.unlink(path)
    for step in ("step-1", "step-2", "step-3"):
        assert not verify(tmp_path / step).ok


def test_a_missing_pool_json(tmp_path):
    pooled_run(tmp_path)
    os.unlink(tmp_path / "shardckpt-pool" / "pool.json")
    with pytest.raises(CheckpointNotFoundError, match="pool"):
        shardckpt.load_full(tmp_path / "step-2")


def _rewrite(path, edit) -> None:
    raw = open(path, "rb").read()
    doc = json.loads(b"{" + raw[len('{"crc32c":"00000000",'):])
    edit(doc)
    open(path, "wb").write(seal(json.dumps(doc, separators=(",", ":")).encode()))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["pool"].update(path="../elsewhere"), "pool path"),
    (lambda d: d["pool"].update(path="../../shardckpt-pool"), "pool path"),
    (lambda d: d.pop("pool"), "must have a 'pool'"),
    (lambda d: d["pool"].update(id="XYZ"), "pool id"),
    (lambda d: d["files"][0].update(path="../step-1/manifest.json"), "unsafe|outside"),
    (lambda d: d["files"][0].update(path="shardckpt-pool.json"), "outside every data-"),
])
def test_hostile_v5_manifests_are_refused(tmp_path, edit, message):
    pooled_run(tmp_path)
    _rewrite(tmp_path / "step-2" / "manifest.json", edit)
    with pytest.raises(CorruptCheckpointError, match=message):
        shardckpt.load_full(tmp_path / "step-2")


def test_a_pool_field_in_an_older_version_is_refused(tmp_path):
    pooled_run(tmp_path)
    _rewrite(tmp_path / "alone" / "manifest.json", lambda d: d.update(pool={"path": "../shardckpt-pool",
                                                                             "id": "0" * 32}))
    with pytest.raises(CorruptCheckpointError, match="'pool' is a format v5 field"):
        shardckpt.load_full(tmp_path / "alone")


def test_verify_of_a_run_checks_the_runs_below_a_run_too(tmp_path):
    pooled_run(tmp_path / "sub")
    shardckpt.save({"w": torch.ones(3)}, tmp_path / "step-1")
    run = shardckpt.verify(tmp_path)
    assert run.ok and [c["name"] for c in run.checkpoints] == ["step-1", "sub/step-1", "sub/step-2", "sub/step-3",
                                                               "sub/alone"]
    flip_a_base_byte(tmp_path / "sub")
    run = shardckpt.verify(tmp_path)
    assert [c["ok"] for c in run.checkpoints] == [True, False, False, False, True]


def test_a_tensor_in_a_missing_file_is_not_checked_and_has_no_checksum_to_differ(tmp_path):
    pooled_run(tmp_path)
    path, _ = base_file(tmp_path)
    os.unlink(path)
    problems = verify(tmp_path / "step-2").problems
    assert any(p.tensor == "base" and "not checked" in p.message for p in problems)
    assert not any("tensor checksum" in p.message for p in problems)
