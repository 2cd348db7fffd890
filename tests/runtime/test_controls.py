"""FSDP2's explicit controls on the runtime: ``unshard(async_op)`` / ``reshard()``, ``reshard_after_forward``
per unit, ``set_requires_gradient_sync``, ``set_reshard_after_backward``, explicit prefetch lists, FSDP1's
``BackwardPrefetch``, ``set_gradient_divide_factor``: each trains exactly as the default does (or as its
definition says), and gathers what it says it does."""
from __future__ import annotations

from typing import Any, Callable

import tempfile

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import runtime
from shardckpt.dist import collectives
from shardckpt.errors import ShardingError
from shardckpt.runtime.flat_group import NotGathered
from tests._dist import run_ranks
from tests.runtime import _helpers, _model
from tests.runtime._model import Block

STEPS = 3


class _Gathers:
    """Counts the runtime's all-gathers while installed."""

    def __enter__(self) -> _Gathers:
        self.count, self._real = 0, collectives.all_gather

        def counting(*args, **kwargs):
            self.count += 1
            return self._real(*args, **kwargs)

        collectives.all_gather = counting
        return self

    def __exit__(self, *exc) -> None:
        collectives.all_gather = self._real


def _run(setup: Callable[[Any], None] | None = None, steps: int = STEPS, **options) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = runtime.shard(_model.make_model(), wrap=(Block,), **options)
    if setup is not None:
        setup(model)
    with _Gathers() as gathers:
        losses, _ = _model.train(model, _model.make_batches(steps), rank=rank, world=world)
    names = [n for n, _ in _model.make_model().named_parameters()]
    return {"losses": _helpers.global_mean(losses), "params": _helpers.full_params(model, names),
            "gathers": gathers.count}


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def _every_control() -> dict[str, Any]:
    base = _run()
    out: dict[str, Any] = {"base_gathers": base["gathers"]}

    def prefetch(model):
        blocks = list(model.blocks)
        model.set_modules_to_forward_prefetch(blocks)  # both blocks as the root's forward starts
        blocks[1].set_modules_to_backward_prefetch([blocks[0]])

    def keep_block0(model):
        model.blocks[0].set_reshard_after_forward(False)

    variants = {
        "prefetch_lists": _run(prefetch),
        "keep_block0": _run(keep_block0),
        "no_reshard_after_forward": _run(reshard_after_forward=False),
        "backward_post": _run(backward_prefetch=runtime.BackwardPrefetch.BACKWARD_POST),
        "torch_backward_post": _run(backward_prefetch=torch.distributed.fsdp.BackwardPrefetch.BACKWARD_POST),
        "no_backward_prefetch": _run(backward_prefetch=None),
        "keep_after_backward": _run(lambda m: m.set_reshard_after_backward(False)),
    }
    out["same"] = {name: _same(result, base) for name, result in variants.items()}
    out["gathers"] = {name: result["gathers"] for name, result in variants.items()}
    return out


def test_every_control_trains_as_the_default() -> None:
    for r in run_ranks(2, _every_control):
        assert all(r["same"].values()), r["same"]
        g, base = r["gathers"], r["base_gathers"]
        # 2 blocks x 2 groups (trainable, frozen) and the root's 2; FULL_SHARD gathers blocks twice a step
        assert base == STEPS * (2 + 2 * 4)
        assert g["keep_block0"] == base - STEPS * 2 and g["no_reshard_after_forward"] == base - STEPS * 4
        assert g["prefetch_lists"] == g["backward_post"] == g["no_backward_prefetch"] == base
        # kept gathered after backward, and gathered again after every optimizer step (any step marks every
        # group: a fused optimizer's writes bypass the version counter): as many gathers as the default here,
        # fewer only between steps (gradient accumulation)
        assert g["keep_after_backward"] == base


