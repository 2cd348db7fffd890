"""The public state-dict functions: get/set any type in memory, and save/load a model + optimizer."""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from shardckpt.checkpoint.async_save import SaveHandle, async_save
from shardckpt.checkpoint.save import save
from shardckpt.dist.group import resolve_group
from shardckpt.errors import BadArgumentError, IncompatibleCheckpointError
from shardckpt.runtime.api import ModuleStateHandlers
from shardckpt.runtime.state import state_of
from shardckpt.state_dict.model_state import get_model_state, rank0_only, set_model_state
from shardckpt.state_dict.optim_state import get_optim_state, prepare_optim_state, unsharded_param_names
from shardckpt.state_dict.types import (
    OptimStateKeyType,
    StateDictConfig,
    StateDictType,
    resolve_config,
)

DEFAULT_TYPE = StateDictType.FULL_STATE_DICT
"""The type ``model.state_dict()`` of a sharded model gives outside a ``state_dict_type`` context: FULL,
as with FSDP, so that it matches the unsharded model's ``state_dict()``."""


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, type: StateDictType,
                   config: StateDictConfig | None = None,
                   optim_key: OptimStateKeyType = OptimStateKeyType.PARAM_NAME) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of the given type (``"optim"`` only with an optimizer).

    Works for models sharded by ``shardckpt.runtime.shard`` and for plain models. Collective for sharded
    models (FULL and SHARDED move data between ranks; LOCAL does not). Optimizer state is keyed by
    parameter name (FQN) or by ID: IDs in the unsharded model's ``named_parameters()`` order (LOCAL: the
    flat parameters' order), each param group recording the names of its IDs as ``param_names``.
    """
    config = resolve_config(type, config)
    out: dict[str, Any] = {"model": get_model_state(model, type, config)}
    if optimizer is not None:
        out["optim"] = get_optim_state(model, optimizer, type, config, optim_key)
    return out


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None, state_dict: dict[str, Any], *,
                   type: StateDictType, config: StateDictConfig | None = None, strict: bool = True,
                   optim_param_names: Sequence[str] | None = None) -> None:
    """Load a state dict of the given type, as ``get_state_dict`` made it at this world size and wrapping.

    Checkpoints from another world size, wrapping or type load with ``load_state``. Mismatches raise
    ``IncompatibleCheckpointError`` naming the key, on every rank. With FULL ``rank0_only``, only rank 0's
    ``state_dict`` is read (the others may pass ``{}``).

    ID-keyed optimizer state maps IDs to parameters by the ``param_names`` its param groups record
    (``get_state_dict`` records them), else by ``optim_param_names`` (the names of IDs 0, 1, ...), else,
    for a plain model, by this optimizer's own param groups as torch's ``load_state_dict`` does;
    otherwise it is refused.
    """
    config = resolve_config(type, config)
    # With FULL rank0_only the other ranks have nothing to give: they may pass {}.
    load_optim = prepare_optim_state(model, optimizer, state_dict.get("optim", {}), type, config,
                                     optim_param_names) \
        if optimizer is not None and (rank0_only(config) or _optim_given(state_dict)) else None
    set_model_state(model, state_dict.get("model", {}), type, config, strict)  # checked before anything moves
    if load_optim is not None:
        load_optim()


def _optim_given(state_dict: dict[str, Any]) -> bool:
    """Whether the state dicts hold optimizer state, the same answer on every rank (collective)."""
    given = resolve_group().all_gather("optim" in state_dict)
    if len(set(given)) > 1:
        raise IncompatibleCheckpointError(
            f"the state dicts given hold optimizer state on ranks {[r for r, g in enumerate(given) if g]} only: give "
            "every rank its own (a FULL state dict given on rank 0 only loads with "
            "FullStateDictConfig(rank0_only=True))")
    return given[0]


_SETTINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ShardState -> (type, config)


@contextlib.contextmanager
def state_dict_type(model: nn.Module, type: StateDictType, config: StateDictConfig | None = None) -> Iterator[None]:
    """Within the context, ``model.state_dict()`` and ``model.load_state_dict()`` of a sharded model use ``type``.

    Unlike FSDP1's, nothing is set on submodules, and the previous setting is restored on exit even when
    the body raises. The setting is kept here, per sharded model, not in the runtime.
    """
    state = state_of(model)
    if state is None:
        raise TypeError("state_dict_type() needs a model returned by shardckpt.runtime.shard()")
    config = resolve_config(type, config)
    previous = _SETTINGS.get(state)
    _SETTINGS[state] = (type, config)
    try:
        yield
    finally:
        if previous is None:
            del _SETTINGS[state]
        else:
            _SETTINGS[state] = previous


def module_state_dict_setting(model: nn.Module) -> tuple[StateDictType, StateDictConfig]:
    """The (type, config) a sharded module's own ``state_dict()`` uses now."""
    return _SETTINGS.get(state_of(model)) or (DEFAULT_TYPE, resolve_config(DEFAULT_TYPE, None))


