"""The benchmarks are not run by the suite (they take minutes), so that what they import from shardckpt still
exists is checked here: a renamed or removed name broke ``bench_async_save.py`` once without a failing test."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib

import pytest
import torch

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


def _big_convert_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS[0].parent))
    return importlib.import_module("bench_convert_big")


def test_the_big_convert_benchmark_generates_a_checkpoint_that_verifies(tmp_path, monkeypatch):
    # its generator calls the writer and the commit directly: a changed signature broke it without a failing test
    import shardckpt

    bench = _big_convert_bench(monkeypatch)
    path = str(tmp_path / "generated")
    _, tensors = bench.generate(path, 0.004)
    report = shardckpt.verify(path)
    assert report.ok and report.tensors == tensors > 0


def test_the_big_convert_benchmark_generates_a_deepspeed_checkpoint_that_reads_back(tmp_path, monkeypatch):
    import shardckpt

    bench = _big_convert_bench(monkeypatch)
    path = str(tmp_path / "zero2")
    _, params = bench.generate_deepspeed(path, 0.004)
    full = shardckpt.load_full(path)
    shapes = bench.param_shapes(0.004)
    assert len(shapes) == params > 0 and full["deepspeed"]["zero_stage"] == 2
    assert {n: tuple(t.shape) for n, t in full["model"].items()} == {n: tuple(s) for n, s in shapes.items()}
    for name in shapes:  # the values are the pool's: finite, not all equal, Adam state of each parameter present
        assert torch.isfinite(full["model"][name]).all() and full["model"][name].std() > 0
        assert full["optim"]["state"][name]["exp_avg_sq"].shape == full["model"][name].shape
