"""``convert``: any readable checkpoint to a shardckpt checkpoint of another world size or type, offline,
checked bit for bit against the source with ``diff`` and by loading the result."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

import shardckpt
from shardckpt import CheckpointExistsError, IncompatibleCheckpointError, StateDictType
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import BadArgumentError
from shardckpt.cli.main import main
from shardckpt.offline import chunk_output, memory
from shardckpt.offline import convert as convert_module
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.formats.detect import open_reader
from shardckpt.formats.native import read_manifest
from shardckpt.io import open_storage
from shardckpt.runtime import FlatLayout
from shardckpt.state_dict import OptimStateKeyType, unsharded_param_names
from shardckpt.format.flat_layout import LAYOUTS_KEY
from shardckpt.formats.local_view import logical_view
from tests._helpers import manifest_of
from tests._dist import run_ranks
from tests.checkpoint.cases import block_size
from tests.state_dict._train import STEPS_AFTER, STEPS_BEFORE, assert_same_state, full_state, new_run, steps
from tests.state_dict.test_resume import _resume
from tests.runtime import _model


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"model": {"w": torch.randn(10, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
                      "s": torch.tensor(2.0), "e": torch.empty(0, 4), "i": torch.arange(5)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}]},
            "step": 5}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_full_to_sharded_at_every_world_size_is_exact(tmp_path, world):
    shardckpt.save(_state(), tmp_path / "src",
                   metadata={"state_dict_type": "FULL_STATE_DICT", "optim_key": "PARAM_NAME"})
    report = convert(tmp_path / "src", tmp_path / "dst", world_size=world)
    assert report.type == ("sharded" if world > 1 else "full") and report.tensors == 7
    assert verify(tmp_path / "dst").ok
    assert diff(tmp_path / "src", tmp_path / "dst").equal  # by checksum: the bytes are the source's
    manifest = manifest_of(tmp_path / "dst")
    assert manifest.world_size == world
    assert manifest.metadata == {"state_dict_type": f"{report.type.upper()}_STATE_DICT", "optim_key": "PARAM_NAME"}
    assert len(manifest.tensors["model.w"].chunks) == world  # dim-0 chunks, one per rank (10 rows)
    assert len(manifest.tensors["model.s"].chunks) == 1  # a 0-d tensor is stored whole
    back = convert(tmp_path / "dst", tmp_path / "back", world_size=1, type="full")
    assert back.type == "full" and diff(tmp_path / "src", tmp_path / "back").equal


def test_cast_and_selection(tmp_path):
    shardckpt.save(_state(), tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", dtype=torch.bfloat16, only=["model"], exclude=["model.e"])
    out = shardckpt.load_full(tmp_path / "dst")
    assert set(out) == {"model"} and set(out["model"]) == {"w", "b", "s", "i"}
    assert out["model"]["w"].dtype == torch.bfloat16 and torch.equal(out["model"]["w"], _state()["model"]["w"].bfloat16())
    assert out["model"]["i"].dtype == torch.int64  # only floating-point tensors are cast
    report = diff(tmp_path / "src", tmp_path / "dst", rtol=1e-2)
    assert {d.kind for d in report.differences} == {"only in A"}  # the values agree within bf16
    assert {d.name for d in report.dtype_differences} == {"model.w", "model.s"}  # told apart (b was bf16)


def test_a_committed_destination_is_kept_unless_overwrite(tmp_path):
    shardckpt.save(_state(), tmp_path / "src")
    shardckpt.save({"old": torch.ones(2)}, tmp_path / "dst")
    with pytest.raises(CheckpointExistsError):
        convert(tmp_path / "src", tmp_path / "dst", world_size=2)
    assert set(shardckpt.load_full(tmp_path / "dst")) == {"old"}
    convert(tmp_path / "src", tmp_path / "dst", world_size=2, overwrite=True)
    assert diff(tmp_path / "src", tmp_path / "dst").equal
    assert [n for n in os.listdir(tmp_path / "dst") if n.startswith("data-")] == \
        [f"data-{manifest_of(tmp_path / 'dst').generation}"]  # the replaced generation is gone


@pytest.mark.parametrize("workers", [1, 2])
def test_a_world_size_above_the_formats_cap_is_refused_before_the_source_is_read(tmp_path, monkeypatch, capsys,
                                                                                 workers):
    """2**24 + 1 ranks (above what a manifest may record) was planned for minutes, growing to GBs, before
    anything refused it."""
    def unread(*args, **kwargs):
        raise AssertionError("the source was read before world_size was checked")

    monkeypatch.setattr(convert_module, "open_reader", unread)
    with pytest.raises(BadArgumentError, match="above the format's cap of 16777216 ranks"):
        shardckpt.convert(tmp_path / "src", tmp_path / "dst", world_size=(1 << 24) + 1, workers=workers)
    args = ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--world-size", str((1 << 24) + 1)]
    assert main(args + ["--workers", str(workers)]) == 2
    assert "cap of 16777216 ranks" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "dst")


def test_a_failure_mid_way_commits_nothing_keeps_the_old_checkpoint_and_what_a_rerun_resumes(tmp_path, monkeypatch):
    shardckpt.save(_state(), tmp_path / "src")
    shardckpt.save({"old": torch.ones(2)}, tmp_path / "dst")
    from shardckpt.formats.native import NativeReader
    calls = []

    def failing(real):  # the fourth read of the source fails, whichever way it reads
        def read(self, *args):
            calls.append(1)
            if len(calls) == 4:
                raise OSError("disk gone")
            return real(self, *args)
        return read

    monkeypatch.setattr(NativeReader, "read", failing(NativeReader.read))
    monkeypatch.setattr(NativeReader, "read_flat", failing(NativeReader.read_flat))
    with pytest.raises(OSError, match="disk gone"):
        convert(tmp_path / "src", tmp_path / "dst", world_size=2, overwrite=True)
    monkeypatch.undo()
    assert set(shardckpt.load_full(tmp_path / "dst")) == {"old"} and verify(tmp_path / "dst").ok
    assert len([n for n in os.listdir(tmp_path / "dst") if n.startswith("data-")]) == 2  # kept for the rerun
    report = convert(tmp_path / "src", tmp_path / "dst", world_size=2, overwrite=True)
    assert report.kept_bytes > 0 and verify(tmp_path / "dst").ok and diff(tmp_path / "src", tmp_path / "dst").equal
    assert len([n for n in os.listdir(tmp_path / "dst") if n.startswith("data-")]) == 1  # the old one removed


def test_what_a_failed_conversion_left_is_debris_for_gc(tmp_path, monkeypatch):
    shardckpt.save(_state(), tmp_path / "src")
    monkeypatch.setattr(chunk_output, "write_file", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "src", tmp_path / "dst", world_size=2)
    assert [n for n in os.listdir(tmp_path / "dst") if n.startswith("data-")]
    assert shardckpt.checkpoint.gc.gc(tmp_path / "dst") and not os.listdir(tmp_path / "dst")


def test_foreign_sources(tmp_path):
    import torch.distributed.checkpoint as dcp

    flat = {"a.weight": torch.randn(7, 5), "a.bias": torch.randn(5).half(), "n": torch.tensor(1)}
    (tmp_path / "hf").mkdir()
    save_file({"a.weight": flat["a.weight"]}, tmp_path / "hf" / "model-00001-of-00002.safetensors")
    save_file({"a.bias": flat["a.bias"], "n": flat["n"]}, tmp_path / "hf" / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "a.bias": "model-00002-of-00002.safetensors",
                                            "n": "model-00002-of-00002.safetensors"}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    convert(tmp_path / "hf", tmp_path / "from-hf", world_size=3)
    assert diff(tmp_path / "hf", tmp_path / "from-hf").equal and verify(tmp_path / "from-hf").ok
    assert manifest_of(tmp_path / "from-hf").metadata["state_dict_type"] == "SHARDED_STATE_DICT"

    with pytest.warns(UserWarning):
        dcp.save({"model": dict(flat), "step": 4}, checkpoint_id=str(tmp_path / "dcp"))
    convert(tmp_path / "dcp", tmp_path / "from-dcp", world_size=2)
    assert diff(tmp_path / "dcp", tmp_path / "from-dcp").equal
    out = shardckpt.load_full(tmp_path / "from-dcp")
    assert out["step"] == 4 and torch.equal(out["model"]["a.weight"], flat["a.weight"])


def _train_and_save(root: str) -> tuple[list[str], dict, list[float]]:
    """Train, save LOCAL and FULL (both optimizer keys), train on: names, the saved state, the later losses."""
    model, optim = new_run()
    batches = _model.make_batches(STEPS_BEFORE + STEPS_AFTER)
    steps(model, optim, batches[:STEPS_BEFORE])
    for key in OptimStateKeyType:
        for sd_type in (StateDictType.LOCAL_STATE_DICT, StateDictType.FULL_STATE_DICT):
            shardckpt.save_state(model, optim, f"{root}/{sd_type.name}-{key.name}", type=sd_type, optim_key=key)
    state = full_state(model, optim)
    return unsharded_param_names(model), state, steps(model, optim, batches[STEPS_BEFORE:])


def _load_at(path: str) -> dict:
    model, optim = new_run()
    shardckpt.load_state(model, optim, path)
    return full_state(model, optim)


@pytest.fixture(scope="module")
def runtime_local(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runtime"))
    names, state, losses = run_ranks(2, _train_and_save, root)[0]
    return root, names, state, losses


@pytest.mark.parametrize("key", list(OptimStateKeyType), ids=lambda k: k.name)
def test_a_runtime_local_checkpoint_converts_to_the_jobs_full_one(runtime_local, tmp_path, key):
    root, names, _, _ = runtime_local
    local, full = f"{root}/LOCAL_STATE_DICT-{key.name}", f"{root}/FULL_STATE_DICT-{key.name}"
    assert convert(local, tmp_path / "same").type == "local"  # the default for a LOCAL source: its own type
    assert diff(tmp_path / "same", local).equal
    convert(local, tmp_path / "full", type="full", world_size=1)  # the parameter order save_state recorded
    report = diff(tmp_path / "full", full)
    assert report.equal and report.tensors > 0, report.differences[:5]
    assert "param_names" not in manifest_of(tmp_path / "full").metadata


def test_a_runtime_local_checkpoint_converted_to_sharded_at_3_resumes_exactly(runtime_local, tmp_path):
    root, names, state, _ = runtime_local
    local = f"{root}/LOCAL_STATE_DICT-{OptimStateKeyType.PARAM_NAME.name}"
    convert(local, tmp_path / "ws3", type="sharded", world_size=3, param_names=names)
    assert manifest_of(tmp_path / "ws3").world_size == 3
    assert_same_state(run_ranks(3, _load_at, str(tmp_path / "ws3"))[0], state, "LOCAL ws2 -> SHARDED ws3")


def _resume_local(path: str, key: OptimStateKeyType) -> dict:
    """A fresh run at this world size resumed from LOCAL checkpoint ``path`` by ``load_state`` and by the in-memory
    LOCAL route (its own LOCAL state dict, optimizer keyed by ``key``, filled by ``shardckpt.load`` with every key
    matched, then set), each trained on: route -> (full state on rank 0, losses)."""
    model, optim = new_run()
    shardckpt.load_state(model, optim, path)
    out = {"load_state": _resume(model, optim)}
    model, optim = new_run()
    sd = shardckpt.get_state_dict(model, optim, type=StateDictType.LOCAL_STATE_DICT, optim_key=key)
    shardckpt.load(sd, path)
    shardckpt.set_state_dict(model, optim, sd, type=StateDictType.LOCAL_STATE_DICT)
    out["LOCAL state dict"] = _resume(model, optim)
    return out


def _resume_dcp_habit(path: str, key: OptimStateKeyType, sd_type: StateDictType) -> tuple[dict, list[float]]:
    """torch DCP's habit at this world size: get_state_dict of ``sd_type``, shardckpt.load of the LOCAL checkpoint
    into it (by parameter, through its layouts), set_state_dict; then trained on."""
    model, optim = new_run()
    sd = shardckpt.get_state_dict(model, optim, type=sd_type, optim_key=key)
    shardckpt.load(sd, path)
    shardckpt.set_state_dict(model, optim, sd, type=sd_type)
    return _resume(model, optim)


@pytest.mark.parametrize("sd_type", [StateDictType.SHARDED_STATE_DICT, StateDictType.FULL_STATE_DICT],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("key", list(OptimStateKeyType), ids=lambda k: k.name)
def test_the_dcp_habit_loads_a_local_checkpoint_at_another_world_size(runtime_local, key, sd_type):
    root, _, state, losses = runtime_local
    got, got_losses = run_ranks(3, _resume_dcp_habit, f"{root}/LOCAL_STATE_DICT-{key.name}", key, sd_type,
                                timeout=300)[0]
    where = f"LOCAL ws2 -> {sd_type.name} state dict at ws3 via shardckpt.load ({key.name})"
    assert_same_state(got, state, where)
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(got_losses, losses)), where


@pytest.mark.parametrize("world", [3, 1, 4])
@pytest.mark.parametrize("key", list(OptimStateKeyType), ids=lambda k: k.name)
def test_a_runtime_local_checkpoint_converted_to_local_at_another_world_size_resumes(runtime_local, tmp_path, key,
                                                                                       world):
    root, names, state, losses = runtime_local
    local, out = f"{root}/LOCAL_STATE_DICT-{key.name}", str(tmp_path / f"ws{world}")
    report = convert(local, out, world_size=world)  # LOCAL by default for a LOCAL source
    assert report.type == "local" and verify(out).ok
    manifest, source = manifest_of(out), manifest_of(local)
    assert manifest.world_size == world
    assert manifest.metadata == {"state_dict_type": "LOCAL_STATE_DICT", "optim_key": key.value, "param_names": names}
    layouts = {k: FlatLayout.from_dict(v) for k, v in manifest.tree["model"][LAYOUTS_KEY].items()}
    assert layouts.keys() == source.tree["model"][LAYOUTS_KEY].keys()
    for k, layout in layouts.items():
        assert layout.world_size == world and layout.padded_numel == layout.shard_numel * world
        assert len(manifest.tensors[f"model.{k}"].chunks) == world  # one flat range per rank
        assert manifest.tensors[f"model.{k}"].shape == (layout.padded_numel,)
    assert manifest.tree["optim"] == source.tree["optim"]  # keys (name or ID) and param groups as stored
    assert diff(logical_view(open_reader(out), param_names=names), f"{root}/FULL_STATE_DICT-{key.name}").equal
    assert diff(out, local).equal  # other layouts: diff compares by parameter by itself
    for route, (got, got_losses) in run_ranks(world, _resume_local, out, key, timeout=300)[0].items():
        where = f"LOCAL ws2 -> LOCAL ws{world} ({key.name}), {route}"
        assert_same_state(got, state, where)
        assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(got_losses, losses)), \
            (where, got_losses, losses)


def test_local_output_streamed_in_slices_across_members_is_the_same(runtime_local, tmp_path, monkeypatch):
    """Slices of a new flat tensor that start and end inside members, gaps and padding (a 64-element slice
    buffer) give the bytes that whole chunks give."""
    root, _, _, _ = runtime_local
    local = f"{root}/LOCAL_STATE_DICT-{OptimStateKeyType.PARAM_NAME.name}"
    convert(local, tmp_path / "whole", world_size=3)
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    with block_size(64):  # 16 fp32 elements a block
        convert(local, tmp_path / "sliced", world_size=3, memory_limit=2 * (64 + 256))
    whole, sliced = manifest_of(tmp_path / "whole"), manifest_of(tmp_path / "sliced")
    assert {n: t.crc32c for n, t in whole.tensors.items()} == {n: t.crc32c for n, t in sliced.tensors.items()}
    assert verify(tmp_path / "sliced").ok and diff(tmp_path / "sliced", local).equal


@pytest.mark.parametrize("key", list(OptimStateKeyType), ids=lambda k: k.name)
def test_diff_compares_local_checkpoints_of_other_layouts_by_parameter(runtime_local, tmp_path, key):
    root, _, _, _ = runtime_local
    local, full = f"{root}/LOCAL_STATE_DICT-{key.name}", f"{root}/FULL_STATE_DICT-{key.name}"
    convert(local, tmp_path / "ws3", world_size=3)
    for a, b in ((local, full), (tmp_path / "ws3", full), (local, tmp_path / "ws3")):
        report = diff(a, b)
        assert report.equal and report.tensors > 0, (a, b, report.differences[:3])
    state = shardckpt.load_full(full)
    name = sorted(state["model"])[1]
    state["model"][name].view(-1)[-1] += 1  # the last element: next to the padding of a flat shard
    shardckpt.save(state, tmp_path / "tampered", metadata=manifest_of(full).metadata)
    report = diff(tmp_path / "ws3", tmp_path / "tampered")
    assert [(d.name, d.kind) for d in report.differences] == [(f"model.{name}", "values")], report.differences


def test_local_output_needs_a_local_source(runtime_local, tmp_path, capsys):
    root, _, _, _ = runtime_local
    full = f"{root}/FULL_STATE_DICT-{OptimStateKeyType.PARAM_NAME.name}"
    with pytest.raises(IncompatibleCheckpointError, match=r"flat layouts \(model._flat_layouts\).*LOCAL source"
                                                          r".*type='sharded'"):
        convert(full, tmp_path / "x", type="local", world_size=3)
    assert main(["convert", full, str(tmp_path / "x"), "--type", "local", "--quiet"]) == 2
    assert "LOCAL output needs the flat layouts" in capsys.readouterr().err
    assert main(["convert", f"{root}/LOCAL_STATE_DICT-PARAM_ID", str(tmp_path / "w"), "--type", "local",
                 "--world-size", "3", "--quiet"]) == 0
    by_param = [logical_view(open_reader(p)) for p in (tmp_path / "w", f"{root}/LOCAL_STATE_DICT-PARAM_ID")]
    assert manifest_of(tmp_path / "w").world_size == 3 and diff(*by_param).equal
    with pytest.raises(ValueError, match="dtype"):
        convert(f"{root}/LOCAL_STATE_DICT-PARAM_NAME", tmp_path / "y", world_size=3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="leave out model._flat_layouts"):
        convert(f"{root}/LOCAL_STATE_DICT-PARAM_NAME", tmp_path / "y", world_size=3, only=["optim"])
    assert not os.path.exists(tmp_path / "x") or not os.listdir(tmp_path / "x")
    report = convert(full, tmp_path / "z", world_size=3)  # the job's FULL checkpoint at another world size
    assert report.type == "sharded" and diff(full, tmp_path / "z").equal


@pytest.mark.parametrize("key", list(OptimStateKeyType), ids=lambda k: k.name)
@pytest.mark.parametrize("out_type", ["full", "sharded", "local"])
def test_optim_key_gives_the_checkpoint_the_job_saves_with_that_key(runtime_local, tmp_path, key, out_type):
    """A runtime LOCAL checkpoint keyed one way, converted with the other ``optim_key``, equals the job's own
    checkpoint saved with that key: FULL by value and key (IDs numbered as get_state_dict numbers them, names
    recorded), LOCAL at ws 2 bit for bit (flat groups numbered as torch numbers them), SHARDED at ws 3 equal
    to the job's FULL one."""
    root, _, _, _ = runtime_local
    other = next(k for k in OptimStateKeyType if k is not key)
    src = f"{root}/LOCAL_STATE_DICT-{key.name}"
    want = f"{root}/{'LOCAL' if out_type == 'local' else 'FULL'}_STATE_DICT-{other.name}"
    world = {"full": 1, "sharded": 3, "local": 2}[out_type]
    convert(src, tmp_path / "out", type=out_type, world_size=world,
            optim_key=other.name.removeprefix("PARAM_").lower())
    got, expected = manifest_of(tmp_path / "out"), manifest_of(want)
    assert got.metadata["optim_key"] == other.value
    assert got.tree["optim"]["param_groups"] == expected.tree["optim"]["param_groups"]
    assert got.tree["optim"]["state"].keys() == expected.tree["optim"]["state"].keys()
    report = diff(tmp_path / "out", want)
    assert report.equal and report.tensors > 0, report.differences[:5]


