"""``export``: model weights of any readable checkpoint as Hugging Face style safetensors, checked bit for bit
against the source with ``safetensors`` itself (``load_file``, ``safe_open``)."""
from __future__ import annotations

import json
import os
import shutil
import struct
import uuid

import fsspec
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

import shardckpt
from shardckpt import CheckpointExistsError, CorruptCheckpointError, StateDictType
from shardckpt.cli.main import main
from shardckpt.offline import memory
from shardckpt.offline.convert import convert
from shardckpt.offline.export import INDEX_NAME, SINGLE_FILE, export
from shardckpt.offline.adapters.reader import strip_wrappers
from shardckpt.offline.export_plan import NoModelWeightsError, plan_shards
from shardckpt.offline.safetensors_files import header_bytes
from shardckpt.sizes import parse_size
from shardckpt.offline.verify_export import verify_export
from shardckpt.formats.detect import open_reader
from shardckpt.formats.native import NativeReader
from shardckpt.io.remote import FsspecStorage
from shardckpt.state_dict import unsharded_param_names
from shardckpt.tensor_views import as_bytes
from tests.convert._spy import read_sizes
from tests._dist import run_ranks
from tests.convert._kill import killed_after
from tests.runtime import _model
from tests.state_dict._train import STEPS_BEFORE, full_state, new_run, steps


def _model_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(10, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "s": torch.tensor(2.0), "e": torch.empty(0, 4), "i": torch.arange(5),
            "flag": torch.tensor([True, False, True]), "h": torch.randn(4, 5, generator=g).half()}


def _state() -> dict:
    g = torch.Generator().manual_seed(2)
    return {"model": _model_state(),
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(10, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "params": ["w"]}]},
            "step": 5}


def _files(dst) -> list[str]:
    dst = str(dst)
    if os.path.exists(os.path.join(dst, INDEX_NAME)):
        with open(os.path.join(dst, INDEX_NAME)) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return [SINGLE_FILE]


def _exported(dst) -> dict[str, torch.Tensor]:
    """Every tensor of the export at ``dst``, each file checked with safetensors' own readers; its ``__metadata__``
    holds nothing of the source's path or save (two exports of equal weights are equal files)."""
    out: dict[str, torch.Tensor] = {}
    for name in _files(dst):
        path = os.path.join(str(dst), name)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        assert n % 8 == 0, (path, n)
        loaded = load_file(path)
        with safe_open(path, "pt") as f:
            assert set(f.keys()) == set(loaded)
            meta = f.metadata()
        assert meta["format"] == "pt" and set(meta) <= {"format", "export_id", "adapter"}, meta
        assert not set(loaded) & set(out), "a tensor in two files"
        out.update(loaded)
    return out


def _same(got: dict, want: dict, dtype: torch.dtype | None = None) -> None:
    """Bit for bit: ``want`` as is, or its floating-point tensors ``.to(dtype)``."""
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        v = v.to(dtype) if dtype is not None and v.is_floating_point() else v
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(as_bytes(got[k].contiguous()), as_bytes(v.contiguous())), k


CASTS = [("keep", None), ("bfloat16", torch.bfloat16), ("float16", torch.float16), (torch.float32, torch.float32)]


@pytest.mark.parametrize("dtype,cast", CASTS, ids=lambda x: str(x))
def test_a_full_checkpoint_exports_its_model_weights(tmp_path, dtype, cast):
    shardckpt.save(_state(), tmp_path / "src")
    done: list[tuple[int, int]] = []
    report = export(tmp_path / "src", tmp_path / "dst", dtype=dtype, progress=lambda d, t: done.append((d, t)))
    assert done[-1] == (report.total_size, report.total_size)
    assert report.files == (SINGLE_FILE,) and report.tensors == 7 and not report.tied
    assert sorted(os.listdir(tmp_path / "dst")) == [SINGLE_FILE]
    got = _exported(tmp_path / "dst")
    _same(got, _model_state(), cast)
    assert got["i"].dtype == torch.int64 and got["flag"].dtype == torch.bool  # only floating point is cast
    assert report.total_size == sum(t.nbytes for t in got.values())


