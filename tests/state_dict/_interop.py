"""Rank functions for the torch interop tests: the same model trained by torch FSDP1 / FSDP2 and by
shardckpt's runtime, and their state dicts in comparable (plain, picklable) form."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import shardckpt
from shardckpt import StateDictType
from tests.runtime import _model
from tests.runtime._model import Block
from tests.state_dict._train import clone_state, new_run, steps

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT
STEPS = 2


def fsdp1_run(batches) -> tuple[Any, Any, list[float]]:
    """The test model under torch FSDP1 on CPU (one flat parameter per Block and one at the root)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # use_orig_params=True: the model mixes frozen and trainable parameters in one module, which
    # FSDP1 refuses to flatten together with use_orig_params=False.
    model = FSDP(_model.make_model(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 use_orig_params=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim, steps(model, optim, batches)


def _plain(obj: Any) -> Any:
    """A deep copy with tensors cloned (so nothing aliases live training state)."""
    return clone_state(obj)


def _gather_flat(local: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D piece, concatenated in rank order (the pieces may differ in length)."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, local.detach().clone())
    return torch.cat(pieces)


def _torch_sharded(value: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None, torch.Tensor | None]:
    """(global shape, this rank's offsets, local data) of a torch ShardedTensor or DTensor."""
    if type(value).__name__ == "DTensor":
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return tuple(value.shape), tuple(offset), value.to_local().detach().clone()
    shards = value.local_shards()
    if not shards:
        return tuple(value.size()), None, None
    (shard,) = shards
    return tuple(value.size()), tuple(shard.metadata.shard_offsets), shard.tensor.detach().clone()


def _fsdp1_members(model) -> dict[str, torch.Tensor]:
    """Every parameter of an FSDP1 model rebuilt from the ranks' LOCAL flat shards (FSDP1's padding dropped)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType as TST

    with FSDP.state_dict_type(model, TST.LOCAL_STATE_DICT):
        sd = model.state_dict()
    handles = {name.replace("_fsdp_wrapped_module.", ""): m._handle.flat_param
               for name, m in model.named_modules() if isinstance(m, FSDP) and m._handle is not None}
    out = {}
    for prefix, flat in handles.items():
        key = f"{prefix}._flat_param" if prefix else "_flat_param"
        _, _, local = _torch_sharded(sd[key])
        full = _gather_flat(local if local is not None else torch.empty(0))
        assert full.numel() == sum(flat._numels_with_padding), key
        pieces = full.split(list(flat._numels_with_padding))
        real = [t for t, pad in zip(pieces, flat._is_padding_mask) if not pad]
        for fqn, shape, t in zip(flat._fqns, flat._shapes, real):
            out[f"{prefix}.{fqn}" if prefix else fqn] = t.view(shape).clone()
    return out


def _runtime_members(model, sd: dict) -> dict[str, torch.Tensor]:
    """Every parameter of a runtime-sharded model rebuilt from the ranks' LOCAL flat shards (our padding
    dropped), using the layouts stored in the LOCAL state dict."""
    from shardckpt.runtime import FlatLayout

    out = {}
    for key, doc in sd["_flat_layouts"].items():
        layout = FlatLayout.from_dict(doc)
        value = sd[key]
        assert value.global_shape == (layout.padded_numel,)
        full = _gather_flat(value.local)
        assert full.numel() == layout.padded_numel
        for name, aliases, shape, offset, numel in zip(layout.names, layout.aliases, layout.shapes, layout.offsets,
                                                        layout.numels):
            for n in (name,) + aliases:
                out[n] = full[offset:offset + numel].view(shape).clone()
    return out


def fsdp1_and_runtime(offload_to_cpu: bool) -> dict[str, Any]:
    """Train the test model 2 AdamW steps under torch FSDP1 and under the runtime; every state-dict type of
    both, as plain data (FULL with ``offload_to_cpu`` for ours only when asked)."""
    from torch.distributed.fsdp import FullOptimStateDictConfig
    from torch.distributed.fsdp import FullStateDictConfig as TorchFullConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType as TST

    batches = _model.make_batches(STEPS)
    torch_model, torch_optim, torch_losses = fsdp1_run(batches)
    # offload_to_cpu=False for both: FSDP1's FULL model state dict with offload segfaults on CPU, and its
    # FULL optimizer state with offload (FullOptimStateDictConfig's default!) is wrong on CPU: every state
    # of a flat parameter is unflattened as a view of ONE gather buffer reused for each state name, and
    # `.cpu()` (the offload) is a no-op there instead of a copy, so `exp_avg` comes back holding
    # `exp_avg_sq`'s values (torch/distributed/fsdp/_optim_utils.py, _allgather_orig_param_states and
    # _unflatten_orig_param_states: the `elif not cpu_offload: value.clone()` branch is the only copy).
    with FSDP.state_dict_type(torch_model, TST.FULL_STATE_DICT, TorchFullConfig(rank0_only=False),
                              FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        torch_full = _plain(torch_model.state_dict())
        torch_optim_full = _plain(FSDP.optim_state_dict(torch_model, torch_optim))
    with FSDP.state_dict_type(torch_model, TST.SHARDED_STATE_DICT):
        torch_sharded = {k: _torch_sharded(v) if type(v).__name__ in ("ShardedTensor", "DTensor")
                         else (tuple(v.shape), None, v.detach().clone())
                         for k, v in torch_model.state_dict().items()}
    torch_local = _fsdp1_members(torch_model)

    model, optim = new_run()
    losses = steps(model, optim, batches)
    config = shardckpt.FullStateDictConfig(offload_to_cpu=offload_to_cpu)
    full = _plain(shardckpt.get_state_dict(model, optim, type=FULL, config=config))
    sharded = {}
    for k, v in shardckpt.get_state_dict(model, None, type=SHARDED)["model"].items():
        if isinstance(v, shardckpt.ShardedTensor):
            region = v.region
            offsets = tuple(region.offsets) if isinstance(region, shardckpt.Box) else None
            sharded[k] = (v.global_shape, offsets, v.local.detach().clone())
        else:
            sharded[k] = (tuple(v.shape), None, v.detach().clone())
    local = _runtime_members(model, shardckpt.get_state_dict(model, None, type=LOCAL)["model"])
    return {
        "torch": {"losses": torch_losses, "full": torch_full, "optim": torch_optim_full, "sharded": torch_sharded,
                  "local": torch_local},
        "ours": {"losses": losses, "full": full["model"], "optim": full["optim"], "sharded": sharded,
                 "local": local},
    }



def fsdp1_and_runtime_full_offloaded() -> dict[str, Any]:
    """FULL model state with ``offload_to_cpu=True`` from torch FSDP1 and from the runtime, after the same steps."""
    from torch.distributed.fsdp import FullStateDictConfig as TorchFullConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType as TST

    batches = _model.make_batches(STEPS)
    torch_model, _, _ = fsdp1_run(batches)
    with FSDP.state_dict_type(torch_model, TST.FULL_STATE_DICT, TorchFullConfig(offload_to_cpu=True, rank0_only=False)):
        torch_full = _plain(torch_model.state_dict())
    model, optim = new_run()
    steps(model, optim, batches)
    config = shardckpt.FullStateDictConfig(offload_to_cpu=True)
    return {"torch": torch_full, "ours": _plain(shardckpt.get_state_dict(model, None, type=FULL, config=config))["model"]}


# ------------------------------------------------------------------------------- torch FSDP2 + DCP


def fsdp2_run():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model.make_model()
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(value: Any) -> Any:
    """A DTensor (or a plain tensor) as a full plain tensor; other values as they are (deep-copied)."""
    if type(value).__name__ == "DTensor":
        return value.full_tensor().detach().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    return value.detach().clone() if torch.is_tensor(value) else value


def fsdp2_save(dcp_dir: str, shardckpt_dir: str) -> dict[str, Any]:
    """FSDP2 trains STEPS steps, saves its DTensor state with torch DCP (and with ``shardckpt.save``), then
    trains one more step. Returns the full state at the save and the losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    batches = _model.make_batches(STEPS + 1)
    model, optim = fsdp2_run()
    losses = steps(model, optim, batches[:STEPS])
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    shardckpt.save({"model": msd, "optim": osd}, shardckpt_dir)
    state = {"model": _full(msd), "optim": _full(osd)}
    losses += steps(model, optim, batches[STEPS:])
    return {"state": state, "losses": losses}


def runtime_from_dcp(dcp_dir: str) -> dict[str, Any]:
    """The runtime model (any world size) loads torch DCP's checkpoint through a FULL state dict that
    torch's own reader fills in place; then one more training step."""
    import torch.distributed.checkpoint as dcp

    model, optim = new_run()
    sd = shardckpt.get_state_dict(model, optim, type=FULL)
    dcp.load(sd, checkpoint_id=dcp_dir)
    shardckpt.set_state_dict(model, optim, sd, type=FULL)
    return _after_load(model, optim)


def runtime_from_shardckpt(path: str) -> dict[str, Any]:
    """The runtime model loads FSDP2's DTensor state saved with ``shardckpt.save``, by ``load_state``."""
    model, optim = new_run()
    shardckpt.load_state(model, optim, path)
    return _after_load(model, optim)


def _after_load(model, optim) -> dict[str, Any]:
    state = _plain(shardckpt.get_state_dict(model, optim, type=FULL))
    loss = steps(model, optim, _model.make_batches(STEPS + 1)[STEPS:])
    return {"state": state, "losses": loss}

