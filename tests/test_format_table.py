"""Format v6 (FORMAT.md, "The tensor table"): a save of many tensors writes its tensors as a table and its tensor
dicts as ``$tensors``; it reads back bit for bit and as the same manifest as the object per tensor of v5; every
damage to the table or a ``$tensors`` is refused, naming the tensor, before anything is read."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import shardckpt
from shardckpt import CorruptCheckpointError
from shardckpt.format import manifest as manifest_module
from shardckpt.format.manifest import (
    TABLE_MIN_TENSORS, TABLE_VERSION, UNCOMPRESSED_VERSION, parse_manifest, version_for,
)
from shardckpt.format.tree import TensorRef, compact_tensor_dicts, encode
from tests.storage._util import assert_tree_equal, manifest_doc, sealed
from tests.test_format_points import _doc_says


def _state(n: int) -> dict:
    """``n`` small tensors of a model and an optimizer (int-keyed state), plain values, an odd key or two."""
    g = torch.Generator().manual_seed(n)
    model = {f"layers.{i}.w": torch.randn(3, 2, generator=g).to((torch.float32, torch.bfloat16)[i % 2])
             for i in range(n)}
    return {"model": model, "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)},
                                                1: {"step": 4, "exp_avg": torch.ones(2)}},
                                      "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
            "floats": {0.5: torch.arange(3)}, "mixed": {"t": torch.tensor(1.0), "x": 1}, "empty": {},
            "0d": {"s": torch.tensor(7)}, "none": torch.empty(0, 4)}


def _manifest(path) -> tuple[bytes, dict]:
    data = open(os.path.join(path, "manifest.json"), "rb").read()
    return data, manifest_doc(b"{" + data[len(b'{"crc32c":"00000000",'):])


@pytest.fixture
def small_table(monkeypatch):
    """Saves write the table from 2 tensors (what a save of 1024 writes, at the size of a unit test)."""
    monkeypatch.setattr(manifest_module, "TABLE_MIN_TENSORS", 2)


def test_a_save_of_many_tensors_writes_the_table_and_reads_back_bit_for_bit(tmp_path):
    sd = _state(TABLE_MIN_TENSORS)
    path = str(tmp_path / "big")
    shardckpt.save(sd, path)
    data, doc = _manifest(path)
    assert doc["version"] == TABLE_VERSION and set(doc["tensors"]) == {"names", "crc32c", "form", "forms"}
    assert len(doc["tensors"]["names"]) == TABLE_MIN_TENSORS + 7 and len(doc["tensors"]["forms"]) < 20
    assert doc["tree"]["model"] == {"$tensors": list(sd["model"])}
    assert doc["tree"]["optim"]["state"]["$dict"][0][1] == {"$tensors": ["step", "exp_avg"]}
    assert doc["tree"]["mixed"] == {"t": {"$tensor": "mixed.t"}, "x": 1}  # not all tensors: as before
    assert_tree_equal(shardckpt.load_full(path), sd)
    target = copy.deepcopy(sd)
    for t in target["model"].values():
        t.zero_()
    shardckpt.load(target, path)
    assert_tree_equal(target, sd)
    assert shardckpt.verify(path).ok
    small = str(tmp_path / "small")
    shardckpt.save(_state(3), small)
    assert _manifest(small)[1]["version"] == UNCOMPRESSED_VERSION  # older readers read small checkpoints


def test_version_for_counts_tensors():
    assert version_for(False, False, TABLE_MIN_TENSORS - 1) == 2
    assert version_for(True, True, TABLE_MIN_TENSORS - 1) == 4
    assert version_for(False, False, TABLE_MIN_TENSORS) == version_for(True, True, 10 ** 6) == TABLE_VERSION


def test_the_table_parses_to_the_manifest_of_one_entry_per_tensor(tmp_path, small_table):
    path = str(tmp_path / "c")
    shardckpt.save(_state(5), path, compress="zstd")
    data, _ = _manifest(path)
    table = parse_manifest(data, "m")
    encoded = encode(table.tree, lambda v: type(v) is TensorRef)
    table.version = 4  # the same checkpoint written as v4 (one entry per tensor, no $tensors): the same manifest
    old = parse_manifest(table.to_bytes(encoded), "m")
    again = parse_manifest(data, "m")
    assert old.version == 4 and again.version == TABLE_VERSION
    assert list(old.tensors.items()) == list(again.tensors.items()) and old.tree.keys() == again.tree.keys()
    assert repr(old.tree) == repr(again.tree)


def test_compaction_keeps_a_tensor_named_otherwise_and_names_dict_keys_as_paths():
    encoded = {"a": {"x": {"$tensor": "a.x"}}, "b": {"y": {"$tensor": "renamed"}},
               "d": {"$dict": [[{"$float": "nan"}, {"w": {"$tensor": "d.nan.w"}}], [1, {"v": {"$tensor": "d.1.v"}}]]},
               "t": {"$tuple": [{"k": {"$tensor": "t.0.k"}}]}, "r": {"$per_rank": [{"q": {"$tensor": "r.0.q"}}]}}
    assert compact_tensor_dicts(encoded) == {
        "a": {"$tensors": ["x"]}, "b": {"y": {"$tensor": "renamed"}},
        "d": {"$dict": [[{"$float": "nan"}, {"$tensors": ["w"]}], [1, {"$tensors": ["v"]}]]},
        "t": {"$tuple": [{"$tensors": ["k"]}]}, "r": {"$per_rank": [{"$tensors": ["q"]}]}}


def test_per_rank_values_and_a_convert_keep_the_table(tmp_path, small_table):
    path, out = str(tmp_path / "c"), str(tmp_path / "out")
    sd = _state(4) | {"rng": shardckpt.PerRank({"gen": torch.arange(3), "seed": 5})}
    shardckpt.save(sd, path)
    assert _manifest(path)[1]["tree"]["rng"] == {"$per_rank": [{"gen": {"$tensor": "rng.0.gen"}, "seed": 5}]}
    shardckpt.convert(path, out, world_size=2)
    assert _manifest(out)[1]["version"] == TABLE_VERSION
    assert shardckpt.diff(path, out).equal
    assert shardckpt.verify(out).ok


def _table_damage() -> dict:
    """Edits of a v6 manifest's document, each naming what the refusal should name."""
    def at(key, value):
        def edit(doc):
            doc["tensors"][key] = value(doc["tensors"][key]) if callable(value) else value
        return edit

    def form(i, edit_form):
        def edit(doc):
            edit_form(doc["tensors"]["forms"][i])
        return edit

    def tree(edit_tree):
        def edit(doc):
            edit_tree(doc["tree"])
        return edit

    return {
        "names shorter": (at("names", lambda v: v[:-1]), "one entry per tensor"),
        "crc32c longer": (at("crc32c", lambda v: v + [1]), "one entry per tensor"),
        "a name not a string": (at("names", lambda v: [1] + v[1:]), "must be a string"),
        "a name twice": (at("names", lambda v: [v[1]] + v[1:]), "listed twice"),
        "a crc a bool": (at("crc32c", lambda v: [True] + v[1:]), "expected an integer"),
        "a crc a float": (at("crc32c", lambda v: [1.0] + v[1:]), "expected an integer"),
        "a crc over 32 bits": (at("crc32c", lambda v: [1 << 32] + v[1:]), "expected an integer"),
        "a crc negative": (at("crc32c", lambda v: v[:-1] + [-1]), "expected an integer"),
        "a form past the end": (at("form", lambda v: [len(v) + 100] + v[1:]), "'form'"),
        "a form a bool": (at("form", lambda v: v[:-1] + [False]), "'form'"),
        "an unused form": (at("forms", lambda v: v + [v[0]]), "the form of no tensor"),
        "no forms": (at("forms", []), "'form'"),
        "a column not a list": (at("form", {"0": 0}), "must be an array"),
        "a table field more": (at("extra", []), "unknown field"),
        "a table field less": (lambda doc: doc["tensors"].pop("crc32c"), "missing field"),
        "a form with a crc": (form(0, lambda f: f.update(crc32c=0)), "unknown field"),
        "a form without chunks": (form(0, lambda f: f.pop("chunks")), "missing field"),
        "a form of an unknown dtype": (form(0, lambda f: f.update(dtype="float33")), "tensors.forms[0]"),
        "a form claiming more chunks than exist": (form(0, lambda f: f.update(
            shape=[1 << 40], chunks={"size": 1, "count": 1 << 40, "files": {"first": 0, "step": 0}})), "claims"),
        "the tensors an object of entries": (lambda doc: doc.update(tensors={}), "missing field"),
        "a name the tree lacks": (at("names", lambda v: ["ghost"] + v[1:]), "disagree"),
        "an empty $tensors": (tree(lambda t: t.update(extra={"$tensors": []})), "$tensors"),
        "a $tensors key twice": (tree(lambda t: t["model"]["$tensors"].append(t["model"]["$tensors"][0])), "twice"),
        "a $tensors key not a string": (tree(lambda t: t["model"]["$tensors"].append(3)), "$tensors"),
        "a $tensors key with $": (tree(lambda t: t["model"]["$tensors"].append("$x")), "$tensors"),
        "a $tensors with another key": (tree(lambda t: t["model"].update(k=1)), "unknown tag"),
        "a $tensors of a tensor not in the table": (tree(lambda t: t["model"]["$tensors"].append("zz")), "disagree"),
        "the root a $tensors": (lambda doc: doc.update(tree={"$tensors": ["a"]}), "disagree"),
    }


