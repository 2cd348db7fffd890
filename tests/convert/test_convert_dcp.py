"""``convert --format dcp``: any readable checkpoint written as a torch DCP directory, checked against torch's own
reader bit for bit (``dcp_to_torch_save`` and ``dcp.load`` into FSDP2 at another world size), resumed after a
kill, committed atomically, and read back by shardckpt's DCP reader."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardckpt
from shardckpt.errors import BadArgumentError, CheckpointExistsError, CorruptCheckpointError, UnsupportedValueError
from shardckpt.format.tree import TensorRef
from shardckpt.offline import dcp_output, memory
from shardckpt.offline.convert import convert
from shardckpt.offline.dcp_layout import flat_boxes, flat_keys
from shardckpt.offline.diff import diff
from shardckpt.offline.export import export
from shardckpt.regions import strides
from shardckpt.state_dict import OptimStateKeyType
from tests._dist import run_ranks
from tests.convert import _dcp_ranks
from tests.convert._kill import killed_after
from tests.convert.test_convert import _train_and_save
from tests.formats._deepspeed_layout import write_like_deepspeed


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(10, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
                      "s": torch.tensor(2.0), "e": torch.empty(0, 4), "two": torch.randn(2, generator=g),
                      "i": torch.arange(5), "big": torch.randn(9, 7, 5, generator=g)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]},
            "step": 5}


def _same(a, b, where="") -> None:
    """Equal trees: the same keys, values, tensor dtypes, shapes and bits."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where  # bits: NaNs too
    else:
        assert a == b, (where, a, b)


def _torch_reads(path, tmp_path) -> dict:
    out = tmp_path / f"{os.path.basename(path)}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


# --- the plan ---------------------------------------------------------------------------------------------------

def test_boxes_tile_each_range_in_order_as_contiguous_runs_within_the_limit():
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        limit = rng.randint(1, numel + 2)
        at = start
        for offsets, sizes, flat in flat_boxes(shape, start, stop, limit):
            assert flat.start == at and 0 < flat.numel <= limit and math.prod(sizes) == flat.numel
            assert sum(o * s for o, s in zip(offsets, strides(shape))) == flat.start
            last = sum((o + z - 1) * s for o, z, s in zip(offsets, sizes, strides(shape)))
            assert last == flat.stop - 1  # one contiguous run
            assert all(o + z <= d for o, z, d in zip(offsets, sizes, shape))
            at = flat.stop
        assert at == stop, (shape, start, stop, limit)


def test_flattened_keys_and_paths_are_torchs():
    tree = {"model": {"a": TensorRef("model.a"), "l": [TensorRef("model.l.0"), {"x": 1}], "n": [1, 2],
                      "t": (0.9, 0.99), "k": {3: TensorRef("model.k.3")}},
            "optim": {"param_groups": [{"lr": 0.1, "params": ["a"]}]}, "step": 5}
    as_tensors = _with_tensors(tree)
    flat, mappings = flatten_state_dict(as_tensors)
    ours = flat_keys(tree)
    assert [k for k, _, _ in ours] == list(flat) and {k: p for k, p, _ in ours} == mappings


def _with_tensors(tree):
    if isinstance(tree, TensorRef):
        return torch.zeros(1)
    if isinstance(tree, dict):
        return {k: _with_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_with_tensors(v) for v in tree]
    return tree


# --- torch reads it, bit for bit -------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 3, 4])
def test_a_sharded_source_converts_to_what_torch_reads_bit_for_bit(tmp_path, world, monkeypatch):
    src = tmp_path / "src"
    shardckpt.save(_state(), tmp_path / "full")
    convert(tmp_path / "full", src, world_size=2)  # a SHARDED checkpoint of 2 ranks
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    report = convert(src, tmp_path / "dcp", world_size=world, format="dcp", memory_limit=4096)  # many chunks
    assert report.world_size == world and report.type == "sharded"
    want = shardckpt.load_full(src)
    _same(_torch_reads(tmp_path / "dcp", tmp_path), want)
    files = sorted(f for f in os.listdir(tmp_path / "dcp"))
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]
    _same(shardckpt.load_full(tmp_path / "dcp"), want)  # shardckpt's DCP reader reads it back
    assert diff(src, tmp_path / "dcp").equal


