"""The README's main job, `shardckpt demo`, runs end to end (small sizes)."""
from __future__ import annotations

from shardckpt.demo import run_demo


def test_demo_runs_every_stage(tmp_path):
    lines: list[str] = []
    run_demo(str(tmp_path), layers=1, hidden=32, vocab=100, say=lines.append)
    stages = {int(line.split(".")[0]): line for line in lines if line[:1].isdigit()}
    assert sorted(stages) == list(range(1, 9)), lines
    assert "verify: OK" in stages[3] and "fails its checksum" in stages[6]
    assert "largest difference" in stages[8]
