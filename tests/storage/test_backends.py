"""One storage suite, run against local disk, memory:// and s3:// (moto on 127.0.0.1)."""
from __future__ import annotations

import json

import pytest
import torch

import shardckpt
from shardckpt import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                       IncompatibleCheckpointError)
from tests.checkpoint.cases import check_equal, empty_like_state, reference
from tests.storage._util import assert_tree_equal, zeros_like_tree


def _other() -> dict:
    """A second version of the reference: same structure, different values."""
    sd = reference()
    sd["model"] = {k: (v + 1 if v.dtype != torch.bool else ~v) for k, v in sd["model"].items()}
    sd["step"] = 11
    return sd


def _save(backend, sd=None, **kw) -> None:
    shardckpt.save(reference() if sd is None else sd, backend.url, storage_options=backend.options, **kw)


def _load_full(backend, **kw) -> dict:
    return shardckpt.load_full(backend.url, storage_options=backend.options, **kw)


def _generations(backend) -> set[str]:
    return {f.split("/")[0] for f in backend.files() if f.startswith("data-")}


def test_round_trip_bit_exact(backend):
    _save(backend)
    assert backend.exists("manifest.json")
    assert not [f for f in backend.files() if ".tmp-" in f]
    sd = empty_like_state(0, 1, 0)
    shardckpt.load(sd, backend.url, storage_options=backend.options)
    check_equal(sd, 0, 1, 0)
    assert_tree_equal(_load_full(backend), reference())


def test_round_trip_special_values(backend):
    sd = {"f": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
          "bf": torch.tensor([float("nan"), -0.0, 3.0]).bfloat16(),
          "c": torch.tensor([1 + 2j, float("nan")], dtype=torch.complex64),
          "strided": torch.arange(24.0).reshape(4, 6)[:, ::2],
          "plain": {"t": (1, 2.5, None), "d": {3: "x"}, "nan": float("nan")}}
    _save(backend, sd)
    out = _load_full(backend)
    for k in ("f", "bf", "c"):
        assert_tree_equal(out[k], sd[k], k)
    assert torch.equal(out["strided"], sd["strided"].contiguous())
    assert out["plain"]["t"] == (1, 2.5, None) and out["plain"]["d"] == {3: "x"}
    assert out["plain"]["nan"] != out["plain"]["nan"]


def test_load_full_keys(backend):
    _save(backend)
    ref = reference()
    only = _load_full(backend, keys=["model.tiny", "meta"])
    assert set(only) == {"model", "meta"} and set(only["model"]) == {"tiny"}
    assert_tree_equal(only["model"]["tiny"], ref["model"]["tiny"])
    assert only["meta"] == ref["meta"]
    model = _load_full(backend, keys=["model"])
    assert_tree_equal(model, {"model": ref["model"]})
    # A prefix matches whole key components only: "model.ti" is not "model.tiny".
    assert _load_full(backend, keys=["model.ti"]) == {}


def test_save_twice_without_overwrite_raises_and_keeps_first(backend):
    _save(backend)
    before = {f: backend.read(f) for f in backend.files()}
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        _save(backend, _other())
    assert {f: backend.read(f) for f in backend.files()} == before  # nothing written, nothing removed
    assert_tree_equal(_load_full(backend), reference())


def test_overwrite_replaces_and_removes_old_generation(backend):
    _save(backend)
    (old,) = _generations(backend)
    _save(backend, _other(), overwrite=True)
    (new,) = _generations(backend)  # the old generation's data directory is gone
    assert new != old and not backend.exists(old)
    assert json.loads(backend.read("manifest.json"))["generation"] == new[len("data-"):]
    assert_tree_equal(_load_full(backend), _other())
    # and back again
    _save(backend, overwrite=True)
    assert len(_generations(backend)) == 1
    assert_tree_equal(_load_full(backend), reference())


def test_no_checkpoint_raises_not_found(backend):
    empty = backend.sibling("nothing-here")
    with pytest.raises(CheckpointNotFoundError):
        _load_full(empty)
    with pytest.raises(CheckpointNotFoundError):
        shardckpt.load(empty_like_state(0, 1, 0), empty.url, storage_options=empty.options)


