"""A sharded module's own state_dict()/load_state_dict() follow the state_dict_type context."""
from __future__ import annotations

import pytest
import torch

import shardckpt
from shardckpt import ShardedTensor, StateDictType
from shardckpt.state_dict.api import module_state_dict_setting
from tests._dist import run_ranks
from tests.runtime import _model
from tests.state_dict._train import new_run


def _module_methods() -> None:
    model, _ = new_run()
    plain = _model.make_model().state_dict()
    default = model.state_dict()  # FULL outside any context, like the unsharded model's
    assert default.keys() == plain.keys() and all(torch.equal(default[k], v) for k, v in plain.items())
    with shardckpt.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
        assert isinstance(sharded["blocks.0.fc1.weight"], ShardedTensor)
        changed = {k: ShardedTensor(v.local + 1, v.global_shape, v.region) if isinstance(v, ShardedTensor) else v
                   for k, v in sharded.items()}
        result = model.load_state_dict(changed)
        assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(model.state_dict()["ln_f.weight"], plain["ln_f.weight"] + 1)
    with shardckpt.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        assert "_flat_param" in local and "_flat_layouts" in local
        model.load_state_dict(local)
    # Exception-safe, and nothing left changed after the context.
    with pytest.raises(RuntimeError):
        with shardckpt.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            raise RuntimeError("boom")
    assert module_state_dict_setting(model)[0] is StateDictType.FULL_STATE_DICT
    with shardckpt.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        with shardckpt.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            assert module_state_dict_setting(model)[0] is StateDictType.LOCAL_STATE_DICT
        assert module_state_dict_setting(model)[0] is StateDictType.SHARDED_STATE_DICT
    with pytest.raises(TypeError):
        with shardckpt.state_dict_type(_model.make_model(), StateDictType.FULL_STATE_DICT):
            pass


@pytest.mark.parametrize("world", [1, 3])
def test_module_methods_follow_the_context(world):
    run_ranks(world, _module_methods)
