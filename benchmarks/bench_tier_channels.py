"""The numbers behind the local-tier design (issue 40, docs/design/tiers.md): where a node's fast copy can live,
and how its bytes can reach a peer.

Storage (this process, ``--mib`` MiB, written and read 16 MiB per call as ``checkpoint.writer`` does):

- ``memcpy``: a copy into a buffer that already exists (the limit for anything in memory);
- ``crc32c``: the checksum of the same bytes (what verifying a copy costs, per pass);
- ``shm write new`` / ``shm write reuse``: into a new ``/dev/shm`` file (pages allocated as written) / over the
  pages of an existing one of the same size; ``shm read``: ``preadv`` into a buffer; ``shm read by mmap``: a copy
  out of a memory map of the file;
- ``disk write`` / ``disk write+fsync``: a new file on ``--disk-dir``'s file system, without and with fsync;
  ``disk read warm`` (page cache) and ``disk read cold`` (that file's pages dropped first with
  ``posix_fadvise(DONTNEED)``, which leaves the rest of the page cache alone on a shared machine);
- ``tmpfs-dir write new`` / ``read``, with ``--tmpfs-dir``: the same on another tmpfs (one with huge pages).

Whole loads (``--mib`` MiB of fp32 tensors saved once with ``shardckpt.save``, then ``shardckpt.load`` into
preallocated tensors, checksums verified): ``load from shm``, ``load from disk warm``, ``load from disk cold``
(every file of the checkpoint dropped from the page cache first, as above).

Channels (two spawned processes on 127.0.0.1, timed on the receiver from a barrier to the last byte):

- ``gloo one send``: one ``dist.send`` of a ``--mib`` MiB CPU tensor; ``gloo 16 MiB pieces``: the same bytes
  as sequential 16 MiB sends;
- ``gloo file->file``: 16 MiB pieces sent from an ``mmap`` of a ``/dev/shm`` file and received into an ``mmap``
  of another (a replica written with no copy beside the socket's);
- ``gloo exchange``: both processes send and receive at once (``isend``/``irecv``: a ring of two nodes, k=1);
  throughput per direction;
- ``tcp socket``: ``sendall`` / ``recv_into`` on a plain socket (a side channel of our own, for comparison);
- ``tcp sendfile``: the sender's ``/dev/shm`` file sent with ``os.sendfile`` (no copy in user space), received
  with ``recv_into``; ``tcp ranged reads``: the receiver asks for 16 MiB ranges one after the other, each answered
  with ``sendfile`` (a peer node's tier 0 read as a ``Storage``).

Medians of ``--repeats`` runs (min in brackets). Loopback TCP is bounded by this machine's CPUs and memory, not a
network: on a cluster the NIC bounds the channels; what the numbers decide is the relative cost (gloo against a
socket of our own, one send against pieces, file to file) and memory against disk.

    python benchmarks/bench_tier_channels.py               # 256 MiB, 5 repeats (~1 min)
    python benchmarks/bench_tier_channels.py --quick       # 64 MiB, 3 repeats
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from _common import loadavg, median

PIECE = 16 << 20  # bytes per write/read call and per gloo message (checkpoint.writer.WRITE_SIZE)


def _pattern(nbytes: int) -> np.ndarray:
    """``nbytes`` of varied bytes (content does not matter to tmpfs or ext4, but zero pages could)."""
    block = np.frombuffer(os.urandom(1 << 20), np.uint8)
    return np.resize(block, nbytes)


def _write(path: str, data: np.ndarray, fsync: bool, truncate: bool = True) -> float:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    t = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        for lo in range(0, data.nbytes, PIECE):
            os.pwrite(fd, view[lo:lo + PIECE], lo)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _read(path: str, out: np.ndarray, cold: bool = False) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(out)
        t = time.perf_counter()
        for lo in range(0, out.nbytes, PIECE):
            os.preadv(fd, [view[lo:lo + PIECE]], lo)
        return time.perf_counter() - t
    finally:
        os.close(fd)


def _mmap_read(path: str, out: np.ndarray) -> float:
    """Map the file and copy from the mapping (page faults instead of read calls)."""
    t = time.perf_counter()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        np.copyto(out, np.frombuffer(mapped, np.uint8))
    return time.perf_counter() - t


def storage(nbytes: int, repeats: int, disk_dir: str, tmpfs_dir: str | None = None) -> dict[str, list[float]]:
    from shardckpt.format.checksum import crc32c

    src, dst = _pattern(nbytes), np.empty(nbytes, np.uint8)
    dst[:] = src  # touch its pages once
    shm = os.path.join("/dev/shm", f"bench-tier-{os.getpid()}.bin")
    disk = os.path.join(disk_dir, f"bench-tier-{os.getpid()}.bin")
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        times.setdefault(name, []).append(fn())

    def copy() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t

    def checksum() -> float:
        t = time.perf_counter()
        crc32c(memoryview(src))
        return time.perf_counter() - t

    try:
        for _ in range(repeats):
            timed("memcpy", copy)
            timed("crc32c", checksum)
            _remove(shm)
            timed("shm write new", lambda: _write(shm, src, fsync=False))
            timed("shm write reuse", lambda: _write(shm, src, fsync=False, truncate=False))
            timed("shm read", lambda: _read(shm, dst))
            timed("shm read by mmap", lambda: _mmap_read(shm, dst))
            if tmpfs_dir:
                other = os.path.join(tmpfs_dir, os.path.basename(shm))
                timed("tmpfs-dir write new", lambda: _write(other, src, fsync=False))
                timed("tmpfs-dir read", lambda: _read(other, dst))
                _remove(other)
            _remove(shm)
            _remove(disk)
            timed("disk write", lambda: _write(disk, src, fsync=False))
            _remove(disk)
            timed("disk write+fsync", lambda: _write(disk, src, fsync=True))
            timed("disk read warm", lambda: _read(disk, dst))
            timed("disk read cold", lambda: _read(disk, dst, cold=True))
            _remove(disk)
    finally:
        _remove(shm)
        _remove(disk)
    return times


def loads(nbytes: int, repeats: int, disk_dir: str) -> dict[str, list[float]]:
    import shutil

    import torch

    import shardckpt

    n = nbytes // 4 // 8
    state = {f"t{i}": torch.randn(n) for i in range(8)}
    target = {k: torch.empty_like(v) for k, v in state.items()}
    places = {"shm": os.path.join("/dev/shm", f"bench-tier-load-{os.getpid()}"),
              "disk": os.path.join(disk_dir, f"bench-tier-load-{os.getpid()}")}
    times: dict[str, list[float]] = {}

    def load(path: str) -> float:
        t = time.perf_counter()
        shardckpt.load(target, path)
        return time.perf_counter() - t

    try:
        for path in places.values():
            shardckpt.save(state, path)
        for _ in range(repeats):
            times.setdefault("load from shm", []).append(load(places["shm"]))
            times.setdefault("load from disk warm", []).append(load(places["disk"]))
            _drop(places["disk"])
            times.setdefault("load from disk cold", []).append(load(places["disk"]))
        if not all(torch.equal(state[k], target[k]) for k in state):
            raise RuntimeError("a load differs from what was saved")
    finally:
        for path in places.values():
            shutil.rmtree(path, ignore_errors=True)
    return times


def _drop(root: str) -> None:
    """Drop every file below ``root`` from the page cache (fsync first: dirty pages stay)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _channel_rank(rank: int, world: int, nbytes: int, repeats: int, out: str, tcp_port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    peer = 1 - rank
    data = torch.from_numpy(_pattern(nbytes)) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {}

    def timed(name: str, body) -> None:
        dist.barrier()
        t = time.perf_counter()
        body()
        dt = time.perf_counter() - t
        got = [None, None]
        dist.all_gather_object(got, dt)
        times.setdefault(name, []).append(got[1])  # the receiver's view: until its last byte arrived

    def one() -> None:
        dist.send(data, peer) if rank == 0 else dist.recv(data, peer)

    def pieces(buf: torch.Tensor) -> None:
        for lo in range(0, nbytes, PIECE):
            piece = buf[lo:lo + PIECE]
            dist.send(piece, peer) if rank == 0 else dist.recv(piece, peer)

    shm = f"/dev/shm/bench-tier-chan-{os.getpid()}.bin"
    with open(shm, "wb") as f:
        f.truncate(nbytes)
        if rank == 0:
            f.write(data.numpy().tobytes())
    fd = os.open(shm, os.O_RDWR)
    mapped = mmap.mmap(fd, nbytes)
    file_tensor = torch.frombuffer(mapped, dtype=torch.uint8)
    mine = torch.from_numpy(_pattern(nbytes))
    theirs = torch.empty(nbytes, dtype=torch.uint8)

    def exchange() -> None:
        works = []
        for lo in range(0, nbytes, PIECE):
            works.append(dist.isend(mine[lo:lo + PIECE], peer))
            works.append(dist.irecv(theirs[lo:lo + PIECE], peer))
        for w in works:
            w.wait()

    sock = _tcp_pair(rank, tcp_port)
    sock_buf = memoryview(data.numpy())

    def tcp() -> None:
        if rank == 0:
            sock.sendall(sock_buf)
        else:
            view, got = sock_buf, 0
            while got < nbytes:
                got += sock.recv_into(view[got:], min(nbytes - got, PIECE))
        sock.sendall(b"k") if rank == 1 else sock.recv(1)  # both sides done before the clock stops

    served = os.open(shm, os.O_RDONLY)  # rank 0 serves its file, rank 1 reads it into memory

    def sendfile_whole() -> None:
        if rank == 0:
            _sendfile(sock, served, 0, nbytes)
        else:
            _recv_exactly(sock, memoryview(theirs.numpy()), nbytes)
        sock.sendall(b"k") if rank == 1 else sock.recv(1)

    def ranged() -> None:  # what a peer's Storage.read_into would do: ask for a range, receive it into place
        view = memoryview(theirs.numpy())
        for lo in range(0, nbytes, PIECE):
            n = min(PIECE, nbytes - lo)
            if rank == 1:
                sock.sendall(lo.to_bytes(8, "little") + n.to_bytes(8, "little"))
                _recv_exactly(sock, view[lo:lo + n], n)
            else:
                head = bytearray(16)
                _recv_exactly(sock, memoryview(head), 16)
                _sendfile(sock, served, int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little"))

    for _ in range(repeats):
        timed("tcp sendfile (shm file -> memory)", sendfile_whole)
        timed("tcp ranged reads (16 MiB requests)", ranged)
        timed("gloo one send", one)
        timed("gloo 16 MiB pieces", lambda: pieces(data))
        timed("gloo file->file", lambda: pieces(file_tensor))
        timed("gloo exchange", exchange)
        timed("tcp socket", tcp)
    from shardckpt.format.checksum import crc32c

    digests = [None, None]
    dist.all_gather_object(digests, crc32c(mapped))
    if digests[0] != digests[1]:
        raise RuntimeError("the file received differs from the one sent")
    del file_tensor
    os.close(served)
    mapped.close()
    os.close(fd)
    sock.close()
    os.remove(shm)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def _sendfile(sock: socket.socket, fd: int, offset: int, count: int) -> None:
    while count:
        sent = os.sendfile(sock.fileno(), fd, offset, count)
        offset, count = offset + sent, count - sent


def _recv_exactly(sock: socket.socket, view: memoryview, n: int) -> None:
    got = 0
    while got < n:
        got += sock.recv_into(view[got:n], n - got)


def _tcp_pair(rank: int, port: int) -> socket.socket:
    if rank == 0:
        with socket.create_server(("127.0.0.1", port)) as server:
            conn, _ = server.accept()
    else:
        for _ in range(200):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def channels(nbytes: int, repeats: int) -> dict[str, list[float]]:
    from _common import spawn_gloo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        spawn_gloo(2, _channel_rank, nbytes, repeats, out, port)
        with open(out) as f:
            return json.load(f)
    finally:
        os.remove(out)


def _row(name: str, samples: list[float], nbytes: int, per_direction: bool = False) -> dict:
    med, low = median(samples), min(samples)
    return {"name": name, "median_s": med, "min_s": low, "gb_per_s": nbytes / med / 1e9,
            "gb_per_s_best": nbytes / low / 1e9, "per_direction": per_direction}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--disk-dir", default=os.environ.get("BENCH_DIR", tempfile.gettempdir()))
    ap.add_argument("--tmpfs-dir", help="another tmpfs to compare with /dev/shm, e.g. one mounted with "
                    "huge=within_size (mount -t tmpfs -o size=2g,huge=within_size tmpfs DIR)")
    ap.add_argument("--no-load", action="store_true", help="leave out the whole shardckpt loads")
    ap.add_argument("--no-channels", action="store_true", help="leave out the two-process channels")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.repeats = 64, 3
    nbytes = args.mib << 20
    print(f"# {args.mib} MiB, {args.repeats} repeats, disk dir {args.disk_dir}; load average {loadavg()}",
          file=sys.stderr)
    rows = [_row(k, v, nbytes) for k, v in storage(nbytes, args.repeats, args.disk_dir, args.tmpfs_dir).items()]
    if not args.no_load:
        rows += [_row(k, v, nbytes) for k, v in loads(nbytes, args.repeats, args.disk_dir).items()]
    if not args.no_channels:
        rows += [_row(k, v, nbytes, k == "gloo exchange") for k, v in channels(nbytes, args.repeats).items()]
    if args.json:
        print(json.dumps({"mib": args.mib, "repeats": args.repeats, "rows": rows, "loadavg": loadavg()}, indent=1))
        return 0
    print(f"| {args.mib} MiB | median s (min) | GB/s (best) |")
    print("|---|---|---|")
    for r in rows:
        label = r["name"] + (" (per direction)" if r["per_direction"] else "")
        print(f"| {label} | {r['median_s']:.3f} ({r['min_s']:.3f}) | {r['gb_per_s']:.2f} ({r['gb_per_s_best']:.2f}) |")
    print(f"# load average after: {loadavg()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
