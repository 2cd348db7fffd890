"""Run directories on the command line (issue 35, item 7): `ls RUN_DIR`, `gc RUN_DIR`, and inspect / export /
diff given a run directory (they said only "it holds no checkpoint format shardckpt reads") or --latest."""
from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt.cli.main import main


@pytest.fixture
def run_dir(tmp_path) -> str:
    """step-000010 and step-000020 committed (LOCAL-typed metadata on the second), step-000030 what a killed
    save leaves: a data directory and no manifest."""
    run = str(tmp_path / "example")
    for step in (10, 20):
        shardckpt.save({"model": {"w": torch.full((256,), float(step))}, "step": step}, f"{run}/step-{step:06d}",
                       metadata={"state_dict_type": "FULL_STATE_DICT"} if step == 20 else None)
    os.makedirs(f"{run}/step-000030/data-abc123")
    with open(f"{run}/step-000030/data-abc123/rank-00000-0.bin", "wb") as f:
        f.write(b"x" * 2048)
    return run


def test_ls_lists_step_state_type_world_size_and_size(run_dir, capsys):
    assert main(["ls", run_dir]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"{run_dir}: 3 checkpoints below (2 committed, 1 incomplete); the latest committed is "
                        f"{run_dir}/step-000020")
    assert lines[1].split() == ["name", "step", "state", "format", "type", "world", "files", "debris"]
    assert lines[2].split() == ["step-000010", "10", "committed", "shardckpt", "-", "1", "1.0", "KiB", "-"]
    assert lines[3].split() == ["*", "step-000020", "20", "committed", "shardckpt", "FULL_STATE_DICT", "1", "1.0",
                                "KiB", "-"]
    assert lines[4].split() == ["step-000030", "30", "incomplete", "-", "-", "-", "-", "1", "(2.0", "KiB)"]


def test_ls_json(run_dir, capsys):
    assert main(["ls", run_dir, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["latest"] == "step-000020" and out["latest_path"] == f"{run_dir}/step-000020"
    assert [(c["name"], c["step"], c["state"]) for c in out["checkpoints"]] == [
        ("step-000010", 10, "committed"), ("step-000020", 20, "committed"), ("step-000030", 30, "incomplete")]
    killed = out["checkpoints"][2]
    assert killed["debris"] == ["data-abc123"] and killed["debris_bytes"] == 2048 and killed["live"] == []
    assert set(out["checkpoints"][0]) == {"name", "path", "step", "state", "format", "file_bytes", "state_dict_type",
                                          "world_size", "debris", "debris_bytes", "live", "detail"}


def test_ls_of_a_missing_directory_exits_2(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_gc_of_a_run_directory_removes_the_debris_below_and_the_emptied_directory(run_dir, capsys):
    assert main(["gc", run_dir]) == 0
    out = capsys.readouterr().out
    assert "removed step-000030/data-abc123" in out and "removed step-000030/" in out
    assert out.strip().endswith(f"{run_dir}: removed 2 entries")  # it said "removed 0 entries"
    assert sorted(os.listdir(run_dir)) == ["step-000010", "step-000020"]


@pytest.mark.parametrize("verb", ["inspect", "export", "diff"])
def test_a_run_directory_where_a_checkpoint_is_expected_names_those_below(run_dir, tmp_path, verb, capsys):
    argv = {"inspect": [run_dir], "export": [run_dir, str(tmp_path / "out")],
            "diff": [f"{run_dir}/step-000010", run_dir]}[verb]
    assert main([verb, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a run directory, not a checkpoint" in err
    assert "step-000010, step-000020, step-000030" in err and f"latest committed is {run_dir}/step-000020" in err
    assert "--latest" in err and not os.path.exists(tmp_path / "out")


def test_a_missing_checkpoint_is_named_not_a_committed_one_with_others_below(tmp_path, capsys):
    """diff A MISSING, where A is a checkpoint with another checkpoint below it (convert A A/ws2 is allowed): the
    error names MISSING (adversarial review: it called A "a run directory, not a checkpoint")."""
    a = tmp_path / "a"
    shardckpt.save({"w": torch.randn(4, 4)}, a)
    shardckpt.convert(a, a / "ws2", world_size=2)
    assert main(["diff", str(a), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "missing") in err and "run directory" not in err, err


def test_inspect_and_export_take_the_latest_checkpoint(run_dir, tmp_path, capsys):
    assert main(["inspect", run_dir, "--latest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == f"{run_dir}/step-000020"
    assert main(["export", run_dir, str(tmp_path / "out"), "--latest", "--quiet"]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["w"], torch.full((256,), 20.0))


def test_diff_latest_resolves_each_side_that_is_a_run_directory(run_dir, capsys):
    assert main(["diff", run_dir, f"{run_dir}/step-000020", "--latest"]) == 0
    assert capsys.readouterr().out.startswith("equal:")
    assert main(["diff", f"{run_dir}/step-000010", run_dir, "--latest"]) == 1


def test_latest_without_a_committed_checkpoint_exits_2(tmp_path, capsys):
    os.makedirs(tmp_path / "run")
    assert main(["inspect", str(tmp_path / "run"), "--latest"]) == 2
    assert "--latest: no checkpoint below" in capsys.readouterr().err
