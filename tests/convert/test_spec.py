"""The verbs' specs (``offline.spec``): one frozen object per verb, checked whole when built, whose fields are the
public function's keywords and the command's options; the command line and the Python API refuse a bad value
with the same words."""
from __future__ import annotations

import dataclasses
import inspect
import pickle
import re

import pytest
import torch

import shardckpt
from shardckpt.api.spec import params
from shardckpt.cli.main import main
from shardckpt.cli.verbs import in_cli_words
from shardckpt.errors import BadArgumentError
from shardckpt.offline.spec import ConvertSpec, ExportSpec
from shardckpt.state_dict import OptimStateKeyType

SPECS = {"convert": ConvertSpec, "export": ExportSpec}

# (verb, option on the command line, its text, the keyword in Python, its value): a value the command line's
# parser refuses (argparse: exit 2) and the spec refuses with the same words
PARSED = [
    ("convert", "--world-size", "0", "world_size", 0),
    ("convert", "--workers", "-1", "workers", -1),
    ("convert", "--dtype", "int8", "dtype", "int8"),
    ("convert", "--compress", "lz4", "compress", "lz4"),
    ("convert", "--memory-limit", "12XB", "memory_limit", "12XB"),
    ("export", "--dtype", "int8", "dtype", "int8"),
    ("export", "--max-shard-size", "0", "max_shard_size", "0"),
    ("export", "--memory-limit", "lots", "memory_limit", "lots"),
]
# refused after parsing, by the spec alone: the command returns 2 with the spec's message in its flags' words
CHECKED = [
    ("convert", ["--world-size", str((1 << 24) + 1)], {"world_size": (1 << 24) + 1}),
    ("convert", ["--format", "dcp", "--workers", "2"], {"format": "dcp", "workers": 2}),
    ("convert", ["--format", "dcp", "--type", "local"], {"format": "dcp", "type": "local"}),
    ("convert", ["--format", "dcp", "--compress", "zstd"], {"format": "dcp", "compress": "zstd"}),
    ("convert", ["--reverse"], {"reverse": True}),
    ("export", ["--reverse"], {"reverse": True}),
]


def _api_error(verb: str, **kwargs) -> str:
    with pytest.raises(BadArgumentError) as e:
        SPECS[verb]("src", "dst", **kwargs)
    with pytest.raises(BadArgumentError) as again:  # the public function builds the same spec
        getattr(shardckpt, verb)("src", "dst", **kwargs)
    assert str(again.value) == str(e.value)
    return str(e.value)


@pytest.mark.parametrize("verb, flag, text, name, value", PARSED)
def test_the_command_lines_parser_and_the_api_refuse_with_the_same_words(verb, flag, text, name, value, capsys):
    message = _api_error(verb, **{name: value})
    with pytest.raises(SystemExit) as exit_info:
        main([verb, "src", "dst", flag, text])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("verb, argv, kwargs", CHECKED)
def test_what_the_spec_refuses_after_parsing_the_command_says_in_its_flags(verb, argv, kwargs, capsys):
    message = _api_error(verb, **kwargs)
    spec = params(getattr(shardckpt, verb))
    assert main([verb, "src", "dst", *argv]) == 2
    assert f"shardckpt {verb}: error: {in_cli_words(message, spec)}\n" == capsys.readouterr().err


@pytest.mark.parametrize("verb", SPECS)
def test_the_public_signature_is_the_spec_and_what_python_adds(verb):
    function, spec = getattr(shardckpt, verb), SPECS[verb]
    extra = ["progress", "spread_over"] if verb == "convert" else ["progress"]
    assert list(inspect.signature(function).parameters) == [f.name for f in dataclasses.fields(spec)] + extra
    with pytest.raises(TypeError, match="unexpected keyword argument 'world_sizes'"):
        function("src", "dst", world_sizes=2)


def test_a_spec_is_frozen_normalised_and_picklable():
    spec = ConvertSpec("a", "b", world_size=3, type="SHARDED", optim_key=OptimStateKeyType.PARAM_NAME,
                       dtype="torch.bfloat16", only="model", exclude=["optim.state"], memory_limit="1GiB",
                       storage_options={"anon": True})
    assert (spec.type, spec.optim_key, spec.dtype, spec.only, spec.exclude) == \
        ("sharded", "name", torch.bfloat16, ("model",), ("optim.state",))  # one string is one prefix
    assert spec.memory_limit == 1 << 30 and spec.files_per_rank == 2 and spec.dst_storage_options == {"anon": True}
    assert pickle.loads(pickle.dumps(spec)) == spec  # what convert_in_workers sends its workers
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.world_size = 4
    with pytest.raises(BadArgumentError, match="world_size 0: must be a positive int"):
        dataclasses.replace(spec, world_size=0)  # a changed spec is checked again
    export = ExportSpec("a", "b", dtype=torch.float16, max_shard_size="2KB", only="model", dst_storage_options={})
    assert (export.dtype, export.max_shard_size, export.only, export.dst_storage_options) == \
        ("float16", 2000, ("model",), {})
    assert ExportSpec("a", "b", dtype="BF16", strip_prefix="").dtype == "bfloat16"


@pytest.mark.parametrize("verb, kwargs, says", [
    ("convert", {"type": "flat"}, "type must be 'full', 'sharded' or 'local', got 'flat'"),
    ("convert", {"optim_key": "ids"}, "optim_key must be 'name' or 'id', got 'ids'"),
    ("convert", {"files_per_rank": 65}, "files_per_rank 65: at most 64"),
    ("convert", {"only": [1]}, "only [1]: expected a sequence of dotted-name prefixes"),
    ("convert", {"overwrite": "yes"}, "overwrite 'yes': expected True or False"),
    ("convert", {"storage_options": "anon=true"}, "storage_options 'anon=true': expected a dict"),
    ("export", {"rename_map": {"(": "x"}}, "rename_map: rename rule '(': not a regular expression"),
    ("export", {"verify": 1}, "verify 1: expected True or False"),
])
def test_python_only_values_are_refused_naming_the_argument(verb, kwargs, says):
    with pytest.raises(BadArgumentError, match=re.escape(says)):
        SPECS[verb]("src", "dst", **kwargs)