def test_uncommitted_data_is_not_a_checkpoint(backend):
    """Data files and a temporary manifest without manifest.json (a crashed save) are not a checkpoint."""
    _save(backend)
    other = backend.sibling("crashed")
    for f in backend.files():
        name = "manifest.json.tmp-0123456789ab" if f == "manifest.json" else f
        other.write(name, backend.read(f))
    with pytest.raises(CheckpointNotFoundError):
        _load_full(other)
    # ...and a save there without overwrite succeeds: there is no committed checkpoint to protect.
    _save(other, _other())
    assert_tree_equal(_load_full(other), _other())


@pytest.mark.parametrize("which", ["bin", "index"])
def test_missing_file_is_corrupt_and_named(backend, which):
    _save(backend)
    victim = sorted(backend.data_files() if which == "bin" else backend.index_files())[0]
    backend.remove(victim)
    with pytest.raises(CorruptCheckpointError, match=victim.split("/")[-1]) as info:
        _load_full(backend)
    assert victim in str(info.value)
    with pytest.raises(CorruptCheckpointError, match=victim.split("/")[-1]):
        shardckpt.load(empty_like_state(0, 1, 0), backend.url, storage_options=backend.options)


# ----------------------------------------------------------------------------------------- strict matching


def _target() -> dict:
    return zeros_like_tree(reference())


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "dtype"])
def test_strict_mismatch_names_the_key(backend, case):
    _save(backend)
    sd = _target()
    if case == "missing":  # the state dict wants a key the checkpoint lacks
        sd["model"]["extra.weight"] = torch.zeros(3)
        key = "model.extra.weight"
    elif case == "unexpected":  # the checkpoint holds a key the state dict lacks
        del sd["model"]["tiny"]
        key = "model.tiny"
    elif case == "shape":
        sd["model"]["tiny"] = torch.zeros(5, 2)
        key = "model.tiny"
    else:
        sd["model"]["tiny"] = torch.zeros(2, 5, dtype=torch.float64)
        key = "model.tiny"
    snapshot = {k: v.clone() for k, v in sd["model"].items()}
    with pytest.raises(IncompatibleCheckpointError, match=key.replace(".", r"\.")):
        shardckpt.load(sd, backend.url, storage_options=backend.options)
    # strict load checks before reading: nothing was filled in
    for k, v in sd["model"].items():
        assert torch.equal(v, snapshot[k]), k
    assert sd["step"] == 10 and sd["meta"] == reference()["meta"]  # the zeroed copy kept plain values


@pytest.mark.parametrize("case", ["missing", "unexpected", "dtype"])
def test_non_strict_loads_the_common_keys(backend, case):
    _save(backend)
    ref = reference()
    sd = _target()
    sd["step"] = -1
    if case == "missing":
        sd["model"]["extra.weight"] = torch.full((3,), 7.0)
    elif case == "unexpected":
        del sd["model"]["tiny"]
    else:
        sd["model"]["tiny"] = torch.zeros(2, 5, dtype=torch.float64)
    shardckpt.load(sd, backend.url, strict=False, storage_options=backend.options)
    assert sd["step"] == 10
    for k, v in ref["model"].items():
        if case == "unexpected" and k == "tiny":
            assert "tiny" not in sd["model"]
        elif case == "dtype" and k == "tiny":
            assert sd["model"][k].dtype == torch.float64 and torch.equal(sd["model"][k], v.double())
        else:
            assert_tree_equal(sd["model"][k], v, k)
    if case == "missing":
        assert torch.equal(sd["model"]["extra.weight"], torch.full((3,), 7.0))  # left as it was


def test_shape_mismatch_raises_even_when_not_strict(backend):
    """Like torch's load_state_dict(strict=False): a shape mismatch is never silently skipped."""
    _save(backend)
    sd = _target()
    sd["model"]["tiny"] = torch.zeros(10)
    with pytest.raises(IncompatibleCheckpointError, match=r"model\.tiny"):
        shardckpt.load(sd, backend.url, strict=False, storage_options=backend.options)


def test_every_error_is_a_checkpoint_error(backend):
    with pytest.raises(CheckpointError):
        _load_full(backend)


# --------------------------------------------------------------------------------------- failed saves


