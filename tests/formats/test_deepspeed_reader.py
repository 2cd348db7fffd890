"""DeepSpeed ZeRO-1, -2 and -3 checkpoints, written by DeepSpeed itself (``fixtures/deepspeed``), read through the
one read interface: weights bit for bit DeepSpeed's own ``zero_to_fp32``, optimizer state bit for bit DeepSpeed's
in-memory state at save time, convert / export / diff / load_full through them, resume in the runtime at
world size 3 continuing the uninterrupted DeepSpeed run; damaged and hostile files refused."""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import struct
import zipfile

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import shardckpt
from shardckpt import runtime
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.offline.export import export
from shardckpt.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.deepspeed import DeepSpeedReader
from shardckpt.formats.deepspeed.unpickle import SAFE_GLOBALS
from shardckpt.formats.detect import open_reader
from shardckpt.regions import FlatRange, full_region
from tests._dist import run_ranks
from tests.formats._deepspeed_layout import write_like_deepspeed

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                        "deepspeed")
STAGES = (1, 2, 3)
TAG = "global_step4"


def _fixture(stage: int) -> str:
    return os.path.join(FIXTURES, f"zero{stage}")


def _expected(stage: int) -> dict:
    return torch.load(os.path.join(_fixture(stage), "expected.pt"), weights_only=True)


def _zero_to_fp32(stage: int) -> dict:
    return torch.load(os.path.join(_fixture(stage), "zero_to_fp32.pt"), weights_only=True)


