"""``CheckpointManager``: the training loop's one object for checkpoint tiers (docs/design/tiers.md, section 4).

    with CheckpointManager(TierConfig(local_dir=..., run_id=..., persistent_dir=..., persistent_every=50)) as ckpt:
        restored = ckpt.restore(state)          # None: a fresh start
        for step in range((restored.step if restored else 0) + 1, total + 1):
            train_step(state)
            ckpt.step(step, state)              # blocked only while staging, when due

Creating one is collective over the default group: the node map, a token for the peer servers, two gloo side
groups (lane W and restores; lanes R and P, shared), and each node leader's peer server. ``step``/``save`` stage
in the caller (as ``async_save``) and hand the rest to lane W; lane RP replicates, uploads when due and trims.
A failed tier-0 write or tier-2 upload raises on every rank at the next ``step``/``save``/``close``; a failed
replication is logged, the step stays unreplicated and training goes on."""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from shardckpt.checkpoint.load import load
from shardckpt.checkpoint.stage import StagingBuffers, stage
from shardckpt.dist.group import Failure, attempt, raise_failures, resolve_group, side_group
from shardckpt.errors import BadArgumentError, CheckpointError
from shardckpt.io import Storage
from shardckpt.tiers import local, restore_io
from shardckpt.tiers.config import TierConfig, TierConfigError
from shardckpt.tiers.lanes import Lanes, NodeState, persist_staged, persist_step, replicate, trim_node, write_step
from shardckpt.tiers.peer import PeerServer, default_peer_host
from shardckpt.tiers.restore import next_epoch
from shardckpt.tiers.topology import join

log = logging.getLogger("shardckpt.tiers")


@dataclass
class TierSave:
    """One step's save: ``committed`` (tier 0 on every node: True, or False when skipped for want of room),
    ``replicated`` (True, False when a replication failed, None without replicas or when a newer step was
    committed before its turn: latest wins) and ``persisted`` (tier 2;
    None when not due), each a ``concurrent.futures.Future``."""

    step: int
    committed: Future = field(default_factory=Future)
    replicated: Future = field(default_factory=Future)
    persisted: Future = field(default_factory=Future)

    def wait(self) -> None:
        for future in (self.committed, self.replicated, self.persisted):
            future.result()


