"""``shard(..., use_orig_params=True)``: per-parameter optimizer groups built from the sharded model's
``named_parameters()`` train as on the unsharded model and as with torch's ``fully_shard``."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardckpt import runtime
from shardckpt.errors import ShardingError
from tests._dist import run_ranks
from tests.runtime import _helpers, _model
from tests.runtime._model import Block

STEPS = 6
GROUPINGS: dict[str, Callable[[nn.Module], list[dict[str, Any]]]] = {
    "decay": _model.decay_groups, "three_lr": _model.three_lr_groups,
    "one": lambda m: [{"params": list(m.parameters())}]}


def train(model: nn.Module, grouping: str, *, rank: int = 0, world: int = 1, clip: bool = False,
          accumulate: bool = False) -> list[float]:
    """AdamW on this rank's slice of each global batch; ``accumulate``: two micro-batches, the first in no_sync."""
    opt = torch.optim.AdamW(GROUPINGS[grouping](model), lr=1e-2, weight_decay=0.1)
    losses = []
    for batch in _model.make_batches(STEPS):
        opt.zero_grad()
        ids, targets = _model.local_slice(batch, rank, world)
        if accumulate:
            half = ids.shape[0] // 2
            with model.no_sync():
                (_model.loss_fn(model, ids[:half], targets[:half]) / 2).backward()
            loss = _model.loss_fn(model, ids[half:], targets[half:]) / 2
        else:
            loss = _model.loss_fn(model, ids, targets)
        loss.backward()
        if clip:
            model.clip_grad_norm_(0.5)
        opt.step()
        losses.append(loss.item())
    return losses


def _named_full(model: nn.Module) -> dict[str, torch.Tensor]:
    names = [n for n, _ in _model.make_model().named_parameters()]
    return _helpers.full_params(model, names)


