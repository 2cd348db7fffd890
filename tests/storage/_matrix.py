"""The machinery of the writer x collector x kill matrix (``test_writer_matrix.py``): where the writers write
(local disk or S3, reset between cases), the verbs and the fingerprints of what they read, and ``Cases``: one
writer's boundaries (``_boundaries``) and the cases run at them, each judged against the output committed last.
A writer (``test_writer_matrix.Writer``) gives ``call(root, version, dst, options, second=False)``: the call
spec of writing ``version`` at ``dst``, which ``_boundaries._call`` (and the second writer's process) runs."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch

import shardckpt
from shardckpt.checkpoint.describe import describe, foreign_format
from shardckpt.checkpoint.verify import verify
from shardckpt.offline.convert import convert
from shardckpt.offline.diff import diff
from shardckpt.offline.export import export
from shardckpt.offline.verify_export import verify_export
from shardckpt.errors import CheckpointError
from shardckpt.io import open_storage
from tests.storage import _boundaries as bnd
from tests.storage._util import zeros_like_tree

VERSIONS = ("old", "A", "B")  # the output there before, the writer under test's, the second writer's


@dataclass(frozen=True)
class Event:
    """What a case does at its boundary: ``action`` (``_boundaries.ACTIONS``); a second writer writes version
    ``second`` (``"A"``: the very command under test, run twice); ``then_kill``: the writer under test is
    killed as well, once the file it was opening at the boundary is written (what it leaves over the second
    writer's output)."""

    action: str
    second: str = "B"
    then_kill: bool = False


EVENTS = {"gc": Event("gc"), "writer2": Event("writer2"), "twin": Event("writer2", second="A"),
          "writer2-kill": Event("writer2", then_kill=True), "kill": Event("kill")}


# ---------------------------------------------------------------------------------------------------------
# Where: local disk or S3, with raw access to reset a path between cases


@dataclass
class Where:
    kind: str
    root: str  # of the writers' outputs
    options: dict | None
    copy_tree: Callable[[str, str], None]  # (from, to): replace ``to`` with a copy of ``from``
    files: Callable[[str], dict[str, bytes]]  # every file under a path (relative name -> bytes)


def _local_files(path: str) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                out[os.path.relpath(os.path.join(folder, name), path)] = f.read()
    return out


def _local_copy(src: str, dst: str) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    if os.path.exists(src):
        shutil.copytree(src, dst)


def where(kind: str, tmp_path: str, s3: tuple | None = None) -> Where:
    """Local disk at ``tmp_path``, or (``s3``: the S3 server and a bucket) a prefix named after it."""
    if kind == "local":
        return Where(kind, tmp_path, None, _local_copy, _local_files)
    server, bucket = s3
    fs = server.raw_fs

    def copy_tree(src: str, dst: str) -> None:
        fs.invalidate_cache()
        src, dst = src.removeprefix("s3://"), dst.removeprefix("s3://")
        if fs.exists(dst):
            fs.rm(dst, recursive=True)
        for key in fs.find(src) if fs.exists(src) else []:
            fs.copy(key, dst + key[len(src):])
        fs.invalidate_cache()

    def files(path: str) -> dict[str, bytes]:
        fs.invalidate_cache()
        path = path.removeprefix("s3://")
        keys = fs.find(path) if fs.exists(path) else []
        return {k[len(path) + 1:]: v for k, v in fs.cat(keys).items()} if keys else {}

    return Where(kind, f"s3://{bucket}/{os.path.basename(tmp_path)}", server.options(), copy_tree, files)


# ---------------------------------------------------------------------------------------------------------
# The verbs: each gives a fingerprint of what it read (or raises CheckpointError)


def _fingerprint(tree: Any) -> str:
    h = hashlib.sha256()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            t = node.detach().contiguous().cpu()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(node, dict):
            for k in sorted(node, key=str):
                if k != "__metadata__":  # an export's header names its source path
                    walk(node[k], f"{path}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}")
        else:
            h.update(f"{path}={node!r};".encode())

    walk(tree, "")
    return h.hexdigest()


def _verbs(template: dict, refs: dict[str, str], scratch: str) -> dict[str, Callable[[str, dict | None], Any]]:
    def load(path, options):
        sd = zeros_like_tree(template)
        shardckpt.load(sd, path, storage_options=options)
        return _fingerprint(sd)

    def inspect(path, options):
        info = describe(open_storage(path, options))
        return json.dumps([info["format"], [(t["name"], t["dtype"], t["shape"], t.get("crc32c"))
                                            for t in info["tensors"]]])

    def verify_(path, options):
        place = open_storage(path, options)
        ok = verify_export(place).ok if foreign_format(place) else verify(place).ok
        if not ok:
            raise CheckpointError("verify found problems")
        return "ok"

    def convert_(path, options):
        out = os.path.join(scratch, f"conv-{uuid.uuid4().hex[:8]}")
        try:
            convert(path, out, world_size=1, storage_options=options)
            return _fingerprint(shardckpt.load_full(out))
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def export_(path, options):
        out = os.path.join(scratch, f"exp-{uuid.uuid4().hex[:8]}")
        try:
            export(path, out, storage_options=options)
            return _fingerprint(shardckpt.load_full(out))
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def diff_(path, options):
        return tuple(v for v, ref in refs.items() if diff(open_storage(path, options), open_storage(ref, options)).equal)

    return {"load_full": lambda p, o: _fingerprint(shardckpt.load_full(p, storage_options=o)), "load": load,
            "inspect": inspect, "verify": verify_, "convert": convert_, "export": export_, "diff": diff_}


_NAME_IDS = re.compile(r"(?<=data-)[0-9a-f]{16}|(?<=\.export-(?:tmp|old)-)[0-9a-f]{12}|(?<=\.tmp-)[0-9a-f]{12}")


def _content(files: dict[str, bytes], keep: set[str]) -> str:
    """What the verbs' answers depend on: the files and their bytes, up to a consistent renaming of the
    generations and temporary-name tokens a writer draws at random (those in ``keep``, the initial state's,
    stay): two paths with one ``_content`` are the same checkpoint to every reader."""
    ids = sorted({m.group(0) for name in files for m in _NAME_IDS.finditer(name)} - keep)
    rename = {i: f"<{n}>" for n, i in enumerate(ids)}

    def norm(text: str) -> str:
        return _NAME_IDS.sub(lambda m: rename.get(m.group(0), m.group(0)), text)

    h = hashlib.sha256()
    for name in sorted(files, key=norm):
        data = files[name]
        for i, r in rename.items():
            data = data.replace(i.encode(), r.encode())
        h.update(f"{norm(name)}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def _read(verbs: dict, path: str, options: dict | None) -> dict[str, Any]:
    """Each verb's fingerprint of ``path``, or ``None`` where it refused (a CheckpointError)."""
    out = {}
    for name, verb in verbs.items():
        try:
            out[name] = verb(path, options)
        except CheckpointError:
            out[name] = None
    return out


# ---------------------------------------------------------------------------------------------------------
# One writer on one backend: its boundaries, then every case


class Cases:
    """One writer on one backend: the versions' reference outputs and what every verb reads of them, the
    writer's boundaries (``boundaries``), one case at a boundary (``run``), and its verdict (``judge``)."""

    def __init__(self, writer, where: Where, sources: str, server, scratch: str):
        self.w, self.where, self.sources, self.server, self.scratch = writer, where, sources, server, scratch
        self.dst = f"{where.root}/dst"
        self.pristine = f"{where.root}/pristine"
        self.events = os.path.join(scratch, "events")
        refs = {}
        for v in VERSIONS:
            refs[v] = f"{where.root}/ref-{v}"
            if v != "old" or writer.initial == "old":
                bnd._call(writer.call(sources, v, refs[v], where.options, second=True))
        if writer.initial == "old":
            where.copy_tree(refs["old"], self.pristine)
        else:
            del refs["old"]
        self.keep = {m.group(0) for name in where.files(self.pristine) for m in _NAME_IDS.finditer(name)}
        self.memo: dict[str, dict] = {}  # _content -> the verbs' answers
        template = shardckpt.load_full(refs["A"], storage_options=where.options)
        self.verbs = _verbs(template, refs, scratch)
        self.known = {v: _read(self.verbs, ref, where.options) for v, ref in refs.items()}
        for v, got in self.known.items():
            assert all(r is not None for r in got.values()), (v, got)  # every verb reads every version

    def boundaries(self) -> tuple[list[tuple[int | None, int, str]], int]:
        """(worker, k, label) of every operation of a run that nothing interrupts, and the position in that
        list of the operation that committed."""
        self.where.copy_tree(self.pristine, self.dst)
        self._fresh_events()
        outcome = self._run_writer(bnd.Spec(self.events))
        assert outcome == "ok", outcome
        ops, commit = [], None
        for e in bnd.events(self.events):
            if e[0] == "op":
                ops.append((None if e[1] == "-" else int(e[1]), int(e[2]), e[3]))
            elif e[0] == "commit":
                commit = len(ops) - 1
        assert ops and commit is not None, "the writer made no storage operation, or did not commit"
        return ops, commit

    def _fresh_events(self) -> None:
        if os.path.exists(self.events):
            os.unlink(self.events)

    def _run_writer(self, spec: bnd.Spec) -> str:
        """The writer under test, in this process (its workers: in theirs); its outcome."""
        call = self.w.call(self.sources, "A", self.dst, self.where.options)
        if self.w.workers:
            os.environ[bnd.ENV] = bnd.spec_env(spec)
        else:
            bnd.install(spec)
        try:
            bnd._call(call)
            return "ok"
        except CheckpointError as e:
            return f"refused {type(e).__name__}"
        except ChildProcessError as e:  # convert --workers: a worker killed
            return "killed" if spec.action == "kill" else f"error ChildProcessError: {e}"
        except Exception as e:  # noqa: BLE001 - a failure of the case
            return f"error {type(e).__name__}: {e}"
        finally:
            bnd.finish_second_writer()
            os.environ.pop(bnd.ENV, None)
            bnd.uninstall()

    def _killed(self, spec: bnd.Spec) -> str:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                bnd.install(spec)
                bnd._call(self.w.call(self.sources, "A", self.dst, self.where.options))
            except BaseException:  # noqa: BLE001 - the kill is the point; anything else is reported by status
                code = 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            return "killed"
        return f"error: exit status {os.WEXITSTATUS(status)} (not killed at its boundary)"

    def run(self, event: str, worker: int | None, k: int, kill_at: int | None = None) -> dict:
        """One case (``kill_at``: the boundary ``then_kill`` kills at); returns what happened and the verbs'
        verdicts."""
        self.where.copy_tree(self.pristine, self.dst)
        self._fresh_events()
        what = EVENTS[event]
        spec = bnd.Spec(self.events, at=k, action=what.action, worker=worker, kill_at=kill_at,
                        gc={"path": self.where.root if self.w.gc_run else self.dst,
                            "storage_options": self.where.options},
                        writer2=self.w.call(self.sources, what.second, self.dst, self.where.options, second=True),
                        server=self.server.address)
        killing = event == "kill" or kill_at is not None
        outcome = self._killed(spec) if killing and not self.w.workers else self._run_writer(spec)
        self.server.wait_idle()  # a second writer the killed one left waiting for its lock has ended too
        log = bnd.events(self.events)
        commits = sorted((int(e[2]), e[1]) for e in log if e[0] == "commit")
        last = commits[-1][1] if commits else None  # the role that committed last
        second = [" ".join(e[2:]) for e in log if e[0] == "writer2"]
        second = second[0] if second else None
        removed = [json.loads(" ".join(e[2:])) for e in log if e[0] == "gc"]
        content = _content(self.where.files(self.dst), self.keep)
        if content not in self.memo:
            self.memo[content] = _read(self.verbs, self.dst, self.where.options)
        got = self.memo[content]
        return {"outcome": outcome, "expected": {"A": "A", "B": what.second, "old": "old"}.get(last, self.w.initial),
                "second": second, "last_ok": {"A": outcome, "B": second}.get(last) == "ok",
                "removed": removed[0] if removed else None, "read": got}

    def judge(self, case: dict, event: str) -> tuple[str, list[str]]:
        """(the verdict: which version the verbs read, or refused; the problems)."""
        problems, seen = [], set()
        expected = case["expected"]
        for verb, fp in case["read"].items():
            if fp is None:
                seen.add("refused")
                continue
            matches = fp if verb == "diff" else tuple(v for v, known in self.known.items() if known[verb] == fp)
            if not matches:
                problems.append(f"{verb} read something that is no whole version (partial or mixed)")
            elif expected not in matches:
                problems.append(f"{verb} read {'/'.join(matches)}, but {expected} was committed last")
            seen.add(expected if expected in matches else "/".join(matches) or "PARTIAL")
        if "refused" in seen and expected != "none" and self.w.atomic:
            problems.append(f"refused, but {expected} was committed: it must stay readable")
        elif "refused" in seen and event == "twin" and self.w.identical_twins and case["last_ok"]:
            problems.append(f"refused, but {expected} was committed by a run that succeeded, and the other run "
                            "wrote the same bytes: the failing run removed what the committed one names")
        if case["outcome"].startswith("error"):
            problems.append(f"the writer failed: {case['outcome']}")
        if event == "gc" and case["outcome"] != "ok":
            problems.append(f"gc broke the live writer: {case['outcome']}")
        gc_ = case["removed"] or {}
        if gc_.get("error") and not gc_.get("checkpoint_error"):
            problems.append(f"gc failed: {gc_['error']}")
        if self.where.kind == "s3" and gc_.get("removed"):
            problems.append(f"gc removed {gc_['removed']} on S3, younger than its age limit")
        if case["second"] is not None and case["second"].startswith("error"):
            problems.append(f"the second writer failed: {case['second']}")
        return ("refused" if seen == {"refused"} else "+".join(sorted(seen))), problems