class CheckpointManager:
    """Tiers of checkpoints over the default process group (see the module docstring)."""

    def __init__(self, config: TierConfig, process_group: Any = None):
        if process_group is not None:
            raise CheckpointError("CheckpointManager runs over the default process group for now")
        self.config = config
        self.group = resolve_group(None)
        self._write, self._copy = side_group(self.group), side_group(self.group)
        topo = join(self._write, config)
        root = local.run_root(config.local_dir, config.run_id)
        token = self._write.broadcast(secrets.token_hex(16) if self._write.rank == 0 else None)
        served = attempt(self._write.rank, lambda: _serve(root, token, config)) if topo.leader else None
        failed = isinstance(served, Failure)
        seen = self._write.all_gather((topo.node, served if failed else served.address if served else None))
        raise_failures([addr for _, addr in seen])  # a leader that cannot serve: every rank raises
        self._server = served
        if topo.leader:
            local.remove_debris(root)
        addresses = {node: addr for node, addr in seen if addr is not None}
        self.lanes = Lanes(config, topo, NodeState(root), self._write, self._copy, token, addresses, StagingBuffers())
        self.epoch: int | None = None
        self._w = ThreadPoolExecutor(1, thread_name_prefix="shardckpt-tier0")
        self._rp = ThreadPoolExecutor(1, thread_name_prefix="shardckpt-tier12")
        self._last: TierSave | None = None
        self._errors: list[BaseException] = []
        self._skipped: list[int] = []  # steps tier 0 had no room for (on_full="skip")
        self._failed: dict[int, str] = {}  # steps whose tier-0 write or tier-2 write failed: the error
        self._closed = False
        self._last_step: int | None = None  # saved or restored: a step saved again must come after it
        _live.add(self)

    # -- saving -------------------------------------------------------------------------------------------------

    def step(self, step: int, state: dict | Callable[[], dict]) -> TierSave | None:
        """Called every training step on every rank: saves when ``config.saves_locally(step)`` (uploads when
        ``config.persists(step)``), else returns None at once."""
        _check_step(step)
        return self.save(step, state) if self.config.saves_locally(step) else None

    def save(self, step: int, state: dict | Callable[[], dict]) -> TierSave:
        """Save ``step`` now (collective): returns once the state is staged; the tiers follow in the background.
        Steps must increase (a step names its directories in every tier; the same name twice would race its own
        upload)."""
        _check_step(step)
        if self._last_step is not None and step <= self._last_step:
            raise BadArgumentError(f"step {step}: not after step {self._last_step}, the last one saved or restored; "
                                   "a CheckpointManager's steps must increase")
        self._finish_previous()
        if self.epoch is None:
            self.epoch = self._first_epoch()
        state = state() if callable(state) else state
        topo = self.lanes.topo
        meta = {"tiers": {"run_id": self.config.run_id, "epoch": self.epoch, "step": step,
                          "nodes": {n: list(r) for n, r in topo.node_ranks.items()}, "domains": topo.domains}}
        staged = stage(state, process_group=self._write.pg, metadata=meta, buffers=self.lanes.buffers)
        handle = TierSave(step)
        epoch = self.epoch

        def background() -> None:
            try:
                data = write_step(self.lanes, step, epoch, staged)
            except BaseException as e:
                self._failed[step] = repr(e)
                handle.committed.set_exception(e)
                handle.replicated.set_result(None)
                handle.persisted.set_result(None)
                raise
            handle.committed.set_result(data is not None)
            if data is None:
                self._skipped.append(step)
                handle.replicated.set_result(None)
                self._persist_skipped(step, staged, handle)
                return
            self._rp.submit(self._replicate_and_upload, step, data, handle)

        self._last, self._last_step = handle, step  # staged: this step is taken (a failed one may be retried)
        self._last_future = self._w.submit(background)
        return handle

    def _persist_skipped(self, step: int, staged: Any, handle: TierSave) -> None:
        """Lane W, a step skipped for want of room in tier 0: when due for tier 2, written there from the staging
        buffers (a failure raises on every rank at the next call, as a failed upload does)."""
        if not self.config.persists(step):
            handle.persisted.set_result(None)
            return
        try:
            done = persist_staged(self.lanes, step, staged)
        except BaseException as e:
            self._failed[step] = repr(e)
            handle.persisted.set_exception(e)
            raise
        handle.persisted.set_result(done)
        if done:
            self._persisted(step)
            log.warning("shardckpt tiers: step %d had no room in tier 0; written to tier 2 directly", step)

    def _persisted(self, step: int) -> None:
        """``step`` is in tier 2: the failures of older steps no longer leave tier 0 the only copy of the newest."""
        for older in [s for s in self._failed if s < step]:
            self._failed.pop(older, None)

    def _replicate_and_upload(self, step: int, data: bytes, handle: TierSave) -> None:
        """Lane RP for one committed step. Latest wins: when every rank has committed a newer step already, this
        one is not replicated (the newer one will be), nor uploaded if a newer due step is committed too."""
        try:
            with self.lanes.state.lock:  # committed ones only: a step in flight may yet be skipped for room
                newest, saved = self.lanes.state.newest, set(self.lanes.state.epochs)
            newest = min(self._copy.all_gather(newest))
            has_peers = any(self.lanes.topo.peers.values()) and newest == step
            handle.replicated.set_result(replicate(self.lanes, step, data) if has_peers else None)
            # a newer step saved and due (not a due step number never saved: steps may skip numbers)
            due_later = any(self.config.persists(s) for s in saved if step < s <= newest)
            if self.config.persists(step) and due_later:
                handle.persisted.set_result(None)
            elif self.config.persists(step):
                try:
                    done = persist_step(self.lanes, step, data)
                    if done:
                        self._persisted(step)
                    handle.persisted.set_result(done)
                except BaseException as e:
                    self._errors.append(e)
                    self._failed[step] = repr(e)
                    handle.persisted.set_exception(e)
            else:
                handle.persisted.set_result(None)
        finally:
            trim_node(self.lanes, step)

    def _redrive(self, step: int, data: bytes, storage: Storage) -> None:
        """Lane RP after a restore: upload the restored step to tier 2 again, from where the restore read it."""
        try:
            persist_step(self.lanes, step, data, storage)
            log.info("shardckpt tiers: step %d, restored but missing from tier 2, uploaded again", step)
        except Exception as e:  # noqa: BLE001 - tier 2 just lacks that step: training goes on (no crash loop)
            log.warning("shardckpt tiers: step %d, restored but missing from tier 2, could not be uploaded again "
                        "(%s); the next due step will be", step, e)
        finally:
            with self.lanes.state.lock:
                self.lanes.state.pinned.discard(step)

    def _finish_previous(self) -> None:
        """Wait for lane W (its staging buffers are reused); a failure of lane W, or of an upload, on any rank is
        raised on every rank (agreed over the idle lane-W group)."""
        future = getattr(self, "_last_future", None)
        error = future.exception() if future is not None else None
        if error is None and self._errors:
            error = self._errors.pop(0)
        if any(self._write.all_gather(error is not None)):
            raise error or CheckpointError("a tiers save failed on another rank")

    def wait(self) -> None:
        """Wait until every lane is idle (every step saved so far committed, replicated and uploaded when due)."""
        future = getattr(self, "_last_future", None)
        if future is not None:
            future.exception()
        self._rp.submit(lambda: None).result()

    def _first_epoch(self) -> int:
        facts = self._facts()
        return next_epoch(facts.layouts)

    # -- restoring ----------------------------------------------------------------------------------------------

    def _facts(self) -> restore_io.Facts:
        topo = self.lanes.topo
        return restore_io.gather_facts(self._write, topo.leader, topo.node, self.lanes.state.root,
                                       self.config, self._server.address if self._server else None)

    def restore(self, target: dict | Callable[[Storage], Any]) -> restore_io.Restored | None:
        """Fill ``target`` (a state dict, in place) or call ``target(storage)`` with the newest complete and
        verified step across the tiers, agreed by every rank (collective). None: nothing to restore."""
        self.wait()
        topo = self.lanes.topo
        facts = self._facts()
        loader = target if callable(target) else \
            (lambda storage: load(target, storage, process_group=self._write.pg))
        source = restore_io.Source(topo.node, self.lanes.state.root, self.lanes.token, self.config,
                                   self.config.peer_timeout_s)
        restored = restore_io.restore(self._write, source, facts, loader)
        self._last_step = restored.step if restored is not None else None
        if restored is not None and self.config.persists(restored.step) and restored.candidate not in facts.persistent:
            data = facts.manifests[restored.candidate]  # due in tier 2, not committed there: a kill during its upload
            with self.lanes.state.lock:  # every node's copy stays until the upload read it (no eviction, no trim)
                self.lanes.state.pinned.add(restored.step)
            self._rp.submit(self._redrive, restored.step, data, restored.storage)
        self.epoch = restore_io.after_restore(topo.leader, topo.node, self.lanes.state.root, facts,
                                              restored.candidate if restored else None)
        with self.lanes.state.lock:  # the epochs of the steps kept here, for the budget's and the trim's order
            state, last = self.lanes.state, restored.step if restored is not None else -1
            # tier 2's newer steps this restore found incomplete or corrupt: saving their numbers again leaves them
            # there (nothing is deleted on a verdict that may be a passing read error)
            state.rejected_tier2 = {c.step: c.digest for c in facts.persistent
                                    if restored is None or c > restored.candidate}
            # a restore in a manager that saved: the abandoned timeline's newer steps are gone from tier 0 (above),
            # and must not count as the newest committed or replicated one (latest wins, the trim's "safe")
            for step in [s for s in state.epochs if s > last]:
                del state.epochs[step]
            state.safe = {s for s in state.safe if s <= last}
            state.newest = last
            for candidate in facts.holdings.get(topo.node, {}):
                if restored is None or candidate <= restored.candidate:
                    state.epochs.setdefault(candidate.step, candidate.epoch)
        return restored

    # -- the end ------------------------------------------------------------------------------------------------

    def status(self) -> dict:
        """This rank's view: its node, the steps in its tier 0 and their bytes, the replicated (``safe``) and pinned
        ones, the bytes the last save moved, the epoch, the steps skipped for want of room and those whose tier-0
        or tier-2 write failed with no later step in tier 2 since (step -> error; a failed replication is only
        logged)."""
        state = self.lanes.state
        with state.lock:
            steps = local.steps_here(state.root)
            return {"node": self.lanes.topo.node, "steps": steps, "safe": sorted(state.safe),
                    "pinned": sorted(state.pinned), "moved": dict(state.moved), "epoch": self.epoch,
                    "tier0_bytes": sum(local.dir_bytes(os.path.join(state.root, local.step_dir(s))) for s in steps),
                    "skipped": list(self._skipped), "failed": dict(self._failed)}

    def close(self) -> None:
        """Finish every lane (the last due step reaches tier 2), raise a failure on every rank, stop the peer
        server and, unless ``keep_local_on_close``, remove this run's tier 0 (collective). Tier 0 stays when a
        lane failed (its steps may be the only copies) and when the manager is left by an exception."""
        self._close(keep_local=self.config.keep_local_on_close)

    def _close(self, keep_local: bool) -> None:
        if self._closed:
            return
        self._closed = True
        finished = False
        try:
            self.wait()
            self._finish_previous()
            finished = True
        finally:
            self._w.shutdown(wait=True)
            self._rp.shutdown(wait=True)
            # Agreed (and no peer reads from another node's server after this): a rank that leaves by an exception,
            # or saw a failure no later tier-2 step made good, keeps every node's tier 0, not only its own leader's.
            keep = any(self._write.all_gather(keep_local or not finished or bool(self._failed)))
            if self._server is not None:
                self._server.close()
                if not keep:
                    shutil.rmtree(self.lanes.state.root, ignore_errors=True)
            self.lanes.buffers.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # a crash: tier 0 holds what the restart restores (torchrun restarts every worker)
            try:
                self._close(keep_local=True)
            except Exception:  # noqa: BLE001 - the error that left the block is the one to see
                log.exception("shardckpt tiers: closing after an error failed")


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < local.MAX_STEPS:
        raise BadArgumentError(f"step {step!r}: must be an int in 0..{local.MAX_STEPS - 1} (it names the tiers' "
                               "step-NNNNNNNNN directories)")


