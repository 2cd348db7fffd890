"""``latest_checkpoint`` finds where a job resumes: the newest committed checkpoint, interrupted saves skipped."""
from __future__ import annotations

import os

import pytest
import torch

import shardckpt
from shardckpt.checkpoint.latest import step_of


@pytest.mark.parametrize("name, step", [("step-1000", 1000), ("global_step500", 500), ("step_000120-ws3", 120),
                                        ("ckpt-300", 300), ("Step7", 7), ("v2-step-10", 10), ("final", None),
                                        ("export-fp16", None), ("model_v2", None), ("checkpoint_500", 500),
                                        ("epoch=1-step=500", 500), ("hf-bf16-300", 300), ("ws3", None),
                                        ("step1k", None), ("step1.5k", None), ("step-10k", None), ("step-2e3", None),
                                        ("step-0x1f", None), ("step-100.5", None), ("step500", 500)])
def test_step_of_a_name(name, step):
    assert step_of(name) == step


def _save(root, name):
    shardckpt.save({"w": torch.arange(4.0), "name": name}, os.path.join(root, name))


def test_the_highest_committed_step_wins_and_interrupted_saves_are_skipped(tmp_path):
    root = str(tmp_path / "run")
    assert shardckpt.latest_checkpoint(root) is None  # no directory yet: a fresh start
    for name in ("step-9", "step-10", "notes"):
        _save(root, name)
    assert shardckpt.latest_checkpoint(root) == os.path.join(root, "step-10")  # by number, not by string
    os.makedirs(os.path.join(root, "step-20", "data-0abc"))  # what a killed save leaves: no manifest
    (tmp_path / "run" / "step-30").write_text("a file, not a checkpoint")
    assert shardckpt.latest_checkpoint(root) == os.path.join(root, "step-10")
    assert shardckpt.load_full(shardckpt.latest_checkpoint(root))["name"] == "step-10"


def test_fsspec_urls_come_back_as_urls():
    root = "memory://latest-test/run"
    for name in ("step-1", "step-2"):
        _save(root, name)
    assert shardckpt.latest_checkpoint(root) == "memory://latest-test/run/step-2"
    assert shardckpt.load_full(shardckpt.latest_checkpoint(root))["name"] == "step-2"
