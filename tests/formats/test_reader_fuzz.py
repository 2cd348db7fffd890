"""Reader resource bounds (issue 34): every foreign reader's memory and time are bounded by the bytes of the files it
reads, and only a ``CheckpointError`` leaves a public function, whatever the damage.

``_reader_fuzz.py`` runs seeded cases per format (DCP ``.metadata``, ``planner_data`` and data files; DeepSpeed file
names and structures; safetensors headers; ``torch.save`` pickles and archives) in a child process whose address
space is capped at 384 MiB above what it maps once torch is imported, and whose CPU time is capped (10 s a public call):
a ``MemoryError``, a ``RecursionError``, any other exception, a call over its CPU time, a reader presenting more
tensor bytes than its files hold, a wrong value where the format checksums, or the child killed by a cap fails it.
The four formats run side by side. Deterministic (fixed seeds); more cases on demand:

    SHARDCKPT_READER_FUZZ_CASES=3000 SHARDCKPT_READER_FUZZ_SEED=7 python -m pytest tests/formats/test_reader_fuzz.py -s
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = int(os.environ.get("SHARDCKPT_READER_FUZZ_CASES", "250"))  # per format
SEED = int(os.environ.get("SHARDCKPT_READER_FUZZ_SEED", "34"))
DRIVER = Path(__file__).with_name("_reader_fuzz.py")
FORMATS = ("deepspeed", "dcp", "safetensors", "torch-save")


@pytest.mark.timeout(1800)
def test_damaged_checkpoints_are_refused_within_memory_and_time_bounds(tmp_path):
    procs = {fmt: subprocess.Popen([sys.executable, str(DRIVER), fmt, str(tmp_path / fmt), str(CASES), str(SEED)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for fmt in FORMATS}
    reports, problems = {}, []
    for fmt, proc in procs.items():
        out, err = proc.communicate(timeout=1700)
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            progress = tmp_path / fmt / "progress"
            last = progress.read_text() if progress.exists() else "(none)"
            problems.append(f"{fmt}: the fuzzer exited {proc.returncode} (killed by a cap?) in case {last}\n"
                            f"{err[-3000:]}")
            continue
        reports[fmt] = json.loads(lines[-1])
    print(f"\nreader fuzz, {CASES} cases per format (seed {SEED}): read whole, refused (CheckpointError), failures; "
          "cases by kind")
    for fmt, row in reports.items():
        kinds = {k: v for k, v in row.items() if k not in ("format", "cases", "read", "refused", "failed",
                                                            "failures", "failure_count")}
        print(f"  {fmt:12s} {row.get('read', 0):5d} {row.get('refused', 0):5d} {row['failure_count']:4d}  {kinds}")
    assert not problems, "\n".join(problems)
    for fmt, row in reports.items():
        assert row["failure_count"] == 0, (fmt, row["failures"])
        assert row.get("read", 0) + row.get("refused", 0) == CASES, (fmt, row)
        assert row.get("refused", 0) > CASES // 4 and row.get("read", 0) > 0, (fmt, row)  # the damage reaches checks
