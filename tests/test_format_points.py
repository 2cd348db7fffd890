"""What FORMAT.md says where a second reader had to guess (issue 42, "FORMAT.md, for a second implementation", points
2-13), each checked against what shardckpt does. Point 1 (LOCAL checkpoints) is tests/test_format_local.py."""
from __future__ import annotations

import copy
import glob
import json
import os

import pytest
import torch

import shardckpt
from shardckpt import CorruptCheckpointError
from shardckpt.checkpoint.verify import verify
from shardckpt.format.checksum import crc32c
from shardckpt.format.index import ChunkRecord
from shardckpt.format.manifest import parse_manifest
from shardckpt.formats.native.reader import record_problem
from shardckpt.regions import FlatRange
from tests._helpers import manifest_of
from tests.storage._util import manifest_doc, sealed

FORMAT_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "FORMAT.md")


def _doc_says(*texts: str) -> None:
    doc = " ".join(open(FORMAT_MD, encoding="utf-8").read().split())
    for text in texts:
        assert " ".join(text.split()) in doc, f"FORMAT.md no longer says: {text}"


def _saved(tmp_path, state=None) -> tuple[str, dict]:
    path = str(tmp_path / "c")
    shardckpt.save(state or {"w": torch.arange(6.0), "b": torch.ones(3)}, path, files_per_rank=1)
    return path, manifest_doc(open(os.path.join(path, "manifest.json"), "rb").read())


def _write(path: str, doc: dict) -> None:
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(sealed(doc))


def _parses(doc: dict):
    return parse_manifest(sealed(doc), "m")


def _refused(doc: dict, match: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=match):
        _parses(doc)


def _nested(n: int, make) -> object:
    value: object = 0
    for _ in range(n):
        value = make(value)
    return value


def test_2_a_whole_tensor_read_checks_the_tensor_checksum(tmp_path):
    _doc_says("A reader that reads every chunk of a tensor whole must also check the tensor's `crc32c`")
    path, doc = _saved(tmp_path)
    doc["tensors"]["w"]["crc32c"] ^= 1  # resealed: the manifest's own checksum passes
    _write(path, doc)
    with pytest.raises(CorruptCheckpointError, match="'w'.*whole tensor"):
        shardckpt.load_full(path)
    with pytest.raises(CorruptCheckpointError, match="'w'.*whole tensor"):
        shardckpt.load({"w": torch.zeros(6), "b": torch.zeros(3)}, path)
    part = shardckpt.ShardedTensor(torch.zeros(3), (6,), FlatRange(0, 3))
    with pytest.raises(CorruptCheckpointError, match="'w'.*whole tensor"):  # (one chunk of one block: read whole)
        shardckpt.load({"w": part, "b": torch.zeros(3)}, path)
    assert torch.equal(shardckpt.load_full(path, verify_checksums=False)["w"], torch.arange(6.0))
    assert torch.equal(shardckpt.load_full(path, ["b"])["b"], torch.ones(3))
    assert not verify(path).ok


def test_2_a_partial_read_of_a_chunk_of_several_blocks_checks_its_blocks_only(tmp_path):
    _doc_says("a partial read checks its blocks only, except of a tensor stored as one chunk of one block")
    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: two blocks of 1 MiB
    path, doc = _saved(tmp_path, {"w": big, "b": torch.ones(3)})
    doc["tensors"]["w"]["crc32c"] ^= 1
    _write(path, doc)
    part = shardckpt.ShardedTensor(torch.zeros(3), (300_000,), FlatRange(0, 3))
    shardckpt.load({"w": part, "b": torch.zeros(3)}, path)  # the first block read and checked, not the tensor
    assert torch.equal(part.local, big[:3])
    with pytest.raises(CorruptCheckpointError, match="'w'.*whole tensor"):
        shardckpt.load_full(path)


def test_2_chunks_of_every_form_combine_to_the_manifests_checksum(tmp_path):
    for version in (1, 2, 3, 4, 6):  # regular and explicit chunks, boxes, several files, compressed frames, a table
        fixture = os.path.join(os.path.dirname(FORMAT_MD), "fixtures", f"v{version}")
        assert shardckpt.load_full(fixture)["step"] == 42


