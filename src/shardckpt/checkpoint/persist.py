"""The one write pipeline's last step: ``persist`` streams an output's files to storage and commits them, for
``save``, ``convert`` and ``export`` alike. What differs is the output format, a writer behind one seam
(``OutputWriter``): shardckpt's chunk files (``checkpoint.writer``: block checksums, indexes, a manifest; for a
save here, for a conversion ``offline.chunk_output`` with resume and the check against its source), safetensors
files (``offline.safetensors_output``) and a torch DCP directory (``offline.dcp_output``).

``persist(writer, group)`` runs, on every process of ``group`` (a world of one for the offline verbs unless spread):

1. ``writer.begin()`` on the coordinator, before any process writes (an exclusive hold on what the commit will
   name, a check that nothing was committed meanwhile); its failure is raised on every process;
2. ``writer.write()`` on every process: this process's files, written (``write_files``: one thread per file,
   ``threads`` at once, each file's pieces streamed a slice at a time) and durable; its result is gathered;
3. ``writer.commit(shares)`` on the coordinator: every process's share (or its ``Failure``), checked, then
   committed last and atomically (a manifest, an index, a ``.metadata``), or the failures raised;
4. ``writer.end()`` on every process, whatever happened: holds released, what a failure left removed.

Every process raises the first failure (``dist.group``), after the same collectives, so a group stays in step.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from shardckpt.dist.group import LOCAL, Failure, Group, attempt, raise_failures, resolve_group
from shardckpt.io import Storage
from shardckpt.io.local import one_thread_suits

F = TypeVar("F")
R = TypeVar("R")


class OutputWriter:
    """An output format behind ``persist``'s seam. ``write`` and ``commit`` are the format's; ``begin`` and
    ``end`` do nothing unless it needs them."""

    def begin(self) -> None:
        """The coordinator, before any process writes."""

    def write(self) -> Any:
        """This process's files, durable on return; the result goes to the coordinator's ``commit``."""
        raise NotImplementedError

    def commit(self, shares: list) -> None:
        """The coordinator: every process's ``write`` result (a ``Failure`` for one that failed), committed."""
        raise NotImplementedError

    def end(self) -> None:
        """Every process, after the commit or a failure."""


def persist(writer: OutputWriter, group: Group | None = None) -> None:
    """Write and commit ``writer``'s output over ``group`` (default: this process alone); see the module docstring."""
    group = group or resolve_group(LOCAL)
    try:
        if type(writer).begin is not OutputWriter.begin:
            begun = attempt(0, writer.begin) if group.is_coordinator else None
            raise_failures([group.broadcast(begun if isinstance(begun, Failure) else None)])
        shares = group.gather(attempt(group.rank, writer.write))
        outcome = attempt(0, lambda: writer.commit(shares)) if group.is_coordinator else None
        raise_failures([group.broadcast(outcome)])
    finally:
        writer.end()


def writer_threads(storage: Storage, files: int, nbytes: int) -> int:
    """How many of ``files`` (holding ``nbytes`` in all) to write to ``storage`` at once
    (``io.local.one_thread_suits``)."""
    return 1 if one_thread_suits(storage, nbytes) else files


def write_files(files: Sequence[F], write: Callable[[F], R], threads: int) -> list[R]:
    """``write(file)`` for every file, each in one writer thread (buffered writes to one file serialise on its
    lock, so files are the unit), ``threads`` at once; the results in ``files``' order. A failure is raised once
    the files being written end; the others are not begun."""
    if len(files) <= 1 or threads <= 1:
        return [write(f) for f in files]
    with ThreadPoolExecutor(min(threads, len(files)), thread_name_prefix="shardckpt-write") as pool:
        futures = [pool.submit(write, f) for f in files]
        try:
            return [future.result() for future in futures]
        except BaseException:  # the first failure stops the files not begun: nothing more is written for nothing
            pool.shutdown(wait=True, cancel_futures=True)
            raise
