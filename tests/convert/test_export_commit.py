"""An export's commit on local disk (``convert/export_commit.py``, issue 34, item 4): its files are held until
they have their final names, so that ``gc`` and a second export leave them alone; a failure renames
everything back, so the destination keeps the old export whole; two exports commit one at a time.
Collectors and second writers run at chosen points through hooks, never by timing."""
from __future__ import annotations

import json
import os
import uuid

import fsspec
import pytest
import torch

import shardckpt
from shardckpt import CheckpointExistsError, CorruptCheckpointError
from shardckpt.errors import BadArgumentError
from shardckpt.checkpoint.gc import gc
from shardckpt.offline import safetensors_files
from shardckpt.offline.export import INDEX_NAME, export
from shardckpt.offline.verify_export import verify_export
from shardckpt.formats.detect import open_reader

OPTIONS = {"max_shard_size": 17_000}  # 4 tensors of 16 KiB: 4 files


def _source(path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shardckpt.save({"model": {f"l{i}": torch.randn(64, 64, generator=g) for i in range(4)}}, path)


def _holds(dst, src, dtype: torch.dtype | None = None, others_live: bool = False) -> None:
    """``dst`` is exactly the export of ``src`` (cast to ``dtype``), and nothing else is there (but the
    temporary files of a live export, ``others_live``)."""
    reader = open_reader(dst)
    want = shardckpt.load_full(src)["model"]
    assert sorted(reader.tensors()) == sorted(want)
    for name, info in reader.tensors().items():
        assert info.dtype == (dtype or want[name].dtype), name
    assert verify_export(dst, against=src).ok
    assert others_live or not [n for n in os.listdir(dst) if ".export-" in n]


@pytest.fixture
def sources(tmp_path):
    _source(tmp_path / "old", 1)
    _source(tmp_path / "new", 2)
    export(tmp_path / "old", tmp_path / "dst", **OPTIONS)
    return tmp_path / "old", tmp_path / "new", tmp_path / "dst"


def _after_file(monkeypatch, k: int, action) -> list:
    """Run ``action()`` once, right after the export wrote its file number ``k`` (from 1)."""
    real, seen = safetensors_files.write_file, []

    def hooked(storage, path, *args):
        out = real(storage, path, *args)
        seen.append(path)
        if len(seen) == k:
            action()
        return out

    monkeypatch.setattr(safetensors_files, "write_file", hooked)
    return seen


@pytest.mark.parametrize("k", [1, 2])
def test_gc_during_export_overwrite_removes_nothing_live(sources, monkeypatch, k):
    old, new, dst = sources
    removed: list = []
    _after_file(monkeypatch, k, lambda: removed.append(gc(dst)))
    export(new, dst, overwrite=True, dtype="bfloat16", **OPTIONS)  # 2 files
    assert removed == [[]]  # it removed every temporary file, and the export then failed with neither left
    _holds(dst, new, torch.bfloat16)


def test_a_second_exports_cleanup_leaves_the_first_ones_files(sources, monkeypatch):
    old, new, dst = sources
    monkeypatch.setattr(safetensors_files, "write_file", safetensors_files.write_file)
    real = safetensors_files.write_file

    def second() -> None:
        monkeypatch.setattr(safetensors_files, "write_file", real)
        export(old, dst, overwrite=True, **OPTIONS)  # commits, then cleans up *.export-tmp-*
        _holds(dst, old, others_live=True)

    _after_file(monkeypatch, 2, second)
    export(new, dst, overwrite=True, dtype="bfloat16", **OPTIONS)  # the last commit wins, whole
    _holds(dst, new, torch.bfloat16)


def test_without_overwrite_the_second_of_two_exports_to_commit_is_refused(tmp_path, monkeypatch):
    _source(tmp_path / "a", 1)
    _source(tmp_path / "b", 2)
    dst = tmp_path / "dst"
    real = safetensors_files.write_file

    def first_commits() -> None:
        monkeypatch.setattr(safetensors_files, "write_file", real)
        export(tmp_path / "b", dst, **OPTIONS)

    _after_file(monkeypatch, 1, first_commits)
    with pytest.raises(CheckpointExistsError, match="committed .* meanwhile"):
        export(tmp_path / "a", dst, **OPTIONS)
    _holds(dst, tmp_path / "b")


@pytest.mark.parametrize("failing", [1, 3, 5, 6, 8])
def test_a_failure_among_the_renames_leaves_the_old_export_whole(sources, monkeypatch, failing):
    """Rename number ``failing`` of the commit raises (the old index and 4 files aside: 1-5; the 2 new files
    and the index in place: 6-8): everything is renamed back, the new files removed, the old export whole."""
    old, new, dst = sources
    real, made = safetensors_files.rename, []

    def rename(storage, a: str, b: str) -> None:
        made.append((a, b))
        if len(made) == failing:
            raise OSError(5, "injected I/O error")
        real(storage, a, b)

    monkeypatch.setattr(safetensors_files, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        export(new, dst, overwrite=True, dtype="bfloat16", **OPTIONS)
    monkeypatch.undo()
    _holds(dst, old)
    assert sorted(os.listdir(dst)) == sorted([f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
                                             + [INDEX_NAME])


def test_one_file_replaces_one_file_in_one_rename(tmp_path, monkeypatch):
    _source(tmp_path / "old", 1)
    _source(tmp_path / "new", 2)
    export(tmp_path / "old", tmp_path / "dst")
    real, made = safetensors_files.rename, []
    monkeypatch.setattr(safetensors_files, "rename", lambda s, a, b: (made.append(b), real(s, a, b))[1])
    export(tmp_path / "new", tmp_path / "dst", overwrite=True)
    assert [b for b in made if "/" not in b] == ["model.safetensors"]  # no moment without a model.safetensors
    _holds(tmp_path / "dst", tmp_path / "new")


def test_a_mix_of_two_exports_files_is_refused_by_name(tmp_path):
    """Each file names its export (export_id, as the index does): a file of another export beside the index,
    which two exports racing on an object store can leave, is refused, never read as one export."""
    _source(tmp_path / "a", 1)
    _source(tmp_path / "b", 2)
    export(tmp_path / "a", tmp_path / "ea", **OPTIONS)
    export(tmp_path / "b", tmp_path / "eb", **OPTIONS)
    assert json.loads((tmp_path / "ea" / INDEX_NAME).read_text())["metadata"]["export_id"]
    os.replace(tmp_path / "eb" / "model-00002-of-00004.safetensors", tmp_path / "ea" / "model-00002-of-00004.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00004.safetensors: written by another export"):
        open_reader(tmp_path / "ea")
    export(tmp_path / "a", tmp_path / "again", **OPTIONS)  # the same source and plan: the same export, one id
    ids = [json.loads((tmp_path / d / INDEX_NAME).read_text())["metadata"]["export_id"] for d in ("ea", "again", "eb")]
    assert ids[0] == ids[1] != ids[2]


@pytest.mark.parametrize("overwrite", [False, True])
def test_on_an_object_store_of_two_racing_exports_one_commits_whole(tmp_path, monkeypatch, overwrite):
    """memory:// (no rename, no locks): a second export starts while the first is between files. Without
    overwrite it finds the first's files and is refused; with overwrite it commits, and the first then stops
    (CheckpointExistsError) without touching the second's files. Either way one export is whole there."""
    _source(tmp_path / "a", 1)
    _source(tmp_path / "b", 2)
    dst = f"memory://export-race-{uuid.uuid4().hex[:8]}"
    if overwrite:
        export(tmp_path / "a", dst, **OPTIONS)
    real, second = safetensors_files.write_file, []

    def run_second() -> None:
        monkeypatch.setattr(safetensors_files, "write_file", real)
        try:
            export(tmp_path / "b", dst, overwrite=overwrite, **OPTIONS)
            second.append("committed")
        except CheckpointExistsError:
            second.append("refused")

    _after_file(monkeypatch, 2, run_second)
    if overwrite:
        with pytest.raises(CheckpointExistsError, match="another export was committed .* meanwhile"):
            export(tmp_path / "a", dst, overwrite=True, **OPTIONS)
    else:
        export(tmp_path / "a", dst, **OPTIONS)
    assert second == ["committed" if overwrite else "refused"]
    assert verify_export(dst, against=tmp_path / ("b" if overwrite else "a")).ok


def test_gc_removes_a_killed_exports_directory_and_the_rerun_starts_over(tmp_path):
    from tests.convert._kill import killed_after

    _source(tmp_path / "a", 1)
    dst = tmp_path / "dst"
    killed_after(2, safetensors_files, "write_file", lambda: export(tmp_path / "a", dst, **OPTIONS))
    [staging] = os.listdir(dst)
    assert gc(dst) == [staging]  # nobody holds it any more
    assert export(tmp_path / "a", dst, **OPTIONS).kept == ()
    _holds(dst, tmp_path / "a")


def test_two_exports_of_one_foreign_source_are_diff_equal(tmp_path):
    """The export_id is a digest of the headers, not random: exporting a safetensors file twice gives two exports
    that diff calls equal (their __metadata__ included)."""
    from safetensors.torch import save_file

    from shardckpt.offline.diff import diff

    save_file({"a": torch.ones(300), "b": torch.zeros(300)}, str(tmp_path / "src.safetensors"))
    for name in ("e1", "e2"):
        export(tmp_path / "src.safetensors", tmp_path / name, max_shard_size=1300)
    assert diff(tmp_path / "e1", tmp_path / "e2").equal


def test_on_an_object_store_exports_of_two_files_at_one_path_are_never_committed_as_one(tmp_path, monkeypatch):
    """Two different safetensors files at one path as given (``src.safetensors`` in two working directories):
    no source identity, so their headers differ only by the export_id, random for such a source. Export B
    writes 3 of its 4 files; A, killed after writing its first 3 files over B's, leaves them there; B must
    not commit that mix (it did when export_id was the headers' digest, alike for both: l0-l2 read from A,
    l3 from B, no error)."""
    from safetensors.torch import save_file

    for name, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        save_file({f"l{i}": torch.full((64, 64), value) for i in range(4)}, str(tmp_path / name / "src.safetensors"))
    fs = fsspec.filesystem("memory")
    dst, a_alone = (f"memory://foreign-{what}-{uuid.uuid4().hex[:8]}" for what in ("mix", "a"))
    monkeypatch.chdir(tmp_path / "a")
    export("src.safetensors", a_alone, **OPTIONS)  # A's files, as A writes them
    monkeypatch.chdir(tmp_path / "b")

    def a_writes_three_and_dies() -> None:
        for i in range(1, 4):
            name = f"model-0000{i}-of-00004.safetensors"
            fs.pipe_file(f"{dst}/{name}", fs.cat_file(f"{a_alone}/{name}"))

    _after_file(monkeypatch, 3, a_writes_three_and_dies)
    with pytest.raises(CheckpointExistsError, match="00001-of-00004.safetensors: another export wrote it meanwhile"):
        export("src.safetensors", dst, overwrite=True, **OPTIONS)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(dst, detail=False)) == [
        f"model-0000{i}-of-00004.safetensors" for i in range(1, 4)]  # A's; B removed its own file, no index
    with pytest.raises(CorruptCheckpointError, match="index model.safetensors.index.json is missing"):
        open_reader(dst)


@pytest.mark.parametrize("limit", [17_000, 10**9], ids=["sharded", "one-file"])
def test_on_an_object_store_a_failing_second_run_of_one_export_leaves_the_committed_one(tmp_path, monkeypatch,
                                                                                         limit):
    """Two runs of one export command (same source, same options: the same headers and index). B writes its
    first file; A runs whole meanwhile (sharded: it takes B's file as finished) and commits. B then fails
    (sharded: it sees A's index; one file: its upload fails). B's cleanup removed what it took for its own,
    A's committed files and index, byte for byte the same as B's; it must leave them."""
    _source(tmp_path / "a", 1)
    dst = f"memory://export-twin-{uuid.uuid4().hex[:8]}"
    options = {"max_shard_size": limit}
    real = safetensors_files.write_file

    def a_commits() -> None:
        monkeypatch.setattr(safetensors_files, "write_file", real)
        export(tmp_path / "a", dst, **options)

    if limit == 17_000:
        _after_file(monkeypatch, 1, a_commits)
        with pytest.raises(CheckpointExistsError, match="committed .* meanwhile"):
            export(tmp_path / "a", dst, **options)
    else:
        def fails(storage, path, *args) -> None:
            a_commits()
            raise OSError(5, "injected: the upload failed")

        monkeypatch.setattr(safetensors_files, "write_file", fails)
        with pytest.raises(OSError, match="injected"):
            export(tmp_path / "a", dst, **options)
    assert verify_export(dst, against=tmp_path / "a").ok


def test_on_an_object_store_a_failure_leaves_a_shardckpt_sources_files_for_the_rerun(tmp_path):
    """A failing export of a shardckpt checkpoint leaves its finished files (refused by every reader without
    their index): a second run of the same export may have taken them as its own; the rerun resumes them."""
    _source(tmp_path / "a", 1)
    dst = f"memory://export-failed-{uuid.uuid4().hex[:8]}"

    def interrupted(done: int, total: int) -> None:  # raised amid the third file
        if done > 2 * 64 * 64 * 4 + 4096:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export(tmp_path / "a", dst, progress=interrupted, slice_bytes=4096, **OPTIONS)
    with pytest.raises(CorruptCheckpointError, match="index model.safetensors.index.json is missing"):
        open_reader(dst)
    assert export(tmp_path / "a", dst, **OPTIONS).kept == ("model-00001-of-00004.safetensors",
                                                            "model-00002-of-00004.safetensors")
    assert verify_export(dst, against=tmp_path / "a").ok


@pytest.mark.parametrize("inside", ["", "/model-00001-of-00004.safetensors"])
def test_on_an_object_store_an_export_over_its_own_source_is_refused_before_anything_is_removed(tmp_path, inside):
    """``export URL URL --overwrite`` on an object store removed the old export (its own source) before reading
    it, then failed: nothing was left. (Local disk renames the old files away only at the commit.)"""
    _source(tmp_path / "a", 1)
    dst = f"memory://export-self-{uuid.uuid4().hex[:8]}"
    export(tmp_path / "a", dst, **OPTIONS)
    with pytest.raises(BadArgumentError, match="the source is in the destination.*export to another directory"):
        export(dst + inside, dst, overwrite=True, dtype="bfloat16", **OPTIONS)
    assert verify_export(dst, against=tmp_path / "a").ok
    export(dst, dst + "-v2", dtype="bfloat16", **OPTIONS)  # a sibling whose name only starts the same is not inside
    export(dst + "-v2", dst, overwrite=True, **OPTIONS)
    assert open_reader(dst).tensors()["l0"].dtype == torch.bfloat16
