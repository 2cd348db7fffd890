"""State-dict types and their configs, under the names FSDP users know."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class StateDictType(enum.Enum):
    """What each rank's state dict holds (see DESIGN.md section 1).

    - FULL_STATE_DICT: ordinary ``{fqn: tensor}`` with original shapes (gathered group by group).
    - SHARDED_STATE_DICT: per original parameter, this rank's dim-0 chunk as a ``ShardedTensor``.
    - LOCAL_STATE_DICT: the flat shards exactly as in memory (zero copy) plus their ``FlatLayout``s.
    """

    FULL_STATE_DICT = "FULL_STATE_DICT"
    SHARDED_STATE_DICT = "SHARDED_STATE_DICT"
    LOCAL_STATE_DICT = "LOCAL_STATE_DICT"


class OptimStateKeyType(enum.Enum):
    """How optimizer state is keyed: by parameter name (FQN, stable across wrapping and world size) or by
    parameter ID (the plain ``torch.optim`` layout). torch numbers IDs in the order of the optimizer's own
    param groups; ``get_state_dict`` numbers them in the unsharded model's ``named_parameters()`` order and
    records each group's names as ``param_names``, so that its IDs never depend on a guess."""

    PARAM_NAME = "PARAM_NAME"
    PARAM_ID = "PARAM_ID"


@dataclass(frozen=True, kw_only=True)
class StateDictConfig:
    """``offload_to_cpu``: return tensors on the CPU (copies), whatever device the model is on."""

    offload_to_cpu: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.offload_to_cpu, bool):
            raise TypeError(f"offload_to_cpu must be a bool, got {self.offload_to_cpu!r}")


@dataclass(frozen=True, kw_only=True)
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 receives the gathered tensors; the other ranks get empty dicts, and no
    rank ever holds more than the full model once plus one group. On load, only rank 0 needs to supply
    the values."""

    rank0_only: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.rank0_only, bool):
            raise TypeError(f"rank0_only must be a bool, got {self.rank0_only!r}")


@dataclass(frozen=True, kw_only=True)
class ShardedStateDictConfig(StateDictConfig):
    """The config of ``StateDictType.SHARDED_STATE_DICT``: each rank's state dict holds, per original
    parameter, its dim-0 chunk as a ``ShardedTensor`` (never the full tensor), which ``shardckpt.save``
    stores once and ``load`` reads back at any world size and sharding. It adds nothing to
    ``StateDictConfig``: ``offload_to_cpu=True`` returns the chunks as CPU copies."""


@dataclass(frozen=True, kw_only=True)
class LocalStateDictConfig(StateDictConfig):
    """The config of ``StateDictType.LOCAL_STATE_DICT``: each rank's state dict holds its flat shards exactly
    as they are in memory (zero copy) with their ``FlatLayout``s, the cheapest to save; a LOCAL checkpoint
    loads at any world size and into any state-dict type through its stored layouts (``load_state``). It adds
    nothing to ``StateDictConfig``: ``offload_to_cpu=True`` makes the shards CPU copies instead."""


@dataclass(frozen=True, kw_only=True)
class FullOptimStateDictConfig(FullStateDictConfig):
    """``FullStateDictConfig`` under the name FSDP gives the optimizer's: here one config serves both the
    model's and the optimizer's state (``get_state_dict``, ``set_state_dict`` and ``state_dict_type`` take one
    ``config``), so this class is accepted wherever a FULL_STATE_DICT config is, and means the same:
    ``rank0_only`` and ``offload_to_cpu`` apply to the gathered optimizer state as to the parameters."""


@dataclass(frozen=True, kw_only=True)
class ShardedOptimStateDictConfig(ShardedStateDictConfig):
    """``ShardedStateDictConfig`` under the name FSDP gives the optimizer's: here one config serves both the
    model's and the optimizer's state (``get_state_dict``, ``set_state_dict`` and ``state_dict_type`` take one
    ``config``), so this class is accepted wherever a SHARDED_STATE_DICT config is, and means the same: the
    optimizer's per-parameter state as ``ShardedTensor``s, like the parameters."""


@dataclass(frozen=True, kw_only=True)
class LocalOptimStateDictConfig(LocalStateDictConfig):
    """``LocalStateDictConfig`` under the name FSDP gives the optimizer's: here one config serves both the
    model's and the optimizer's state (``get_state_dict``, ``set_state_dict`` and ``state_dict_type`` take one
    ``config``), so this class is accepted wherever a LOCAL_STATE_DICT config is, and means the same: the
    optimizer's state as flat shards, like the parameters."""


DEFAULT_CONFIGS = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig(),
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig(),
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig(),
}
_CONFIG_CLASSES = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
}


def resolve_config(type: StateDictType, config: StateDictConfig | None) -> StateDictConfig:
    """The config to use for ``type``: the given one (checked to fit the type) or the default."""
    if not isinstance(type, StateDictType):
        raise TypeError(f"type must be a StateDictType, got {type!r}")
    if config is None:
        return DEFAULT_CONFIGS[type]
    if not isinstance(config, _CONFIG_CLASSES[type]):
        raise TypeError(f"{type.name} takes a {_CONFIG_CLASSES[type].__name__}, got {config.__class__.__name__}")
    return config
