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
