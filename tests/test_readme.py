"""The README cannot rot: its first commands are what CI runs, its examples are the files in examples/, and
every fenced code block runs (python and bash blocks, in order, in one directory, as a reader would;
``text`` blocks are synopses and listings)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
DEMO_LINE = "shardckpt demo "  # run by tests/test_demo.py (demo_line below), not twice


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _commands() -> list[str]:
    lines = _readme().splitlines()[:12]
    return [line.strip() for line in lines if line.startswith("    python3 -m venv")]


def blocks() -> list[tuple[str, str]]:
    return FENCE.findall(_readme())


def _examples() -> dict[str, str]:
    folder = os.path.join(ROOT, "examples")
    return {name: open(os.path.join(folder, name), encoding="utf-8").read()
            for name in sorted(os.listdir(folder)) if name.endswith(".py")}


def demo_line() -> list[str]:
    """The README's example of `shardckpt demo`, as arguments."""
    lines = [line for lang, code in blocks() if lang == "bash" for line in code.splitlines()
             if line.startswith(DEMO_LINE)]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])[1:]


def test_readme_opens_with_the_demo_and_the_test_command():
    demo, tests = _commands()
    assert demo.endswith("shardckpt demo") and "constraints-cpu.txt" in demo and ".[demo]" in demo
    assert "pytest" in tests and "constraints-cpu.txt" in tests


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _commands()[1] in ci.splitlines()


def test_every_fenced_block_says_what_it_is():
    assert blocks() and {lang for lang, _ in blocks()} <= {"python", "bash", "text"}, [lang for lang, _ in blocks()]


def test_the_readme_shows_the_examples_as_they_are():
    shown = [code for lang, code in blocks() if lang == "python"]
    for name, text in _examples().items():
        assert text in shown, f"README.md does not show examples/{name} as it is"


@pytest.mark.timeout(1200)  # every block in turn, transformers' ones too: past 600 s on a loaded machine
def test_every_code_block_runs(tmp_path):
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    examples = set(_examples().values())
    ran = 0
    for lang, code in blocks():
        if lang == "python" and code not in examples:  # the examples run under the torchrun lines below them
            cmd = [sys.executable, "-c", code]
        elif lang == "bash":
            script = "\n".join(line for line in code.splitlines() if not line.startswith(DEMO_LINE))
            cmd = ["bash", "-euo", "pipefail", "-c", script]
        else:
            continue
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"this README block failed:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ran += 1
    assert ran == 9  # 4 python, the CLI, export for inference, the DCP backend, the 2 torchrun pairs
    assert sorted(os.listdir(tmp_path / "runs" / "example-hf")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]


@pytest.mark.parametrize("name", ["--help", "--version"])
def test_the_command_line_tool_answers(name):
    done = subprocess.run([sys.executable, "-m", "shardckpt.cli.main", name], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip()


def test_the_cpu_install_for_an_ordinary_machine_takes_the_pinned_torch_from_the_cpu_index():
    # The constraints' pin alone is the CUDA build on PyPI: the README says how to get the CPU one, same version.
    with open(os.path.join(ROOT, "constraints-cpu.txt"), encoding="utf-8") as f:
        pin = re.search(r"^torch==(\S+)$", f.read(), re.MULTILINE).group(1)
    readme = _readme()
    assert f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in readme