def test_3_a_path_listed_twice_is_refused(tmp_path):
    _doc_says("No path may appear twice among all the `path`s and `index.path`s of `files`")
    _, doc = _saved(tmp_path)
    twice = copy.deepcopy(doc)
    twice["files"].append(copy.deepcopy(twice["files"][0]))
    _refused(twice, "listed twice")
    crossed = copy.deepcopy(doc)
    crossed["files"][0]["index"]["path"] = crossed["files"][0]["path"]
    _refused(crossed, "listed twice")


def test_4_a_byte_order_mark_is_refused(tmp_path):
    _doc_says("UTF-8, with no byte-order mark (a reader rejects one, and any other encoding)")
    path, doc = _saved(tmp_path)
    with pytest.raises(CorruptCheckpointError):
        parse_manifest(b"\xef\xbb\xbf" + sealed(doc), "m")
    (index,) = glob.glob(os.path.join(path, "data-*", "*.index.json"))
    raw = b"\xef\xbb\xbf" + open(index, "rb").read()
    open(index, "wb").write(raw)
    doc["files"][0]["index"].update(size=len(raw), crc32c=crc32c(raw))
    _write(path, doc)
    with pytest.raises(CorruptCheckpointError, match="byte-order mark"):
        shardckpt.load_full(path)  # json.loads alone would have skipped it


def test_5_the_depth_limit_counts_the_root_and_a_tuple_or_dict_as_one_level(tmp_path):
    _doc_says("the tree itself is level 1, so `{\"x\": [[...]]}` with 99 nested lists is the deepest valid tree")
    _, doc = _saved(tmp_path)
    for make in (lambda v: [v], lambda v: {"$tuple": [v]}, lambda v: {"$dict": [[1, v]]}, lambda v: {"k": v}):
        deepest, deeper = copy.deepcopy(doc), copy.deepcopy(doc)
        deepest["tree"]["x"], deeper["tree"]["x"] = _nested(99, make), _nested(100, make)
        _parses(deepest)
        _refused(deeper, "more than 100 levels")


def test_5_json_nested_past_the_limit_is_refused_as_it_is_walked_at_any_place(tmp_path):
    # 300 JSON levels (a $dict level is three) and beyond, below json's own recursion limit: refused by the walk
    # that counts them, wherever they are (a $dict key too), before it could run out of stack.
    _, doc = _saved(tmp_path)
    for tree_x in (_nested(400, lambda v: [v]), _nested(160, lambda v: {"$tuple": [v]}),
                   {"$dict": [[_nested(400, lambda v: [v]), 1], ["b", 2]]}, _nested(120, lambda v: {"$dict": [[1, v]]}),
                   {"$tuple": _nested(299, lambda v: [v])}):
        deep = copy.deepcopy(doc)
        deep["tree"]["x"] = tree_x
        _refused(deep, "more than 100 levels")


@pytest.mark.parametrize("leaf", [torch.ones(2), float("nan"), 5])
def test_5_the_deepest_tree_of_dict_levels_saves_and_loads_whatever_its_leaf(tmp_path, leaf):
    # from helper-34: 100 int-keyed dict levels (the root the first) over a tensor or a NaN were refused: the tagged
    # leaf is one JSON level below the last $dict's three, and the JSON allowance counted three per level only
    _doc_says("counted in the value")
    def nest(levels):
        value = leaf
        for _ in range(levels):
            value = {1: value}
        return value
    path = str(tmp_path / "deepest")
    shardckpt.save(nest(100), path)
    got = shardckpt.load_full(path)
    for _ in range(99):
        got = got[1]
    assert torch.equal(got[1], leaf) if isinstance(leaf, torch.Tensor) else str(got[1]) == str(leaf)
    with pytest.raises(shardckpt.UnsupportedValueError, match="more than 100 levels"):
        shardckpt.save(nest(101), str(tmp_path / "deeper"))