def _save_sharded(path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = _state()
    state["model"] = {k: shardckpt.ShardedTensor.from_full(v, rank, world) if v.dim() and v.numel() else v
                      for k, v in state["model"].items()}
    shardckpt.save(state, path, metadata={"state_dict_type": "sharded"})


@pytest.mark.parametrize("dtype,cast", CASTS[:2], ids=lambda x: str(x))
def test_a_sharded_checkpoint_saved_at_ws2_exports_the_full_tensors(tmp_path, dtype, cast):
    run_ranks(2, _save_sharded, str(tmp_path / "src"))
    export(tmp_path / "src", tmp_path / "dst", dtype=dtype, max_shard_size=100)
    assert len(_files(tmp_path / "dst")) > 1
    _same(_exported(tmp_path / "dst"), _model_state(), cast)


def _train_and_save(root: str) -> tuple[dict | None, list[str]]:
    model, optim = new_run()
    steps(model, optim, _model.make_batches(STEPS_BEFORE))
    shardckpt.save_state(model, optim, f"{root}/local", type=StateDictType.LOCAL_STATE_DICT)
    shardckpt.save_state(model, optim, f"{root}/full", type=StateDictType.FULL_STATE_DICT)
    state = full_state(model, optim)
    return (state["model"] if state is not None else None), unsharded_param_names(model)


@pytest.fixture(scope="module")
def runtime_local(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runtime"))
    model, _ = run_ranks(2, _train_and_save, root)[0]
    return root, model


def test_a_runtime_local_checkpoint_exports_by_parameter_name_with_tied_weights_once(runtime_local, tmp_path,
                                                                                     capsys):
    root, model = runtime_local
    assert "head.weight" in model and "tok.weight" in model  # the head is tied to the embedding
    report = export(f"{root}/local", tmp_path / "local", dtype="bfloat16", max_shard_size=2000)
    assert report.tied == {"head.weight": "tok.weight"}  # the first name is kept, as transformers expects
    got = _exported(tmp_path / "local")
    _same(got, {k: v for k, v in model.items() if k != "head.weight"}, torch.bfloat16)
    assert len(_files(tmp_path / "local")) > 1
    assert main(["export", f"{root}/local", str(tmp_path / "cli")]) == 0  # the summary says what became of it
    assert ("1 tied weight written once, under the other name (transformers re-ties it on load: "
            "head.weight = tok.weight)") in capsys.readouterr().out
    # A FULL checkpoint stores the tied weight under both names: that they were one is not knowable.
    export(f"{root}/full", tmp_path / "full")
    _same(_exported(tmp_path / "full"), model)


def test_a_torch_dcp_directory_and_a_torch_save_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save(_state(), checkpoint_id=str(tmp_path / "dcp"))
    export(tmp_path / "dcp", tmp_path / "from-dcp", dtype="bf16")
    _same(_exported(tmp_path / "from-dcp"), _model_state(), torch.bfloat16)
    export(tmp_path / "dcp", tmp_path / "from-dcp-unchecked", verify=False, slice_bytes=16)  # raw chunks by span
    _same(_exported(tmp_path / "from-dcp-unchecked"), _model_state())

    torch.save(_state(), tmp_path / "train.pt")
    export(tmp_path / "train.pt", tmp_path / "from-pt")
    _same(_exported(tmp_path / "from-pt"), _model_state())

    # A plain state dict of a wrapped, compiled model: every tensor, the wrapper prefixes removed.
    wrapped = {f"module._orig_mod.{k}": v for k, v in _model_state().items()}
    torch.save(wrapped, tmp_path / "plain.pt")
    export(tmp_path / "plain.pt", tmp_path / "from-plain")
    _same(_exported(tmp_path / "from-plain"), _model_state())


def test_only_and_strip_prefix_pick_other_entries(tmp_path):
    state = _state()
    state["ema"] = {"w": torch.ones(2, 2)}
    shardckpt.save(state, tmp_path / "src")
    export(tmp_path / "src", tmp_path / "ema", only=["ema"], strip_prefix="ema.")
    _same(_exported(tmp_path / "ema"), {"w": torch.ones(2, 2)})
    export(tmp_path / "src", tmp_path / "both", only=["ema", "model.w"])
    _same(_exported(tmp_path / "both"), {"ema.w": torch.ones(2, 2), "model.w": _model_state()["w"]})


def test_names_and_sizes():
    assert strip_wrappers("module._orig_mod.layer.weight") == "layer.weight"
    assert strip_wrappers("enc._orig_mod.layer.module.w") == "enc.layer.module.w"  # `module` inside is a name
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 << 20 and parse_size(42) == 42
    for bad in ("5XB", "", -1, "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_shards_are_balanced_never_split_and_oversized_tensors_alone():
    sizes = [4] * 10
    shards = plan_shards(sizes, 15)
    assert len(shards) == 4 and [i for s in shards for i in s] == list(range(10))
    totals = [sum(sizes[i] for i in s) for s in shards]
    assert max(totals) <= 15 and max(totals) - min(totals) <= 4, totals  # greedy would leave [12, 12, 12, 4]
    assert plan_shards([4, 100, 4, 4, 1, 0], 10) == [[0], [1], [2, 3, 4, 5]]
    assert plan_shards([3, 3], 10) == [[0, 1]] and plan_shards([], 10) == []


def test_sharded_output_index_limits_and_an_oversized_tensor(tmp_path):
    g = torch.Generator().manual_seed(3)
    model = {f"layer{i}.w": torch.randn(5, 5, generator=g) for i in range(6)}  # 100 bytes each
    model["big"] = torch.randn(100, generator=g)  # 400 bytes: over the limit
    model["layer9.b"] = torch.randn(5, generator=g)
    shardckpt.save({"model": model}, tmp_path / "src")
    limit = 250
    report = export(tmp_path / "src", tmp_path / "dst", max_shard_size=limit)
    with open(tmp_path / "dst" / INDEX_NAME) as f:
        index = json.load(f)
    names = sorted(set(index["weight_map"].values()))
    assert list(report.files) == names and len(names) == 5
    assert names == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert sorted(os.listdir(tmp_path / "dst")) == sorted(names + [INDEX_NAME])  # no temporary files left
    got = _exported(tmp_path / "dst")
    _same(got, model)
    assert sorted(index["weight_map"]) == sorted(model)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in model.values()) == report.total_size
    for name in names:
        held = load_file(tmp_path / "dst" / name)
        size = sum(v.nbytes for v in held.values())
        assert size <= limit or list(held) == ["big"], (name, list(held))
        assert all(index["weight_map"][k] == name for k in held)


def test_reads_come_in_bounded_slices(tmp_path, monkeypatch):
    big = torch.randn(10_000)  # 40 000 bytes
    shardckpt.save({"model": {"big": big, "small": torch.arange(3)}}, tmp_path / "src")
    seen: list[tuple[str, int]] = []
    real = NativeReader.read

    def spy(self, requests):
        seen.extend((r.tensor, r.dest.nbytes) for r in requests)
        return real(self, requests)

    monkeypatch.setattr(NativeReader, "read", spy)
    for dtype, cast in (("keep", None), ("bfloat16", torch.bfloat16)):
        seen.clear()
        export(tmp_path / "src", tmp_path / f"dst-{dtype}", dtype=dtype, slice_bytes=4096, overwrite=True)
        assert max(n for _, n in seen) <= 4096
        assert sum(1 for t, _ in seen if t == "model.big") == 10  # 40 000 bytes in 4 096-byte slices
        _same(_exported(tmp_path / f"dst-{dtype}"), {"big": big, "small": torch.arange(3)}, cast)


def _nothing_at(dst) -> None:
    names = os.listdir(dst) if os.path.exists(dst) else []
    assert INDEX_NAME not in names and SINGLE_FILE not in names and not names, names


def test_failures_are_clear_and_leave_no_export(tmp_path, capsys):
    shardckpt.save(_state(), tmp_path / "src")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        export(tmp_path / "src", tmp_path / "a", dtype="int8")
    _nothing_at(tmp_path / "a")

    shardckpt.save({"optim": _state()["optim"], "step": 1}, tmp_path / "no-model")
    with pytest.raises(NoModelWeightsError, match=r"no model weights.*only=.*optim \(2 tensors\)"):
        export(tmp_path / "no-model", tmp_path / "b")
    with pytest.raises(NoModelWeightsError, match=r"only=\['nothing'\] selects no tensor.*model \(7 tensors\)"):
        export(tmp_path / "src", tmp_path / "b", only=["nothing"])
    _nothing_at(tmp_path / "b")
    assert main(["export", str(tmp_path / "no-model"), str(tmp_path / "b"), "--quiet"]) == 2
    assert "--only" in capsys.readouterr().err


def test_an_existing_export_is_kept_unless_overwrite(tmp_path, capsys):
    shardckpt.save(_state(), tmp_path / "src")
    export(tmp_path / "src", tmp_path / "dst", max_shard_size=100)
    before = sorted(os.listdir(tmp_path / "dst"))
    assert INDEX_NAME in before
    with pytest.raises(CheckpointExistsError, match="overwrite"):
        export(tmp_path / "src", tmp_path / "dst")
    assert sorted(os.listdir(tmp_path / "dst")) == before
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "dst"), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    export(tmp_path / "src", tmp_path / "dst", overwrite=True, dtype="bfloat16")  # sharded -> one file
    assert sorted(os.listdir(tmp_path / "dst")) == [SINGLE_FILE]  # the old shards and index are gone
    _same(_exported(tmp_path / "dst"), _model_state(), torch.bfloat16)


def test_a_corrupted_source_chunk_fails_and_leaves_nothing(tmp_path):
    g = torch.Generator().manual_seed(4)
    model = {f"l{i}": torch.randn(64, 64, generator=g) for i in range(3)}
    shardckpt.save({"model": model}, tmp_path / "src")
    data = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "src") for f in fs if "data-" in d]
    victim = max(data, key=os.path.getsize)
    with open(victim, "r+b") as f:
        size = os.path.getsize(victim)
        f.seek(size - 100)
        byte = f.read(1)
        f.seek(size - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    for limit in (10**9, 20_000):  # one file; three shards (the damage is in a later one)
        done: list[int] = []
        with pytest.raises(CorruptCheckpointError):
            export(tmp_path / "src", tmp_path / "dst", max_shard_size=limit, progress=lambda d, t: done.append(d))
        assert done and done[-1] >= 2 * 64 * 64 * 4  # the tensors before the damage were written
        _nothing_at(tmp_path / "dst")  # no index, no data files, no temporary files


def test_a_failure_on_an_object_store_removes_what_was_written(tmp_path):
    """Of a source without identity (a shardckpt one's files stay for the rerun: test_export_commit.py)."""
    torch.save(_state(), tmp_path / "src.pt")

    def interrupted(done: int, total: int) -> None:  # raised mid-file, after the first files are complete
        if done > 150:
            raise KeyboardInterrupt

    url = f"memory://export-{uuid.uuid4().hex[:8]}"
    with pytest.raises(KeyboardInterrupt):
        export(tmp_path / "src.pt", url, max_shard_size=100, progress=interrupted)
    fs = fsspec.filesystem("memory")
    assert not fs.exists(url) or fs.ls(url, detail=False) == []


def test_round_trip_through_convert(tmp_path):
    shardckpt.save(_state(), tmp_path / "src")
    export(tmp_path / "src", tmp_path / "one", max_shard_size=100)
    convert(tmp_path / "one", tmp_path / "conv", world_size=2)  # the export as a source
    export(tmp_path / "conv", tmp_path / "two", max_shard_size=100)
    first, second = _exported(tmp_path / "one"), _exported(tmp_path / "two")
    _same(second, first)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_export_to_an_fsspec_memory_filesystem_writes_the_index_last(tmp_path, monkeypatch):
    shardckpt.save(_state(), tmp_path / "src")
    url = f"memory://export-{uuid.uuid4().hex[:8]}"
    order: list[str] = []
    real_writer, real_put = FsspecStorage.open_writer, FsspecStorage.put_atomic
    monkeypatch.setattr(FsspecStorage, "open_writer", lambda self, p: order.append(p) or real_writer(self, p))
    monkeypatch.setattr(FsspecStorage, "put_atomic", lambda self, p, d, **k: order.append(p) or real_put(self, p, d, **k))
    report = export(tmp_path / "src", url, max_shard_size=100, dtype="float16")
    assert order == list(report.files) + [INDEX_NAME] and len(report.files) > 1
    fs = fsspec.filesystem("memory")
    got = {}
    for name in report.files:
        got.update(load_bytes(fs.cat_file(f"{url}/{name}")))
    _same(got, _model_state(), torch.float16)
    reader = open_reader(url)  # and shardckpt reads it back as the safetensors directory it is
    assert sorted(reader.tensors()) == sorted(_model_state())
    single = f"memory://export-{uuid.uuid4().hex[:8]}"
    export(tmp_path / "src", single)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(single, detail=False)) == [SINGLE_FILE]
    _same(load_bytes(fs.cat_file(f"{single}/{SINGLE_FILE}")), _model_state())


