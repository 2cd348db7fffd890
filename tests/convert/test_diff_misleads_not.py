"""``diff`` that does not mislead (issue 35, item 8): a checkpoint against its own export (it reported every name
as "only in" and "0 tensors compared"), two exports that differ only in their ``__metadata__`` (it said
DIFFERENT), fp32 against a bf16 export with a tolerance (a dtype difference made it DIFFERENT whatever the
values), and a progress bar as the other long verbs have."""
from __future__ import annotations

import json

import pytest
import torch

import shardckpt
from shardckpt.cli.main import main
from shardckpt.offline.diff import diff
from shardckpt.offline.export import export
from shardckpt.errors import IncompatibleCheckpointError


@pytest.fixture
def trained(tmp_path) -> str:
    """A training checkpoint as a loop saves it: model weights, optimizer state, the step."""
    g = torch.Generator().manual_seed(0)
    model = {"embed.weight": torch.randn(64, 16, generator=g), "head.weight": torch.randn(8, 16, generator=g)}
    state = {"model": model, "optim": {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in model.items()}},
             "step": 7}
    path = str(tmp_path / "step-000007")
    shardckpt.save(state, path)
    return path


def test_a_checkpoint_against_its_own_export_says_what_to_do_when_nothing_is_compared(trained, tmp_path):
    export(trained, tmp_path / "hf")
    report = diff(trained, tmp_path / "hf")
    assert not report.equal and report.tensors == 0
    [hint] = report.notes
    assert "nothing was compared" in hint and "--only model --strip-prefix model." in hint
    assert "shardckpt verify EXPORT --against CHECKPOINT" in hint


def test_only_and_strip_prefix_compare_a_checkpoint_with_its_export(trained, tmp_path):
    export(trained, tmp_path / "hf")
    report = diff(trained, tmp_path / "hf", only=["model"], strip_prefix="model.")
    assert report.equal, report.differences
    assert report.tensors == 2 and report.plain_values == 0  # step and the optimizer state left out
    assert report.notes == ["only=['model'] selects nothing in B: B is compared whole"]
    changed = tmp_path / "changed"
    shardckpt.save({"model": {"embed.weight": torch.zeros(64, 16), "head.weight": torch.zeros(8, 16)}}, changed)
    report = diff(changed, tmp_path / "hf", only=["model"], strip_prefix="model.")
    assert sorted((d.name, d.kind) for d in report.differences) == [("embed.weight", "values"),
                                                                    ("head.weight", "values")]


def test_only_selects_on_both_sides_and_strip_prefix_refuses_a_collision(tmp_path):
    shardckpt.save({"model": {"w": torch.ones(3)}, "ema": {"w": torch.ones(3) * 2}}, tmp_path / "a")
    shardckpt.save({"model": {"w": torch.ones(3)}, "ema": {"w": torch.zeros(3)}}, tmp_path / "b")
    assert not diff(tmp_path / "a", tmp_path / "b").equal
    assert diff(tmp_path / "a", tmp_path / "b", only=["model"]).equal
    assert [d.name for d in diff(tmp_path / "a", tmp_path / "b", only=["ema"]).differences] == ["ema.w"]
    shardckpt.save({"model": {"w": torch.ones(3)}, "w": torch.ones(3)}, tmp_path / "c")
    with pytest.raises(IncompatibleCheckpointError, match="'model.w' and 'w' both become 'w'"):
        diff(tmp_path / "c", tmp_path / "a", strip_prefix="model.")


def test_exports_of_identical_tensors_from_other_paths_are_equal_files(trained, tmp_path):
    copy = tmp_path / "copy"
    shardckpt.save(shardckpt.load_full(trained), copy)
    export(trained, tmp_path / "hf-a")
    export(copy, tmp_path / "hf-b")
    report = diff(tmp_path / "hf-a", tmp_path / "hf-b")
    assert report.equal and report.tensors == 2 and report.differences == []  # it said DIFFERENT
    assert report.metadata_differences == []  # no path or save generation in __metadata__ (issue 36)


