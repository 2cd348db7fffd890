"""`shardckpt demo --tiers` end to end in a reduced mode: a node lost, the run resumed from a peer's replica."""
from __future__ import annotations

import json
import os

import pytest

from shardckpt.cli.main import main
from shardckpt.demo.config import TiersDemoConfig
from shardckpt.demo.tiers_job import run_tiers_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo-tiers") / "run")
    lines: list[str] = []
    summary = run_tiers_demo(TiersDemoConfig(out=out, steps=40, save_every=5, persistent_every=10, crash_at=15),
                             say=lines.append)
    return out, summary, lines


def test_every_check_passes_and_the_resume_reads_the_replicas(demo):
    out, summary, lines = demo
    assert summary["checksums_equal"] is True and lines[-1] == "checksums_equal: true", lines
    names = [c["name"] for c in summary["checks"]]
    assert "the restart restored the newest complete step" in names and "node 1's shards came from the replicas" in names
    assert sum(n.startswith("verify persistent/") for n in names) >= 1  # tier 2 held step 10 at least
    resume = summary["resume"]
    assert resume["from_step"] == resume["expected_step"] >= 15 and resume["from_step"] % 5 == 0
    assert resume["bytes_by_tier"]["tier1"] > 0 and resume["bytes_by_tier"]["tier0"] > 0
    assert resume["steps_saved_over_tier2"] == resume["from_step"] - resume["tier2_newest_step"] > 0
    regrow = summary["regrow"]  # node 0's newest copy corrupted, node 1 back empty
    assert regrow["from_step"] == regrow["expected_step"] and regrow["copies_excluded"] >= 1
    assert regrow["corrupted"].startswith("nodes/node-0/") and sum(regrow["bytes_by_tier"].values()) > 0
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f) == json.loads(json.dumps(summary))


def test_the_resumed_losses_continue_the_killed_runs(demo):
    _, summary, _ = demo
    first, resumed = (dict(map(tuple, summary["losses"][k])) for k in ("first", "resumed"))
    start = summary["resume"]["from_step"]
    assert min(resumed) == start and max(resumed) == summary["steps"] - 1
    overlap = [s for s in resumed if s in first]
    assert len(overlap) >= 2 and overlap[0] == start
    assert max(abs(first[s] - resumed[s]) for s in overlap) < 2e-3


@pytest.mark.parametrize("argv, message", [
    (["demo", "--persistent-every", "10"], "applies to the tiers variant"),
    (["demo", "--tiers", "--save-every", "10", "--persistent-every", "15"], "multiple of save_every"),
    (["demo", "--tiers", "--steps", "12", "--save-every", "2", "--crash-at", "11", "--persistent-every", "2"],
     "use --steps 16 or more"),
])
def test_settings_that_do_not_fit_are_a_usage_error(tmp_path, capsys, argv, message):
    assert main(argv + ["--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
