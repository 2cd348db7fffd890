"""Pure conversions (no model, no process group) agree bit for bit with what the ranks produce themselves."""
from __future__ import annotations

import torch
import torch.distributed as dist

import shardckpt
from shardckpt import ShardedTensor, StateDictType
from shardckpt.format.flat_layout import param_order
from shardckpt.state_dict.merge_split import layouts_of, merge, split
from tests._dist import run_ranks
from tests.runtime import _model
from tests.state_dict._train import full_state, new_run, steps

TYPES = tuple(StateDictType)
FULL, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.LOCAL_STATE_DICT


def _every_type() -> dict:
    model, optim = new_run()
    steps(model, optim, _model.make_batches(2))
    return {t: shardckpt.get_state_dict(model, optim, type=t) for t in TYPES}


def _set_local_and_read_full(local: list[dict]) -> dict:
    model, optim = new_run()
    shardckpt.set_state_dict(model, optim, local[dist.get_rank()], type=LOCAL)
    return full_state(model, optim)


def _equal(a, b, where: str) -> None:
    if isinstance(a, ShardedTensor):
        assert isinstance(b, ShardedTensor) and a.region == b.region and a.global_shape == b.global_shape, where
        _equal(a.local, b.local, where)
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for x, y in zip(a, b):
            _equal(x, y, where)
    else:
        assert a == b, (where, a, b)


def assert_merge_split_match_ranks(per_rank: list[dict]) -> None:
    """Every type merged from all ranks equals FULL, and split to every type equals each rank's own."""
    full = per_rank[0][FULL]
    layouts, order = layouts_of(per_rank[0][LOCAL]["model"]), param_order(per_rank[0][LOCAL]["model"])
    for src in TYPES:
        merged = merge([r[src] for r in per_rank], src)
        _equal(merged, full, f"merge({src.name})")
        for dst in TYPES:
            for rank, state in enumerate(split(merged, dst, len(per_rank), layouts, param_names=order)):
                _equal(state, per_rank[rank][dst], f"{src.name} -> {dst.name} rank {rank}")


def test_merge_and_split_match_the_ranks():
    assert_merge_split_match_ranks(run_ranks(3, _every_type))


def test_local_converts_to_another_world_size_offline():
    per_rank = run_ranks(3, _every_type)
    full = per_rank[0][FULL]
    layouts, order = layouts_of(per_rank[0][LOCAL]["model"]), param_order(per_rank[0][LOCAL]["model"])
    local_at_2 = split(merge([r[LOCAL] for r in per_rank], LOCAL), LOCAL, 2, layouts, param_names=order)
    _equal(merge(local_at_2, LOCAL), full, "LOCAL ws 3 -> ws 2 -> FULL")
    loaded = run_ranks(2, _set_local_and_read_full, local_at_2)[0]
    _equal(loaded["model"], full["model"], "converted LOCAL loaded at ws 2")
    for name, entry in full["optim"]["state"].items():
        _equal(loaded["optim"]["state"][name], entry, f"optim {name}")