def test_exports_that_differ_in_metadata_only_are_equal_their_metadata_apart(trained, tmp_path):
    export(trained, tmp_path / "hf-a")
    export(trained, tmp_path / "hf-b", adapter="hf")  # HF's names as they are: the same tensors, noted in metadata
    report = diff(tmp_path / "hf-a", tmp_path / "hf-b")
    assert report.equal and report.tensors == 2 and report.differences == []
    fields = {d.name: d.detail for d in report.metadata_differences}
    assert "__metadata__.adapter" in fields and "__metadata__.export_id" not in fields, fields
    assert all(d.kind == "metadata" for d in report.metadata_differences)


def test_fp32_against_a_bf16_export_within_a_tolerance_says_the_dtypes_differ(trained, tmp_path):
    export(trained, tmp_path / "fp32")
    export(trained, tmp_path / "bf16", dtype="bfloat16")
    exact = diff(tmp_path / "fp32", tmp_path / "bf16")
    assert not exact.equal and {d.kind for d in exact.differences} >= {"dtype"}  # bits: not the same
    within = diff(tmp_path / "fp32", tmp_path / "bf16", atol=0.02, rtol=0.01)
    assert within.equal, within.differences  # bf16 keeps 8 bits of mantissa: within 1/128 relative
    assert [(d.name, d.detail) for d in within.dtype_differences] == [("embed.weight", "float32 != bfloat16"),
                                                                      ("head.weight", "float32 != bfloat16")]
    too_tight = diff(tmp_path / "fp32", tmp_path / "bf16", atol=1e-6)
    assert [d.kind for d in too_tight.differences] == ["values", "values"] and too_tight.dtype_differences


def test_an_integer_against_a_float_stays_a_difference_under_a_tolerance(tmp_path):
    shardckpt.save({"i": torch.arange(4)}, tmp_path / "a")
    shardckpt.save({"i": torch.arange(4).double()}, tmp_path / "b")
    report = diff(tmp_path / "a", tmp_path / "b", atol=0.5)
    assert [d.kind for d in report.differences] == ["dtype"] and report.dtype_differences == []


def test_progress_is_told_the_bytes_read(trained, tmp_path):
    export(trained, tmp_path / "hf")
    calls = []
    diff(trained, tmp_path / "hf", only=["model"], strip_prefix="model.", slice_bytes=1024,
         progress=lambda done, total: calls.append((done, total)))
    total = 2 * (64 * 16 + 8 * 16) * 4
    assert calls[0] == (0, total) and calls[-1] == (total, total) and len(calls) > 3
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))


def test_cli_strip_prefix_only_and_the_notes(trained, tmp_path, capsys):
    export(trained, tmp_path / "hf")
    assert main(["diff", trained, str(tmp_path / "hf")]) == 1
    out = capsys.readouterr().out
    assert "0 tensors compared" in out and "note: no tensor name is in both" in out and "verify EXPORT --against" in out
    assert main(["diff", trained, str(tmp_path / "hf"), "--only", "model", "--strip-prefix", "model."]) == 0
    assert capsys.readouterr().out.startswith("equal: 2 tensors compared")


def test_cli_metadata_and_dtypes_reported_apart(trained, tmp_path, capsys):
    export(trained, tmp_path / "fp32")
    export(trained, tmp_path / "bf16", dtype="bfloat16")
    assert main(["diff", str(tmp_path / "fp32"), str(tmp_path / "bf16"), "--atol", "0.02", "--rtol", "0.01"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("equal: 2 tensors compared")
    assert "dtypes differ, values compared within the tolerance: embed.weight (float32 != bfloat16)" in out
    assert "file metadata differs" not in out  # one source: export_id, the one field apart, is no value
    assert main(["diff", str(tmp_path / "fp32"), str(tmp_path / "bf16"), "--atol", "0.02", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] and len(doc["dtype_differences"]) == 2 and doc["differences"] == []
    assert doc["metadata_differences"] == [] and doc["notes"] == []


def test_cli_shows_a_progress_bar_on_a_terminal(trained, tmp_path, monkeypatch):
    from tests.cli.test_cli import _Terminal

    export(trained, tmp_path / "hf")
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["diff", trained, str(tmp_path / "hf"), "--only", "model", "--strip-prefix", "model."]) == 0
    assert "diff" in terminal.text and "100%" in terminal.text
    terminal.text = ""
    assert main(["diff", trained, str(tmp_path / "hf"), "--only", "model", "--strip-prefix", "model.", "--quiet"]) == 0
    assert terminal.text == ""