def test_header_is_padded_to_8_bytes():
    from shardckpt.formats.api import TensorInfo
    from shardckpt.offline.streams import Output

    for n in range(1, 12):
        raw = header_bytes([Output("x" * n, (), TensorInfo("x", torch.float32, (2,), None), torch.float32)],
                           {"format": "pt"})
        (size,) = struct.unpack("<Q", raw[:8])
        assert size % 8 == 0 and len(raw) == 8 + size and raw[8:9] == b"{"


def test_cli(tmp_path, capsys):
    shardckpt.save(_state(), tmp_path / "src")
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "dst"), "--dtype", "bfloat16",
                 "--max-shard-size", "100B"]) == 0
    out = capsys.readouterr().out
    assert "files, 7 tensors" in out and "dtype bfloat16" in out, out
    _same(_exported(tmp_path / "dst"), _model_state(), torch.bfloat16)
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it: usage, exit 2
        main(["export", str(tmp_path / "src"), str(tmp_path / "x"), "--dtype", "int8"])
    assert exit_info.value.code == 2 and "dtype 'int8'" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_a_rename_map_renames_by_whole_name_match_and_null_leaves_out(tmp_path, capsys):
    shardckpt.save(_state(), tmp_path / "src")
    rules = {r"(w|b)": r"layer.\1_renamed", "flag": None, r"h": "half"}
    report = export(tmp_path / "src", tmp_path / "dst", rename_map=rules)
    want = {("layer.w_renamed" if k == "w" else "layer.b_renamed" if k == "b" else "half" if k == "h" else k): v
            for k, v in _model_state().items() if k != "flag"}
    _same(_exported(tmp_path / "dst"), want)
    assert report.tensors == 6
    check = verify_export(tmp_path / "dst", against=tmp_path / "src", rename=rules)
    assert check.ok and check.values.tensors == 6
    assert not verify_export(tmp_path / "dst", against=tmp_path / "src").ok  # without the map the names differ
    (tmp_path / "map.json").write_text(json.dumps(rules))
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "cli"), "--rename-map", str(tmp_path / "map.json"),
                 "--quiet"]) == 0
    assert main(["verify", str(tmp_path / "cli"), "--against", str(tmp_path / "src"), "--rename-map",
                 str(tmp_path / "map.json")]) == 0
    assert _exported(tmp_path / "cli").keys() == want.keys()


