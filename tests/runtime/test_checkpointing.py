"""Activation checkpointing with the runtime: every common form (``checkpoint`` inside a unit's forward,
around all of it or a part, reentrant or not; torch's ``checkpoint_wrapper`` applied before or after
``shard``) trains exactly as the same sharded model without checkpointing, within the parity tolerance of
unsharded training, with every strategy; all-gathers per step are counted."""
from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardckpt import runtime
from shardckpt.dist import collectives
from tests._dist import run_ranks
from tests.runtime import _helpers, _model
from tests.runtime._model import Block

STEPS = 4
TORCH_FORMS = ("inner", "inner_part", "wrapper_before")  # run with torch's fully_shard too
FORMS = ("none", "inner", "inner_part", "inner_reentrant", "inner_part_reentrant", "wrapper_before",
         "wrapper_before_reentrant", "wrapper_after")


def _inner(block: Block, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    return checkpoint(Block.forward, block, x, use_reentrant=reentrant)


def _inner_part(block: Block, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    """Only the MLP half recomputed; the attention half's uses of the unit's parameters stay outside."""
    x = x + block.attn(block.ln1(x), block.mask.to(x.dtype))
    mlp = lambda y: block.gate * block.fc2(F.gelu(block.fc1(block.ln2(y))))  # noqa: E731
    return x + checkpoint(mlp, x, use_reentrant=reentrant)


def _prepare(form: str, model: torch.nn.Module) -> None:
    """The checkpointing a form applies before sharding."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if form.startswith("inner"):
        body = _inner_part if "part" in form else _inner
        for block in model.blocks:
            block.forward = types.MethodType(functools.partial(body, reentrant=form.endswith("reentrant")), block)
    elif form.startswith("wrapper_before"):
        impl = CheckpointImpl.REENTRANT if form.endswith("reentrant") else CheckpointImpl.NO_REENTRANT
        for i in range(len(model.blocks)):
            model.blocks[i] = checkpoint_wrapper(model.blocks[i], checkpoint_impl=impl)


def _build(form: str, strategy: runtime.ShardingStrategy) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = _model.make_model()
    _prepare(form, model)
    model = runtime.shard(model, strategy=strategy, wrap=(Block,),
                          process_group=_helpers.mesh_for(strategy, dist.get_world_size()))
    if form == "wrapper_after":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def _train_every_form(strategy_name: str) -> dict[str, Any]:
    strategy = runtime.ShardingStrategy[strategy_name]
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _helpers.reference_run(STEPS)
    gathers = [0]
    real = collectives.all_gather

    def counting(*args, **kwargs):
        gathers[0] += 1
        return real(*args, **kwargs)

    collectives.all_gather = counting
    out = {}
    try:
        for form in FORMS:
            model = _build(form, strategy)
            gathers[0] = 0
            losses, _ = _model.train(model, _model.make_batches(STEPS), rank=rank, world=world)
            per_step = gathers[0] / STEPS
            out[form] = {"losses": _helpers.global_mean(losses), "gathers_per_step": per_step,
                         "params": _full_params(model, list(reference["params"]))}
    finally:
        collectives.all_gather = real
    base = out["none"]
    fsdp2 = {form: _helpers.torch_fsdp2_run(strategy, STEPS, prepare=functools.partial(_prepare, form))
             for form in TORCH_FORMS}
    return {form: {"losses": r["losses"], "gathers_per_step": r["gathers_per_step"],
                   "vs_none": _helpers.max_param_diff(r["params"], base["params"]),
                   "vs_reference": _helpers.max_param_diff(r["params"], reference["params"])}
            for form, r in out.items()} | {
        "reference_losses": reference["losses"],
        "fsdp2": {form: {"losses": f["losses"], "vs_ours": _helpers.max_param_diff(out[form]["params"], f["params"])}
                  for form, f in fsdp2.items()}}


def _full_params(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Copies of the full parameters by their unwrapped names (torch's checkpoint wrappers forward attributes
    to the module they wrap)."""
    with runtime.summon_full_params(model, writeback=False):
        return {name: functools.reduce(getattr, name.split("."), model).detach().clone() for name in names}


@pytest.mark.parametrize("strategy, world_size", [("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 2),
                                                  ("HYBRID_SHARD", 4), ("FULL_SHARD", 3)])
def test_every_checkpointing_form_trains_as_without_it(strategy: str, world_size: int) -> None:
    results = run_ranks(world_size, _train_every_form, strategy, timeout=600)
    assert all(r == results[0] for r in results), "ranks disagree"
    result = results.pop() if len(results) == 1 else results[0]
    none = result["none"]
    for form in FORMS:
        r = result[form]
        # The recomputation repeats the same operations on the same values: the same training, bit for bit.
        assert r["losses"] == none["losses"], (form, r["losses"], none["losses"])
        assert r["vs_none"][0] == 0.0, (form, r["vs_none"])
        torch.testing.assert_close(r["losses"], result["reference_losses"], rtol=2e-6, atol=0)
        assert r["vs_reference"][0] < 2e-6, (form, r["vs_reference"])
        # The backward re-gather a freed unit needs anyway serves the recomputation: no extra all-gather; but a
        # reentrant checkpoint runs the unit's forward without grad, after which every strategy frees it (as
        # for an evaluation forward), so without resharding after forward its recomputation gathers it again:
        # once per group (trainable and frozen) of each block.
        keeps = strategy in ("SHARD_GRAD_OP", "NO_SHARD")  # the strategies that do not reshard after forward
        extra = 2 * _model.LAYERS if form == "wrapper_before_reentrant" and keeps else 0
        assert r["gathers_per_step"] == none["gathers_per_step"] + extra, (form, r["gathers_per_step"], none)
    for form, f in result["fsdp2"].items():  # torch's fully_shard with the same checkpointing
        torch.testing.assert_close(f["losses"], result[form]["losses"], rtol=2e-6, atol=0)
        assert f["vs_ours"][0] < 2e-6, (form, f["vs_ours"])


def _llama_losses(order: str) -> tuple[list[float], int]:
    """A tiny transformers Llama (from a config, no download) sharded by decoder layer, 4 AdamW steps on one
    batch; ``order``: no checkpointing, or ``gradient_checkpointing_enable()`` before or after ``shard``.
    Returns the losses and how many times the first decoder layer's MLP ran forward (transformers 5 checkpoints
    a layer's ``forward``, inside the unit's hooks: the form of ``checkpoint`` inside a unit)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).train()
    if order == "before":
        model.gradient_checkpointing_enable()
    model = runtime.shard(model, strategy=runtime.ShardingStrategy.FULL_SHARD, wrap=(LlamaDecoderLayer,))
    if order == "after":
        model.gradient_checkpointing_enable()
    calls = [0]
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2 * world, 12), generator=gen)[2 * rank:2 * rank + 2]
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return _helpers.global_mean(losses), calls[0]


def _llama_every_order() -> dict[str, tuple[list[float], int]]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        return {order: _llama_losses(order) for order in ("none", "before", "after")}


def test_a_transformers_llama_with_gradient_checkpointing_trains_as_without_it() -> None:
    pytest.importorskip("transformers")
    results = run_ranks(2, _llama_every_order, timeout=600)
    (none, calls), before, after = (results[0][order] for order in ("none", "before", "after"))
    assert before[0] == none and after[0] == none, results[0]
    assert none[-1] < none[0] - 0.5  # it learns the batch
    assert calls == 4 and before[1] == after[1] == 8  # recomputed in every backward: checkpointing was on
