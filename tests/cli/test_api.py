"""Every verb is a function on the package (``shardckpt.convert(...)``) whose signature is also its
command's spec; the command answers ``--help`` without importing torch."""
from __future__ import annotations

import inspect
import logging
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

import shardckpt
from shardckpt.api.results import ConvertResult, DiffResult, ExportResult, GcResult, InspectResult, VerifyResult
from shardckpt.api.spec import VERBS, params, python_only
from shardckpt.cli.main import build_parser, main
from shardckpt.errors import BadArgumentError, CheckpointExistsError

# Parameters a command line cannot give (callbacks, process groups, in-memory values); each verb's docstring
# says what they do.
PYTHON_ONLY = {"convert": {"dst_storage_options", "progress", "spread_over", "files_per_rank", "param_names"},
               "export": {"dst_storage_options", "progress", "verify"}, "verify": {"progress"}, "diff": {"progress"}}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "run" / "step-000010"
    shardckpt.save({"model": {"w": torch.randn(16, 4), "b": torch.zeros(4)}, "step": 10}, path)
    return path


def test_every_verb_is_a_function_on_the_package_even_after_its_modules_load():
    import shardckpt.offline.convert  # noqa: F401 - the modules that do the work: they must not shadow the verbs
    import shardckpt.offline.export  # noqa: F401

    for verb in VERBS:
        function = getattr(shardckpt, verb.name)
        assert inspect.isfunction(function) and function is verb.load(), verb.name
        assert f"shardckpt {verb.name}" in " ".join((function.__doc__ or "").split()), verb.name
        assert verb.name in shardckpt.__all__


def test_the_command_line_is_the_signature():
    parser = build_parser()
    for verb in VERBS:
        function = verb.load()
        assert set(python_only(function)) == PYTHON_ONLY.get(verb.name, set()), verb.name
        args = parser.parse_args([verb.name] + ["x"] * sum(p.positional for p in params(function)))
        given = {name for name in vars(args) if name not in ("command", "run", "spec", "quiet", "verbose", "json",
                                                                "stored")}
        assert given == {p.name for p in params(function) if p.positional}, verb.name  # defaults: the function's
        help_text = parser._subparsers._group_actions[0].choices[verb.name].format_help()
        for flag in ("--quiet", "--verbose", "--json"):
            assert flag in help_text, (verb.name, flag)
        for p in params(function):
            assert p.positional or p.flags[0] in help_text, (verb.name, p.name)


def test_functions_return_results(ckpt, tmp_path):
    converted = shardckpt.convert(ckpt, tmp_path / "ws2", world_size=2, type="SHARDED", memory_limit="1GiB")
    assert isinstance(converted, ConvertResult) and converted.world_size == 2 and converted.type == "sharded"
    assert converted.tensor_bytes == 16 * 4 * 4 + 4 * 4 and converted.seconds > 0
    exported = shardckpt.export(ckpt, tmp_path / "hf", dtype="bf16", memory_limit="1GiB")
    assert isinstance(exported, ExportResult) and exported.dtype == "bfloat16" and exported.tensors == 2
    checked = shardckpt.verify(ckpt)
    assert isinstance(checked, VerifyResult) and checked.ok and checked.kind == "checkpoint" and checked.tensors == 2
    assert shardckpt.verify(tmp_path / "hf", against=ckpt).kind == "export"
    compared = shardckpt.diff(ckpt, tmp_path / "ws2")
    assert isinstance(compared, DiffResult) and compared.equal and compared.tensors == 2 == compared.by_checksum
    calls = []  # against the export: read by value (progress is told the bytes read, both sides)
    compared = shardckpt.diff(ckpt, tmp_path / "hf", only=["model"], strip_prefix="model.", atol=0.01,
                              progress=lambda done, total: calls.append((done, total)))
    assert compared.equal and compared.tensors == 2 and len(compared.dtype_differences) == 2
    total = (16 * 4 + 4) * (4 + 2)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert shardckpt.ls(tmp_path / "run").latest_path == str(ckpt)
    info = shardckpt.inspect(ckpt)
    assert isinstance(info, InspectResult) and info.format == "shardckpt" and info.details["world_size"] == 1
    assert isinstance(shardckpt.gc(ckpt), GcResult)
    assert shardckpt.latest(tmp_path / "run").latest == str(ckpt)