@pytest.mark.parametrize("where", ["data", "commit"])
def test_failed_overwrite_keeps_the_old_checkpoint(backend, monkeypatch, where):
    """A save that fails after writing data (or while committing) leaves the old checkpoint whole."""
    import shardckpt.checkpoint.save as save_mod

    _save(backend)
    old_generations = _generations(backend)
    if where == "data":
        real = save_mod.write_rank_files

        def failing_write(*args, **kwargs):
            real(*args, **kwargs)  # the data and index files are written...
            raise OSError("injected: disk full")  # ...then this rank fails

        monkeypatch.setattr(save_mod, "write_rank_files", failing_write)
    else:
        storage_cls = type(save_mod.open_storage(backend.url, backend.options))

        def failing_put(self, path, data, exclusive=False):
            raise OSError("injected: commit failed")

        monkeypatch.setattr(storage_cls, "put_atomic", failing_put)
    with pytest.raises(OSError, match="injected"):  # an I/O failure keeps its type (dist.raise_failures)
        _save(backend, _other(), overwrite=True)
    monkeypatch.undo()
    assert_tree_equal(_load_full(backend), reference())
    assert old_generations <= _generations(backend)
    if where == "data":  # the failed generation's files were removed
        assert _generations(backend) == old_generations
    # and a later overwrite works and cleans up the previous generation
    _save(backend, _other(), overwrite=True)
    assert_tree_equal(_load_full(backend), _other())
    assert not (old_generations & _generations(backend))


def test_odd_keys_and_tensor_free_state_dicts(backend):
    cases = [{}, {"step": 3, "lrs": [0.1, (1, None)]}, {"e": torch.zeros(0, 3)},
             {"": torch.ones(2), "x/y": torch.ones(1), "..": torch.full((3,), 2.0), "$s": torch.ones(1),
              5: torch.arange(4), "ü": {"../../etc": torch.ones(1, dtype=torch.bool)}}]
    for i, sd in enumerate(cases):
        where = backend.sibling(f"odd-{i}")
        shardckpt.save(sd, where.url, storage_options=where.options)
        assert_tree_equal(shardckpt.load_full(where.url, storage_options=where.options), sd)
        shardckpt.save(sd, where.url, overwrite=True, storage_options=where.options)
        assert_tree_equal(shardckpt.load_full(where.url, storage_options=where.options), sd)
        assert all(".." not in f.split("/") for f in where.files())


def test_load_into_non_contiguous_targets(backend):
    t = torch.randn(4, 6)
    _save(backend, {"t": t.t().contiguous(), "s": t[:, 1]})
    sd = {"t": torch.zeros(4, 6).t(), "s": torch.zeros(4, 3)[:, 0]}  # a transpose, a strided column
    shardckpt.load(sd, backend.url, storage_options=backend.options)
    assert torch.equal(sd["t"], t.t()) and torch.equal(sd["s"], t[:, 1])


def test_exclusive_commit_point_on_every_backend(backend, monkeypatch):
    """The commit of a save without overwrite is an exclusive create (a conditional PUT on S3): a manifest
    committed between a save's existence check and its commit makes that save fail, not replace it."""
    from shardckpt.io import open_storage

    storage = open_storage(backend.url, backend.options)
    storage.put_atomic("probe.json", b"1", exclusive=True)
    with pytest.raises(FileExistsError):
        storage.put_atomic("probe.json", b"2", exclusive=True)
    assert storage.read_bytes("probe.json") == b"1"
    storage.put_atomic("probe.json", b"3")  # overwrite
    assert storage.read_bytes("probe.json") == b"3"
    backend.remove("probe.json")
    _save(backend)
    # Another writer commits while this save is between its check and its commit.
    storage_cls = type(open_storage(backend.url, backend.options))
    real_put = storage_cls.put_atomic

    theirs = backend.read("manifest.json")

    def race(self, path, data, exclusive=False):
        if path == "manifest.json":
            real_put(self, path, theirs)  # the other writer's commit lands first
        return real_put(self, path, data, exclusive)

    backend.remove("manifest.json")
    before = _generations(backend)
    monkeypatch.setattr(storage_cls, "put_atomic", race)
    with pytest.raises(CheckpointExistsError, match="another save committed"):
        _save(backend, {"w": torch.ones(3)})
    monkeypatch.setattr(storage_cls, "put_atomic", real_put)
    assert _generations(backend) == before  # the loser's data is gone
    assert_tree_equal(_load_full(backend), reference())