@pytest.mark.parametrize("rules, error", [
    ({"nope": "x"}, r"rename rules that match no exported tensor: \['nope'\]"),  # a typo is not silent
    ({"w": "b"}, r"both become 'b'"),
    ({".*": None}, "leave every tensor out"),
    ({"(": "x"}, "not a regular expression"),
    ({"w": r"\2"}, r"rename rule 'w'"),
    ({"w": 3}, "expected a pattern and a new name"),
])
def test_bad_rename_maps_are_refused_before_writing(tmp_path, rules, error):
    shardckpt.save(_state(), tmp_path / "src")
    with pytest.raises((ValueError, shardckpt.IncompatibleCheckpointError), match=error):
        export(tmp_path / "src", tmp_path / "dst", rename_map=rules)
    _nothing_at(tmp_path / "dst")


def test_a_rename_map_file_that_is_not_a_json_object_is_a_usage_error(tmp_path, capsys):
    shardckpt.save(_state(), tmp_path / "src")
    for text in ("[1, 2]", "{nope", '{"(": "x"}', r'{"(.*)": "\\9"}'):  # the last: a group it does not have
        (tmp_path / "map.json").write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            main(["export", str(tmp_path / "src"), str(tmp_path / "dst"), "--rename-map", str(tmp_path / "map.json")])
        assert exit_info.value.code == 2 and "--rename-map" in capsys.readouterr().err


