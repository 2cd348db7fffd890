"""How an export's files reach their names, so that no reader, collector or second writer ever takes part of
an export for a whole one, and a failed export never leaves its destination without the old export and
without the new one (issue 34, items 1 and 4). ``export`` plans the files; this module puts them in place.

**Local disk.** Every file, the index too, is written in this export's own directory
``.export-tmp-<token>/``, which it holds (an exclusive ``flock``) until it ends, so that ``gc`` and another
export's cleanup leave it and its files alone (``checkpoint.gc``). No file gets its final name before the
last one is whole. Then, under an exclusive lock on the destination (one export commits there at a time, so
two never mix), the old export's files are moved aside into that directory, the new ones renamed into place,
the index (or the one file) last, and the directory removed with the old files. The old index goes first: a
directory of shards without their index is refused by every reader
(``formats.safetensors.refuse_lone_shard``). A failure on the way moves everything back, so the old export
is whole again; a kill inside those few renames leaves no index, which no reader takes for an export, and
the rerun finishes it.

**Resume.** A killed export's directory is held by nobody: a rerun of the same source and plan holds it, takes
each file in it that is exactly the file it would write (its size and header,
``safetensors_files.is_written``; the header holds the source's identity), and writes only the others. A
file has its name in that directory only once it is durable: it is written as ``<name>.part`` and renamed
after its close (fsync), so that a machine's crash, which can leave a file its full size with blocks never
written (safetensors has no checksum to tell), never leaves one that a rerun takes. Files under their final
names without an index are what a kill during the commit's renames leaves (the index is renamed last): they
are kept the same way, in place.

**Object stores** have no rename and no locks: each file is written at its name (an object appears only
once its upload completes), the old export's files removed before, the index last and exclusively (the old
one is gone: one there is another export's). A second export at the same path is seen before each file and
around the commit (an index appeared, a file is no longer ours): the export then stops. Its files carry an
``export_id`` that the index names, so that a reader refuses a mix of two exports' files that a race left
(``formats.safetensors``), never reading it as one export; it is random where the source has no identity,
so that two exports of different files at one path as given are never taken for each other
(``export_id``). A failing export removes nothing an index of another export names: the index only where it
put it itself, and its files only where their ``export_id`` is random (no other export takes those for its
own); an export of a shardckpt checkpoint leaves its files, which a second run of the same command may have
taken as finished and committed, and which a rerun resumes (``_clean_up``).
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from shardckpt.checkpoint.gc import EXPORT_STAGING, EXPORT_TEMP
from shardckpt.checkpoint.persist import OutputWriter, write_files
from shardckpt.dist.group import raise_failures
from shardckpt.offline import safetensors_files
from shardckpt.offline.safetensors_files import SINGLE_FILE, is_written
from shardckpt.errors import BadArgumentError, CheckpointError, CheckpointExistsError
from shardckpt.formats.safetensors_header import EXPORT_ID_KEY, INDEX_NAME
from shardckpt.io import LocalStorage, Storage


@dataclass(frozen=True)
class PlannedFile:
    name: str
    header: bytes
    members: Sequence  # export's output tensors, in file order

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.members)


Write = Callable[[Storage, str, PlannedFile], None]  # writes the file whole at a path


@dataclass(frozen=True)
class Beside:
    """The small files written beside the weights (``export --config``: name -> bytes), in place before the
    index (or the one file), and the ones there now that they replace or remove (moved aside, back on failure)."""

    files: Mapping[str, bytes] = field(default_factory=dict)
    stale: Sequence[str] = ()


def export_id(headers: Sequence[bytes], content: str | None) -> str:
    """What names one export: a digest of its files' headers (names, dtypes, shapes, adapter) and the source's
    ``content`` (``resume.content_identity``): two exports of equal weights get the same id, and identical ids
    mean identical bytes, so a rerun resumes and a mix of two such exports' files is harmless. Random for a
    source without one (``content`` None): its headers hold only names, dtypes and shapes, which two different
    sources can share, and their exports' files must never be taken for each other's. Readers do not present
    it among the plain values (``formats.safetensors``), so two exports stay ``diff``-equal."""
    nonce = uuid.uuid4().bytes if content is None else content.encode()
    return hashlib.sha256(b"".join(headers) + nonce).hexdigest()[:16]


def index_bytes(files: Sequence[PlannedFile], total: int, ident: str, counted: Mapping[str, int] = {}) -> bytes | None:
    """The ``model.safetensors.index.json`` of a sharded export (None for one file); ``counted``: more
    metadata (``total_parameters``, as ``save_pretrained`` writes it)."""
    if len(files) == 1:
        return None
    index = {"metadata": {**counted, "total_size": total, EXPORT_ID_KEY: ident},
             "weight_map": {t.name: f.name for f in files for t in f.members}}
    return (json.dumps(index, indent=2) + "\n").encode()


def unfinished_error(storage: Storage, old: list[str]) -> CheckpointExistsError:
    return CheckpointExistsError(f"{storage.url(old[0])}: an unfinished export of another source or with other "
                                 f"options already exists at {storage.root} ({len(old)} files); pass "
                                 "overwrite=True to replace it")


@dataclass(frozen=True)
class ExportFiles:
    """What an export puts at its destination (``export`` plans it) and what is there now."""

    files: Sequence[PlannedFile]
    index: bytes | None  # None: one file, no index
    beside: Beside
    old: list[str]  # the export files at the destination now, none of them a committed export unless overwrite
    overwrite: bool
    resumable: bool  # the source has an identity: the files a killed run finished are kept


class LocalExport(OutputWriter):
    """Local disk (see the module's docstring): each file written in this export's held directory, then all renamed
    into place under a lock, the index last. ``kept``: the names adopted from a killed run (``skip`` is told of
    each); ``write(storage, path, file)`` writes one file whole."""

    def __init__(self, storage: LocalStorage, planned: ExportFiles, write: Write, skip: Callable[[PlannedFile], None],
                 token: str):
        self.storage, self.planned, self.write_file, self.skip, self.token = storage, planned, write, skip, token
        self.stage: _Stage | None = None
        self.committed = False

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(self.stage.kept) if self.stage is not None else ()

    def begin(self) -> None:
        planned = self.planned
        self.stage = _Stage(self.storage, self.token)
        if planned.resumable:
            no_export = INDEX_NAME not in planned.old and SINGLE_FILE not in planned.old
            for f in self.stage.adopt(planned.files, finals_too=no_export):
                self.skip(f)
        if planned.old and not planned.overwrite and not self.stage.kept:
            raise unfinished_error(self.storage, planned.old)

    def write(self) -> None:
        stage = self.stage
        write_files([f for f in self.planned.files if f.name not in stage.ready],
                    lambda f: stage.write(f, self.write_file), 1)

    def commit(self, shares: list) -> None:
        raise_failures(shares)
        stage, planned = self.stage, self.planned
        for name, data in planned.beside.files.items():
            self.storage.put_atomic(stage.path(name), data)
            stage.ready[name] = stage.path(name)
        if planned.index is not None:
            self.storage.put_atomic(stage.path(INDEX_NAME), planned.index)
            stage.ready[INDEX_NAME] = stage.path(INDEX_NAME)
        stage.commit(list(planned.beside.files) + [f.name for f in planned.files], planned.overwrite,
                     planned.beside.stale)
        self.committed = True

    def end(self) -> None:
        if self.stage is not None:
            self.stage.close()
        if self.committed:  # what killed exports left, nobody's any more
            for name in self.storage.list_dirs() + self.storage.list_files():
                if EXPORT_STAGING.match(name) or EXPORT_TEMP.match(name):
                    self.storage.remove_abandoned(name, 0.0)


class _Stage:
    """This export's directory ``.export-tmp-<token>/`` at local ``storage``, held exclusively while it lives
    (gc and other exports leave it alone; its files need no lock of their own), and the export's files: final
    name -> the path it has now."""

    def __init__(self, storage: LocalStorage, token: str):
        self.storage, self.dir = storage, f".export-tmp-{token}"
        # Waiting: another export may hold it for a moment, taking it for a killed one's (and remove it).
        self.hold = storage.hold_dir(self.dir, exclusive=True, wait=True)
        self.ready: dict[str, str] = {}
        self.kept: list[str] = []

    def path(self, name: str) -> str:
        return f"{self.dir}/{name}"

    def write(self, f: PlannedFile, write: Write) -> None:
        """File ``f`` written whole as ``<name>.part`` and closed (fsync), then renamed to ``<name>``: a file
        has its name here only once it is durable, the only files a rerun adopts."""
        write(self.storage, self.path(f"{f.name}.part"), f)
        safetensors_files.rename(self.storage, self.path(f"{f.name}.part"), self.path(f.name))
        self.ready[f.name] = self.path(f.name)

    def adopt(self, files: Sequence[PlannedFile], finals_too: bool) -> list[PlannedFile]:
        """Take, as this export's, the files a killed run left that are exactly ones of ``files``: from its
        directory (held meanwhile, then removed; its ``.part`` files, perhaps not durable, are not taken), or
        (``finals_too``: no export is committed here) under their final names, where a kill during the
        commit's renames leaves them (older versions' files there have no ``export_id``: never taken).
        Returns those taken."""
        taken = []
        for d in [n for n in self.storage.list_dirs() if EXPORT_STAGING.match(n) and n != self.dir]:
            try:
                hold = self.storage.hold_dir(d, exclusive=True)
            except CheckpointError:
                continue  # a live export's
            try:
                for f in files:
                    if f.name not in self.ready and self._same(f"{d}/{f.name}", f):
                        safetensors_files.rename(self.storage, f"{d}/{f.name}", self.path(f.name))
                        self.ready[f.name] = self.path(f.name)
                        taken.append(f)
                self.storage.remove_dir(d)
            finally:
                hold.release()
        for f in files:
            if finals_too and f.name not in self.ready and self._same(f.name, f):
                self.ready[f.name] = f.name  # in place: no reader takes it for an export without its index
                taken.append(f)
        self.kept = [f.name for f in files if f in taken]
        return taken

    def _same(self, path: str, f: PlannedFile) -> bool:
        try:
            return self.storage.exists(path) and is_written(self.storage, path, f.header, f.members)
        except CheckpointError:
            return False

    def commit(self, names: list[str], overwrite: bool, stale: Sequence[str] = ()) -> None:
        """Under the directory's lock: the old export (and ``stale``, files beside it) moved aside into this
        export's directory, the new files in place (the index, or the one file, last); everything moved back if
        a step fails."""
        lock = self.storage.hold_dir("", exclusive=True, wait=True)
        try:
            old = safetensors_files.existing_export(self.storage)
            if not overwrite and (INDEX_NAME in old or SINGLE_FILE in old):
                raise _committed_meanwhile(self.storage)
            last = INDEX_NAME if INDEX_NAME in self.ready else SINGLE_FILE
            ours = set(self.ready.values())
            # The old index first (existing_export's order); one file replaces its old self atomically.
            moves = [(n, self.path(f"{n}.old")) for n in old if n not in ours and not (n == SINGLE_FILE == last)]
            moves += [(n, self.path(f"{n}.old")) for n in stale if self.storage.exists(n)]
            moves += [(self.ready[n], n) for n in names + [INDEX_NAME] * (last == INDEX_NAME) if self.ready[n] != n]
            done: list[tuple[str, str]] = []
            try:
                for src, dst in moves:
                    safetensors_files.rename(self.storage, src, dst)
                    done.append((src, dst))
            except BaseException:
                for src, dst in reversed(done):  # back as it was: the old export whole again
                    try:
                        safetensors_files.rename(self.storage, dst, src)
                    except OSError:
                        pass
                raise
            finally:
                self.storage.sync_dir("")
        finally:
            lock.release()

    def close(self) -> None:
        """This export's directory removed: what is left there, the old export's files after a commit, the new
        ones after a failure."""
        self.storage.remove_dir(self.dir)
        self.hold.release()


def refuse_own_source(storage: Storage, source: Storage, src: str) -> None:
    """An object store's export with overwrite removes (or overwrites) the old export's files before it has read
    its source (no renames there): a source at or inside the destination would be gone before it is read."""
    if type(source) is not type(storage) or type(getattr(source, "fs", None)) is not type(getattr(storage, "fs", None)):
        return
    at, root = source.url("").rstrip("/"), storage.url("").rstrip("/")
    if at == root or at.startswith(f"{root}/"):
        raise BadArgumentError(f"{src}: the source is in the destination; on an object store, overwrite removes the "
                               "old export before the new one is written: export to another directory")


class RemoteExport(OutputWriter):
    """An object store: the stale old files removed first (the index first), then each file at its name, the
    index last; a failure removes what ``_clean_up`` says. A killed run's files under their names are kept
    where exactly what this run would write (not with ``overwrite``): ``kept``, their names."""

    def __init__(self, storage: Storage, planned: ExportFiles, write: Write, skip: Callable[[PlannedFile], None]):
        self.storage, self.planned, self.write_file, self.skip = storage, planned, write, skip
        self.names = [f.name for f in planned.files]
        self.finished: set[str] = set()
        self.written: list[PlannedFile] = []
        self.put = False  # whether the index there is the one this run put
        self.committed = False

    @property
    def kept(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n in self.finished)

    def begin(self) -> None:
        storage, planned = self.storage, self.planned
        self.finished = {f.name for f in planned.files if planned.resumable and not planned.overwrite
                         and f.name in planned.old and is_written(storage, f.name, f.header, f.members)}
        if planned.old and not planned.overwrite and not self.finished:
            raise unfinished_error(storage, planned.old)
        stale = sorted((n for n in planned.old if n not in self.names or n == INDEX_NAME),
                       key=lambda n: n != INDEX_NAME)
        for name in stale + list(planned.beside.stale):
            safetensors_files.remove(storage, name)

    def write(self) -> None:
        for f in self.planned.files:
            if f.name in self.finished:
                self.skip(f)
                continue
            _no_other_commit(self.storage, self.names)
            self.written.append(f)
            self.write_file(self.storage, f.name, f)

    def commit(self, shares: list) -> None:
        raise_failures(shares)
        storage, planned = self.storage, self.planned
        for name, data in planned.beside.files.items():  # before the index (or the one file's commit) is seen
            storage.put_atomic(name, data)
        if planned.index is not None:
            _no_other_commit(storage, self.names)
            _all_ours(storage, planned.files, "nothing committed")
            try:  # exclusive: the old index is gone, so one there now is another export's
                storage.put_atomic(INDEX_NAME, planned.index, exclusive=True)
            except FileExistsError:
                raise _committed_meanwhile(storage) from None
            self.put = True
            _all_ours(storage, planned.files, "its readers refuse the mix (export again)")
        self.committed = True

    def end(self) -> None:
        if not self.committed:
            _clean_up(self.storage, [] if self.planned.resumable else self.written, self.put, self.planned.index)


def _clean_up(storage: Storage, written: Sequence[PlannedFile], put: bool, index: bytes | None) -> None:
    """After a failure on an object store: the index this run put (a mix of two exports' files: its readers
    would refuse it), and ``written``, the files of an export with a random ``export_id`` (a source without
    identity) that are still its own: no other export takes those for its own, so no index of another names
    them as its files. A source with an identity leaves its files: a second run of the same export may have
    taken them as finished and committed them (their bytes are the same), and a rerun resumes them."""
    if put and _index_is(storage, index):  # (another export's, after an overwrite meanwhile, differs)
        safetensors_files.remove(storage, INDEX_NAME)
    for f in written:  # a file at that name may be another export's now
        if _still_ours(storage, f):
            safetensors_files.remove(storage, f.name)


def _all_ours(storage: Storage, files: Sequence[PlannedFile], what: str) -> None:
    """Every file is the one this export wrote: on an object store (no locks) a second export at the same path
    may have written over one."""
    for f in files:
        if not is_written(storage, f.name, f.header, f.members):
            raise CheckpointExistsError(f"{storage.url(f.name)}: another export wrote it meanwhile; {what}")


def _index_is(storage: Storage, index: bytes | None) -> bool:
    try:
        return storage.read_bytes(INDEX_NAME) == index
    except CheckpointError:
        return False


def _still_ours(storage: Storage, f: PlannedFile) -> bool:
    """Whether file ``f.name`` begins as ours (whole, or cut short by the failure) does."""
    try:
        head = bytearray(min(len(f.header), storage.file_size(f.name)))
        storage.read_into(f.name, 0, memoryview(head))
    except CheckpointError:  # not there (an upload aborted), or unreadable: nothing of ours to remove
        return False
    return f.header.startswith(bytes(head))


def _committed_meanwhile(storage: Storage) -> CheckpointExistsError:
    return CheckpointExistsError(f"{storage.url(INDEX_NAME)}: another export was committed at {storage.root} "
                                 "meanwhile; pass overwrite=True to replace it")


def _no_other_commit(storage: Storage, names: list[str]) -> None:
    """This export removed the old index (and a single file it does not write) first: one there now is another
    export's, committed meanwhile, and writing on would spoil it."""
    if storage.exists(INDEX_NAME) or (SINGLE_FILE not in names and storage.exists(SINGLE_FILE)):
        raise _committed_meanwhile(storage)