def test_optim_key_round_trip_and_errors(tmp_path, capsys):
    shardckpt.save(_state(), tmp_path / "src",
                   metadata={"state_dict_type": "FULL_STATE_DICT", "optim_key": "PARAM_NAME"})
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "ids"), "--world-size", "2", "--optim-key", "id",
                 "--quiet"]) == 0
    ids = manifest_of(tmp_path / "ids")
    assert ids.metadata["optim_key"] == "PARAM_ID" and list(ids.tree["optim"]["state"]) == [0]
    assert ids.tree["optim"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0],
                                                  "param_names": ["w"]}]
    exp_avg = shardckpt.load_full(tmp_path / "ids")["optim"]["state"][0]["exp_avg"]
    assert exp_avg.equal(_state()["optim"]["state"]["w"]["exp_avg"])
    convert(tmp_path / "ids", tmp_path / "names", optim_key="name")
    assert diff(tmp_path / "src", tmp_path / "names").equal
    assert manifest_of(tmp_path / "names").metadata["optim_key"] == "PARAM_NAME"
    with pytest.raises(ValueError, match="optim_key must be 'name' or 'id'"):
        convert(tmp_path / "src", tmp_path / "x", optim_key="ids")  # (case-insensitive, as the CLI)
    # torch's own ID-keyed state records no names: to key it by name, say what the IDs are
    sd = {"optim": {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    torch.save(sd, tmp_path / "plain.pt")
    with pytest.raises(IncompatibleCheckpointError, match="param_names"):
        convert(tmp_path / "plain.pt", tmp_path / "x", optim_key="name")
    convert(tmp_path / "plain.pt", tmp_path / "named", optim_key="name", param_names=["layer.w"])
    assert manifest_of(tmp_path / "named").tree["optim"]["param_groups"][0]["params"] == ["layer.w"]
    # asked for the key it has, an ID-keyed state without names stays as it is, metadata included: its IDs
    # keep the numbering a loader gives them (torch's param-group order), not the one optim_key stamps
    convert(tmp_path / "plain.pt", tmp_path / "same", optim_key="id")
    same = manifest_of(tmp_path / "same")
    assert "optim_key" not in same.metadata and list(same.tree["optim"]["state"]) == [0]
    assert same.tree["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(tmp_path / "src"), str(tmp_path / "x"), "--optim-key", "ids"])
    assert exit_info.value.code == 2 and "--optim-key" in capsys.readouterr().err


def test_cli(tmp_path, capsys):
    shardckpt.save(_state(), tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--world-size", "2", "--quiet"]) == 0
    assert diff(tmp_path / "src", tmp_path / "dst").equal
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "bf"), "--dtype", "bfloat16", "--only", "model",
                 "--quiet"]) == 0
    assert shardckpt.load_full(tmp_path / "bf")["model"]["w"].dtype == torch.bfloat16


def test_sources_that_are_not_a_dict_or_select_nothing_are_refused(tmp_path):
    from shardckpt import UnsupportedValueError

    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(UnsupportedValueError, match="list at its root"):
        convert(tmp_path / "list.pt", tmp_path / "a")
    torch.save({"w": torch.ones(2), "dtype": torch.float16}, tmp_path / "odd.pt")
    with pytest.raises(UnsupportedValueError, match="'dtype'"):
        convert(tmp_path / "odd.pt", tmp_path / "b")
    shardckpt.save(_state(), tmp_path / "src")
    with pytest.raises(ValueError, match="nothing to convert"):
        convert(tmp_path / "src", tmp_path / "c", only=["nope"])
    assert not any((tmp_path / d).exists() and os.listdir(tmp_path / d) for d in ("a", "b", "c"))


@pytest.mark.parametrize("compress", [None, "zstd"])
@pytest.mark.parametrize("world", [1, 2, 5])
def test_per_rank_values_are_carried_through_at_any_world_size(tmp_path, world, compress):
    source = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures", "v4")
    out = str(tmp_path / "out")
    convert(source, out, world_size=world, compress=compress)  # refused after writing, before: index versions
    assert read_manifest(open_storage(out)).version == 4 and verify(out).ok
    assert diff(source, out).equal
    full, expected = shardckpt.load_full(out), shardckpt.load_full(source)
    saved = [k for k, v in expected.items() if isinstance(v, list) and type(v).__name__ == "PerRankValues"]
    assert saved and all(type(full[k]) is type(expected[k]) and len(full[k]) == len(expected[k]) for k in saved)
