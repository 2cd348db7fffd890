"""The benchmarks are not run by the suite (they take minutes), so that what they import from shardckpt still
exists is checked here: a renamed or removed name broke ``bench_async_save.py`` once without a failing test."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib

import pytest

BENCHMARKS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def _shardckpt_imports(path: pathlib.Path) -> list[tuple[str, str | None]]:
    """(module, name) for every ``from shardckpt... import name`` and ``import shardckpt...``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardckpt":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "shardckpt"]
    return found


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_what_a_benchmark_imports_from_shardckpt_exists(path):
    for module, name in _shardckpt_imports(path):
        imported = importlib.import_module(module)
        if name is not None:
            assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}") is not None, (
                f"{path.name} imports {name} from {module}, which has no such name")


def test_the_big_convert_benchmark_generates_a_checkpoint_that_verifies(tmp_path, monkeypatch):
    # its generator calls the writer and the commit directly: a changed signature broke it without a failing test
    import shardckpt

    monkeypatch.syspath_prepend(str(BENCHMARKS[0].parent))
    bench = importlib.import_module("bench_convert_big")
    path = str(tmp_path / "generated")
    _, tensors = bench.generate(path, 0.004)
    report = shardckpt.verify(path)
    assert report.ok and report.tensors == tensors > 0
