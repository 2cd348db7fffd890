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


@pytest.mark.parametrize("compress", [None, "zstd"])
def test_inspect_of_a_checkpoint_with_an_empty_tensor_says_compressed_only_when_it_is(tmp_path, capsys, compress):
    """An empty tensor has no chunks, hence no codecs: not a damaged index ("?"), and no sign of compression
    (adversarial review: an uncompressed checkpoint was shown "compressed: 0.64x smaller (codecs ?, raw)")."""
    state = {"w": torch.zeros(4096), "empty": torch.empty(0, 3)}
    shardckpt.save(state, tmp_path / "ck", compress=compress)
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert ("compressed:" in out) == (compress is not None) and "?" not in out, out


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
    from shardckpt.cli.verbs import keyword_arguments

    from shardckpt import StorageOptions, StorageTuning

    args = build_parser().parse_args(["verify", "s3://b/c", "-o", "endpoint_url=http://127.0.0.1:9000", "-o",
                                      "anon=true", "--storage-option", "client_kwargs.region_name=eu-west-1",
                                      "-o", "retry_deadline_s=30"])
    assert keyword_arguments(args.spec, args)["storage_options"] == StorageOptions({
        "endpoint_url": "http://127.0.0.1:9000", "anon": True, "client_kwargs": {"region_name": "eu-west-1"}},
        StorageTuning(retry_deadline_s=30))  # shardckpt's own key typed at the edge
    args = build_parser().parse_args(["inspect", "/x"])
    assert "storage_options" not in keyword_arguments(args.spec, args)  # not given: the function's default


@pytest.mark.parametrize("bad", ["novalue", "=x", "a=1,a.b=2"])
def test_bad_storage_option_exits_2(ckpt, bad, capsys):
    argv = ["inspect", ckpt] + [x for item in bad.split(",") for x in ("-o", item)]
    assert main(argv) == 2
    assert "--storage-option" in capsys.readouterr().err


# Other formats: inspect lists them as logical tensors; verify refuses them (it checks shardckpt's checksums).

