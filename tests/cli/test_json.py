"""``--json`` on every verb prints one object whose keys are the ones docs/json.md documents for it."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

import shardckpt
from shardckpt.cli.main import main

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "json.md")


def documented_keys() -> dict[str, set[str]]:
    """verb -> the keys of its table in docs/json.md."""
    out: dict[str, set[str]] = {}
    verb = None
    for line in open(DOC, encoding="utf-8"):
        if line.startswith("## "):
            verb = line[3:].strip()
        elif verb and (m := re.match(r"\| `(\w+)` \|", line)):
            out.setdefault(verb, set()).add(m.group(1))
    return out


@pytest.fixture
def run_dir(tmp_path):
    state = {"model": {"w": torch.randn(16, 4), "b": torch.zeros(4)}, "optim": {"state": {}}, "step": 3}
    shardckpt.save(state, tmp_path / "run" / "step-000003")
    return tmp_path / "run"


def _json(argv, capsys, code=0) -> dict:
    assert main([*argv, "--json"]) == code, capsys.readouterr().err
    out = capsys.readouterr().out
    return json.loads(out)


def test_every_verb_prints_its_documented_keys(run_dir, tmp_path, capsys):
    ckpt = str(run_dir / "step-000003")
    doc = documented_keys()
    outputs = {
        "convert": _json(["convert", ckpt, str(tmp_path / "ws2"), "--world-size", "2"], capsys),
        "export": _json(["export", ckpt, str(tmp_path / "hf")], capsys),
        "verify": _json(["verify", ckpt], capsys),
        "diff": _json(["diff", ckpt, str(tmp_path / "ws2")], capsys),
        "inspect": _json(["inspect", ckpt], capsys),
        "gc": _json(["gc", ckpt, "--dry-run"], capsys),
        "latest": _json(["latest", str(run_dir)], capsys),
        "ls": _json(["ls", str(run_dir)], capsys),
    }
    shardckpt.save({"x": torch.zeros(2)}, run_dir / "step-000001")
    outputs["rm"] = _json(["rm", str(run_dir / "step-000001")], capsys)
    assert set(doc) == set(outputs), "docs/json.md has one table per verb"
    for verb, out in outputs.items():
        if verb == "inspect":  # the common keys, then what the format tells
            assert doc[verb] <= set(out), (verb, doc[verb] - set(out))
        else:
            assert set(out) == doc[verb], (verb, set(out) ^ doc[verb])
        assert out["schema_version"] == 1
    assert outputs["verify"]["ok"] and outputs["diff"]["equal"] and outputs["latest"]["latest"] == ckpt
    assert outputs["ls"]["latest_path"] == ckpt and outputs["ls"]["checkpoints"][0]["state"] == "committed"
    assert outputs["convert"]["world_size"] == 2 and outputs["convert"]["tensor_bytes"] > 0
    assert outputs["export"]["files"] == ["model.safetensors"] and outputs["export"]["tensors"] == 2
    export_check = _json(["verify", str(tmp_path / "hf"), "--against", ckpt], capsys)
    assert set(export_check) == doc["verify"] and export_check["kind"] == "export" and export_check["ok"]


def test_json_of_a_failed_check_exits_1(run_dir, tmp_path, capsys):
    ckpt = str(run_dir / "step-000003")
    shardckpt.save({"model": {"w": torch.zeros(16, 4), "b": torch.zeros(4)}, "optim": {"state": {}}, "step": 3},
                   tmp_path / "other")
    out = _json(["diff", ckpt, str(tmp_path / "other")], capsys, code=1)
    assert not out["equal"] and [d["name"] for d in out["differences"]] == ["model.w"]
    out = _json(["latest", str(tmp_path / "other")], capsys, code=1)
    assert out["latest"] is None


def test_quiet_prints_nothing_on_success(run_dir, tmp_path, capsys):
    ckpt = str(run_dir / "step-000003")
    for argv in (["convert", ckpt, str(tmp_path / "c"), "--memory-limit", "8GiB"], ["export", ckpt, str(tmp_path / "e")],
                 ["inspect", ckpt], ["gc", ckpt]):
        assert main([*argv, "-q"]) == 0
        assert capsys.readouterr() == ("", ""), argv