def _unshard_reshard() -> dict[str, Any]:
    model = runtime.shard(_model.make_model(), wrap=(Block,))
    block = model.blocks[0]
    handle = block.unshard(async_op=True)
    handle.wait()
    handle.wait()  # idempotent
    seen = block.ln2.weight
    with _Gathers() as gathers:  # the next forward uses the gathered block without gathering it again
        ids, _ = _model.local_slice(_model.make_batches(1)[0], dist.get_rank(), dist.get_world_size())
        with torch.no_grad():
            model(ids)
    after_forward = block.ln2.weight
    block.unshard()
    block.reshard()
    reshard_drops = isinstance(block.ln2.weight, NotGathered)
    errors = []
    for call in (lambda: model.set_modules_to_forward_prefetch([torch.nn.Linear(2, 2)]),
                 lambda: model.set_gradient_divide_factor(0), lambda: block.set_reshard_after_forward(1)):
        try:
            call()
        except ShardingError as e:
            errors.append(str(e))
    return {"exposed": not isinstance(seen, NotGathered) and tuple(seen.shape) == (_model.DIM,),
            "gathers": gathers.count, "freed_after_forward": isinstance(after_forward, NotGathered), "reshard_drops": reshard_drops, "errors": errors}


def test_unshard_and_reshard() -> None:
    for r in run_ranks(2, _unshard_reshard):
        assert r["exposed"] and r["freed_after_forward"] and r["reshard_drops"]
        assert r["gathers"] == 2 + 2  # the root's 2 groups and block 1's 2: block 0 was gathered already
        assert len(r["errors"]) == 3 and "not a unit" in r["errors"][0] and "positive" in r["errors"][1]


def _sync_and_divide() -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _model.make_batches(2)

    def grads(setup) -> list[torch.Tensor]:
        model = runtime.shard(_model.make_model(), wrap=(Block,))
        setup(model)
        for i, batch in enumerate(batches):
            if i == len(batches) - 1:
                model.set_requires_gradient_sync(True)
            _model.loss_fn(model, *_model.local_slice(batch, rank, world)).backward()
        return [g.flat_param.grad.clone() for g in runtime.groups(model) if g.flat_param.grad is not None]

    def no_sync_form(model):
        model.set_requires_gradient_sync(False)

    accumulated = grads(no_sync_form)
    reference = grads(lambda model: None)  # two synchronised backwards add up the same gradients
    summed = grads(lambda model: (no_sync_form(model), model.set_gradient_divide_factor(1)))
    return {"accumulate": all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(accumulated, reference)),
            "sum_is_world_times_mean": all(torch.equal(s, a * world) for s, a in zip(summed, accumulated))}


def test_requires_gradient_sync_and_divide_factor() -> None:
    for r in run_ranks(2, _sync_and_divide):
        assert r["accumulate"] and r["sum_is_world_times_mean"], r


@pytest.mark.parametrize("bad", ["yes", 2])
def test_bad_prefetch_choices_are_refused(bad) -> None:
    with pytest.raises(ShardingError, match="backward_prefetch"):
        runtime.shard(_model.make_model(), wrap=(Block,), backward_prefetch=bad)


