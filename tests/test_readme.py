"""The README's first commands are what CI runs: keep them from drifting apart."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commands() -> list[str]:
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()[:12]
    return [line.strip() for line in lines if line.startswith("    python3 -m venv")]


def test_readme_opens_with_the_demo_and_the_test_command():
    demo, tests = _commands()
    assert demo.endswith("shardckpt demo") and "constraints-cpu.txt" in demo
    assert "pytest" in tests and "constraints-cpu.txt" in tests


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _commands()[1] in ci.splitlines()