def _maker():
    """``fixtures/deepspeed/make_fixtures.py``: the model, batches and config the fixtures were trained with."""
    spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(FIXTURES, "make_fixtures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read_all(reader) -> dict[str, torch.Tensor]:
    out = {n: torch.empty(i.shape, dtype=i.dtype) for n, i in reader.tensors().items()}
    reader.read([ReadRequest(n, full_region(t.shape), t) for n, t in out.items()])
    return out


def _copy(stage: int, tmp_path) -> str:
    dst = str(tmp_path / f"zero{stage}")
    shutil.copytree(os.path.join(_fixture(stage), "checkpoint"), dst)
    return dst


@pytest.mark.parametrize("stage", STAGES)
def test_weights_are_zero_to_fp32s_bit_for_bit_and_optimizer_state_deepspeeds(stage):
    reader = open_reader(os.path.join(_fixture(stage), "checkpoint"))  # the directory with 'latest'
    assert isinstance(reader, DeepSpeedReader)
    got, expected, z = _read_all(reader), _expected(stage), _zero_to_fp32(stage)
    for name, t in z.items():
        assert got[f"model.{name}"].dtype == t.dtype and torch.equal(got[f"model.{name}"], t), name
    for name, t in {**expected["params"], **expected["frozen"]}.items():
        assert torch.equal(got[f"model.{name}"], t), name
    if stage == 1:  # DeepSpeed 0.19.8's zero_to_fp32 leaves ZeRO-1's frozen parameter out; shardckpt keeps it
        assert set(z) == set(expected["params"]) | {"head.weight"}
    for name, state in expected["optim"].items():
        for key, t in state.items():
            assert torch.equal(got[f"optim.state.{name}.{key}"], t), (name, key)
        assert got[f"optim.state.{name}.step"].item() == expected["step"]
    tree = reader.tree()
    assert set(tree["optim"]["state"]) == set(expected["params"])  # frozen and tied-alias: no state
    assert tree["optim"]["param_groups"][0]["params"] == list(expected["params"])
    assert tree["optim"]["param_groups"][0]["lr"] == 0.02
    assert tree["deepspeed"]["zero_stage"] == stage and tree["deepspeed"]["world_size"] == 2
    assert tree["deepspeed"]["global_steps"] == expected["step"]
    assert torch.equal(got["model.head.weight"], got["model.embed.weight"])  # tied, as shared_params records


@pytest.mark.parametrize("stage", STAGES)
def test_any_region_reads_as_the_whole_tensor_holds_it(stage):
    reader = DeepSpeedReader(os.path.join(_fixture(stage), "checkpoint", TAG))
    whole = _read_all(reader)
    for name, info in reader.tensors().items():
        n = math.prod(info.shape)
        for lo, hi in [(0, n), (n // 3, n - n // 4), (n - 1, n), (n, n)]:
            if lo > hi:
                continue
            dest = torch.empty(hi - lo, dtype=torch.float64)  # a cast on the way
            reader.read([ReadRequest(name, FlatRange(lo, hi), dest)])
            assert torch.equal(dest, whole[name].reshape(-1)[lo:hi].double()), (name, lo, hi)


@pytest.mark.parametrize("stage", STAGES)
def test_convert_to_three_ranks_diff_export_and_load_full(stage, tmp_path):
    src = os.path.join(_fixture(stage), "checkpoint")
    report = convert(src, tmp_path / "ws3", world_size=3)
    assert report.world_size == 3 and report.type == "sharded"
    assert diff(src, tmp_path / "ws3").equal
    full = shardckpt.load_full(tmp_path / "ws3")
    expected = _expected(stage)
    for name, state in expected["optim"].items():
        assert torch.equal(full["optim"]["state"][name]["exp_avg_sq"], state["exp_avg_sq"])
    export(src, tmp_path / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, t in _zero_to_fp32(stage).items():
        assert torch.equal(exported[name], t), name


# --- resuming in the runtime at another world size ---------------------------------------------------------

def _resume(src: str) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    mk = _maker()
    torch.manual_seed(7)  # other initial weights: everything must come from the checkpoint
    model = mk.Tiny()
    model = runtime.shard(model, wrap=(nn.Sequential,))
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.5, weight_decay=0.3)
    extra = shardckpt.load_state(model, optim, src)
    assert extra["deepspeed"]["global_steps"] == mk.SAVE_AT
    assert optim.param_groups[0]["lr"] == 0.02 and optim.param_groups[0]["weight_decay"] == 0.01
    mine = [[0, 1], [2], [3]][rank]  # the global batch of 4 sequences over 3 ranks
    losses = []
    for step in range(mk.SAVE_AT, mk.SAVE_AT + mk.AFTER):
        ids, targets = mk.batches(step)
        optim.zero_grad()
        logits = model(ids[mine])
        total = nn.functional.cross_entropy(logits.reshape(-1, mk.VOCAB), targets[mine].reshape(-1), reduction="sum")
        (total * world / targets.numel()).backward()  # the runtime averages over ranks: the global mean's gradient
        model.clip_grad_norm_(1.0)  # DeepSpeed's default gradient_clipping
        optim.step()
        reported = total.detach() / targets.numel()
        dist.all_reduce(reported)
        losses.append(reported.item())
    return losses


@pytest.mark.parametrize("stage", STAGES)
def test_resume_at_world_size_3_continues_the_uninterrupted_deepspeed_run(stage):
    resumed = run_ranks(3, _resume, os.path.join(_fixture(stage), "checkpoint"))[0]
    uninterrupted = _expected(stage)["losses_after"]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(resumed, uninterrupted)), (resumed, uninterrupted)


# --- damage and hostility -----------------------------------------------------------------------------------

class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling it would create the marker file


def test_a_hostile_pickle_in_place_of_a_deepspeed_file_is_refused_without_running(tmp_path):
    ckpt = _copy(2, tmp_path)
    marker = str(tmp_path / "ran")
    victim = os.path.join(ckpt, TAG, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": _RunsCode(marker)}, victim)
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt.*refused"):
        open_reader(ckpt)
    assert not os.path.exists(marker)


def test_a_class_deepspeed_does_not_write_is_refused(tmp_path):
    ckpt = _copy(1, tmp_path)
    model_file = os.path.join(ckpt, TAG, "mp_rank_00_model_states.pt")
    state = torch.load(model_file, weights_only=False)  # the test's own trusted file
    state["lr_scheduler"] = nn.Linear(1, 1)  # a module: a class outside the admitted few
    torch.save(state, model_file)
    with pytest.raises(CorruptCheckpointError, match="mp_rank_00_model_states.pt"):
        DeepSpeedReader(ckpt)


def test_a_flipped_byte_in_a_partition_is_caught_on_read(tmp_path):
    ckpt = _copy(3, tmp_path)
    victim = os.path.join(ckpt, TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with zipfile.ZipFile(victim) as zf:
        record = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size >= 16)
    data = bytearray(open(victim, "rb").read())
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_len + extra_len + 5] ^= 0x40  # inside a tensor's bytes
    with open(victim, "wb") as f:
        f.write(data)
    reader = DeepSpeedReader(ckpt)
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        _read_all(reader)


def test_a_missing_rank_file_and_a_stray_one_are_named(tmp_path):
    ckpt = _copy(2, tmp_path)
    tag = os.path.join(ckpt, TAG)
    os.rename(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), tmp_path / "kept.pt")
    with pytest.raises(CorruptCheckpointError, match=r"rank\(s\) \[0\] are missing"):
        DeepSpeedReader(ckpt)
    os.rename(tmp_path / "kept.pt", os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    shutil.copy(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                os.path.join(tag, "zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    with pytest.raises(CorruptCheckpointError, match="partition_count is 2, but 3 ranks"):
        DeepSpeedReader(ckpt)
    os.remove(os.path.join(tag, "zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    os.remove(os.path.join(tag, "mp_rank_00_model_states.pt"))
    with pytest.raises(CorruptCheckpointError, match="mp_rank_00_model_states.pt: missing"):
        DeepSpeedReader(ckpt)


def test_shapes_that_do_not_fill_the_partitions_are_refused(tmp_path):
    ckpt = _copy(3, tmp_path)
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"):
        path = os.path.join(ckpt, TAG, name)
        state = torch.load(path, weights_only=False)
        state["param_shapes"][0]["mlp.0.bias"] = torch.Size([12])  # 2 elements more than saved
        torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match="do not match the partitions|runs past"):
        DeepSpeedReader(ckpt)


def test_model_parallel_checkpoints_and_urls_are_refused_clearly(tmp_path):
    ckpt = _copy(1, tmp_path)
    shutil.copy(os.path.join(ckpt, TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                os.path.join(ckpt, TAG, "zero_pp_rank_0_mp_rank_01_optim_states.pt"))
    with pytest.raises(IncompatibleCheckpointError, match="model-parallel rank 1"):
        DeepSpeedReader(ckpt)
    with pytest.raises(CheckpointError, match="local disk only"):
        DeepSpeedReader("s3://bucket/ckpt")


# --- layouts the fixtures do not show: several groups, alignment padding, sub-groups, 0-d and empty tensors ----

def _params() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"a": torch.randn((), generator=g), "e": torch.randn(7, 3, generator=g), "b": torch.randn(0, 3)},
            {"d": torch.randn(2, generator=g), "c": torch.randn(5, generator=g)}]


@pytest.mark.parametrize("stage", (2, 3))
@pytest.mark.parametrize("world", (1, 3, 4))
def test_layouts_beyond_the_fixtures_read_exactly(stage, world, tmp_path):
    groups = _params()
    write_like_deepspeed(str(tmp_path / "ck"), stage, world, groups)
    reader = DeepSpeedReader(tmp_path / "ck")
    got = _read_all(reader)
    for name, t in {n: t for g in groups for n, t in g.items()}.items():
        assert got[f"model.{name}"].shape == t.shape and torch.equal(got[f"model.{name}"], t), name
        assert torch.equal(got[f"optim.state.{name}.exp_avg"], t * 2), name
        assert torch.equal(got[f"optim.state.{name}.exp_avg_sq"], t * t), name
        assert got[f"optim.state.{name}.step"].item() == 3.0
    pgs = reader.tree()["optim"]["param_groups"]
    assert [pg["params"] for pg in pgs] == [list(g) for g in groups] and [pg["lr"] for pg in pgs] == [0.1, 0.2]


def test_partitions_and_paddings_that_do_not_match_the_groups_are_refused(tmp_path):
    ckpt = _copy(2, tmp_path)
    path = os.path.join(ckpt, TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with torch.serialization.safe_globals(SAFE_GLOBALS):  # DeepSpeed's objects as stand-ins, replaced below
        state = torch.load(path, weights_only=True)
    osd = state["optimizer_state_dict"]
    osd["zero_stage"] = 2
    del osd["loss_scaler"], osd["param_slice_mappings"]
    state["optimizer_state_dict"]["param_alignment_paddings"] = [[0] * 6, [0]]
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match="alignment paddings for 2 param groups"):
        DeepSpeedReader(ckpt)
    state["optimizer_state_dict"]["param_alignment_paddings"] = "none"
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match="param_alignment_paddings is .none., not a list"):
        DeepSpeedReader(ckpt)
    state["optimizer_state_dict"]["param_alignment_paddings"] = [[0] * 6]
    state["optimizer_state_dict"]["single_partition_of_fp32_groups"].append(torch.zeros(3))
    torch.save(state, path)
    with pytest.raises(CorruptCheckpointError, match="2 fp32 partitions for 1 param groups"):
        DeepSpeedReader(ckpt)