def test_the_memory_limit_bounds_the_slices(tmp_path, monkeypatch):
    big = torch.randn(10_000)  # 40 000 bytes
    shardckpt.save({"model": {"big": big}}, tmp_path / "src")
    seen = read_sizes(monkeypatch)
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)  # the whole limit is buffers
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "dst"), "--memory-limit", "8KiB", "--dtype", "bf16",
                 "--quiet"]) == 0
    assert seen and max(seen) <= 4096 and len(seen) == 10  # two 4 KiB buffers: as read, and as cast
    _same(_exported(tmp_path / "dst"), {"big": big}, torch.bfloat16)


def _killed_after(files: int, src, dst, **options) -> None:
    """export killed (kill -9 style) as it starts file number ``files + 1``."""
    import shardckpt.offline.safetensors_files as module

    killed_after(files, module, "write_file", lambda: export(src, dst, **options))


def _big_state(seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(6)}, "step": 1}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_killed_export_resumes_rewriting_only_its_unfinished_files(tmp_path, monkeypatch, where):
    shardckpt.save(_big_state(), tmp_path / "src")
    dst = str(tmp_path / "dst") if where == "local" else f"memory://resume-{uuid.uuid4().hex}/dst"
    options = {"max_shard_size": 17_000, "dtype": "bfloat16"}  # 6 tensors of 8 KiB in bf16: 2 per file
    if where == "memory":  # a forked child's memory filesystem dies with it: lay out what a killed run leaves
        export(tmp_path / "src", tmp_path / "whole", **options)
        for name in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):
            with fsspec.open(f"{dst}/{name}", "wb") as f:
                f.write(open(tmp_path / "whole" / name, "rb").read())
    else:
        _killed_after(2, tmp_path / "src", dst, **options)
        # The finished files are in the killed export's directory: nothing there has an export's name yet.
        [staging] = os.listdir(dst)
        assert staging.startswith(".export-tmp-") and sorted(os.listdir(os.path.join(dst, staging))) == [
            "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
        with pytest.raises(shardckpt.CheckpointNotFoundError):
            open_reader(dst)
    import shardckpt.offline.safetensors_files as module
    real, wrote = module.write_file, []
    monkeypatch.setattr(module, "write_file", lambda storage, path, *a: (wrote.append(path), real(storage, path, *a)))
    report = export(tmp_path / "src", dst, **options)
    assert report.kept == ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors")
    assert [p.rsplit("/", 1)[-1].removesuffix(".part") for p in wrote] == ["model-00003-of-00003.safetensors"]
    if where == "local":
        assert sorted(os.listdir(dst)) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                           "model-00003-of-00003.safetensors", INDEX_NAME]  # no temporary left
    check = verify_export(dst, against=tmp_path / "src")
    assert check.ok and check.values.tensors == 6