def test_each_source_format_converts_to_what_torch_reads(tmp_path):
    g = torch.Generator().manual_seed(0)
    groups = [{"w0": torch.randn(6, 5, generator=g), "w1": torch.randn(7, generator=g)}]
    write_like_deepspeed(str(tmp_path / "zero"), 3, 2, groups)
    shardckpt.save(_state(), tmp_path / "native")
    export(tmp_path / "native", tmp_path / "hf", only=["model"])
    for name in ("zero", "hf"):
        convert(tmp_path / name, tmp_path / f"{name}-dcp", world_size=3, format="dcp")
        _same(_torch_reads(tmp_path / f"{name}-dcp", tmp_path), shardckpt.load_full(tmp_path / name))


@pytest.fixture(scope="module")
def runtime_local(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runtime"))
    run_ranks(2, _train_and_save, root)
    return root


def test_a_local_flat_checkpoint_converts_to_the_jobs_full_state_as_torch_reads_it(runtime_local, tmp_path):
    """A LOCAL checkpoint of shardckpt's runtime (flat shards of 2 ranks) -> DCP at 3: torch reads the job's FULL
    state dict (name-keyed optimizer state), bit for bit."""
    key = OptimStateKeyType.PARAM_NAME.name
    convert(f"{runtime_local}/LOCAL_STATE_DICT-{key}", tmp_path / "dcp", world_size=3, format="dcp")
    _same(_torch_reads(tmp_path / "dcp", tmp_path), shardckpt.load_full(f"{runtime_local}/FULL_STATE_DICT-{key}"))


def test_a_cast_converts_floats_only(tmp_path):
    shardckpt.save(_state(), tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dcp", world_size=2, format="dcp", dtype=torch.bfloat16)
    got, want = _torch_reads(tmp_path / "dcp", tmp_path), shardckpt.load_full(tmp_path / "src")
    assert got["model"]["w"].dtype == torch.bfloat16 and torch.equal(got["model"]["w"], want["model"]["w"].bfloat16())
    assert torch.equal(got["model"]["i"], want["model"]["i"])


def test_fsdp2_loads_the_converted_checkpoint_at_another_world_size_and_trains_on_the_same(tmp_path):
    """saved by FSDP2 at 2 ranks (shardckpt.save of get_state_dict) -> DCP at 3 -> torch's dcp.load at 3."""
    uninterrupted = run_ranks(2, _dcp_ranks.train_save_and_go_on, str(tmp_path / "ws2"))[0]
    convert(tmp_path / "ws2", tmp_path / "dcp3", world_size=3, format="dcp")
    resumed = run_ranks(3, _dcp_ranks.load_dcp_and_go_on, str(tmp_path / "dcp3"))[0]
    assert len(resumed) == _dcp_ranks.AFTER
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(resumed, uninterrupted)), (resumed, uninterrupted)


# --- resume, commit, refusals ----------------------------------------------------------------------------------

def test_a_killed_dcp_convert_keeps_its_finished_ranks_and_commits_what_an_uninterrupted_run_does(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    killed_after(2, dcp_output._RankFile, "write", lambda: convert(src, dst, world_size=4, format="dcp"))
    assert not (dst / ".metadata").exists()  # nothing half-written reads as DCP
    with open(dst / "__1_0.distcp", "r+b") as f:  # a kept file that no longer checks is written again
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    report = convert(src, dst, world_size=4, format="dcp")
    assert report.kept_ranks == (0,)
    _same(_torch_reads(dst, tmp_path), shardckpt.load_full(src))
    assert sorted(os.listdir(dst)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]


def test_values_that_do_not_match_the_sources_checksums_commit_nothing_and_are_not_kept(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_state(), src)
    real = dcp_output._chunk
    monkeypatch.setattr(dcp_output, "_chunk", lambda *a: (lambda t, crc: (t, crc ^ 1))(*real(*a)))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        convert(src, dst, world_size=2, format="dcp")
    assert not (dst / ".metadata").exists()
    monkeypatch.setattr(dcp_output, "_chunk", real)
    assert convert(src, dst, world_size=2, format="dcp").kept_ranks == ()
    _same(_torch_reads(dst, tmp_path), shardckpt.load_full(src))


def test_a_committed_dcp_checkpoint_is_kept_unless_overwrite_and_read_whole_until_replaced(tmp_path, monkeypatch):
    shardckpt.save(_state(), tmp_path / "src")
    shardckpt.save({"model": {"w": torch.ones(4)}}, tmp_path / "other")
    convert(tmp_path / "src", tmp_path / "dst", world_size=3, format="dcp")
    with pytest.raises(CheckpointExistsError):
        convert(tmp_path / "other", tmp_path / "dst", format="dcp")
    seen = []
    real = dcp_output._check_against_source

    def check_then_read_the_old(*args):  # just before the commit: the old checkpoint still reads whole
        seen.append(_torch_reads(tmp_path / "dst", tmp_path))
        return real(*args)

    monkeypatch.setattr(dcp_output, "_check_against_source", check_then_read_the_old)
    convert(tmp_path / "other", tmp_path / "dst", format="dcp", overwrite=True)
    _same(seen[0], shardckpt.load_full(tmp_path / "src"))
    _same(_torch_reads(tmp_path / "dst", tmp_path), shardckpt.load_full(tmp_path / "other"))
    assert sorted(os.listdir(tmp_path / "dst")) == [".metadata", "__0_1.distcp"]  # the old files removed


def test_what_dcp_output_cannot_be_is_refused_before_anything_is_written(tmp_path):
    shardckpt.save(_state(), tmp_path / "src")
    for options in ({"compress": "zstd"}, {"workers": 2}, {"type": "local"}, {"format": "onnx"}):
        with pytest.raises(BadArgumentError):
            convert(tmp_path / "src", tmp_path / "dst", **{"format": "dcp", **options})
    assert not (tmp_path / "dst").exists()
    with pytest.raises(CheckpointExistsError):  # a shardckpt checkpoint's directory is not made a DCP one too
        convert(tmp_path / "src", tmp_path / "src", format="dcp", overwrite=True)


def test_the_commands_formats_are_converts():
    from shardckpt.api.spec import params
    from shardckpt.offline.spec import FORMATS

    [option] = [p for p in params(shardckpt.convert) if p.name == "format"]
    assert option.opt.choices == FORMATS == ("shardckpt", "dcp")


def test_the_command_says_it_wrote_a_dcp_directory(tmp_path, capsys):
    import json

    from shardckpt.cli.main import main

    shardckpt.save(_state(), tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--format", "dcp", "--world-size", "2"]) == 0
    assert "torch DCP checkpoint at world size 2" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out2"), "--format", "dcp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "dcp"


def test_per_rank_values_are_refused_naming_their_keys_and_the_rest_converts_without_them(tmp_path, capsys):
    """DCP stores one value per key; the golden v4 checkpoint's rng, loader and mixed hold one per saving rank."""
    from shardckpt.cli.main import main

    source = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures", "v4")
    with pytest.raises(UnsupportedValueError, match=r"rng, loader, mixed: per-rank values .* exclude=\['rng', "):
        convert(source, tmp_path / "dst", format="dcp")
    assert not os.path.exists(tmp_path / "dst" / ".metadata")
    assert main(["convert", source, str(tmp_path / "cli"), "--format", "dcp"]) == 2
    assert "--exclude rng --exclude loader --exclude mixed" in capsys.readouterr().err
    rest = ["rng", "loader", "mixed"]
    convert(source, tmp_path / "dst", format="dcp", exclude=rest)
    convert(source, tmp_path / "ref", exclude=rest)
    assert diff(tmp_path / "ref", tmp_path / "dst").equal
    flat = flatten_state_dict(shardckpt.load_full(tmp_path / "ref"))[0]
    _same(flatten_state_dict(_torch_reads(tmp_path / "dst", tmp_path))[0], flat)  # DCP's keys are strings: 0 is '0'
