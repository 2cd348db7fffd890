"""Fuzzing the manifest parser, the chunk index and every foreign reader (issue 16, hostile inputs): the
only outcomes allowed are a ``CheckpointError`` or a load of exactly the original bytes, within a memory cap.

The fuzzing runs in a child process (``_fuzz.py``) whose address space is capped at 2 GiB above what it
holds after its imports, so that a memory bomb fails it instead of this process. Briefly in CI, longer on
demand:

    SHARDCKPT_FUZZ_EXAMPLES=5000 python -m pytest tests/storage/test_fuzz.py -s
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = int(os.environ.get("SHARDCKPT_FUZZ_EXAMPLES", "300"))  # per target; ~25 s in all here
DRIVER = Path(__file__).with_name("_fuzz.py")


@pytest.mark.timeout(1800)
def test_fuzzed_inputs_are_refused_or_read_exactly(tmp_path):
    proc = subprocess.run([sys.executable, str(DRIVER), str(tmp_path / "work"), str(EXAMPLES)],
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nfuzz ({EXAMPLES} examples per target): examples, refused (CheckpointError), loaded exactly (of "
          "which verify flags an inconsistency the load did not need), failures")
    for target, row in report.items():
        print(f"  {target:15s} {row['examples']:6d} {row.get('refused', 0):8d} {row.get('loaded', 0):8d} "
              f"({row.get('loaded, verify damaged', 0)}) {row['failure_count']:6d}")
    for target, row in report.items():
        assert row["examples"] == EXAMPLES, (target, row)
        assert row["failure_count"] == 0, (target, row["failures"])
        assert row.get("refused", 0) > 0, target  # the mutations do reach the checks
