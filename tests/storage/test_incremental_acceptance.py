"""Issue 39's acceptance test: ten incremental saves of a LoRA fine-tune, each killed (SIGKILL, a real forked
process) at a storage operation drawn from its count and then restarted; random ``rm``s (some killed), a ``gc``
killed midway and an unkilled one after every save. After every event every committed step loads bit for bit and
verifies; the bytes on disk are reported against ten full saves (tests/storage/_acceptance.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_acceptance.py")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [1, 2])
def test_ten_incremental_saves_with_kills_deletions_and_gc(tmp_path, seed):
    out = subprocess.run([sys.executable, SCRIPT, str(tmp_path), str(seed)], capture_output=True, text=True,
                         timeout=850)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nbytes on disk {found['bytes_on_disk']} vs ten full saves {found['ten_full_saves']}: "
          f"{found['ratio']:.3f}x; events: {found['events']}")
    assert found["failures"] == []
    assert sum("killed=True" in e for e in found["events"] if e.startswith("save")) >= 8
    assert found["ratio"] <= 0.3
