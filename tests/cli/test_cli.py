"""The `shardckpt` command, driven through main(argv) as a user would type it."""
from __future__ import annotations

import glob
import json

import pytest
import torch

import shardckpt
from shardckpt.cli.main import main


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ckpt")
    shardckpt.save({"model": {"w": torch.randn(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, "step": 3}, path,
                   metadata={"state_dict_type": "FULL_STATE_DICT"})
    return path


def test_inspect_prints_one_row_per_tensor(ckpt, capsys):
    assert main(["inspect", ckpt]) == 0
    out = capsys.readouterr().out
    assert "world size 1" in out and "FULL_STATE_DICT" in out
    assert any(line.startswith("model.w") and "float32" in line and "64x8" in line for line in out.splitlines())


def test_inspect_json_lists_tensors(ckpt, capsys):
    assert main(["inspect", ckpt, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {(t["name"], t["dtype"], tuple(t["shape"])) for t in info["tensors"]} == {
        ("model.w", "float32", (64, 8)), ("model.b", "bfloat16", (8,))}
    assert info["total_bytes"] == 64 * 8 * 4 + 8 * 2


def test_verify_sound_checkpoint_exits_0(ckpt, capsys):
    assert main(["verify", ckpt, "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("OK ")


def test_verify_flipped_byte_exits_1_naming_tensor_and_file(ckpt, capsys):
    data_file = sorted(glob.glob(f"{ckpt}/data-*/rank-*.bin"))[0]  # slot 0 holds the biggest tensor
    raw = bytearray(open(data_file, "rb").read())
    raw[100] ^= 0x40  # inside model.w (written first, 2 KiB)
    open(data_file, "wb").write(bytes(raw))
    assert main(["verify", ckpt, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "model.w" in err and data_file in err and "model.b" not in err


def test_verify_json_reports_problems(ckpt, capsys):
    for index in glob.glob(f"{ckpt}/data-*/rank-*.index.json"):
        open(index, "a").write(" ")
    assert main(["verify", ckpt, "--quiet", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and "index" in report["problems"][0]["message"]


def test_missing_checkpoint_exits_2(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err


def test_bad_usage_exits_2():
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


def test_storage_options_parse_json_values_and_dotted_keys():
    from shardckpt.cli.main import build_parser
    from shardckpt.cli.options import storage_options

    args = build_parser().parse_args(["verify", "s3://b/c", "-o", "endpoint_url=http://127.0.0.1:9000", "-o",
                                      "anon=true", "--storage-option", "client_kwargs.region_name=eu-west-1"])
    assert storage_options(args) == {"endpoint_url": "http://127.0.0.1:9000", "anon": True,
                                     "client_kwargs": {"region_name": "eu-west-1"}}
    assert storage_options(build_parser().parse_args(["inspect", "/x"])) is None


@pytest.mark.parametrize("bad", ["novalue", "=x", "a=1,a.b=2"])
def test_bad_storage_option_exits_2(ckpt, bad, capsys):
    argv = ["inspect", ckpt] + [x for item in bad.split(",") for x in ("-o", item)]
    assert main(argv) == 2
    assert "--storage-option" in capsys.readouterr().err
