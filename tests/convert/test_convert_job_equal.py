"""An offline conversion gives what the job itself saves in the output's type: for every sharding strategy, the flat
form and ``use_orig_params``, both optimizer keys, and a checkpoint saved by ``save_state`` or by ``save`` of the
state dict (no metadata), ``diff``-equal and the same tree, in the same order (param groups' ``params`` included)."""
from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch

import shardckpt
from shardckpt import CorruptCheckpointError, OptimStateKeyType, StateDictType
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.formats.native import read_manifest
from shardckpt.io import open_storage
from shardckpt.runtime import ShardingStrategy, shard
from shardckpt.format.flat_layout import LAYOUTS_KEY, POSITIONS
from tests._dist import run_ranks
from tests.runtime import _model
from tests.runtime._model import Block
from tests.state_dict._train import STEPS_BEFORE, steps
from tests.storage._util import manifest_doc, sealed

ROUTES = ("save_state", "save")
# (source type, output type, output world size): every direction the job saves both ends of; LOCAL output at the
# world size of the job's flat layouts (its shard group: 1 with NO_SHARD, whatever the job's world size)
DIRECTIONS = [("LOCAL", "FULL", 1), ("LOCAL", "SHARDED", 2), ("LOCAL", "LOCAL", None), ("SHARDED", "FULL", 1),
              ("FULL", "SHARDED", 2)]


def _path(root: str, route: str, sd_type: str, key: OptimStateKeyType) -> str:
    return f"{root}/{route}-{sd_type}-{key.name}"


def _train_and_save(root: str, strategy: str, orig_params: bool) -> None:
    model = shard(_model.make_model(), wrap=(Block,), strategy=ShardingStrategy(strategy), use_orig_params=orig_params)
    params = _model.three_lr_groups(model) if orig_params else model.parameters()
    optim = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    steps(model, optim, _model.make_batches(STEPS_BEFORE))
    for sd_type, key in itertools.product(StateDictType, OptimStateKeyType):
        name = sd_type.name.removesuffix("_STATE_DICT")
        shardckpt.save_state(model, optim, _path(root, "save_state", name, key), type=sd_type, optim_key=key)
        sd = shardckpt.get_state_dict(model, optim, type=sd_type, optim_key=key)
        shardckpt.save(sd, _path(root, "save", name, key))


def _layouts_world(path: str) -> int:
    layouts = read_manifest(open_storage(path)).tree["model"][LAYOUTS_KEY]
    return next(iter(layouts.values()))["world_size"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(strategy, orig_params) -> the root of what that job saved (each job run once)."""
    roots: dict[tuple[str, bool], str] = {}

    def saved(strategy: str, orig_params: bool) -> str:
        if (strategy, orig_params) not in roots:
            root = str(tmp_path_factory.mktemp(f"{strategy}-{orig_params}"))
            run_ranks(2, _train_and_save, root, strategy, orig_params, timeout=300)
            roots[(strategy, orig_params)] = root
        return roots[(strategy, orig_params)]

    return saved


@pytest.mark.parametrize("orig_params", [False, True], ids=["flat", "orig_params"])
@pytest.mark.parametrize("strategy", [s.value for s in ShardingStrategy])
def test_an_offline_conversion_gives_what_the_job_saves(job, tmp_path, strategy, orig_params):
    source_root, root = job(strategy, orig_params), str(tmp_path)
    wrong = []
    for route, key, (source, target, world) in itertools.product(ROUTES, OptimStateKeyType, DIRECTIONS):
        out, want = f"{root}/out-{route}-{key.name}-{source}-{target}", _path(source_root, route, target, key)
        world = world or _layouts_world(want)
        convert(_path(source_root, route, source, key), out, type=target.lower(), world_size=world)
        report = diff(out, want)
        got, expected = (read_manifest(open_storage(p)) for p in (out, want))
        where = f"{route} {key.name} {source} -> {target} ws {world}"
        if not report.equal or report.tensors == 0:
            wrong.append(f"{where}: {[(d.name, d.detail[:120]) for d in report.differences[:3]]}")
        elif repr(got.tree) != repr(expected.tree) or list(got.tensors) != list(expected.tensors):
            wrong.append(f"{where}: the same values, in another order")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("damage", ["twice", "missing", "not ints"])
def test_damaged_positions_are_a_corrupt_checkpoint_naming_them(job, tmp_path, damage):
    path = str(tmp_path / "damaged")
    shutil.copytree(_path(job(ShardingStrategy.FULL_SHARD.value, False), "save", "LOCAL", OptimStateKeyType.PARAM_ID),
                    path)
    manifest = os.path.join(path, "manifest.json")
    doc = manifest_doc(open(manifest, "rb").read())
    positions = doc["tree"]["model"][LAYOUTS_KEY]["blocks.0._flat_param"][POSITIONS]
    positions[1:] = {"twice": [positions[0]] * (len(positions) - 1), "missing": positions[2:],
                     "not ints": ["x"] * (len(positions) - 1)}[damage]
    with open(manifest, "wb") as f:
        f.write(sealed(doc))
    with pytest.raises(CorruptCheckpointError, match=POSITIONS):
        convert(path, tmp_path / "out", type="full", world_size=1)
