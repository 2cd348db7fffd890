"""The object collectives save, load and the state-dict layer need, over a torch process group or a world of one."""
from __future__ import annotations

import functools
import pickle
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from shardckpt.errors import CheckpointError

T = TypeVar("T")

# Pass as ``process_group`` to act as a world of one even when torch.distributed is initialised.
LOCAL = object()


@dataclass(frozen=True)
class Group:
    pg: Any
    rank: int
    world_size: int

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any] | None:
        """Rank 0 gets every rank's ``obj``; the others get None."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        # Rank 0's own object stays as it is, as in a world of one: not pickled there and back.
        dist.gather_object(None if self.rank == 0 else obj, out, dst=self._global(0), group=self.pg)
        if out is not None:
            out[0] = obj
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank ``r`` gets ``objs[r]`` from rank 0."""
        if self.world_size == 1:
            return objs[0]
        out = [None]
        sent = [None, *objs[1:]] if self.rank == 0 else None  # rank 0 keeps its own, as in a world of one
        dist.scatter_object_list(out, sent, src=self._global(0), group=self.pg)
        return objs[0] if self.rank == 0 else out[0]

    def broadcast(self, obj: Any) -> Any:
        """Every rank gets rank 0's ``obj``."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(0), group=self.pg)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank) if self.pg is not None else group_rank


def resolve_group(process_group: Any = None) -> Group:
    """The given group, else the default group if torch.distributed is initialised, else a world of one."""
    if process_group is LOCAL or (process_group is None and not (dist.is_available() and dist.is_initialized())):
        return Group(None, 0, 1)
    pg = process_group if process_group is not None else dist.group.WORLD
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


@dataclass(frozen=True)
class Failure:
    """A rank's exception, carried to the other ranks so that all of them raise instead of hanging."""

    rank: int
    error: BaseException
    text: str


def attempt(rank: int, fn: Callable[[], T]) -> T | Failure:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
        try:
            pickle.dumps(e)
            rebuild, args = e.__reduce__()[:2]
            rebuild(*args)  # what unpickling it on another rank does
        except Exception:  # noqa: BLE001 - one that does not travel (unpicklable, or not rebuilt: an __init__ of
            # other arguments) goes as its text: a rank failing to unpickle it would leave the others in a collective
            e = CheckpointError(f"{type(e).__name__}: {e}")
        return Failure(rank, e, traceback.format_exc())


def raise_failures(results: list[Any]) -> None:
    """Re-raise the first rank's failure on every rank, as the exception it was (same type and message),
    with a note naming the rank, and the original traceback when it crossed from another process."""
    failures = [r for r in results if isinstance(r, Failure)]
    if not failures:
        return
    first = failures[0]
    error = first.error
    note = f"shardckpt: raised on rank {first.rank}"
    if hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):  # Python >= 3.11
        error.add_note(note if error.__traceback__ is not None else f"{note}:\n{first.text}")
    raise error


def agreed(group: Group, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank of ``group``, then its outcome agreed: if it raised on any rank, every rank raises that
    (before any rank goes on, e.g. to read into its targets: a refusal leaves every rank's targets as they were)."""
    outcome = attempt(group.rank, fn)
    raise_failures(group.all_gather(outcome if isinstance(outcome, Failure) else None))
    return outcome


def side_group(group: Group, given: Any = None) -> Group:
    """A gloo group of ``group``'s ranks (same rank numbers), for collectives that run in a background
    thread while the caller's own collectives go on in ``group``: separate groups never interleave or
    deadlock. ``given``: one the caller made for this. Otherwise only for the default group: it is created
    here, collectively over every rank of the world. (Torch names a group made by only some ranks from
    how many groups each rank has seen, so such a group can hang when ranks have seen different numbers.)"""
    if given is not None:
        side = resolve_group(given)
        if dist.get_process_group_ranks(given) != dist.get_process_group_ranks(group.pg):
            raise ValueError("the background group must have the same ranks, in the same order, as the process group")
        return side
    if group.world_size == 1:
        return group
    if group.pg is not dist.group.WORLD:
        raise ValueError("an async save on a process group other than the default one needs a background group: "
                         "create a gloo group of the same ranks on every rank of the world "
                         "(dist.new_group(ranks, backend='gloo')) and pass it as background_group")
    pg = dist.new_group(dist.get_process_group_ranks(group.pg), backend="gloo")
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


# Called with the group about to be destroyed (None: every group) before torch destroys it; each returns an
# error to raise once the groups are gone, or None.
_BEFORE_DESTROY: list[Callable[[Any], BaseException | None]] = []
_hook_lock = threading.Lock()


def before_destroy(callback: Callable[[Any], BaseException | None]) -> None:
    """Have ``torch.distributed.destroy_process_group(group)`` call ``callback(group)`` first (``group`` None
    when every group goes), e.g. to finish collectives a background thread runs on a group about to go. The
    first error a callback returns is raised after the groups are destroyed (an exception a callback raises
    propagates at once, destroying nothing). A caller that bound ``destroy_process_group`` before this
    module was imported calls torch's own."""
    if not dist.is_available():  # no process groups to destroy
        return
    with _hook_lock:
        c10d = dist.distributed_c10d
        if not getattr(c10d.destroy_process_group, "_shardckpt_hook", False):
            hooked = _hooked(c10d.destroy_process_group)
            c10d.destroy_process_group = dist.destroy_process_group = hooked
        if callback not in _BEFORE_DESTROY:
            _BEFORE_DESTROY.append(callback)


def _hooked(destroy: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        errors = [e for e in (callback(group) for callback in list(_BEFORE_DESTROY)) if e is not None]
        destroy(group)
        if errors:
            raise errors[0]

    destroy_process_group._shardckpt_hook = True  # type: ignore[attr-defined]
    return destroy_process_group


def destroys(group: Any, pg: Any) -> bool:
    """Whether ``destroy_process_group(group)`` destroys ``pg`` (destroying the default group destroys all)."""
    return group is None or group is pg or group is dist.GroupMember.WORLD