def _serve(root: str, token: str, config: TierConfig) -> PeerServer:
    host = config.peer_host or default_peer_host()
    try:
        return PeerServer(root, token, host, config.peer_port)
    except OSError as e:
        raise TierConfigError(f"peer_host/peer_port: cannot serve this node's tier 0 on {host}:{config.peer_port} "
                              f"({e.strerror or e}): peer_host must be an IPv4 address of this node, peer_port a free "
                              "port (0: one the OS picks)") from None


_live: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _close_managers_at_exit() -> None:
    """A manager the program did not close finishes its lanes at exit, as ``async_save``'s savers do: the save in
    flight reaches tier 0 (and its replicas, and tier 2 when due) instead of being dropped with the process. No
    collective of ``close`` (other ranks may be gone, or training on); failures are printed. Runs before
    concurrent.futures refuses new work at exit (registered after it, run before it)."""
    for manager in (m for m in list(_live) if not m._closed):
        manager.wait()  # the lanes' collectives run on every rank's own lane threads: no rank needs to be here
        future = getattr(manager, "_last_future", None)
        for error in manager._errors + [e for e in [future.exception() if future else None] if e is not None]:
            print(f"shardckpt tiers: a save in flight at exit failed: {error!r}", file=sys.stderr, flush=True)


threading._register_atexit(_close_managers_at_exit)  # noqa: SLF001 - the hook concurrent.futures uses itself