def test_only_and_exclude_repeat_and_leave_the_positionals_alone(ckpt, tmp_path, capsys):
    assert main(["convert", "--only", "model.w", "--only", "step", str(ckpt), str(tmp_path / "a"), "-q"]) == 0
    assert {t["name"] for t in shardckpt.inspect(tmp_path / "a").tensors} == {"model.w"}
    assert main(["convert", "--exclude", "model.b", str(ckpt), str(tmp_path / "b"), "-q"]) == 0
    assert {t["name"] for t in shardckpt.inspect(tmp_path / "b").tensors} == {"model.w"}


def test_choices_are_case_insensitive(ckpt, tmp_path):
    assert main(["convert", str(ckpt), str(tmp_path / "f"), "--type", "FULL", "--optim-key", "Name", "-q"]) == 0
    assert shardckpt.inspect(tmp_path / "f").details["state_dict_type"] in (None, "FULL_STATE_DICT")
    assert main(["export", str(ckpt), str(tmp_path / "e"), "--dtype", "BF16", "-q"]) == 0


def test_errors_name_the_flag_on_the_command_line_and_the_argument_in_python(ckpt, tmp_path, capsys):
    shardckpt.export(ckpt, tmp_path / "hf")
    with pytest.raises(CheckpointExistsError) as e:
        shardckpt.export(ckpt, tmp_path / "hf")
    assert "overwrite=True" in str(e.value) and "--overwrite" not in str(e.value)
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err
    with pytest.raises(BadArgumentError, match="dtype 'int8'"):
        shardckpt.convert(ckpt, tmp_path / "x", dtype="int8")


def test_verbose_logs_what_gc_removed(ckpt, capsys, caplog):
    debris = ckpt / "data-0123abcd"
    debris.mkdir()
    (debris / "rank-00000-0.bin").write_bytes(b"x")
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        removed = shardckpt.gc(ckpt).removed
    assert removed == ("data-0123abcd",) and any("removed" in r.message and "data-0123abcd" in r.message
                                                 for r in caplog.records)


def _help_run(argv: list[str]) -> tuple[float, bool]:
    """CPU seconds of a fresh interpreter answering ``shardckpt ARGV`` and whether it imported torch."""
    probe = ("import sys; from shardckpt.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
             "    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert "usage:" in done.stdout, done.stderr
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu, done.stderr.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("argv", [["--help"]] + [[v.name, "--help"] for v in VERBS] + [["demo", "--help"]])
def test_help_answers_fast_without_torch(argv):
    """The benchmark (benchmarks/bench_cli_start.py) has the real figure (~0.14 s of CPU; 3.2 s with torch);
    CPU time, not wall time, so that a loaded machine does not fail it."""
    cpu, torch_imported = _help_run(argv)
    assert not torch_imported, f"shardckpt {' '.join(argv)} imported torch"
    assert cpu < 1.0, f"shardckpt {' '.join(argv)}: {cpu:.2f} s of CPU"


def test_py_typed_ships_with_the_package():
    import shardckpt as package

    assert os.path.isfile(os.path.join(os.path.dirname(package.__file__), "py.typed"))
    pyproject = open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")).read()
    assert 'shardckpt = ["py.typed"]' in pyproject


def test_bytes_print_one_way_with_a_unit_and_say_what_they_count(ckpt, tmp_path, capsys):
    from shardckpt.sizes import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 * 2**30)] == ["0 B", "1023 B", "1.0 KiB", "1.5 KiB",
                                                                           "5.0 GiB"]
    assert main(["verify", str(ckpt)]) == 0
    assert re.search(r"2 tensors, \d+ chunks, 272 B of tensor data checked", capsys.readouterr().out)
    assert main(["inspect", str(ckpt)]) == 0
    header = capsys.readouterr().out.splitlines()
    assert re.search(r"2 tensors, 272 B of tensor data in \d+ files \(\d+ B on disk\)$", header[0]), header[0]
    assert ["name", "dtype", "shape", "tensor", "bytes", "crc32c"] in [line.split() for line in header]
