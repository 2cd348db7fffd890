"""DeepSpeed checkpoints that are damaged, or older than the fixtures (issue 34): ZeRO-3's empty placeholders are
never presented as values (resolved as ties, else refused by name), a stray file name costs nothing, every field
taken from a pickle is checked before use (a ``CorruptCheckpointError`` naming the file and the field), and tensor
hyper-parameters (a tensor ``lr``) convert and come back as the same values."""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import shardckpt
from shardckpt.offline.convert import convert
from shardckpt.offline.export import export
from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.formats.deepspeed import DeepSpeedReader
from shardckpt.formats.deepspeed.unpickle import LossScaler
from tests.formats._caps import address_space_cap
from tests.formats._deepspeed_layout import resave, write_like_deepspeed

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures",
                        "deepspeed")
TAG = "global_step4"


def _copy(stage: int, tmp_path) -> str:
    dst = str(tmp_path / f"zero{stage}")
    shutil.copytree(os.path.join(FIXTURES, f"zero{stage}", "checkpoint"), dst)
    return dst


def _edit(ckpt: str, pattern: str, edit) -> None:
    files = glob.glob(os.path.join(ckpt, TAG, pattern))
    assert files, pattern
    for path in files:
        resave(path, edit)


def _zero_to_fp32(stage: int) -> dict:
    return torch.load(os.path.join(FIXTURES, f"zero{stage}", "zero_to_fp32.pt"), weights_only=True)


# --- defect 6: ZeRO-3's placeholders ---------------------------------------------------------------------------

def _forget_frozen(state: dict) -> None:
    """As a DeepSpeed that did not record frozen parameters saved it."""
    state.pop("frozen_param_shapes")
    state.pop("frozen_param_fragments")


def test_zero3_placeholders_of_unrecorded_frozen_parameters_are_refused_by_name(tmp_path):
    ckpt = _copy(3, tmp_path)
    _edit(ckpt, "*_model_states.pt", _forget_frozen)
    for verb in (lambda: shardckpt.load_full(ckpt), lambda: convert(ckpt, tmp_path / "out"),
                 lambda: export(ckpt, tmp_path / "hf")):
        with pytest.raises(IncompatibleCheckpointError, match=r"holds no value for parameter\(s\) \['norm.bias'\]"):
            verb()
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_a_tie_deepspeed_did_not_record_reads_as_its_target(stage, tmp_path):
    ckpt = _copy(stage, tmp_path)
    pattern = "*_model_states.pt"
    _edit(ckpt, pattern, lambda s: s.update(shared_params={}))  # the file still saves head and embed as one tensor
    model = shardckpt.load_full(ckpt)["model"]
    embed = _zero_to_fp32(stage)["embed.weight"]
    assert model["head.weight"].shape == (11, 6) and torch.equal(model["head.weight"], embed)
    export(ckpt, tmp_path / "hf")
    assert torch.equal(load_file(str(tmp_path / "hf" / "model.safetensors"))["head.weight"], embed)


def test_zero3_a_tie_whose_placeholder_is_not_shared_is_refused(tmp_path):
    ckpt = _copy(3, tmp_path)

    def untie(state):
        state["shared_params"] = {}
        state["module"]["head.weight"] = torch.empty(0)  # its own placeholder: nothing says whose tie it is
    _edit(ckpt, "*_model_states.pt", untie)
    with pytest.raises(IncompatibleCheckpointError, match=r"\['head.weight'\]"):
        DeepSpeedReader(ckpt)


@pytest.mark.parametrize("stage", (2, 3))
def test_zero_element_buffers_and_parameters_still_load(stage, tmp_path):
    params = [{"w": torch.arange(6.0).reshape(2, 3), "empty": torch.zeros(0, 3)}]
    buffers = {"none_yet": torch.zeros(0), "count": torch.tensor([5])}
    write_like_deepspeed(str(tmp_path / "ck"), stage, 2, params, cut_subgroups=False, buffers=buffers)
    model = shardckpt.load_full(tmp_path / "ck")["model"]
    assert torch.equal(model["w"], params[0]["w"]) and model["empty"].shape == (0, 3)
    assert model["none_yet"].shape == (0,) and torch.equal(model["count"], torch.tensor([5]))


# --- defect 10: a stray file name -------------------------------------------------------------------------------

def test_a_stray_rank_file_with_a_huge_rank_is_refused_in_bounded_memory(tmp_path):
    ckpt = _copy(2, tmp_path)
    open(os.path.join(ckpt, TAG, f"zero_pp_rank_{10**30}_mp_rank_00_optim_states.pt"), "wb").close()
    with address_space_cap(512 << 20), pytest.raises(CorruptCheckpointError, match=r"rank\(s\) \[2\] are missing"):
        DeepSpeedReader(ckpt)