@pytest.fixture
def foreign(tmp_path):
    """One checkpoint of each foreign format, the same two tensors and a plain value."""
    import warnings

    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    w, b = torch.randn(64, 8), torch.zeros(8, dtype=torch.bfloat16)
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.torch.save_file({"model.w": w}, str(hf / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    safetensors.torch.save_file({"model.b": b}, str(hf / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.w": "model-00001-of-00002.safetensors", "model.b": "model-00002-of-00002.safetensors"}}))
    safetensors.torch.save_file({"model.w": w, "model.b": b}, str(tmp_path / "one.safetensors"))
    torch.save({"model": {"w": w, "b": b}, "step": 3}, str(tmp_path / "state.pt"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it assumes a single process
        dcp.save({"model": {"w": w, "b": b}, "step": 3}, checkpoint_id=str(tmp_path / "dcp"))
    return {"hf": str(hf), "file": str(tmp_path / "one.safetensors"), "torch.save": str(tmp_path / "state.pt"),
            "dcp": str(tmp_path / "dcp")}


@pytest.mark.parametrize("kind, title, values", [
    ("hf", "safetensors (Hugging Face directory, 2 files), 2 tensors", "__metadata__"),
    ("file", "safetensors, 2 tensors", "none"),
    ("torch.save", "torch.save, 2 tensors", "step"),
    ("dcp", "torch DCP (1 data file), 2 tensors", "step"),
])
def test_inspect_a_foreign_format_lists_its_tensors(foreign, kind, title, values, capsys):
    assert main(["inspect", foreign[kind]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{foreign[kind]}: {title}, 2.0 KiB of tensor data"
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("model.")}
    assert rows == {"model.w": ["model.w", "float32", "64x8", "2.0", "KiB", "-"],
                    "model.b": ["model.b", "bfloat16", "8", "16", "B", "-"]}
    assert lines[-1] == f"plain values: {values}"


@pytest.mark.parametrize("kind, fmt", [("hf", "safetensors"), ("torch.save", "torch.save"), ("dcp", "torch DCP")])
def test_inspect_json_of_a_foreign_format(foreign, kind, fmt, capsys):
    assert main(["inspect", foreign[kind], "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == fmt and info["path"] == foreign[kind]
    assert {(t["name"], t["dtype"], tuple(t["shape"]), t["bytes"], t["crc32c"]) for t in info["tensors"]} == {
        ("model.w", "float32", (64, 8), 64 * 8 * 4, None), ("model.b", "bfloat16", (8,), 16, None)}
    assert info["total_bytes"] == 64 * 8 * 4 + 8 * 2
    assert info["values"] == (["__metadata__"] if kind == "hf" else ["step"])


@pytest.mark.parametrize("kind", ["hf", "file"])
def test_verify_checks_the_structure_of_a_safetensors_export(foreign, kind, capsys):
    assert main(["verify", foreign[kind], "--quiet"]) == 0
    assert capsys.readouterr().out.startswith(f"OK {foreign[kind]}: ")


@pytest.mark.parametrize("kind", ["torch.save", "dcp"])
def test_verify_refuses_a_foreign_format_with_exit_2(foreign, kind, capsys):
    assert main(["verify", foreign[kind], "--quiet"]) == 2
    captured = capsys.readouterr()
    assert "verify checks shardckpt checkpoints" in captured.err and foreign[kind] in captured.err
    assert captured.out == ""


def test_inspect_of_nothing_readable_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "Looked for" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "typo")]) == 2
    err = capsys.readouterr().err
    assert err == f"shardckpt inspect: error: {tmp_path / 'typo'}: no such file or directory\n", err


class _Terminal:
    """A stderr that says it is a terminal, keeping what is written."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_progress_bars_show_on_a_terminal_only_and_not_when_quiet(capsys):
    from shardckpt.cli.progress import Progress

    shown, quiet = _Terminal(), _Terminal()
    for stream, is_quiet in ((shown, False), (quiet, True)):
        bar = Progress("convert", quiet=is_quiet, stream=stream)
        for done in (0, 1 << 20, 3 << 20, 4 << 20):
            bar(done, 4 << 20)
        bar.close()
    assert "convert" in shown.text and "100%" in shown.text and "4.00M" in shown.text, shown.text
    assert quiet.text == ""
    bar = Progress("verify")  # pytest's stderr is no terminal
    bar(1, 2)
    bar.close()
    assert capsys.readouterr().err == ""


def test_an_error_of_the_system_is_one_line_naming_the_path(ckpt, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    # (a limit above what the process holds: no warning line, whatever ran before in this process)
    assert main(["convert", ckpt, str(tmp_path / "a-file" / "dst"), "--quiet", "--memory-limit", "64GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardckpt convert: error: ") and "a-file" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_inspect_shows_a_local_checkpoint_by_parameter_and_as_stored_on_request(tmp_path, capsys):
    from torch import nn

    from shardckpt.runtime import shard

    model = shard(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), wrap=(nn.Linear,))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    path = str(tmp_path / "local")
    shardckpt.save_state(model, optim, path, type=shardckpt.StateDictType.LOCAL_STATE_DICT)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "stored as LOCAL: 2 flat groups padded for world size 1" in out
    assert "model.0.weight" in out and "8x4" in out and "optim.state.2.bias.exp_avg" in out
    assert "_flat_param " not in out.split("shown by parameter")[1]
    assert main(["inspect", path, "--stored"]) == 0
    stored = capsys.readouterr().out
    assert "model.0._flat_param" in stored and "model.0.weight" not in stored
    assert main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {p["name"]: p["shape"] for p in info["parameters"]}["model.2.weight"] == [2, 8]
    assert main(["inspect", path.replace("local", "plain")]) == 2  # nothing there: the usual error