def test_5_a_per_rank_value_counts_as_a_level_and_is_refused_past_the_limit_as_any_tree(tmp_path):
    # helper-35: the depth check did not look inside a PerRank: 5000 levels raised RecursionError, one level past the
    # limit was refused late as "would not load"
    def lists(levels, leaf):
        for _ in range(levels):
            leaf = [leaf]
        return leaf
    path = str(tmp_path / "deepest")
    shardckpt.save({"x": shardckpt.PerRank(lists(98, torch.ones(2)))}, path)  # root, PerRank, 98 lists: 100
    got = shardckpt.load_full(path)["x"][0]
    for _ in range(98):
        got = got[0]
    assert torch.equal(got, torch.ones(2))
    for levels in (99, 5000):
        with pytest.raises(shardckpt.UnsupportedValueError, match="more than 100 levels"):
            shardckpt.save({"x": shardckpt.PerRank(lists(levels, 1))}, str(tmp_path / f"deeper{levels}"))


def test_6_and_13_a_dict_root_is_allowed_other_roots_and_an_empty_dict_are_not(tmp_path):
    _doc_says("it decodes to a dict: a plain object or a `$dict`", "and so is `{\"$dict\": []}` (an empty dict is `{}`)")
    path, _ = _saved(tmp_path, {1: torch.arange(3.0), "a": 2})
    assert torch.equal(shardckpt.load_full(path)[1], torch.arange(3.0))
    _, doc = _saved(tmp_path / "o")
    for root in ({"$tuple": [{"$tensor": "0"}]}, {"$tensor": ""}, {"$float": "nan"}):
        bad = copy.deepcopy(doc)
        bad["tree"], bad["tensors"] = root, {"0": doc["tensors"]["w"], "": doc["tensors"]["w"]}
        _refused(bad, "must be a state dict")
    empty = copy.deepcopy(doc)
    empty["tree"]["e"] = {"$dict": []}
    _refused(empty, "must be a JSON object")
    assert shardckpt.load_full(_saved(tmp_path / "e", {"w": torch.ones(1), "e": {}})[0])["e"] == {}


def test_7_a_row_the_manifest_does_not_place_loads_and_verify_reports_it(tmp_path):
    _doc_says("A row the manifest does not place is not an error for a reader")
    path, doc = _saved(tmp_path)
    (index,) = glob.glob(os.path.join(path, "data-*", "*.index.json"))
    index_doc = json.loads(open(index, "rb").read())
    extra = copy.deepcopy(next(r for r in index_doc["chunks"] if r[0] == "w"))
    extra[1] = 7
    index_doc["chunks"].append(extra)
    raw = json.dumps(index_doc, separators=(",", ":")).encode()
    open(index, "wb").write(raw)
    doc["files"][0]["index"].update(size=len(raw), crc32c=crc32c(raw))
    _write(path, doc)
    assert torch.equal(shardckpt.load_full(path)["w"], torch.arange(6.0))
    report = verify(path)
    assert not report.ok and any("unknown chunk 7" in p.message for p in report.problems)


def test_8_float_keys_are_named_as_python_repr_writes_them(tmp_path):
    _doc_says("(`1e-05`, `1e+16`, `1.5e+300`), else positional (`0.0001`, `123456789012345.0`)")
    keys = [2.0, -0.0, 1e-05, 1e16, 1.5e300, 0.0001, 123456789012345.0, 0.1, float("inf"), True, None]
    state = {"a": {k: torch.tensor([i]) for i, k in enumerate(keys)}}
    path, _ = _saved(tmp_path, state)
    names = set(manifest_of(path).tensors)
    assert names == {f"a.{n}" for n in ("2.0", "-0.0", "1e-05", "1e+16", "1.5e+300", "0.0001", "123456789012345.0",
                                        "0.1", "inf", "True", "None")}


