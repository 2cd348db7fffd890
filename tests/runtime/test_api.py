"""The runtime's structure and contract: layouts, group order, aliases, frozen groups, buffers, errors."""
from __future__ import annotations

import json
from math import prod
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardckpt import runtime
from shardckpt.errors import ShardingError
from shardckpt.runtime import FlatLayout, ShardingStrategy
from shardckpt.format.flat_layout import ALIGN_BYTES, build_layout
from tests._dist import run_ranks
from tests.runtime import _model
from tests.runtime._model import Block


def _expected_flat(layout: FlatLayout, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unsharded flat parameter a layout describes, built from named full tensors."""
    flat = torch.zeros(layout.padded_numel, dtype=layout.torch_dtype)
    for name, offset, numel in zip(layout.names, layout.offsets, layout.numels):
        flat[offset:offset + numel] = params[name].detach().reshape(-1)
    return flat


def test_single_process_without_group_is_world_of_one() -> None:
    if dist.is_initialized():
        pytest.skip("this process has a default group")
    original = dict(_model.make_model().named_parameters())
    model = runtime.shard(_model.make_model(), wrap=(Block,))
    assert runtime.is_sharded(model) and not runtime.is_sharded(_model.make_model())
    groups = runtime.groups(model)
    assert [g.name for g in groups] == ["<root>", "<root><frozen>", "blocks.0", "blocks.0<frozen>",
                                        "blocks.1", "blocks.1<frozen>"]
    assert [g.prefix for g in groups] == ["", "", "blocks.0", "blocks.0", "blocks.1", "blocks.1"]
    assert [id(p) for p in model.parameters()] == [id(g.flat_param) for g in groups]
    root = groups[0].layout
    assert root.names == ("tok.weight", "ln_f.weight", "ln_f.bias")
    assert root.aliases == (("head.weight",), (), ())
    assert groups[1].layout.names == ("pos",) and not groups[1].flat_param.requires_grad
    assert groups[3].layout.names == ("blocks.0.ln1.bias",) and not groups[3].layout.requires_grad
    assert "blocks.0.mask" in dict(model.named_buffers())
    for group in groups:
        assert group.layout.world_size == 1 and group.flat_param.dtype == torch.float32
        assert torch.equal(group.flat_param.detach(), _expected_flat(group.layout, original))
    covered = {n for g in groups for n in g.layout.names + sum(g.layout.aliases, ())}
    assert covered == {n for n, _ in _model.make_model().named_parameters(remove_duplicate=False)}


def test_layout_alignment_json_round_trip_and_validation() -> None:
    layout = build_layout(["a", "b", "c"], [(3, 5), (1,), (2, 2)], torch.float32, 3, aliases=[(), ("x",), ()])
    assert layout.offsets == (0, 16, 20) and layout.numel == 24
    assert layout.padded_numel % (3 * ALIGN_BYTES // 4) == 0 and layout.shard_numel * 3 == layout.padded_numel
    again = FlatLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout and again.torch_dtype == torch.float32
    broken = layout.to_dict() | {"offsets": [0, 10, 20]}  # 'b' would overlap 'a'
    with pytest.raises(ShardingError, match="overlaps"):
        FlatLayout.from_dict(broken)
    with pytest.raises(ShardingError, match="shard_numel"):
        FlatLayout.from_dict(layout.to_dict() | {"shard_numel": 1})
    with pytest.raises(ShardingError, match="malformed"):
        FlatLayout.from_dict({"names": ["a"]})
    with pytest.raises(ShardingError, match="dtype"):
        FlatLayout.from_dict(layout.to_dict() | {"dtype": "float99"})


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3), min_size=1, max_size=6),
       world=st.integers(1, 8), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_shards_tile_every_member(shapes: list[list[int]], world: int, dtype: torch.dtype) -> None:
    layout = build_layout([f"p{i}" for i in range(len(shapes))], shapes, dtype, world)
    align = ALIGN_BYTES // dtype.itemsize
    assert all(offset % align == 0 for offset in layout.offsets)
    assert layout.padded_numel % world == 0 and layout.shard_numel % align == 0
    for index, shape in enumerate(shapes):
        held = sorted((h.at, h.count) for r in range(world) if (h := layout.held(index, r)) is not None)
        starts = [0] + [at + count for at, count in held]
        assert [at for at, _ in held] == starts[:-1] and starts[-1] == prod(shape)


def _local_shards() -> dict[str, Any]:
    original = dict(_model.make_model().named_parameters())
    model = runtime.shard(_model.make_model(), wrap=(Block,))
    rank = dist.get_rank()
    exact = []
    for group in runtime.groups(model):
        start, stop = group.layout.shard_range(rank)
        exact.append(torch.equal(group.flat_param.detach(), _expected_flat(group.layout, original)[start:stop]))
    return {"layouts": [g.layout.to_dict() for g in runtime.groups(model)], "exact": exact}


def test_local_shards_are_slices_of_the_layout() -> None:
    if dist.is_initialized():
        pytest.skip("this process has a default group")
    single = [g.layout for g in runtime.groups(runtime.shard(_model.make_model(), wrap=(Block,)))]
    results = run_ranks(3, _local_shards)
    assert all(r["layouts"] == results[0]["layouts"] for r in results)
    assert all(all(r["exact"]) for r in results)
    for one, three in zip(single, map(FlatLayout.from_dict, results[0]["layouts"])):
        assert (one.names, one.offsets, one.numel, three.world_size) == (three.names, three.offsets, three.numel, 3)


class _TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3).double()


def _errors() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    cases = {
        "twice": lambda: runtime.shard(runtime.shard(_model.make_model())),
        "submodule_of_sharded": lambda: runtime.shard(runtime.shard(_model.make_model()).blocks[0]),
        "wrong_device": lambda: runtime.shard(_model.make_model(), device="meta"),
        "hybrid_single_group": lambda: runtime.shard(_model.make_model(), strategy=ShardingStrategy.HYBRID_SHARD,
                                                     process_group=dist.group.WORLD),
        "hybrid_groups_not_a_mesh": lambda: runtime.shard(
            _model.make_model(), strategy=ShardingStrategy.HYBRID_SHARD,
            process_group=(dist.group.WORLD, dist.group.WORLD)),
        "mesh_ndim": lambda: runtime.shard(_model.make_model(), process_group=init_device_mesh("cpu", (1, world))),
        "bad_wrap": lambda: runtime.shard(_model.make_model(), wrap="Block"),
        "mixed_dtypes": lambda: runtime.shard(_TwoDtypes()),
        "groups_of_unsharded": lambda: runtime.groups(_model.make_model()),
        "summon_mid_step": _summon_between_forward_and_backward,
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
        except ShardingError as exc:
            messages[name] = str(exc)
        else:
            messages[name] = "NO ERROR"
    return messages


def _summon_between_forward_and_backward() -> None:
    model = runtime.shard(_model.make_model(), strategy=ShardingStrategy.SHARD_GRAD_OP, wrap=(Block,))
    ids, targets = _model.make_batches(1)[0]
    loss = _model.loss_fn(model, ids, targets)
    try:
        with model.summon_full_params():
            pass
    finally:
        loss.backward()


def test_misuse_gives_clear_errors() -> None:
    messages = run_ranks(2, _errors)[0]
    expected = {
        "twice": "already", "submodule_of_sharded": "already", "wrong_device": "meta",
        "hybrid_single_group": "two groups", "hybrid_groups_not_a_mesh": "do not match",
        "mesh_ndim": "1-D DeviceMesh", "bad_wrap": "wrap must be", "mixed_dtypes": "one floating dtype",
        "groups_of_unsharded": "returned by shard", "summon_mid_step": "between forward and backward",
    }
    for case, fragment in expected.items():
        assert fragment in messages[case], (case, messages[case])


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig_params"])
def test_a_sharded_model_is_freed_with_its_last_reference(orig: bool) -> None:
    """Nothing global keeps a sharded model (and its shards, gradients, gathered buffers) alive: a training job
    that builds models again and again (a sweep, an evaluation copy) would otherwise run out of GPU memory."""
    import gc
    import weakref

    import shardckpt

    model = runtime.shard(_model.make_model(), wrap=(_model.Block,), use_orig_params=orig)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _model.loss_fn(model, *_model.make_batches(1)[0]).backward()
    optim.step()
    with shardckpt.state_dict_type(model, shardckpt.StateDictType.SHARDED_STATE_DICT):
        shardckpt.get_state_dict(model, optim, type=shardckpt.StateDictType.SHARDED_STATE_DICT)
    refs = [weakref.ref(model), weakref.ref(runtime.groups(model)[0].flat_param)]
    del model, optim
    gc.collect()
    assert all(ref() is None for ref in refs)


def _loads_inside_summon(path: str) -> list[str]:
    import shardckpt
    from shardckpt import StateDictType

    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)).state_dict()
    model = runtime.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), wrap=(nn.Linear,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loads = {"load_state_dict": lambda: model.load_state_dict(want),
             "set_state_dict": lambda: shardckpt.set_state_dict(model, None, {"model": want},
                                                                type=StateDictType.FULL_STATE_DICT),
             "load_state": lambda: shardckpt.load_state(model, None, path)}
    out = []
    for name, load in loads.items():
        with model.summon_full_params():
            try:
                load()
                out.append(f"{name}: loaded")
            except ShardingError as e:
                out.append(f"{name}: refused" if "summon_full_params" in str(e) else str(e))
    got = model.state_dict()
    out.append(f"unchanged: {all(torch.equal(got[k], before[k]) for k in before)}")
    with model.summon_full_params(writeback=False):  # no write-back to undo it (helper-31)
        shardckpt.load_state(model, None, path)
    got = model.state_dict()
    out.append(f"loaded after: {all(torch.equal(got[k], want[k]) for k in want)}")
    return out


def test_a_load_inside_summon_full_params_is_refused(tmp_path):
    # helper-30: the context's write-back on exit put the weights of before the load back, silently
    import shardckpt

    torch.manual_seed(0)
    shardckpt.save({"model": nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)).state_dict()}, str(tmp_path / "c"))
    got = run_ranks(2, _loads_inside_summon, str(tmp_path / "c"), timeout=120)
    assert got[0] == got[1] == ["load_state_dict: refused", "set_state_dict: refused", "load_state: refused",
                                "unchanged: True", "loaded after: True"], got