def _module_state_dict(model: nn.Module) -> dict[str, Any]:
    return get_model_state(model, *module_state_dict_setting(model))


def _module_load_state_dict(model: nn.Module, sd: dict[str, Any], strict: bool) -> tuple[list[str], list[str]]:
    return set_model_state(model, sd, *module_state_dict_setting(model), strict=strict)


MODULE_STATE_HANDLERS = ModuleStateHandlers(get=_module_state_dict, set=_module_load_state_dict)


def save_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
               type: StateDictType = StateDictType.SHARDED_STATE_DICT, config: StateDictConfig | None = None,
               optim_key: OptimStateKeyType = OptimStateKeyType.PARAM_NAME, extra: dict | None = None,
               **save_kwargs: Any) -> None:
    """Save model (and optimizer) state of ``type`` to ``path``; ``load_state`` reads it at any world size.

    ``extra`` adds plain entries (e.g. ``{"step": 1000}``). The manifest's metadata records the type and
    the optimizer key type, and for LOCAL state the unsharded model's parameter names in order
    (``param_names``), which the flat layouts alone do not give: offline tools number optimizer IDs and
    list param groups as the job's FULL state dict does with them.
    """
    sd, metadata = _state_to_save(model, optimizer, type, config, optim_key, extra)
    save(sd, path, metadata=metadata, **save_kwargs)


def async_save_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
                     type: StateDictType = StateDictType.SHARDED_STATE_DICT, config: StateDictConfig | None = None,
                     optim_key: OptimStateKeyType = OptimStateKeyType.PARAM_NAME, extra: dict | None = None,
                     **save_kwargs: Any) -> SaveHandle:
    """``save_state`` through ``shardckpt.async_save``: returns once the state is copied into the staging
    buffers (after ``get_state_dict``, whose FULL type gathers in the caller's thread); ``handle.wait()``."""
    sd, metadata = _state_to_save(model, optimizer, type, config, optim_key, extra)
    return async_save(sd, path, metadata=metadata, **save_kwargs)


def _state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer | None, type: StateDictType,
                   config: StateDictConfig | None, optim_key: OptimStateKeyType,
                   extra: dict | None) -> tuple[dict, dict]:
    """The state dict ``save_state`` saves, and its manifest metadata."""
    taken = sorted(set(extra or {}) & {"model", "optim"})
    if taken:  # it would replace the state saved under that key
        raise BadArgumentError(f"extra: {taken} name the model's and optimizer's state in the checkpoint; give "
                               "extra values other keys")
    sd = get_state_dict(model, optimizer, type=type, config=config, optim_key=optim_key)
    sd.update(extra or {})
    metadata = {"state_dict_type": type.value, "optim_key": optim_key.value}
    if type is StateDictType.LOCAL_STATE_DICT:
        metadata["param_names"] = unsharded_param_names(model)
    return sd, metadata