def _vs_fsdp2(strategy_name: str, grouping: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    strategy = runtime.ShardingStrategy[strategy_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _model.make_model()
    ref_losses = train(reference, grouping)
    ours = runtime.shard(_model.make_model(), strategy=strategy, wrap=(Block,), use_orig_params=True)
    our_losses = _helpers.global_mean(train(ours, grouping, rank=rank, world=world))
    mesh = init_device_mesh("cpu", (world,))
    theirs = _model.make_model()
    reshard = strategy is runtime.ShardingStrategy.FULL_SHARD
    for module in theirs.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(theirs, mesh=mesh, reshard_after_forward=reshard)
    their_losses = _helpers.global_mean(train(theirs, grouping, rank=rank, world=world))
    their_params = {n: p.full_tensor().detach() for n, p in theirs.named_parameters()}
    ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    mine = _named_full(ours)
    return {"losses": our_losses, "reference": ref_losses, "fsdp2": their_losses,
            "vs_reference": _helpers.max_param_diff(mine, ref_params),
            "vs_fsdp2": _helpers.max_param_diff(mine, their_params)}


@pytest.mark.parametrize("grouping", ["decay", "three_lr"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_per_parameter_groups_match_unsharded_and_fsdp2(world_size: int, strategy: str, grouping: str) -> None:
    results = run_ranks(world_size, _vs_fsdp2, strategy, grouping)
    assert all(r == results[0] for r in results), "ranks disagree"
    result = results[0]
    torch.testing.assert_close(result["losses"], result["reference"], rtol=2e-6, atol=0)
    torch.testing.assert_close(result["losses"], result["fsdp2"], rtol=2e-6, atol=0)
    assert result["vs_reference"][0] < 2e-6, result["vs_reference"]
    assert result["vs_fsdp2"][0] < 2e-6, result["vs_fsdp2"]


def _recipe_groups(_: None) -> dict[str, Any]:
    """The groups the recipes build on the sharded model are the ones they build on the unsharded model."""
    model = runtime.shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    plain = _model.make_model()
    out = {}
    for grouping in ("decay", "three_lr"):
        name_of = [{id(p): n for n, p in m.named_parameters()} for m in (model, plain)]
        out[grouping] = [[[name_of[i][id(p)] for p in g["params"]] for g in GROUPINGS[grouping](m)]
                         for i, m in enumerate((model, plain))]
    return out


def test_recipes_see_the_original_names_and_dimensions() -> None:
    results = run_ranks(3, _recipe_groups, None)
    assert all(r == results[0] for r in results)
    result = results[0]
    for grouping, (sharded, plain) in result.items():
        assert sharded == plain, grouping
        assert all(group for group in sharded), grouping  # no empty group: the recipe really split the model
    assert "blocks.0.fc1.weight" in result["decay"][0][0] and "blocks.0.fc1.bias" in result["decay"][0][1]
    assert "blocks.0.ln1.weight" in result["decay"][0][1]


def _same_as_flat(strategy_name: str, bf16: bool) -> dict[str, Any]:
    strategy = runtime.ShardingStrategy[strategy_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    mp = runtime.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    out = {}
    for orig in (False, True):
        model = runtime.shard(_model.make_model(), strategy=strategy, wrap=(Block,), mixed_precision=mp,
                              process_group=_helpers.mesh_for(strategy, world), use_orig_params=orig)
        losses = train(model, "one", rank=rank, world=world, clip=True, accumulate=True)
        out[orig] = {"losses": losses, "params": _named_full(model)}
    return out


@pytest.mark.parametrize(("strategy", "world_size"), [("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 2),
                                                      ("HYBRID_SHARD", 4)])
@pytest.mark.parametrize("bf16", [False, True])
def test_one_group_trains_bit_for_bit_as_the_flat_form(strategy: str, world_size: int, bf16: bool) -> None:
    """Clipping, no_sync accumulation and mixed precision: the same arithmetic on pieces as on flat shards."""
    for result in run_ranks(world_size, _same_as_flat, strategy, bf16):
        assert result[True]["losses"] == result[False]["losses"]
        for name, value in result[False]["params"].items():
            assert torch.equal(result[True]["params"][name], value), name


def _pieces(_: None) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = runtime.shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    full = _named_full(model)
    out: dict[str, Any] = {"names": [n for n, _ in model.named_parameters()], "pieces": {}}
    for name, p in model.named_parameters():
        out["pieces"][name] = (tuple(p.shape), p.detach().reshape(-1).clone())
    out["tied"] = model.head.weight is model.tok.weight
    out["shape_outside"] = tuple(model.blocks[0].fc1.weight.shape)
    # A forward sees full weights under the names; afterwards they are the pieces again.
    seen = {}
    handle = model.blocks[0].fc1.register_forward_pre_hook(lambda m, a: seen.update(shape=tuple(m.weight.shape)))
    _model.loss_fn(model, *_model.local_slice(_model.make_batches(1)[0], rank, world)).backward()
    handle.remove()
    out["shape_inside"] = seen["shape"]
    out["grads"] = {n: None if p.grad is None else tuple(p.grad.shape) for n, p in model.named_parameters()}
    out["full"] = full
    return out


def test_parameters_are_this_ranks_pieces_under_the_original_names() -> None:
    results = run_ranks(3, _pieces, None)
    plain = _model.make_model()
    assert results[0]["names"] == [n for n, _ in plain.named_parameters()]
    for name, p in plain.named_parameters():
        pieces = [r["pieces"][name] for r in results]
        assert all(len(shape) == max(p.dim(), 1) for shape, _ in pieces), (name, pieces)
        assert torch.equal(torch.cat([flat for _, flat in pieces]), p.detach().reshape(-1)), name
        if p.numel() < 3:  # the one-element gate: two ranks own none of it and hold an empty piece
            assert sorted(flat.numel() for _, flat in pieces) == [0] * (3 - p.numel()) + [1] * p.numel()
    for r in results:
        assert r["tied"] and r["shape_inside"] == (_model.HIDDEN, _model.DIM)
        assert len(r["shape_outside"]) == 2 and r["shape_outside"][0] == 1
        # every trainable piece has a gradient shaped like it, empty ones included; frozen ones none
        for name, shape in r["grads"].items():
            assert shape == r["pieces"][name][0] if plain.get_parameter(name).requires_grad else shape is None, name


def _zero_grad_forms(_: None) -> dict[str, Any]:
    """zero_grad(set_to_none) / zero_grad() / a .grad set by hand: the next backward accumulates onto exactly that."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = _model.local_slice(_model.make_batches(1)[0], rank, world)
    model = runtime.shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    params = dict(model.named_parameters())
    _model.loss_fn(model, *batch).backward()
    once = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    _model.loss_fn(model, *batch).backward()
    twice_ok = all(torch.allclose(params[n].grad, 2 * g) for n, g in once.items())
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model(batch[0])
    released = all(g.flat_param.grad is None for g in runtime.groups(model))  # not kept through the next step
    _model.loss_fn(model, *batch).backward()
    after_none = all(torch.equal(params[n].grad, g) for n, g in once.items())
    model.zero_grad(set_to_none=False)
    params["blocks.0.fc1.weight"].grad = torch.ones_like(params["blocks.0.fc1.weight"])
    params["ln_f.weight"].grad = None
    _model.loss_fn(model, *batch).backward()
    by_hand = torch.equal(params["blocks.0.fc1.weight"].grad, once["blocks.0.fc1.weight"] + 1)
    others = all(torch.equal(params[n].grad, g) for n, g in once.items() if n != "blocks.0.fc1.weight")
    return {"twice": twice_ok, "released": released, "after_none": after_none, "by_hand": by_hand,
            "others": others}


def test_zero_grad_and_hand_set_gradients_are_respected() -> None:
    for result in run_ranks(2, _zero_grad_forms, None):
        assert result == {"twice": True, "released": True, "after_none": True, "by_hand": True, "others": True}


def _written_through_a_piece(_: None) -> bool:
    """A write into an original parameter (not through an optimizer) refreshes a unit kept gathered."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = _model.local_slice(_model.make_batches(1)[0], rank, world)
    model = runtime.shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    model.set_reshard_after_backward(False)
    _model.loss_fn(model, *batch).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    seen = {}
    hook = model.blocks[1].fc2.register_forward_pre_hook(lambda m, a: seen.update(w=m.weight.detach().clone()))
    model(batch[0])
    hook.remove()
    expected = _model.make_model().blocks[1].fc2.weight.detach() * 0.5
    return torch.equal(seen["w"], expected)


def test_writes_through_the_pieces_are_not_served_stale() -> None:
    assert run_ranks(2, _written_through_a_piece, None) == [True, True]


def test_use_orig_params_must_be_a_bool() -> None:
    with pytest.raises(ShardingError, match="use_orig_params"):
        runtime.shard(_model.make_model(), use_orig_params="yes")


def _frozen_after_shard(_: None) -> dict[str, Any]:
    """A parameter frozen after ``shard`` gets no gradient and stays put, as on the unsharded model; a frozen one
    made trainable is refused by name at the next forward (it could never get a gradient)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reference, model = _model.make_model(), runtime.shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    for m in (reference, model):
        m.blocks[1].fc1.weight.requires_grad_(False)
        m.ln_f.requires_grad_(False)
    ref_losses = train(reference, "decay")
    losses = _helpers.global_mean(train(model, "decay", rank=rank, world=world, clip=False))
    full = _named_full(model)
    grads = {n: p.grad is None for n, p in model.named_parameters() if n in ("blocks.1.fc1.weight", "ln_f.bias")}
    unfrozen = runtime.shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    unfrozen.blocks[0].ln1.bias.requires_grad_(True)
    try:
        _model.loss_fn(unfrozen, *_model.local_slice(_model.make_batches(1)[0], rank, world))
        error = None
    except ShardingError as e:
        error = str(e)
    return {"losses": losses, "reference": ref_losses, "no_grad": grads, "error": error,
            "diff": _helpers.max_param_diff(full, {n: p.detach() for n, p in reference.named_parameters()}),
            "unchanged": torch.equal(full["blocks.1.fc1.weight"], _model.make_model().blocks[1].fc1.weight)}


def test_requires_grad_changed_after_shard() -> None:
    for r in run_ranks(2, _frozen_after_shard, None):
        torch.testing.assert_close(r["losses"], r["reference"], rtol=2e-6, atol=0)
        assert r["diff"][0] < 2e-6 and r["unchanged"], r["diff"]
        assert r["no_grad"] == {"blocks.1.fc1.weight": True, "ln_f.bias": True}
        assert "'blocks.0.ln1.bias'" in r["error"] and "before shard()" in r["error"], r["error"]


def _composed(feature: str) -> dict[bool, dict[str, Any]]:
    """The runtime's other features with the original parameters exposed: bit for bit the flat form's training."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from tests.runtime.test_checkpointing import _full_params, _prepare
    from tests.runtime.test_init import _init_fn

    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for orig in (False, True):
        options: dict[str, Any] = {"use_orig_params": orig}
        if feature == "meta":
            with torch.device("meta"):
                model = _model.TinyTransformer()
            options["param_init_fn"] = _init_fn({id(m): n for n, m in model.named_modules()})
        else:
            model = _model.make_model(seed=rank if feature == "sync_module_states" else 0)
        if feature.startswith("wrapper_before") or feature.startswith("inner"):
            _prepare(feature, model)
        model = runtime.shard(model, wrap=(Block,), sync_module_states=feature == "sync_module_states",
                              device="cpu", **options)
        if feature == "wrapper_after":
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        if feature == "kept_gathered":
            model.set_reshard_after_backward(False)
            model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
        losses = train(model, "one", rank=rank, world=world, clip=True)
        names = [n for n, _ in _model.make_model().named_parameters()]
        out[orig] = {"losses": losses, "params": _full_params(model, names),
                     "names": [n for n, _ in model.named_parameters()]}
    return out


@pytest.mark.parametrize("feature", ["meta", "sync_module_states", "inner_part_reentrant", "wrapper_before",
                                     "wrapper_after", "kept_gathered"])
def test_the_runtime_features_compose_with_original_parameters(feature: str) -> None:
    for result in run_ranks(2, _composed, feature):
        assert result[True]["losses"] == result[False]["losses"], feature
        for name, value in result[False]["params"].items():
            assert torch.equal(result[True]["params"][name], value), (feature, name)
        plain = [n for n, _ in _model.make_model().named_parameters()]
        assert result[True]["names"] == plain or feature.startswith("wrapper"), result[True]["names"]
        assert len(result[True]["names"]) == len(plain)


def _summoned(_: None) -> dict[str, Any]:
    """Inside ``summon_full_params`` ``named_parameters()`` yields the full parameters too (FSDP1's semantics), and
    writes through them persist; outside, the very parameter objects the optimizer holds come back."""
    model = runtime.shard(_model.make_model(), wrap=(Block,), use_orig_params=True)
    before = list(model.parameters())
    plain = dict(_model.make_model().named_parameters())
    with model.summon_full_params(writeback=True):
        inside = dict(model.named_parameters())
        same = {n: torch.equal(p, plain[n]) for n, p in inside.items()}
        attr = model.blocks[0].fc1.weight is inside["blocks.0.fc1.weight"] and model.head.weight is inside["tok.weight"]
        with torch.no_grad():
            inside["blocks.1.fc2.weight"].mul_(2)
    after = list(model.parameters())
    full = _named_full(model)
    return {"same": same, "names": list(inside), "attr": attr,
            "requires_grad": {n: p.requires_grad for n, p in inside.items()},
            "restored": len(after) == len(before) and all(a is b for a, b in zip(after, before)),
            "written": torch.equal(full["blocks.1.fc2.weight"], plain["blocks.1.fc2.weight"] * 2)}


def test_summon_full_params_lists_the_full_parameters() -> None:
    plain = _model.make_model()
    for r in run_ranks(3, _summoned, None):
        assert r["names"] == [n for n, _ in plain.named_parameters()]
        assert all(r["same"].values()), r["same"]
        assert r["requires_grad"] == {n: p.requires_grad for n, p in plain.named_parameters()}
        assert r["attr"] and r["restored"] and r["written"], r


class _ReadsDevice(Block):
    """A block that places its input by the next block's weight's device (as code written for FSDP1 does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nxt = self.next_block[0]
        assert nxt.fc1.weight.device == x.device and nxt.fc1.weight.is_floating_point() and not nxt.fc1.weight.is_cuda
        return super().forward(x.to(nxt.fc1.weight.device))


def _forward_raises(_: None) -> dict[str, Any]:
    """After a forward that raised (and one under no_grad), the names read the pieces again; a stand-in tells its
    device and dtype to another unit's forward, as the piece would."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model.make_model()
    model.blocks[0].__class__ = _ReadsDevice
    object.__setattr__(model.blocks[0], "next_block", [model.blocks[1]])
    model = runtime.shard(model, wrap=(Block,), use_orig_params=True)
    batch = _model.local_slice(_model.make_batches(1)[0], rank, world)
    piece = model.blocks[1].fc1.weight
    out = {"reads_device": _model.loss_fn(model, *batch).item() > 0}
    hook = model.blocks[1].register_forward_pre_hook(lambda m, a: 1 / 0)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ZeroDivisionError):
            model(batch[0])
        out[f"after raise, grad={grad}"] = model.blocks[1].fc1.weight is piece
    hook.remove()
    with torch.no_grad():
        model(batch[0])
    out["after no_grad"] = model.blocks[1].fc1.weight is piece
    return out


def test_the_names_read_the_pieces_after_any_forward() -> None:
    for result in run_ranks(2, _forward_raises, None):
        assert all(result.values()), result
