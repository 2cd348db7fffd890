"""The README's main job, `shardckpt demo`, end to end in a reduced mode (fewer steps), and its failure paths."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from shardckpt.cli.main import build_parser, main
from shardckpt.demo.config import DemoConfig, DemoError
from shardckpt.demo.job import _loss_continuity, _prepare, run_demo
from shardckpt.demo.processes import TrainingRanks
from tests.test_readme import demo_line


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The README's `shardckpt demo` example (reduced: fewer steps), with its output in a temporary directory."""
    args = build_parser().parse_args(demo_line())
    assert (args.steps, args.save_every, args.crash_at) == (40, 10, 20)  # the assertions below count on these
    out = str(tmp_path_factory.mktemp("demo") / "run")
    lines: list[str] = []
    summary = run_demo(DemoConfig(out=out, steps=args.steps, save_every=args.save_every, crash_at=args.crash_at),
                       say=lines.append)
    return out, summary, lines


def test_every_check_passes_and_is_written_down(demo):
    out, summary, lines = demo
    assert summary["checksums_equal"] is True and lines[-1] == "checksums_equal: true", lines
    assert [c["ok"] for c in summary["checks"]] == [True] * 5, summary["checks"]
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f) == json.loads(json.dumps(summary))
    assert [line[:2] for line in lines[:6]] == ["1.", "2.", "3.", "4.", "5.", "6."], lines


def test_the_kill_lands_while_a_save_is_written_and_the_run_resumes_from_the_one_before(demo):
    out, summary, _ = demo
    crash = summary["crash"]
    assert crash["save_in_flight"] and crash["bytes_on_disk_at_kill"] > 0
    assert crash["step"] >= 20 and crash["last_committed_step"] == crash["step"] - 10
    assert crash["debris_removed_by_gc"] and not os.path.exists(os.path.join(out, "checkpoints", f"step-{crash['step']:06d}",
                                                                             crash["debris_removed_by_gc"][0]))
    assert summary["convert"]["src"].endswith(f"step-{crash['last_committed_step']:06d}")
    sizes = {c["world_size"] for c in summary["checkpoints"]}
    assert sizes == {2, 3} and all(c["bytes"] > 0 for c in summary["checkpoints"])
    assert summary["saves"]["count"] >= 4 and summary["saves"]["training_blocked_s_total"] > 0


def test_the_resumed_loss_continues_from_the_killed_runs(demo):
    _, summary, _ = demo
    first, resumed = (dict(map(tuple, summary["losses"][k])) for k in ("first", "resumed"))
    start = summary["resume"]["from_step"]
    assert min(resumed) == start and max(resumed) == summary["steps"] - 1
    overlap = [s for s in resumed if s in first]
    assert overlap and overlap[0] == start  # the killed run trained past its last committed checkpoint
    assert max(abs(first[s] - resumed[s]) for s in overlap) < 1e-3
    assert resumed[max(resumed)] < first[0] / 2  # it learns


def test_the_export_equals_the_final_weights_in_bf16(demo):
    out, summary, _ = demo
    weights = torch.load(os.path.join(out, "final-weights.pt"), weights_only=True)
    exported = {}
    for name in summary["export"]["files"]:
        if name.endswith(".safetensors"):
            exported.update(load_file(os.path.join(out, "export", name)))
    assert exported and set(exported) <= set(weights)
    assert set(weights) - set(exported) <= {"head.weight"}  # tied to embed.weight: written once
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, weights[name].to(torch.bfloat16)), name


def test_the_loss_plot_is_drawn(demo):
    out, summary, _ = demo
    assert summary["loss_png"] == os.path.join(out, "loss.png")
    with open(summary["loss_png"], "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_rerun_replaces_its_own_files_but_never_anothers(tmp_path):
    (tmp_path / "mine" / "checkpoints").mkdir(parents=True)  # names like the demo's, in a directory it did not make
    (tmp_path / "mine" / "summary.json").write_text("{}")
    with pytest.raises(DemoError, match=r"not written by shardckpt demo \(no .shardckpt-demo there\)"):
        _prepare(str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "summary.json").read_text() == "{}"
    assert _prepare(str(tmp_path / "run")) == str(tmp_path / "run")  # a demo's directory: cleared on a rerun
    (tmp_path / "run" / "summary.json").write_text("{}")
    assert _prepare(str(tmp_path / "run")) == str(tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()
    (tmp_path / "run" / "thesis.tex").write_text("mine")
    with pytest.raises(DemoError, match=r"holds files the demo did not write \(thesis.tex\)"):
        _prepare(str(tmp_path / "run"))
    assert (tmp_path / "run" / "thesis.tex").read_text() == "mine"


def test_a_diverging_resume_fails_the_continuity_check():
    assert _loss_continuity({5: 1.0, 6: 0.9}, {5: 1.0, 6: 0.9 + 1e-7, 7: 0.8})["ok"]
    assert not _loss_continuity({5: 1.0, 6: 0.9}, {5: 1.0, 6: 0.95})["ok"]
    assert not _loss_continuity({5: 1.0}, {6: 1.0})["ok"]  # nothing to compare is no proof


@pytest.mark.parametrize("config, message", [
    (DemoConfig(steps=40, save_every=10, crash_at=25), "must be a save step"),
    (DemoConfig(steps=40, save_every=10, crash_at=40), "crash_at"),
])
def test_bad_settings_are_refused(config, message):
    with pytest.raises(DemoError, match=message):
        config.check()


def test_a_failing_rank_stops_the_demo_with_its_log(tmp_path):
    ranks = TrainingRanks(1, ["--steps", "nonsense"], str(tmp_path), "first")
    ranks.procs[0].wait()
    with pytest.raises(DemoError, match=r"training rank 0 exited with 2:(.|\n)*invalid int value(.|\n)*first-rank0.log"):
        ranks.check()


def test_an_unusable_out_is_a_usage_error_in_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert main(["demo", "--out", str(tmp_path)]) == 2  # was 1, the code of a failed check
    err = capsys.readouterr().err
    assert err.startswith("shardckpt demo: error: ") and "notes.txt" in err and err.count("\n") == 1, err
    for out, says in [(tmp_path / "notes.txt", "is a file, not a directory"),
                      (tmp_path / "notes.txt" / "run", "cannot create"),
                      ]:
        assert main(["demo", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert says in err and str(out) in err and "Errno" not in err and err.count("\n") == 1, err
    assert main(["demo", "--out", str(tmp_path / "new"), "--steps", "30", "--crash-at", "40"]) == 2
    assert (tmp_path / "notes.txt").read_text() == "x"


def test_the_command_exits_1_with_one_line_on_failure(tmp_path, capsys, monkeypatch):
    import shardckpt.demo.job as job
    monkeypatch.setattr(job, "run_demo", lambda config: {"checksums_equal": False})
    assert main(["demo", "--out", str(tmp_path / "new")]) == 1
    monkeypatch.setattr(job, "run_demo", lambda config: {"checksums_equal": True})
    assert main(["demo", "--out", str(tmp_path / "new"), "--steps", "30"]) == 0


def test_help_tells_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "kill -9" in text and "--crash-at" in text and "examples:" in text
