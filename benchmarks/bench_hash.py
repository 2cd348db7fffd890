"""Content-hash throughput for incremental checkpoints (issue 39, docs/design/incremental.md), against CRC32C.

Candidates: CRC32C (``crc32c``, what every block already pays), xxh3-128 (``xxhash``), BLAKE3 (``blake3``,
keyed) and BLAKE2b-128 (``hashlib``, keyed). Each is measured three ways, medians of ``--repeats``:

- ``1 thread``: one call over the whole buffer (64 MiB and 1 GiB), the library's best case;
- ``x2 threads``: 2 threads (a save's ``files_per_rank`` writer threads, or ws 2's ranks), each streaming its own
  half of the buffer in 1 MiB blocks into the hash: what hashing unchanged chunks costs; shows whether the
  library releases the GIL (every one of these does);
- ``x2 + crc``: the same with CRC32C of each block first: what a writer pays per written byte;
- BLAKE3's own multithreading (``max_threads=2``) over one buffer.

Then the estimate for the issue's LoRA target (1 GiB frozen fp32 base + 2 % trainable with AdamW, ws 2: each
rank hashes its half of the base and writes its half of the changed bytes) against a full save, from a raw
write + fsync measured here (``--disk``) or given (``--write-gbps``).

    python benchmarks/bench_hash.py                 # 64 MiB and 1 GiB, 5 / 3 repeats (~1 min)
    python benchmarks/bench_hash.py --quick         # 64 MiB only, 3 repeats
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from _common import fsync_path, loadavg, median

from shardckpt.format import content_hash

BLOCK = 1 << 20  # the writer's checksum block (format.index.BLOCK_SIZE)
KEY = bytes(range(32))  # any 32 bytes: keying does not change the speed


def _crc(view: memoryview) -> None:
    import crc32c

    crc32c.crc32c(view)


def _xxh3(view: memoryview) -> None:
    import xxhash

    xxhash.xxh3_128_digest(view)


def _blake3(view: memoryview, threads: int = 1) -> None:
    import blake3

    blake3.blake3(view, key=KEY, max_threads=threads).digest(16)


def _blake2b(view: memoryview) -> None:
    hashlib.blake2b(view, digest_size=16, key=KEY).digest()


def _ours(view: memoryview) -> None:
    content_hash.chunk_hash(KEY, view)


ONE_SHOT = {"crc32c": _crc, "xxh3-128": _xxh3, "blake3": _blake3, "blake2b-128": _blake2b,
            f"shardckpt ({content_hash.ALGORITHM})": _ours}


def _streamer(name: str, with_crc: bool):
    """A function that streams a buffer block by block as a writer thread would: the hash updated with each block,
    after its CRC32C with ``with_crc`` (``crc32c`` alone: the writer's cost today)."""
    import crc32c

    def make():
        if name == "xxh3-128":
            import xxhash

            return xxhash.xxh3_128()
        if name == "blake3":
            import blake3

            return blake3.blake3(key=KEY)
        if name == "blake2b-128":
            return hashlib.blake2b(digest_size=16, key=KEY)
        if name.startswith("shardckpt"):
            return content_hash.ChunkHasher(KEY)
        return None

    def stream(view: memoryview) -> None:
        h = make()
        for lo in range(0, len(view), BLOCK):
            block = view[lo:lo + BLOCK]
            if with_crc or h is None:
                crc32c.crc32c(block)
            if h is not None:
                h.update(block)
        if h is not None:
            h.digest()

    return stream


def _timed(fn, view: memoryview) -> float:
    t0 = time.perf_counter()
    fn(view)
    return time.perf_counter() - t0


def _timed_threads(fn, views: list[memoryview]) -> float:
    threads = [threading.Thread(target=fn, args=(v,)) for v in views]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def measure(buf: np.ndarray, repeats: int) -> dict[str, dict[str, float]]:
    """GB/s per method and mode, medians of ``repeats`` (methods interleaved within each repeat)."""
    view = memoryview(buf).cast("B")
    half = len(view) // 2
    halves = [view[:half], view[half:]]
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, fn in ONE_SHOT.items():
            runs.setdefault((name, "1 thread"), []).append(_timed(fn, view))
            runs.setdefault((name, "x2 threads"), []).append(_timed_threads(_streamer(name, False), halves))
            runs.setdefault((name, "x2 + crc"), []).append(_timed_threads(_streamer(name, True), halves))
        runs.setdefault(("blake3", "max_threads=2"), []).append(_timed(lambda v: _blake3(v, 2), view))
    out: dict[str, dict[str, float]] = {}
    for (name, mode), secs in runs.items():
        out.setdefault(name, {})[mode] = len(view) / median(secs) / 1e9
    return out


def raw_write_gbps(directory: str, nbytes: int, repeats: int) -> float:
    """Sequential write + fsync of ``nbytes`` (the limit a full save is measured against), GB/s, median."""
    data = memoryview(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)).cast("B")
    secs = []
    for _ in range(repeats):
        path = os.path.join(directory, "bench_hash.raw")
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for lo in range(0, nbytes, 16 << 20):
                f.write(data[lo:lo + (16 << 20)])
        fsync_path(path)
        secs.append(time.perf_counter() - t0)
        os.unlink(path)
    return nbytes / median(secs) / 1e9