class _TableBlock(Block):
    """A block that also adds a positional table owned by the first block (one table every block reads)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.owner_of_table[0].table[: x.shape[1]])


def _table_model() -> torch.nn.Module:
    model = _model.make_model()
    torch.manual_seed(3)
    blocks = list(model.blocks)
    blocks[0].table = torch.nn.Parameter(torch.randn(_model.SEQ, _model.DIM) * 0.1)
    for block in blocks:
        block.__class__ = _TableBlock
        object.__setattr__(block, "owner_of_table", [blocks[0]])  # a plain reference, not a submodule
    return model


def _shared_table(orig: bool) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _model.make_batches(STEPS)
    reference = _table_model()
    ref_losses, _ = _model.train(reference, batches)
    model = runtime.shard(_table_model(), wrap=(Block,), use_orig_params=orig)
    try:
        _model.train(model, batches, rank=rank, world=world)
        error = None
    except ShardingError as e:
        error = str(e)
    shared = runtime.shard(_table_model(), wrap=(Block,), shared_params=["blocks.0.table"], use_orig_params=orig)
    losses, _ = _model.train(shared, batches, rank=rank, world=world)
    names = [n for n, _ in reference.named_parameters()]
    got = _helpers.full_params(shared, names)
    worst = max((got[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    with pytest.raises(ShardingError, match=r"shared_params names \['blocks.9.table'\]"):
        runtime.shard(_table_model(), wrap=(Block,), shared_params=["blocks.9.table"])
    return {"error": error, "losses": _helpers.global_mean(losses), "reference": ref_losses, "worst": worst}


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig_params"])
def test_a_parameter_used_outside_its_unit_fails_clearly_or_works_when_shared(orig: bool) -> None:
    """With ``use_orig_params`` too: the name reads this rank's piece between steps, but not in another unit's
    forward (a piece of the (5, 14) table could broadcast: at ws 5 it is shaped (1, 14))."""
    for r in run_ranks(2, _shared_table, orig):
        assert r["error"] is not None and "'blocks.0.table'" in r["error"] and "shared_params" in r["error"], r
        torch.testing.assert_close(r["losses"], r["reference"], rtol=2e-6, atol=0)
        assert r["worst"] < 2e-6, r["worst"]


def _backward_that_raises() -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = _model.local_slice(_model.make_batches(1)[0], rank, world)

    def grads(model) -> list[torch.Tensor]:
        _model.loss_fn(model, *batch).backward()
        return [g.flat_param.grad.clone() for g in runtime.groups(model) if g.flat_param.grad is not None]

    model = runtime.shard(_model.make_model(), wrap=(Block,))
    failing = [True]

    def boom(module, grad_output):
        if failing[0]:
            failing[0] = False
            raise RuntimeError("out of memory (injected)")

    model.blocks[0].register_full_backward_pre_hook(boom)  # after block 1's reduction has started
    try:
        grads(model)
        raised = False
    except RuntimeError:
        raised = True
    again = grads(model)  # the same step again, after the failure: as if it never happened
    fresh = grads(runtime.shard(_model.make_model(), wrap=(Block,)))
    return {"raised": raised, "same": len(again) == len(fresh) and all(torch.equal(a, b) for a, b in zip(again, fresh))}


def test_a_backward_that_raises_leaves_the_next_step_clean() -> None:
    for r in run_ranks(2, _backward_that_raises):
        assert r == {"raised": True, "same": True}, r


def _kept_gathered_never_serves_old_weights() -> dict[str, Any]:
    """Units kept gathered after backward see every change of their shards: a fused optimizer's step (it does
    not bump autograd's version counter) and a load straight into the shards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _model.make_batches(STEPS)

    def fused_losses(keep: bool) -> list[float]:
        model = runtime.shard(_model.make_model(), wrap=(Block,))
        model.set_reshard_after_backward(not keep)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        losses = []
        for batch in batches:
            loss = _model.loss_fn(model, *_model.local_slice(batch, rank, world))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        return losses

    model = runtime.shard(_model.make_model(), wrap=(Block,))
    model.set_reshard_after_backward(False)
    ids, targets = _model.local_slice(batches[0], rank, world)
    _model.loss_fn(model, ids, targets).backward()  # every unit now kept gathered
    path = tempfile.mkdtemp() if rank == 0 else None
    path = _helpers_broadcast(path)
    other = runtime.shard(_model.make_model(seed=7), wrap=(Block,))
    shardckpt.save_state(other, None, f"{path}/ckpt")
    shardckpt.load_state(model, None, f"{path}/ckpt")
    with torch.no_grad():
        after_load = model(ids)
        want = other(ids)
    return {"fused": fused_losses(True) == fused_losses(False), "load": torch.equal(after_load, want)}


def _helpers_broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def test_units_kept_gathered_never_serve_old_weights() -> None:
    for r in run_ranks(2, _kept_gathered_never_serves_old_weights):
        assert r == {"fused": True, "load": True}, r