def test_a_file_killed_before_its_fsync_is_never_adopted(tmp_path):
    """A machine's crash can leave a file its full size with blocks never written, and safetensors has no
    checksum to tell. Killed as its second file's close (the fsync) begins, the export leaves that file
    whole in the page cache only: zeroing its data stands for the crash. The rerun must write it again, since
    only files named after their fsync are adopted (it took it on its size and header, exporting zeros)."""
    from shardckpt.io import local

    shardckpt.save(_big_state(), tmp_path / "src")
    dst = tmp_path / "dst"
    options = {"max_shard_size": 17_000, "dtype": "bfloat16"}  # 6 tensors of 8 KiB in bf16: 2 per file
    killed_after(1, local._LocalWriter, "close", lambda: export(tmp_path / "src", dst, **options))
    [staging] = os.listdir(dst)
    [unsynced] = [p for p in (dst / staging).iterdir() if p.name.startswith("model-00002-of-00003.safetensors")]
    size, header = unsynced.stat().st_size, 8 + struct.unpack("<Q", unsynced.read_bytes()[:8])[0]
    with open(unsynced, "r+b") as f:  # the crash: the size and the header made it to disk, the data did not
        f.seek(header)
        f.write(bytes(size - header))
    report = export(tmp_path / "src", dst, **options)
    assert report.kept == ("model-00001-of-00003.safetensors",)
    assert verify_export(dst, against=tmp_path / "src").ok