# --- defect 11: every field checked before use -----------------------------------------------------------------

def _base(state: dict) -> dict:
    osd = state["optimizer_state_dict"]
    return osd["base_optimizer_state"] if "base_optimizer_state" in osd else osd["optimizer_state_dict"]


def _osd(state: dict) -> dict:
    return state["optimizer_state_dict"]


DAMAGE = [  # (stage, files, edit, the field the error names)
    (2, "*model_states.pt", lambda s: s.update(frozen_param_fragments=[1, 2]), "frozen_param_fragments is"),
    (3, "*model_states.pt", lambda s: s.update(frozen_param_fragments=[1, 2]), "frozen_param_fragments is"),
    (1, "*optim_states.pt", lambda s: _base(s).update(state=[1, 2]), "the optimizer's 'state' is"),
    (2, "*optim_states.pt", lambda s: _base(s).update(state=[1, 2]), "the optimizer's 'state' is"),
    (3, "*optim_states.pt", lambda s: _base(s).update(state=[1, 2]), "the optimizer's 'state' is"),
    (2, "*optim_states.pt", lambda s: _osd(s).update(partition_count=[2, "2"]), "partition_count is"),
    (3, "*optim_states.pt", lambda s: _osd(s).update(partition_count=True), "partition_count is"),
    (3, "*optim_states.pt", lambda s: _osd(s).update(fp32_flat_groups=[1]), "fp32_flat_groups is"),
    (1, "*optim_states.pt", lambda s: s.pop("optimizer_state_dict"), "optimizer_state_dict is missing"),
    (2, "*optim_states.pt", lambda s: _base(s)["state"].update({0: [1]}), "state of flat group 0"),
    (2, "*optim_states.pt", lambda s: _base(s).update(param_groups={"lr": 1}), "the optimizer's 'param_groups'"),
    (3, "*optim_states.pt", lambda s: _base(s)["param_groups"][0].update(lr=LossScaler()), "not plain data"),
    (1, "*model_states.pt", lambda s: s.update(module=[1]), "module is"),
    (3, "*model_states.pt", lambda s: s.update(buffer_names="x"), "buffer_names is"),
    (2, "*model_states.pt", lambda s: s.update(shared_params={"a": 1}), "shared_params is"),
    (1, "*model_states.pt", lambda s: s.update(param_shapes={"a": 1}), "param_shapes is"),
    (1, "*model_states.pt", lambda s: s.update(dp_world_size="2"), "dp_world_size is"),
    (3, "*model_states.pt", lambda s: s.update(frozen_param_shapes=[("norm.bias", 6)]), "frozen_param_shapes is"),
]


@pytest.mark.parametrize("stage, pattern, edit, field", DAMAGE, ids=[f"zero{d[0]}-{d[3]}" for d in DAMAGE])
def test_a_damaged_field_is_named_with_its_file(stage, pattern, edit, field, tmp_path):
    ckpt = _copy(stage, tmp_path)
    _edit(ckpt, pattern, edit)
    with pytest.raises(CorruptCheckpointError) as e:
        shardckpt.load_full(ckpt)
    assert field in str(e.value) and f"{TAG}/" in str(e.value), str(e.value)
    assert "_states.pt" in str(e.value).split(":")[0]


def test_a_file_that_is_not_a_mapping_is_named(tmp_path):
    ckpt = _copy(3, tmp_path)
    torch.save([torch.zeros(1)], os.path.join(ckpt, TAG, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_1_mp_rank_00_model_states.pt: holds"):
        shardckpt.load_full(ckpt)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_tensor_hyper_parameters_convert_and_come_back_as_they_were(stage, tmp_path):
    ckpt = _copy(stage, tmp_path)

    def tensor_lr(state):
        for group in _base(state)["param_groups"]:
            group.update(lr=torch.tensor(0.02, dtype=torch.float64), betas=(torch.tensor(0.9), 0.999))
    _edit(ckpt, "*optim_states.pt", tensor_lr)
    before = shardckpt.load_full(ckpt)["optim"]["param_groups"][0]
    convert(ckpt, tmp_path / "ws3", world_size=3)
    after = shardckpt.load_full(tmp_path / "ws3")["optim"]["param_groups"][0]
    for got in (before, after):
        assert isinstance(got["lr"], torch.Tensor) and got["lr"].dtype == torch.float64 and got["lr"].item() == 0.02
        assert torch.equal(got["betas"][0], torch.tensor(0.9)) and got["betas"][1] == 0.999
    assert after["params"] == before["params"] and after["weight_decay"] == before["weight_decay"] == 0.01
