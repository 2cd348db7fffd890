"""Crash safety of the chunk pool on local disk (issue 39): kill -9 at every step boundary of an incremental save, of
``gc`` and of ``rm``, and a collector (``gc``; ``rm`` of the save's parent, then ``gc``) run at every boundary of a
save; after each, every committed step loads bit for bit and verifies, before and after an unkilled gc, and a
further save works (tests/checkpoint/_pool_crasher.py, forked real processes). A protocol with the saver's holds
dropped is caught by the same trials."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CRASHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pool_crasher.py")


def _run(tmp_path, ops: str, *mutant: str) -> dict:
    out = subprocess.run([sys.executable, CRASHER, str(tmp_path), ops, *mutant], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1500)
def test_kill_and_collectors_at_every_boundary_of_save_gc_and_rm(tmp_path):
    found = _run(tmp_path, "save,gc,rm,save_gc,save_rm_gc")
    assert found["trials"]["save"] >= 10 and found["trials"]["gc"] >= 4 and found["trials"]["rm"] >= 2
    assert found["failures"] == []


@pytest.mark.timeout(600)
def test_the_trials_catch_a_saver_that_does_not_hold_what_it_references(tmp_path):
    found = _run(tmp_path, "save_rm_gc", "no_saver_holds")
    assert any("file missing" in f for f in found["failures"])

