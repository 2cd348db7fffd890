"""A LOCAL checkpoint, seen through ``logical_view``, is the FULL checkpoint the same job saves: parameters (tied
ones under every name) and their optimizer state by name or ID, padding never showing, any region readable."""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

import shardckpt
from shardckpt import CorruptCheckpointError, IncompatibleCheckpointError, StateDictType
from shardckpt.format.flat_layout import LAYOUTS_KEY, POSITIONS
from shardckpt.format.param_ids import PARAM_NAMES
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.detect import open_reader
from shardckpt.formats.local_view import LogicalView, logical_view
from shardckpt.offline.diff import diff
from shardckpt.regions import Box, FlatRange, Run, full_region
from shardckpt.state_dict import OptimStateKeyType, unsharded_param_names
from tests._helpers import state_path
from tests._dist import run_ranks
from tests.runtime import _model
from tests.state_dict._train import STEPS_BEFORE, new_run, steps
from tests.storage._util import manifest_doc, sealed

LOCAL, FULL = StateDictType.LOCAL_STATE_DICT, StateDictType.FULL_STATE_DICT
KEYS = tuple(OptimStateKeyType)


def _train_and_save(root: str) -> list[str]:
    """Train at this world size, then save LOCAL and FULL, by name and by ID, from the same step."""
    model, optim = new_run()
    steps(model, optim, _model.make_batches(STEPS_BEFORE))
    for sd_type in (LOCAL, FULL):
        for key in KEYS:
            shardckpt.save_state(model, optim, state_path(root, sd_type, key), type=sd_type, optim_key=key,
                                 extra={"step": STEPS_BEFORE})
    return unsharded_param_names(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("logical"))
    names = run_ranks(2, _train_and_save, root)[0]
    return root, names


def _straddling(view: LogicalView) -> tuple[str, int]:
    """A multi-row member that the ws-2 shard boundary splits mid-row, and the row-major index it splits at."""
    for layout in view.layouts.values():
        for name, shape, offset in zip(layout.names, layout.shapes, layout.offsets):
            cut = layout.shard_numel - offset
            if len(shape) == 2 and shape[0] > 2 and 0 < cut < math.prod(shape) and cut % shape[1]:
                return name, cut
    raise AssertionError("the test model has no member split mid-row at ws 2")


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_a_local_checkpoint_is_diff_equal_to_the_jobs_full_one(saved, key):
    root, names = saved
    local, full = open_reader(state_path(root, LOCAL, key)), open_reader(state_path(root, FULL, key))
    view = logical_view(local, param_names=names)
    report = diff(view, full)
    assert report.equal, report.differences[:5]
    assert report.tensors == len(full.tensors()) > 0 and report.bytes_read > 0
    tensors = view.tensors()
    assert not any(n.endswith("_flat_param") for n in tensors)  # flat tensors and their padding never show
    assert "model.head.weight" in tensors and "model.tok.weight" in tensors  # tied: both names, as FULL has
    assert tensors["model.head.weight"].crc32c is None
    model = view.tree()["model"]
    assert LAYOUTS_KEY not in model and isinstance(model["blocks.0.mask"], TensorRef)
    groups = view.tree()["optim"]["param_groups"]
    if key is OptimStateKeyType.PARAM_ID:
        assert groups[0]["params"] == list(range(len(names))) and groups[0][PARAM_NAMES] == names
    else:
        assert groups[0]["params"] == names


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_without_param_names_the_recorded_order_is_used_else_only_the_order_differs(saved, key, tmp_path):
    root, names = saved
    full = open_reader(state_path(root, FULL, key))
    assert diff(logical_view(open_reader(state_path(root, LOCAL, key))), full).equal  # save_state recorded the order
    unrecorded = str(tmp_path / "unrecorded")  # as saved by `save` of a LOCAL state dict: the layouts record it
    shutil.copytree(state_path(root, LOCAL, key), unrecorded)
    manifest = os.path.join(unrecorded, "manifest.json")
    doc = manifest_doc(open(manifest, "rb").read())
    del doc["metadata"]["param_names"]
    with open(manifest, "wb") as f:
        f.write(sealed(doc))
    assert diff(logical_view(open_reader(unrecorded)), full).equal
    for layout in doc["tree"]["model"][LAYOUTS_KEY].values():  # as an older save left it: no order anywhere
        del layout[POSITIONS]
    with open(manifest, "wb") as f:
        f.write(sealed(doc))
    view = logical_view(open_reader(unrecorded))
    groups = view.tree()["optim"]["param_groups"]
    listed = groups[0][PARAM_NAMES] if key is OptimStateKeyType.PARAM_ID else groups[0]["params"]
    assert sorted(listed) == sorted(names) and listed != names
    if key is OptimStateKeyType.PARAM_NAME:
        report = diff(view, full)
        assert [(d.name, d.kind) for d in report.differences] == [("optim.param_groups", "plain value")]
    else:  # IDs follow the stored layouts' order, and each group records which name each ID means
        ids = dict(zip(groups[0]["params"], groups[0][PARAM_NAMES]))
        by_name = logical_view(open_reader(state_path(root, LOCAL, OptimStateKeyType.PARAM_NAME)))
        for i, entry in view.tree()["optim"]["state"].items():
            assert entry.keys() == by_name.tree()["optim"]["state"][ids[i]].keys()


def test_a_recorded_order_that_is_not_a_list_of_names_is_a_corrupt_checkpoint(saved, tmp_path):
    root, _ = saved
    path = str(tmp_path / "bad")
    shutil.copytree(state_path(root, LOCAL, OptimStateKeyType.PARAM_NAME), path)
    manifest = os.path.join(path, "manifest.json")
    doc = manifest_doc(open(manifest, "rb").read())
    doc["metadata"]["param_names"] = [1, 2]
    with open(manifest, "wb") as f:
        f.write(sealed(doc))
    with pytest.raises(CorruptCheckpointError, match=r"bad.*metadata.param_names is not a list of parameter names"):
        logical_view(open_reader(path))