@pytest.mark.parametrize("case", sorted(_table_damage()))
def test_a_damaged_table_or_tensors_list_is_refused_naming_it(tmp_path, small_table, case):
    _doc_says("`names`, `crc32c` and `form` have one entry per tensor; every `form[i]` is a valid position in `forms`, "
              "and every form is the form of at least one tensor.", "the tensor names, each once",
              "each exactly `{\"dtype\", \"shape\", \"chunks\"}`",
              "holds at least one key, no key twice, each a string not starting with `$`")
    edit, named = _table_damage()[case]
    path = str(tmp_path / "c")
    shardckpt.save(_state(4), path)
    data, doc = _manifest(path)
    edit(doc)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(sealed(doc))
    with pytest.raises(CorruptCheckpointError, match="manifest.json") as info:
        shardckpt.load_full(path)
    assert named in str(info.value), f"{case}: {info.value}"
    report = shardckpt.verify(path)
    assert not report.ok and any(named in str(p) for p in report.problems), f"{case}: {report.problems}"


def test_the_table_and_tensors_need_version_6(tmp_path, small_table):
    path = str(tmp_path / "c")
    shardckpt.save(_state(4), path)
    data, doc = _manifest(path)
    for version in (2, 5):
        old = dict(doc, version=version) | ({"pool": {"path": "../shardckpt-pool", "id": "0" * 32}}
                                            if version == 5 else {})
        with pytest.raises(CorruptCheckpointError):
            parse_manifest(sealed(old), "m")
    tree_only = json.loads(json.dumps(doc))
    tree_only["tree"] = {"model": {"$tensors": ["a"]}}
    manifest_module_doc = dict(tree_only, version=4, tensors={})
    with pytest.raises(CorruptCheckpointError, match="unknown tag"):
        parse_manifest(sealed(manifest_module_doc), "m")
    pooled = dict(doc, pool={"path": "../shardckpt-pool", "id": "0" * 32})  # a pool's v5 indexes: never v6
    with pytest.raises(CorruptCheckpointError, match="'pool' is a format v5 field"):
        parse_manifest(sealed(pooled), "m")