def test_9_ranges_of_chunk_sizes_counts_and_index_rows(tmp_path):
    _doc_says("`S` is 1 .. 2^50 and `N` is 0 .. 2^50", "the chunk number is 0 .. 2^50, the byte offset 0 .. 2^62")
    path, doc = _saved(tmp_path)
    for field, value in (("size", 0), ("size", 2 ** 50 + 1), ("count", -1), ("count", 2 ** 50 + 1)):
        bad = copy.deepcopy(doc)
        bad["tensors"]["w"]["chunks"][field] = value
        _refused(bad, "expected an integer|must equal|count")
    (index,) = glob.glob(os.path.join(path, "data-*", "*.index.json"))
    original = open(index, "rb").read()
    for column, value in ((1, -1), (1, 2 ** 50 + 1), (2, 2 ** 62 + 1), (3, 0)):
        index_doc = json.loads(original)
        index_doc["chunks"][0][column] = value
        raw = json.dumps(index_doc, separators=(",", ":")).encode()
        open(index, "wb").write(raw)
        doc["files"][0]["index"].update(size=len(raw), crc32c=crc32c(raw))
        _write(path, doc)
        with pytest.raises(CorruptCheckpointError, match="expected an integer"):
            shardckpt.load_full(path)


def test_10_with_a_nonzero_step_the_bytes_are_bounded_by_all_files(tmp_path):
    _doc_says("the sum of the `size`s of **all** of the manifest's files, not only the files named")
    _, doc = _saved(tmp_path, {"w": torch.arange(6.0), "big": torch.zeros(1000)})
    files = doc["files"]
    doc["files"] = [files[0], {**copy.deepcopy(files[0]), "path": files[0]["path"] + "x",
                               "index": {**files[0]["index"], "path": files[0]["index"]["path"] + "x"}}]
    w = doc["tensors"]["w"]
    need = 6 * 4
    doc["files"][0]["size"], doc["files"][1]["size"] = need - 8, 8 + 4000  # w's file alone is too small
    w["chunks"] = {"size": 3, "count": 2, "files": {"first": 0, "step": 1}}
    _parses(doc)  # all files together hold enough: the manifest is valid ...
    w["chunks"] = {"size": 6, "count": 1, "files": [0]}
    _refused(doc, "its data files hold")  # ... while a list of files is checked against the files named


def test_11_the_seal_covers_every_version_from_2_and_planes_need_whole_elements_per_row(tmp_path):
    _doc_says("a manifest of version 2 or later (2 to 6) without that prefix",
              "for each row whose codec is `zstd-planes`")
    for version in (2, 3, 4, 5, 6):
        unsealed = json.dumps({"format": "shardckpt", "version": version}).encode()
        with pytest.raises(CorruptCheckpointError, match="must begin with its checksum"):
            parse_manifest(unsealed, "m")
    entry = manifest_of(_saved(tmp_path)[0]).tensors["w"]  # float32: k = 4
    region = FlatRange(0, 6)
    planes = ChunkRecord(0, 24, 0, "zstd-planes", 6, (0,) * 4, (6,) * 4)
    assert "split its" in record_problem(planes, entry, region)
    assert record_problem(ChunkRecord(0, 24, 0, "zstd", 6, (0,) * 4, (6,) * 4), entry, region) is None
    assert record_problem(ChunkRecord(0, 24, 0, "raw", 6, (0,) * 4), entry, region) is None


def test_12_version_1_keeps_the_json_rules_but_ignores_unknown_fields(tmp_path):
    _doc_says("Version 1 follows these rules too")
    v1 = os.path.join(os.path.dirname(FORMAT_MD), "fixtures", "v1")
    doc = json.loads(open(os.path.join(v1, "manifest.json"), "rb").read())
    parse_manifest(json.dumps({**doc, "unknown": 1}).encode(), "v1")
    lean = {k: v for k, v in doc.items() if k not in ("created_by", "metadata")}
    parse_manifest(json.dumps(lean).encode(), "v1")
    text = json.dumps(doc)
    for bad in (b"\xef\xbb\xbf" + text.encode(), text.replace('"version": 1', '"version": 1.0').encode(),
                text.replace('{"format"', '{"format": "x", "format"', 1).encode()):
        with pytest.raises(CorruptCheckpointError):
            parse_manifest(bad, "v1")
    deep = {**doc, "tree": {**doc["tree"], "x": _nested(100, lambda v: [v])}}
    with pytest.raises(CorruptCheckpointError, match="more than 100 levels"):
        parse_manifest(json.dumps(deep).encode(), "v1")
    no_crc = copy.deepcopy(doc)
    del no_crc["files"][0]["index"]["crc32c"]
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        parse_manifest(json.dumps(no_crc).encode(), "v1")