def lora_estimate(rates: dict[str, dict[str, float]], write_gbps: float, full_s: float | None = None) -> dict[str, dict]:
    """Seconds per save at ws 2 for the issue's LoRA workload. A full save writes every byte (at the raw write rate:
    optimistic for the full save, so the ratio is conservative); an incremental one hashes the unchanged base (each
    rank its half, so both cores: the ``x2 threads`` rate) and writes the changed bytes, hashing them as it goes
    (the writer's CRC is paid by both saves and left out)."""
    base = 1 << 30
    changed = base * 0.02 * 3  # the adapters (2 %), and AdamW's exp_avg and exp_avg_sq of them
    full = full_s or (base + changed) / (write_gbps * 1e9)
    out: dict = {"bytes": {"full": base + changed, "changed": changed}, "full_s": full}
    for name in rates:
        if name == "crc32c":
            continue
        rate = rates[name]["x2 threads"] * 1e9
        incr = base / rate + changed / (write_gbps * 1e9) + changed / rate
        out[name] = {"incremental_s": incr, "ratio": incr / full, "target": 0.15}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64 MiB only, 3 repeats")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--disk", default=tempfile.gettempdir(), help="where to time a raw write + fsync")
    p.add_argument("--write-gbps", type=float, default=None, help="skip the disk timing: use this rate")
    p.add_argument("--full-s", type=float, default=None,
                   help="a measured full save of ~1.06 GiB (s) to compare against, instead of the raw write's time "
                        "(benchmarks/README.md: 0.67 s in a quiet window)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    sizes = [64 << 20] if args.quick else [64 << 20, 1 << 30]
    results: dict = {"loadavg_before": loadavg(), "cpus": os.cpu_count(), "sizes": {}}
    rng = np.random.default_rng(0)
    for size in sizes:
        repeats = args.repeats or (3 if args.quick or size >= 1 << 30 else 5)
        buf = rng.integers(0, 1 << 63, size // 8, dtype=np.uint64)  # real pages, not one shared zero page
        results["sizes"][size] = measure(buf, repeats)
        del buf
        print(f"\n{size >> 20} MiB, GB/s, median of {repeats} (load average now {loadavg()})")
        modes = ["1 thread", "x2 threads", "x2 + crc", "max_threads=2"]
        print(f"{'method':<26}" + "".join(f"{m:>16}" for m in modes))
        for name, by_mode in results["sizes"][size].items():
            print(f"{name:<26}" + "".join(f"{by_mode[m]:>16.2f}" if m in by_mode else f"{'':>16}" for m in modes))
    write = args.write_gbps or raw_write_gbps(args.disk, 256 << 20, 3)
    rates = results["sizes"][sizes[-1]]
    est = lora_estimate(rates, write, args.full_s)
    results.update(write_gbps=write, lora=est, loadavg_after=loadavg())
    print(f"\nLoRA, ws 2 (1 GiB frozen fp32 base + 2 % trainable, AdamW): raw write + fsync {write:.2f} GB/s; "
          f"full save {est['full_s']:.2f} s ({est['bytes']['full'] / 2**20:.0f} MiB), changed "
          f"{est['bytes']['changed'] / 2**20:.1f} MiB")
    for name, e in est.items():
        if isinstance(e, dict) and "ratio" in e:
            print(f"  {name:<24} incremental {e['incremental_s']:.3f} s = {e['ratio']:.3f}x a full save "
                  f"(target <= {e['target']}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