def _read(reader, name: str, region, dtype) -> torch.Tensor:
    dest = torch.empty(region.numel, dtype=dtype)
    reader.read([ReadRequest(name, region, dest)])
    return dest


@pytest.mark.parametrize("state_key", ["", "exp_avg"])
def test_partial_reads_across_the_shard_boundary_equal_the_full_tensor(saved, state_key):
    root, names = saved
    key = OptimStateKeyType.PARAM_NAME
    view = logical_view(open_reader(state_path(root, LOCAL, key)), param_names=names)
    full = open_reader(state_path(root, FULL, key))
    member, cut = _straddling(view)
    name = f"optim.state.{member}.{state_key}" if state_key else f"model.{member}"
    info = view.tensors()[name]
    rows, cols = info.shape
    whole = _read(full, name, full_region(info.shape), info.dtype).view(rows, cols)
    assert torch.equal(_read(view, name, full_region(info.shape), info.dtype).view(rows, cols), whole)
    row, col = divmod(cut, cols)
    box = Box((row - 1, max(col - 2, 0)), (3, min(5, cols - max(col - 2, 0))))  # rows on both sides of the cut
    got = _read(view, name, box, info.dtype).view(box.sizes)
    assert torch.equal(got, whole[row - 1:row + 2, box.offsets[1]:box.offsets[1] + box.sizes[1]])
    flat = FlatRange(cut - 3, cut + cols + 2)  # starts and ends mid-row, crosses the cut
    assert torch.equal(_read(view, name, flat, info.dtype), whole.reshape(-1)[flat.start:flat.stop])
    src = view.source(name)
    assert isinstance(src, Run) and src.source.endswith("_flat_param" if not state_key else state_key)


def test_reads_of_several_tensors_go_to_the_stored_reader_in_one_call(saved):
    root, names = saved
    local = open_reader(state_path(root, LOCAL, OptimStateKeyType.PARAM_ID))
    calls = []
    real = local.read
    local.read = lambda requests: (calls.append(list(requests)), real(requests))[1]
    view = logical_view(local, param_names=names)
    wanted = ["model.head.weight", "model.blocks.0.mask", "optim.state.1.step", "optim.state.1.exp_avg"]
    dests = [torch.empty(math.prod(view.tensors()[n].shape), dtype=view.tensors()[n].dtype) for n in wanted]
    view.read([ReadRequest(n, full_region(view.tensors()[n].shape), d) for n, d in zip(wanted, dests)])
    assert len(calls) == 1
    assert {r.tensor for r in calls[0]} == {"model._flat_param", "model.blocks.0.mask", "optim.state.0.step",
                                            "optim.state.0.exp_avg"}
    full = open_reader(state_path(root, FULL, OptimStateKeyType.PARAM_ID))
    for n, d in zip(wanted, dests):
        assert torch.equal(d, _read(full, n, full_region(view.tensors()[n].shape), d.dtype))
    with pytest.raises(IncompatibleCheckpointError, match="no tensor 'model._flat_param'"):
        view.read([ReadRequest("model._flat_param", FlatRange(0, 1), torch.empty(1))])
    with pytest.raises(IncompatibleCheckpointError, match="exceeds"):
        view.read([ReadRequest("model.head.weight", Box((12, 0), (2, 14)), torch.empty(28))])


def test_a_checkpoint_that_is_not_local_comes_back_unchanged(saved, tmp_path):
    root, _ = saved
    for key in KEYS:
        full = open_reader(state_path(root, FULL, key))
        assert logical_view(full) is full
    path = str(tmp_path / "plain.pt")
    torch.save({"w": torch.arange(6.0)}, path)
    plain = open_reader(path)
    assert logical_view(plain) is plain


def _damaged(root: str, tmp_path, change) -> str:
    """A copy of the by-name LOCAL checkpoint whose manifest ``change`` edits (re-sealed: only the layout is bad)."""
    path = str(tmp_path / "damaged")
    shutil.copytree(state_path(root, LOCAL, OptimStateKeyType.PARAM_NAME), path)
    manifest = os.path.join(path, "manifest.json")
    doc = manifest_doc(open(manifest, "rb").read())
    change(doc["tree"]["model"][LAYOUTS_KEY]["blocks.0._flat_param"])
    with open(manifest, "wb") as f:
        f.write(sealed(doc))
    return path


def test_a_layout_running_past_its_flat_tensor_is_a_corrupt_checkpoint(saved, tmp_path):
    root, _ = saved

    def grow(layout):  # consistent in itself: the last member moved 16 elements on, the sizes grown to match
        layout["offsets"][-1] += 16
        layout["numel"] += 16
        layout["padded_numel"] += 16
        layout["shard_numel"] += 8

    path = _damaged(root, tmp_path, grow)
    with pytest.raises(CorruptCheckpointError, match=r"'model\.blocks\.0\._flat_param'"):
        logical_view(open_reader(path))


def test_an_invalid_layout_is_a_corrupt_checkpoint_naming_it(saved, tmp_path):
    root, _ = saved

    def break_offsets(layout):
        layout["offsets"] = ["x"] * len(layout["offsets"])

    path = _damaged(root, tmp_path, break_offsets)
    with pytest.raises(CorruptCheckpointError, match=rf"model\.{LAYOUTS_KEY}\.blocks\.0\._flat_param"):
        logical_view(open_reader(path))