def test_an_unfinished_export_of_a_source_saved_again_is_never_mixed_in(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_big_state(), src)
    _killed_after(2, src, dst, max_shard_size=40_000)
    shardckpt.save(_big_state(seed=4), src, overwrite=True)  # the same path, new values
    report = export(src, dst, max_shard_size=40_000)  # what the killed run left is debris now: nothing kept
    assert report.kept == () and verify_export(dst, against=src).ok
    assert all(torch.equal(v, _big_state(seed=4)["model"][k]) for k, v in _exported(dst).items())
    assert sorted(os.listdir(dst)) == sorted(list(report.files) + [INDEX_NAME])  # the debris removed


def test_an_unfinished_export_left_under_final_names_is_resumed_or_refused(tmp_path):
    """Files an older version left under their final names without an index (as an export to an object store
    still does): the same source and plan adopt them; another source raises unless overwrite."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    shardckpt.save(_big_state(), src)
    options = {"max_shard_size": 17_000, "dtype": "bfloat16"}  # 3 files
    export(src, tmp_path / "whole", **options)
    os.makedirs(dst)
    for name in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):
        shutil.copy(tmp_path / "whole" / name, dst / name)
    with pytest.raises(CorruptCheckpointError, match="index model.safetensors.index.json is missing"):
        open_reader(dst)
    with pytest.raises(CheckpointExistsError, match="unfinished export of another source or with other options"):
        export(src, dst, max_shard_size=17_000, dtype="float16")  # other options: another plan
    report = export(src, dst, **options)
    assert report.kept == ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors")
    assert verify_export(dst, against=src).ok
    assert sorted(os.listdir(dst)) == sorted(list(report.files) + [INDEX_NAME])


def test_an_unfinished_export_of_a_foreign_source_is_not_resumed(tmp_path):
    from safetensors.torch import save_file
    save_file(_big_state()["model"], str(tmp_path / "src.safetensors"))
    _killed_after(1, tmp_path / "src.safetensors", tmp_path / "dst", max_shard_size=40_000)
    [staging] = os.listdir(tmp_path / "dst")  # its first file, in its directory
    assert os.listdir(tmp_path / "dst" / staging) == ["model-00001-of-00003.safetensors"]
    report = export(tmp_path / "src.safetensors", tmp_path / "dst", max_shard_size=40_000)
    assert report.kept == () and len(report.files) == 3
    assert sorted(os.listdir(tmp_path / "dst")) == sorted(list(report.files) + [INDEX_NAME])


@pytest.mark.parametrize("finished", [1, 2])
def test_a_killed_sharded_export_is_refused_by_every_verb(tmp_path, capsys, finished):
    """Killed with ``finished`` of its 3 files whole: no verb reads what it left, in the directory or as its
    first file (issue 34, item 1: with one file finished, every verb read that file's tensors as the export);
    nor the same files left under their final names (an older version's kill, or an object store's)."""
    shardckpt.save(_big_state(), tmp_path / "src")
    dst = tmp_path / "dst"
    _killed_after(finished, tmp_path / "src", dst, max_shard_size=17_000, dtype="bf16")
    legacy = tmp_path / "legacy"
    [staging] = os.listdir(dst)
    shutil.copytree(dst / staging, legacy)  # the same files under their final names
    for where in (dst, legacy, legacy / "model-00001-of-00003.safetensors"):
        with pytest.raises(shardckpt.CheckpointError):
            shardckpt.load_full(where)
        with pytest.raises(shardckpt.CheckpointError):
            shardckpt.load({"layer0.weight": torch.empty(64, 64)}, where)
        for argv in (["inspect", str(where)], ["verify", str(where)], ["export", str(where), str(tmp_path / "out")],
                     ["convert", str(where), str(tmp_path / "conv"), "--world-size", "1"],
                     ["diff", str(where), str(where)]):
            assert main(argv + ["--quiet"] * (argv[0] in ("export", "convert", "verify"))) in (1, 2), argv
            err = capsys.readouterr().err
            assert "Traceback" not in err and (where == dst or "index model.safetensors.index.json is missing" in err)
        assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "conv")


def _file_bytes(dst) -> dict[str, bytes]:
    return {name: open(os.path.join(str(dst), name), "rb").read() for name in sorted(os.listdir(str(dst)))}


def test_two_exports_of_equal_weights_are_equal_files(tmp_path):
    """Issue 36: ``__metadata__`` is ``{"format": "pt"}`` and the export id, nothing that makes two exports of
    equal weights differ: not the source's path, its save's generation or its world size."""
    state = _big_state()
    shardckpt.save(state, tmp_path / "a")
    shardckpt.save(state, tmp_path / "elsewhere" / "b")  # another save (another generation) of the same values
    export(tmp_path / "a", tmp_path / "out-a", max_shard_size=40_000)
    export(tmp_path / "elsewhere" / "b", tmp_path / "out-b", max_shard_size=40_000)
    first = _file_bytes(tmp_path / "out-a")
    assert len(first) == 4 and first == _file_bytes(tmp_path / "out-b")
    from safetensors.torch import save_file  # a source without checksums, exported to local disk twice
    save_file(state["model"], str(tmp_path / "m.safetensors"))
    export(tmp_path / "m.safetensors", tmp_path / "st-1", max_shard_size=40_000)
    export(tmp_path / "m.safetensors", tmp_path / "st-2", max_shard_size=40_000)
    assert _file_bytes(tmp_path / "st-1") == _file_bytes(tmp_path / "st-2")


def test_exports_of_different_weights_have_different_ids(tmp_path):
    shardckpt.save(_big_state(), tmp_path / "a")
    changed = _big_state()
    next(iter(changed["model"].values())).view(-1)[0] += 1  # one element of one tensor
    shardckpt.save(changed, tmp_path / "b")
    ids = []
    for name in ("a", "b"):
        export(tmp_path / name, tmp_path / f"out-{name}")
        with safe_open(str(tmp_path / f"out-{name}" / SINGLE_FILE), "pt") as f:
            ids.append(f.metadata()["export_id"])
    assert ids[0] != ids[1]
