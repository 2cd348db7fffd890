"""``convert --format dcp --strip-prefix model.``: a ``shardckpt.save({"model": sd})`` of torchtitan's Llama becomes
the DCP directory torchtitan's own ``CheckpointManager`` finds (``step-N`` with its ``.metadata``) and loads (flat
model keys, torchtitan 0.2.2 from PyPI) into a fresh model: the same weights bit for bit, the same next loss.
``strip_prefix`` itself, on both output formats: what moves up, and the names it refuses."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import shardckpt
from shardckpt.errors import CheckpointError
from shardckpt.offline.convert import convert
from tests.convert import _torchtitan as titan

IDS = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))


def _loss(model: torch.nn.Module) -> torch.Tensor:
    logits = model(IDS)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1)[:-1], IDS.flatten()[1:])


def _trained() -> torch.nn.Module:
    model = titan.new_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optim.zero_grad()
        _loss(model).backward()
        optim.step()
    return model


def _checkpoint_manager(base_folder: str, model: torch.nn.Module):
    """torchtitan's checkpointer over ``model``, loading the model's states only (the checkpoint holds no
    optimizer, scheduler or data loader state), synchronously, without a process group."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config.job_config import Checkpoint

    config = Checkpoint(enable=True, folder="checkpoint", async_mode="disabled",
                        exclude_from_loading=["optimizer", "lr_scheduler", "dataloader"])
    return CheckpointManager(dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
                             checkpoint_config=config, sd_adapter=None, base_folder=base_folder)


def test_torchtitans_checkpoint_manager_loads_a_converted_save_with_the_same_weights_and_loss(tmp_path):
    trained = _trained()
    shardckpt.save({"model": trained.state_dict()}, str(tmp_path / "src"))
    convert(tmp_path / "src", tmp_path / "titan" / "checkpoint" / "step-3", format="dcp", only=["model"],
            strip_prefix="model.")
    fresh = titan.new_model(seed=1)
    assert not torch.equal(fresh.tok_embeddings.weight, trained.tok_embeddings.weight)
    manager = _checkpoint_manager(str(tmp_path / "titan"), fresh)
    try:
        assert manager._find_load_step() == 3  # torchtitan's own probe for step-N/.metadata
        assert manager.load() is True
    finally:
        manager.close()
    want, got = trained.state_dict(), fresh.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    with torch.no_grad():
        assert torch.equal(_loss(fresh), _loss(trained))


def test_the_unstripped_names_are_what_torchtitan_does_not_find(tmp_path):
    """Without the option the keys are ``model.<name>``, which torchtitan's flat model keys never match."""
    shardckpt.save({"model": titan.new_model().state_dict()}, str(tmp_path / "src"))
    convert(tmp_path / "src", tmp_path / "titan" / "checkpoint" / "step-1", format="dcp")
    manager = _checkpoint_manager(str(tmp_path / "titan"), titan.new_model(seed=1))
    try:
        with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict"):
            manager.load()
    finally:
        manager.close()


def _source(path) -> dict:
    state = {"model": {"a.w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
                       "e": torch.empty(0, 2)},
             "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, "step": 7}
    shardckpt.save(state, str(path))
    return state


@pytest.mark.parametrize("format", ["shardckpt", "dcp"])
def test_strip_prefix_moves_the_entries_under_it_to_the_top_and_keeps_the_rest(tmp_path, format):
    state = _source(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", strip_prefix="model.", format=format)
    if format == "dcp":
        dcp_to_torch_save(tmp_path / "out", tmp_path / "out.pt")
        got = torch.load(tmp_path / "out.pt", weights_only=False)
        assert sorted(got) == ["a.w", "b", "e", "optim", "step"]
    else:
        got = shardckpt.load_full(tmp_path / "out")
        assert sorted(got) == ["a.w", "b", "e", "optim", "step"] and got["step"] == 7
        assert got["optim"] == state["optim"]
    for name, tensor in state["model"].items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_prefix_that_stops_inside_a_name_shortens_it(tmp_path):
    _source(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", strip_prefix="model.a.")
    got = shardckpt.load_full(tmp_path / "out")
    assert sorted(got) == ["model", "optim", "step", "w"] and sorted(got["model"]) == ["b", "e"]


@pytest.mark.parametrize("prefix, match", [
    ("model.b", "'model.b' would become empty"),
    ("ema.", "no entry's name starts with it"),
])
def test_names_it_would_empty_or_that_it_matches_nowhere_are_refused_naming_them(tmp_path, prefix, match):
    _source(tmp_path / "src")
    with pytest.raises(CheckpointError, match=match):
        convert(tmp_path / "src", tmp_path / "out", strip_prefix=prefix)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("format", ["shardckpt", "dcp"])
def test_names_it_would_make_equal_are_refused_naming_both(tmp_path, format):
    shardckpt.save({"model": {"step": torch.ones(2)}, "step": 3}, str(tmp_path / "src"))
    with pytest.raises(CheckpointError, match="'model.step' would be named 'step', as 'step' is"):
        convert(tmp_path / "src", tmp_path / "out", strip_prefix="model.", format=format)
    shardckpt.save({"model": {"x.y": torch.ones(2)}, "x": {"y": torch.zeros(2)}}, str(tmp_path / "src2"))
    with pytest.raises(CheckpointError, match="both named 'x.y'"):  # equal once joined, as save refuses
        convert(tmp_path / "src2", tmp_path / "out2", strip_prefix="model.", format=format)


def test_the_command_and_workers_strip_it_too(tmp_path):
    from shardckpt.cli.main import main

    state = _source(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dcp"), "--format", "dcp", "--only", "model",
                 "--strip-prefix", "model.", "-q"]) == 0
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    assert sorted(got) == sorted(state["model"])
    shardckpt.convert(tmp_path / "src", tmp_path / "ws2", world_size=2, workers=2, strip_prefix="model.")
    got = shardckpt.load_full(tmp_path / "ws2")
    for name, tensor in state["model"].items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name



def test_a_killed_run_is_resumed_by_the_same_prefix_only(tmp_path):
    """A rerun with the killed run's prefix keeps its finished rank files; one with another prefix keeps
    nothing and writes the names it asks for."""
    from shardckpt.offline import dcp_output
    from tests.convert._kill import killed_after

    state = _source(tmp_path / "src")
    src, dst = tmp_path / "src", tmp_path / "dcp"
    killed_after(2, dcp_output._RankFile, "write",
                 lambda: convert(src, dst, world_size=4, format="dcp", strip_prefix="model."))
    assert convert(src, dst, world_size=4, format="dcp", strip_prefix="model.a.").kept_ranks == ()
    killed_after(2, dcp_output._RankFile, "write",
                 lambda: convert(src, tmp_path / "dcp2", world_size=4, format="dcp", strip_prefix="model."))
    assert convert(src, tmp_path / "dcp2", world_size=4, format="dcp", strip_prefix="model.").kept_ranks
    for out, name in ((dst, "w"), (tmp_path / "dcp2", "a.w")):
        dcp_to_torch_save(out, tmp_path / "out.pt")
        assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=False)[name], state["model"]["a.w"])
