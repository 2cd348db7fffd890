"""``plan_conversion(reader, spec)`` is pure: everything a conversion writes is decided from what the reader holds
(its tree, tensor list and manifest), with no value read and no file touched: a stub reader without storage
plans like a checkpoint on disk."""
from __future__ import annotations

import builtins
import math
from typing import Any

import pytest
import torch

from shardckpt.format.tree import TensorRef
from shardckpt.format.manifest import FORMAT_NAME
from shardckpt.formats.api import Facts, TensorInfo
from shardckpt.offline.conversion import ConversionRequestError
from shardckpt.offline.convert_plan import ConversionPlan, plan_conversion
from shardckpt.offline.spec import ConvertSpec
from shardckpt.regions import FlatRange

SHAPES = {"model.w": ((10, 3), torch.float32), "model.b": ((3,), torch.float32), "model.ids": ((5,), torch.int64),
          "model.scale": ((), torch.float32)}


def _shardckpt(identity: str, world_size: int, metadata: dict) -> Facts:
    return Facts(FORMAT_NAME, "stub", world_size, metadata.get("state_dict_type"), metadata, identity)


class StubReader:
    """A source held by nothing: tensors and a tree, no values (a read fails the test), and its facts (with an
    identity: a shardckpt source's)."""

    def __init__(self, facts: Facts | None = None):
        self._infos = {name: TensorInfo(name, dtype, shape, None) for name, (shape, dtype) in SHAPES.items()}
        self._tree: Any = {"model": {name.split(".", 1)[1]: TensorRef(name) for name in SHAPES}, "step": 7}
        self._facts = facts or Facts("safetensors", "stub")

    def facts(self) -> Facts:
        return self._facts

    def tensors(self):
        return self._infos

    def tree(self):
        return self._tree

    def read(self, requests):
        raise AssertionError("plan_conversion read a value")


@pytest.fixture
def no_io(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError(f"plan_conversion opened a file: {args}")

    monkeypatch.setattr(builtins, "open", refused)


def _plan(reader=None, **options) -> ConversionPlan:
    return plan_conversion(reader or StubReader(), ConvertSpec("src", "dst", **options))


def test_a_sharded_plan_is_dim0_chunks_each_rank_its_own_and_scalars_once(no_io):
    plan = _plan(world_size=3)
    assert (plan.what.world, plan.what.out_type) == (3, "sharded")
    assert [o.name for o in plan.what.outputs] == ["model.w", "model.b", "model.ids", "model.scale"]
    w = plan.chunks.tensors["model.w"]
    assert list(w.regions) == [FlatRange(0, 12), FlatRange(12, 24), FlatRange(24, 30)] and list(w.writers) == [0, 1, 2]
    by_name = {o.name: o for o in plan.what.outputs}
    assert plan.place(by_name["model.w"], 1) == (FlatRange(12, 24), False)
    assert plan.place(by_name["model.scale"], 2)[1]  # a replica: written once
    assert len(plan.chunks.tensors["model.scale"].regions) == 1
    written = sum(plan.chunks.tasks.bytes(r) for r in plan.chunks.tasks.writing_ranks())
    assert written == plan.tensor_bytes == sum(math.prod(s) * d.itemsize for s, d in SHAPES.values())
    assert plan.what.metadata["state_dict_type"] == "SHARDED_STATE_DICT" and plan.version >= 2


def test_the_spec_decides_the_selection_the_cast_and_the_format(no_io):
    plan = _plan(world_size=2, dtype="bfloat16", exclude=["model.ids"], strip_prefix="model.")
    assert {o.name: o.dtype for o in plan.what.outputs} == {"w": torch.bfloat16, "b": torch.bfloat16,
                                                            "scale": torch.bfloat16}
    assert plan.shaping["dtype"] == torch.bfloat16 and plan.shaping["strip_prefix"] == "model."
    dcp = _plan(format="dcp")
    assert dcp.chunks is None and dcp.what.out_type == "sharded" and dcp.shaping["format"] == "dcp"
    full = _plan(type="full", world_size=4)
    assert all(len(t.regions) == 1 for t in full.chunks.tensors.values())  # every tensor whole, once
    with pytest.raises(ConversionRequestError, match="nothing to convert"):
        _plan(only=["optim"])


def test_the_generation_is_the_same_for_the_same_conversion_of_the_same_source(no_io):
    source = StubReader(_shardckpt("g1", 4, {"state_dict_type": "SHARDED_STATE_DICT"}))
    first, again = _plan(source, world_size=2), _plan(source, world_size=2)
    assert first.generation == again.generation == first.chunks.generation  # a rerun finds the killed run's files
    assert _plan(source, world_size=3).generation != first.generation
    assert _plan(StubReader(_shardckpt("g2", 4, {})), world_size=2).generation != first.generation
    assert _plan(world_size=2).generation != _plan(world_size=2).generation  # no identity: never resumed
    assert _plan(source).what.world == 4  # the source's world size by default
    renamed = first.with_generation("fresh")
    assert renamed.generation == renamed.chunks.generation == "fresh" and first.generation != "fresh"
