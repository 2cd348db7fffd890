"""StateDictType handling: FULL, SHARDED and LOCAL state dicts for model and optimizer, and conversions."""
from __future__ import annotations

from shardckpt.runtime.api import register_module_state_handlers
from shardckpt.state_dict.api import (
    DEFAULT_TYPE,
    MODULE_STATE_HANDLERS,
    async_save_state,
    get_state_dict,
    save_state,
    set_state_dict,
    state_dict_type,
)
from shardckpt.state_dict.load_state import load_state
from shardckpt.state_dict.optim_state import init_optim_state, unsharded_param_names
from shardckpt.state_dict.rekey import rekey_optim_state_dict
from shardckpt.state_dict.types import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)

__all__ = [
    "DEFAULT_TYPE", "async_save_state", "FullOptimStateDictConfig", "FullStateDictConfig", "LocalOptimStateDictConfig",
    "LocalStateDictConfig", "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig",
    "StateDictConfig", "StateDictType", "get_state_dict", "init_optim_state", "load_state",
    "rekey_optim_state_dict", "save_state", "set_state_dict", "state_dict_type", "unsharded_param_names",
]

# A sharded module's own state_dict()/load_state_dict() follow state_dict_type: installed here, so that
# the runtime below needs no import of this package.
register_module_state_handlers(MODULE_STATE_HANDLERS)
