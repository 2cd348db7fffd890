"""The manifest is checked like the data: a checksum over its bytes, bounded validation, bounded nesting.

Regression tests for issue 19 items 4-6: flipped manifest bytes returned wrong data with no error, a
hostile chunk count hung ``verify``/``load_full``, and deep nesting escaped as ``RecursionError``.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import shardckpt
from shardckpt import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from shardckpt.checkpoint.verify import verify
from shardckpt.cli.main import main
from shardckpt.format.manifest import seal
from shardckpt.format.tree import MAX_DEPTH
from tests.storage._util import assert_tree_equal, manifest_doc, sealed

FIXTURE_V1 = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "fixtures", "v1")


def _small_state() -> dict:
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1.5, -2.0])},
            "optim": {"state": {0: {"step": 3, "exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.5}]},
            "step": 3, "name": "run-a"}


def _outcome(path: str, original: dict) -> tuple[str, str]:
    """(what load_full did, what verify said) for the checkpoint as it is on disk now."""
    try:
        got = shardckpt.load_full(path)
    except CheckpointError:
        load = "refused"
    else:
        try:
            assert_tree_equal(got, original)
            load = "original"
        except AssertionError:
            load = "WRONG"
    try:
        report = verify(path)
        check = "ok" if report.ok else "reported"
    except CheckpointError:
        check = "reported"
    return load, check


def test_every_flipped_manifest_byte_is_caught(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    original = _small_state()
    shardckpt.save(original, path)
    manifest = os.path.join(path, "manifest.json")
    pristine = open(manifest, "rb").read()
    counts: dict[tuple[str, str], int] = {}
    for at in range(len(pristine)):
        damaged = bytearray(pristine)
        damaged[at] ^= 0x01
        with open(manifest, "wb") as f:
            f.write(damaged)
        outcome = _outcome(path, original)
        counts[outcome] = counts.get(outcome, 0) + 1
        assert outcome[0] != "WRONG", f"byte {at}: load_full returned wrong data with no error"
        assert outcome[0] == "original" or outcome[1] == "reported", f"byte {at}: verify says OK for changed data"
    with capsys.disabled():
        print(f"\nmanifest flip sweep over {len(pristine)} bytes: {counts}")
    assert counts == {("refused", "reported"): len(pristine)}  # the checksum catches every single flip


def test_v1_manifest_is_read_and_said_to_be_unchecked(capsys):
    report = verify(FIXTURE_V1)
    assert report.ok and report.version == 1 and not report.manifest_checksum
    assert main(["verify", FIXTURE_V1, "--quiet"]) == 0
    assert "no checksum" in capsys.readouterr().out
    assert main(["inspect", FIXTURE_V1]) == 0
    assert "no manifest checksum" in capsys.readouterr().out


def test_new_checkpoints_say_their_manifest_is_checked(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    shardckpt.save(_small_state(), path)
    assert main(["verify", path, "--quiet", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["manifest_checksum"] is True and report["version"] == 2
    assert main(["inspect", path]) == 0
    assert "manifest checksummed; chunk checksums per 1.0 MiB block" in capsys.readouterr().out


def _rewrite(path: str, edit) -> None:
    manifest = os.path.join(path, "manifest.json")
    doc = manifest_doc(open(manifest, "rb").read())
    edit(doc)
    with open(manifest, "wb") as f:
        f.write(sealed(doc))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claimed_file_size", ["as stored", "2**45"])
def test_hostile_chunk_count_is_refused_quickly(tmp_path, claimed_file_size):
    """Issue 19 item 5: 2**40 one-element chunks in one file looped 2**40 times in verify and load_full."""
    path = str(tmp_path / "ckpt")
    shardckpt.save(_small_state(), path)

    def edit(doc: dict) -> None:
        doc["tensors"]["model.b"].update(shape=[2 ** 40], chunks={"size": 1, "count": 2 ** 40,
                                                                  "files": {"first": 0, "step": 0}})
        if claimed_file_size != "as stored":  # the manifest vouches for the bytes; the file does not hold them
            for f in doc["files"]:
                f["size"] = 2 ** 45
    _rewrite(path, edit)
    with pytest.raises(CorruptCheckpointError):
        shardckpt.load_full(path)
    try:
        assert not verify(path).ok
    except CorruptCheckpointError:
        pass


@pytest.mark.parametrize("depth", [101, 400, 600, 990, 5000])
def test_deep_nesting_in_a_manifest_is_a_clear_error(tmp_path, depth, capsys):
    """Issue 19 item 6: at depth 400 a RecursionError escaped from the tree walk."""
    path = str(tmp_path / "ckpt")
    shardckpt.save(_small_state(), path)
    manifest = os.path.join(path, "manifest.json")
    body = b"{" + open(manifest, "rb").read()[len(b'{"crc32c":"00000000",'):]
    deep = b'"name":' + b"[" * depth + b"1" + b"]" * depth
    with open(manifest, "wb") as f:
        f.write(seal(body.replace(b'"name":"run-a"', deep)))
    for call in (lambda: shardckpt.load_full(path), lambda: verify(path),
                 lambda: shardckpt.load(_small_state(), path)):
        with pytest.raises(CorruptCheckpointError, match="nested|not valid JSON"):
            call()
    assert main(["verify", path, "--quiet"]) == 1
    assert "Traceback" not in capsys.readouterr().err


def _nest(levels: int) -> object:
    value: object = torch.ones(2)
    for _ in range(levels):
        value = {"x": value}
    return value


def test_nesting_limit_is_the_same_on_save_and_load(tmp_path):
    ok = {"deep": _nest(MAX_DEPTH - 1)}  # the root dict is one level more
    shardckpt.save(ok, str(tmp_path / "ok"))
    assert_tree_equal(shardckpt.load_full(str(tmp_path / "ok")), ok)
    with pytest.raises(UnsupportedValueError, match="levels deep"):
        shardckpt.save({"deep": _nest(MAX_DEPTH)}, str(tmp_path / "too-deep"))
    assert not os.path.exists(tmp_path / "too-deep" / "manifest.json")


@pytest.mark.parametrize("state", [{"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},
                                   {"a.b": 1, "a": {"b": torch.zeros(1)}},
                                   {"opt": {1: torch.ones(1), "1": torch.zeros(1)}}])
def test_entries_whose_dotted_names_collide_are_refused_on_save(tmp_path, state):
    with pytest.raises(UnsupportedValueError, match="both named"):
        shardckpt.save(state, str(tmp_path / "ckpt"))


def test_bool_bytes_other_than_0_and_1_are_corrupt(tmp_path):
    """A byte 2 stored as bool: the CRCs match (they cover bytes), so the dtype rule must catch it."""
    path = str(tmp_path / "ckpt")
    shardckpt.save({"mask": torch.tensor([0, 1, 2, 1], dtype=torch.uint8)}, path)
    _rewrite(path, lambda doc: doc["tensors"]["mask"].update(dtype="bool"))
    with pytest.raises(CorruptCheckpointError, match="'mask'.*bool byte"):
        shardckpt.load_full(path)
    with pytest.raises(CorruptCheckpointError, match="'mask'.*bool byte"):
        shardckpt.load({"mask": torch.zeros(4, dtype=torch.bool)}, path)


def test_a_flipped_gap_byte_between_chunks_is_harmless(tmp_path):
    """FORMAT.md: alignment gaps are covered by no checksum because no reader ever reads them."""
    path = str(tmp_path / "ckpt")
    state = {"a": torch.arange(3, dtype=torch.float32), "b": torch.arange(5, dtype=torch.float64)}
    shardckpt.save(state, path, files_per_rank=1)
    (index,) = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".index.json")]
    rows = sorted(json.loads(open(index, "rb").read())["chunks"], key=lambda r: r[2])
    gap = rows[0][2] + rows[0][3]
    assert gap < rows[1][2]  # the second chunk starts at the next 64-byte boundary
    data_file = index[:-len(".index.json")] + ".bin"
    raw = bytearray(open(data_file, "rb").read())
    raw[gap] ^= 0xFF
    open(data_file, "wb").write(bytes(raw))
    assert_tree_equal(shardckpt.load_full(path), state)
    assert verify(path).ok


def test_dollar_keys_and_scalar_keys_round_trip(tmp_path):
    """A user dict with a '$'-key, and every scalar key type, is stored as a $dict and comes back as it was."""
    state = {"d": {"$ref": 1, "x": 2}, "k": {None: 1, True: 2, 3: 3, 1.5: 4, "s": 5, float("inf"): 6}}
    shardckpt.save(state, str(tmp_path / "ckpt"))
    assert shardckpt.load_full(str(tmp_path / "ckpt")) == state


@pytest.mark.timeout(60)
def test_a_chunk_count_the_indexes_cannot_hold_is_refused_before_any_per_chunk_work(tmp_path):
    """Review finding: one-byte chunks, as many as the data file has bytes, cost verify ~2.5 KB of memory
    per chunk before any index row was checked. Each chunk needs an index row, so the count is bounded."""
    path = str(tmp_path / "ckpt")
    shardckpt.save({"w": torch.zeros(200_000, dtype=torch.uint8)}, path, files_per_rank=1)
    _rewrite(path, lambda doc: doc["tensors"]["w"].update(
        chunks={"size": 1, "count": 200_000, "files": {"first": 0, "step": 0}}))
    for call in (lambda: shardckpt.load_full(path), lambda: verify(path)):
        with pytest.raises(CorruptCheckpointError, match="indexes hold at most"):
            call()


def test_conjugated_and_negated_views_save_and_load_their_values(tmp_path):
    path = str(tmp_path / "ckpt")
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    shardckpt.save({"c": z.conj(), "n": torch._neg_view(torch.tensor([1.5, -2.0]))}, path)
    full = shardckpt.load_full(path)
    assert torch.equal(full["c"], z.conj().resolve_conj()) and torch.equal(full["n"], torch.tensor([-1.5, 2.0]))
    target = {"c": torch.zeros(2, dtype=torch.complex64).conj(), "n": torch._neg_view(torch.zeros(2))}
    shardckpt.load(target, path)
    assert torch.equal(target["c"].resolve_conj(), z.conj().resolve_conj())
    assert torch.equal(target["n"].resolve_neg(), torch.tensor([-1.5, 2.0]))


def test_a_one_element_view_with_a_stride_saves_and_loads_in_place(tmp_path):
    path = str(tmp_path / "ckpt")
    base = torch.arange(4.0)
    shardckpt.save({"t": base[::2][1:]}, path)  # shape (1,), stride (2,)
    into = torch.zeros(4)
    shardckpt.load({"t": into[::2][1:]}, path)
    assert torch.equal(into, torch.tensor([0.0, 0.0, 2.0, 0.0]))
