"""Cold resharding load (saved at world size 2, loaded at world size 3): format v2 against the v1 code.

Format v2 checks every partial read of a chunk: the read is widened to whole checksum blocks around the
wanted bytes and every block's CRC32C is checked. Format v1 (the code of ``--base-rev``, default 1c852b6)
read only the wanted span and checked nothing. This measures what that costs on the load where nearly
every read is partial: ~1 GiB of fp32 transformer-shaped tensors saved by 2 gloo ranks (each its dim-0
chunk, or with ``--layout flat`` its even flat shard) and loaded by 3 (each its own dim-0 chunk / flat
shard, so every chunk read is partial).

Variants, each loaded by its own 3 ranks from a checkpoint written by the same code:

- ``base``: the ``--base-rev`` code (format v1), ``shardckpt.load`` with its defaults;
- ``v2``: the current code (format v2, 1 MiB blocks), ``verify_checksums=True`` (the default);
- ``v2-noverify``: the current code, same checkpoint, ``verify_checksums=False`` (reference);
- ``v2-<size>``: the current code with checksum blocks of another size (``--block-sizes``), verified.
  The block size is set by patching ``shardckpt.checkpoint.writer.BLOCK_SIZE`` in the saving processes.

Process layout: per code version one group of 2 saving processes and one group of 3 loading processes
(real processes, gloo on 127.0.0.1, ``PYTHONPATH`` pointing at that version's ``src``; each checks that it
imported the right ``shardckpt``). The parent drives them over pipes. Each checkpoint is saved once; the
loads are interleaved repeat by repeat, the order rotating from repeat to repeat, so that noise on this
shared machine hits every variant alike. Before every load: the targets are zeroed (outside the timing),
then the parent syncs and drops the page cache (root; otherwise a warning and the loads are warm). Timed:
in-process wall time of ``shardckpt.load`` after a barrier, max over the 3 ranks; CPU time (user+sys of
each process, all threads) summed over the ranks is reported next to it. The first repeat checks that
every variant loaded the right values (every element is a known function of its index); before it, each
group does one untimed, checked warm-up load (its first load pays for lazy imports and thread start-up).

Reported: median and minimum per variant, ratios to ``base`` on medians, on minimums and the median of
the per-repeat ratios; per block size, the index bytes per GiB of data and the bytes the widened reads
copy per byte wanted. Target: ``v2`` / ``base`` <= 1.05.

    python benchmarks/bench_reshard_load.py                      # ~1 GiB, 11 repeats (~2.5 min)
    python benchmarks/bench_reshard_load.py --quick              # ~0.25 GiB, 3 repeats
    python benchmarks/bench_reshard_load.py --base-src /tmp/shardckpt-base/src   # a checked-out baseline
    python benchmarks/bench_reshard_load.py --base-src /tmp/before/src --base-version 2   # before/after a change
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import can_drop_caches, drop_caches, loadavg, median, remove, verdict

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_WORLD, LOAD_WORLD = 2, 3
TARGET = 1.05
REPLY = "@@bench@@"
PHI = 0.6180339887498949
STEP = 1 << 22  # elements generated / checked per piece (bounds the float64 temporaries)


# ------------------------------------------------------------------------------------------- workload


def model_shapes(quick: bool) -> dict[str, list[int]]:
    """One Llama-7B-shaped layer (q/k/v/o, gate/up/down, two norms) and a second layer's attention:
    1.004 GiB fp32 (hidden 4096, intermediate 11008); ``quick``: hidden 2048, intermediate 5504 (0.25 GiB)."""
    h, i = (2048, 5504) if quick else (4096, 11008)
    shapes: dict[str, list[int]] = {}
    for w in ("q", "k", "v", "o"):
        shapes[f"layers.0.attn.{w}.weight"] = [h, h]
    shapes["layers.0.attn_norm.weight"] = [h]
    shapes["layers.0.mlp.gate.weight"] = [i, h]
    shapes["layers.0.mlp.up.weight"] = [i, h]
    shapes["layers.0.mlp.down.weight"] = [h, i]
    shapes["layers.0.mlp_norm.weight"] = [h]
    for w in ("q", "k", "v", "o"):
        shapes[f"layers.1.attn.{w}.weight"] = [h, h]
    return shapes


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_range(shape, layout: str, index: int, count: int) -> tuple[int, int]:
    """The row-major element range ``[start, stop)`` of shard ``index`` of ``count``: the dim-0 chunk
    (``torch.chunk`` semantics, as ``ShardedTensor.dim0_chunk``) or the even flat shard."""
    if layout == "dim0":
        rows = -(-shape[0] // count)
        cols = numel(shape[1:])
        return min(index * rows, shape[0]) * cols, min((index + 1) * rows, shape[0]) * cols
    size = -(-numel(shape) // count)
    return min(index * size, numel(shape)), min((index + 1) * size, numel(shape))


def read_amplification(shapes: dict, layout: str, block: int | None, itemsize: int = 4) -> tuple[int, int]:
    """(bytes the loading ranks read and check, bytes they want), modelled on ``reader.execute_read``:
    a read of a whole chunk is exact; a partial one is widened to whole blocks (``block=None``: v1, exact)."""
    read = wanted = 0
    for shape in shapes.values():
        for j in range(SAVE_WORLD):
            s, e = shard_range(shape, layout, j, SAVE_WORLD)
            length = (e - s) * itemsize
            for r in range(LOAD_WORLD):
                S, E = shard_range(shape, layout, r, LOAD_WORLD)
                lo, hi = (max(s, S) - s) * itemsize, (min(e, E) - s) * itemsize
                if hi <= lo:
                    continue
                wanted += hi - lo
                if block is not None and not (lo == 0 and hi == length):
                    lo, hi = lo // block * block, min(-(-hi // block) * block, length)
                read += hi - lo
    return read, wanted


def fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB"


# --------------------------------------------------------------------------------------------- worker


def _fill(out, start: int, k: int) -> None:
    """Element i of tensor k: frac(i * phi + k / 8) - 1/2 (exact in float64, then rounded to fp32)."""
    import torch

    for lo in range(0, out.numel(), STEP):
        hi = min(out.numel(), lo + STEP)
        v = torch.arange(start + lo, start + hi, dtype=torch.float64).mul_(PHI).add_(k / 8)
        out[lo:hi].copy_(v.sub_(v.floor()).sub_(0.5))


def _check(out, start: int, k: int) -> bool:
    import torch

    expect = torch.empty(min(out.numel(), STEP), dtype=out.dtype)
    for lo in range(0, out.numel(), STEP):
        hi = min(out.numel(), lo + STEP)
        _fill(expect[:hi - lo], start + lo, k)
        if not torch.equal(out[lo:hi], expect[:hi - lo]):
            return False
    return True


def worker(cfg: dict) -> None:
    """One rank of a saving or loading group; reads JSON commands from stdin, answers on stdout."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import shardckpt
    from shardckpt import ShardedTensor

    got = os.path.realpath(shardckpt.__file__)
    if not got.startswith(os.path.realpath(cfg["src"]) + os.sep):
        raise SystemExit(f"worker imported {got}, expected shardckpt from {cfg['src']}")
    rank, world, layout = cfg["rank"], cfg["world"], cfg["layout"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world)
    sd, starts = {}, {}
    for k, (name, shape) in enumerate(cfg["shapes"].items()):
        start, stop = shard_range(shape, layout, rank, world)
        local = torch.zeros(stop - start)
        if cfg["role"] == "save":
            _fill(local, start, k)
        starts[name] = (start, k)
        if layout == "dim0":
            sd[name] = ShardedTensor.dim0_chunk(local.view(-1, *shape[1:]), shape, rank, world)
        else:
            sd[name] = ShardedTensor.flat(local, shape, start)

    def answer(obj) -> None:
        print(REPLY + json.dumps(obj), flush=True)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "prep":
            for t in sd.values():
                t.local.zero_()
            gc.collect()
            answer({})
        elif op == "check":
            bad = [n for n, t in sd.items() if not _check(t.local.reshape(-1), *starts[n])]
            answer({"bad": bad})
        elif op in ("save", "load"):
            if op == "save" and cmd.get("block_size"):
                from shardckpt.checkpoint import writer

                if not hasattr(writer, "BLOCK_SIZE"):
                    raise SystemExit("this shardckpt has no writer.BLOCK_SIZE to patch")
                writer.BLOCK_SIZE = cmd["block_size"]
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            if op == "save":
                shardckpt.save(sd, cmd["path"])
            else:
                shardckpt.load(sd, cmd["path"], verify_checksums=cmd["verify"])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            per_rank = [None] * world
            dist.all_gather_object(per_rank, (wall, cpu))
            answer({"wall": max(w for w, _ in per_rank), "cpu": sum(c for _, c in per_rank),
                    "walls": [w for w, _ in per_rank]})
        else:
            raise SystemExit(f"unknown command {op!r}")
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """``world`` worker processes running the ``shardckpt`` found in ``src``."""

    def __init__(self, name: str, role: str, world: int, src: str, shapes: dict, layout: str):
        self.name = name
        env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
        port = _free_port()
        self.procs = []
        for rank in range(world):
            cfg = {"role": role, "rank": rank, "world": world, "port": port, "src": src, "shapes": shapes,
                   "layout": layout}
            self.procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))

    def call(self, **cmd) -> list[dict]:
        for p in self.procs:
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        return [self._reply(p) for p in self.procs]

    def _reply(self, p) -> dict:
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: a worker exited (rc {p.wait()}); see its stderr above")
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
            sys.stderr.write(line)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.close()
            except OSError:  # it already exited
                pass
        rcs = []
        for p in self.procs:
            try:
                rcs.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:  # stuck in a collective after a peer failed
                p.kill()
                rcs.append(p.wait())
        if any(rcs):
            raise RuntimeError(f"{self.name}: workers exited with {rcs}")


def base_source(args, scratch: str) -> str:
    """The baseline's ``src``: ``--base-src``, or ``git archive`` of ``--base-rev`` (no worktree, no locks)."""
    if args.base_src:
        return os.path.abspath(args.base_src)
    out = os.path.join(scratch, "base-code")
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", args.base_rev, "src"], check=True,
                             stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return os.path.join(out, "src")


def checkpoint_info(path: str) -> dict:
    """Index and manifest bytes of a saved checkpoint, with the version and block size its indexes record."""
    index_bytes, versions, blocks = 0, set(), set()
    for f in sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs):
        if f.endswith(".index.json"):
            with open(f, "rb") as fh:
                data = fh.read()
            index_bytes += len(data)
            doc = json.loads(data)
            versions.add(doc.get("version"))
            blocks.add(doc.get("block_size"))
    manifest = os.path.getsize(os.path.join(path, "manifest.json"))
    return {"index_bytes": index_bytes, "manifest_bytes": manifest, "versions": sorted(versions, key=str),
            "block_sizes": sorted(blocks, key=str)}


def run(args, shapes: dict, total: int, scratch: str) -> dict:
    cur_src, base_src = os.path.join(REPO, "src"), base_source(args, scratch)
    blocks = sorted({*args.block_sizes, MIB})
    ckpt = {bs: os.path.join(scratch, f"v2-{fmt_size(bs).replace(' ', '')}") for bs in blocks}
    ckpt_base = os.path.join(scratch, "v1-base")
    res: dict = {"save": {}, "ckpt": {}}

    def save(group: Group, key: str, path: str, block_size: int | None) -> None:
        remove(path)
        drop_caches()
        r = group.call(op="save", path=path, block_size=block_size)[0]
        res["save"][key] = r
        res["ckpt"][key] = info = checkpoint_info(path)
        print(f"  save {key:14s} {r['wall']:7.3f} s (max over ranks), index {info['index_bytes']:,} B, manifest "
              f"{info['manifest_bytes']:,} B, index version {info['versions']}, block size {info['block_sizes']}",
              flush=True)

    print(f"saving at world size {SAVE_WORLD} ({args.layout}) ...", flush=True)
    g = Group("save current", "save", SAVE_WORLD, cur_src, shapes, args.layout)
    try:
        for bs in blocks:
            save(g, f"v2-{fmt_size(bs)}", ckpt[bs], bs)
    finally:
        g.close()
    g = Group("save base", "save", SAVE_WORLD, base_src, shapes, args.layout)
    try:
        save(g, "base", ckpt_base, None)
    finally:
        g.close()
    for bs in blocks:
        if res["ckpt"][f"v2-{fmt_size(bs)}"]["block_sizes"] != [bs]:
            raise RuntimeError(f"the v2 checkpoint meant to have {bs}-byte blocks records "
                               f"{res['ckpt'][f'v2-{fmt_size(bs)}']['block_sizes']}")
    if res["ckpt"]["base"]["versions"] != [args.base_version]:
        raise RuntimeError(f"the baseline wrote index version {res['ckpt']['base']['versions']}, not "
                           f"{args.base_version} (--base-version)")
    del g
    gc.collect()

    print(f"loading at world size {LOAD_WORLD}, cold, {args.repeats} repeats ...", flush=True)
    cur = Group("load current", "load", LOAD_WORLD, cur_src, shapes, args.layout)
    base = Group("load base", "load", LOAD_WORLD, base_src, shapes, args.layout)
    variants = {"base": (base, ckpt_base, True), "v2": (cur, ckpt[MIB], True),
                "v2-noverify": (cur, ckpt[MIB], False)}
    for bs in blocks:
        if bs != MIB:
            variants[f"v2-{fmt_size(bs)}"] = (cur, ckpt[bs], True)
    names = list(variants)

    def check(n: str, group: Group) -> None:
        bad = [b for x in group.call(op="check") for b in x["bad"]]
        if bad:
            raise AssertionError(f"{n}: wrong values loaded in {sorted(set(bad))}")
    res.update({"load": {n: [] for n in names}, "cpu": {n: [] for n in names}, "walls": {n: [] for n in names},
                "loadavg": [], "checked": not args.no_check})
    try:
        # One untimed load per group first (lazy imports, thread pools, first-touch of code), checked.
        for n in ("v2", "base"):
            group, path, verify = variants[n]
            group.call(op="prep")
            drop_caches()
            r = group.call(op="load", path=path, verify=verify)[0]
            print(f"  warm-up {n:10s} {r['wall']:7.3f} s (not counted)", flush=True)
            if not args.no_check:
                check(n, group)
        for rep in range(args.repeats):
            res["loadavg"].append(loadavg())
            order = names[rep % len(names):] + names[:rep % len(names)]
            for n in order:
                group, path, verify = variants[n]
                group.call(op="prep")
                drop_caches()
                r = group.call(op="load", path=path, verify=verify)[0]
                res["load"][n].append(r["wall"])
                res["cpu"][n].append(r["cpu"])
                res["walls"][n].append(r["walls"])
                print(f"  rep {rep} {n:14s} {r['wall']:7.3f} s (max over ranks; ranks "
                      f"{' '.join(f'{w:.3f}' for w in r['walls'])}), CPU {r['cpu']:.3f} s", flush=True)
                if rep == 0 and not args.no_check:
                    check(n, group)
    finally:
        cur.close()
        base.close()
    return res


# --------------------------------------------------------------------------------------------- report


def report(res: dict, shapes: dict, total: int, args) -> dict:
    names = list(res["load"])
    L = {n: median(v) for n, v in res["load"].items()}
    Lmin = {n: min(v) for n, v in res["load"].items()}
    C = {n: median(v) for n, v in res["cpu"].items()}
    paired = {n: median([a / b for a, b in zip(res["load"][n], res["load"]["base"])]) for n in names}
    gib = total / GIB
    print(f"\n== resharding load: {gib:.3f} GiB fp32 ({len(shapes)} tensors, {args.layout}), saved at ws "
          f"{SAVE_WORLD}, loaded cold at ws {LOAD_WORLD}; {args.repeats} repeats; loadavg at repeat starts: "
          f"{res['loadavg']}")
    print(f"{'variant':14s} {'median s':>8s} {'min s':>7s} {'CPU s':>7s} {'x base':>7s} {'paired':>7s} {'min x':>7s}")
    for n in names:
        print(f"{n:14s} {L[n]:8.3f} {Lmin[n]:7.3f} {C[n]:7.3f} {L[n] / L['base']:7.3f} {paired[n]:7.3f} "
              f"{Lmin[n] / Lmin['base']:7.3f}")
    print("  (CPU s: user+sys summed over the 3 loading processes; x base: ratio of medians; paired: median of the "
          "per-repeat ratios; min x: ratio of minimums)")

    rows = []
    _, wanted = read_amplification(shapes, args.layout, None)
    for key in res["ckpt"]:
        if key == "base":
            bs, name, load = None, "base", "base"
        else:
            bs = res["ckpt"][key]["block_sizes"][0]
            name, load = key, ("v2" if bs == MIB else key)
        read, _ = read_amplification(shapes, args.layout, bs)
        rows.append({"ckpt": name, "block_size": bs, "load": load, "load_median_s": L[load],
                     "x_base": L[load] / L["base"], "paired_x_base": paired[load],
                     "index_bytes": res["ckpt"][key]["index_bytes"],
                     "index_bytes_per_gib": res["ckpt"][key]["index_bytes"] / gib,
                     "manifest_bytes": res["ckpt"][key]["manifest_bytes"], "read_per_wanted": read / wanted,
                     "save_s": res["save"][key]["wall"]})
    rows.sort(key=lambda r: (r["block_size"] or 0))
    print(f"\n{'block size':10s} {'load s':>7s} {'x base':>7s} {'paired':>7s} {'index B':>9s} {'index B/GiB':>11s} "
          f"{'read/wanted':>11s} {'save s':>7s}")
    for r in rows:
        bs = "v1 (none)" if r["block_size"] is None else fmt_size(r["block_size"])
        print(f"{bs:10s} {r['load_median_s']:7.3f} {r['x_base']:7.3f} {r['paired_x_base']:7.3f} {r['index_bytes']:9,d} "
              f"{r['index_bytes_per_gib']:11,.0f} {r['read_per_wanted']:11.4f} {r['save_s']:7.3f}")
    print("  (read/wanted: bytes copied and checked by the widened partial reads per byte wanted, by the reader's rule; "
          "save s: one save each, max over ranks)")

    checks = [("resharding load v2 (1 MiB, verified) <= 1.05x base (medians)", L["v2"] / L["base"],
               L["v2"] <= TARGET * L["base"]),
              ("  same, median of the per-repeat ratios", paired["v2"], paired["v2"] <= TARGET),
              ("  same, on minimums", Lmin["v2"] / Lmin["base"], Lmin["v2"] <= TARGET * Lmin["base"])]
    print("\ntarget:")
    for name, ratio, ok in checks:
        print(f"  {verdict(ok)}  {name}: {ratio:.3f}")
    return {"gib": gib, "bytes": total, "tensors": len(shapes), "layout": args.layout, "repeats": args.repeats,
            "base_rev": args.base_rev if not args.base_src else args.base_src, "load_median_s": L,
            "load_min_s": Lmin, "cpu_median_s": C, "paired_ratio_median": paired, "block_sizes": rows,
            "checks": [{"target": n, "ratio": r, "pass": ok} for n, r, ok in checks], "raw": res,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()}


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KIB, "M": MIB, "G": GIB}.get(s[-1:], 1)
    return int(s[:-1] if mult > 1 else s) * mult


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB, 3 repeats")
    ap.add_argument("--layout", choices=("dim0", "flat"), default="dim0")
    ap.add_argument("--block-sizes", type=lambda v: [parse_size(x) for x in v.split(",")],
                    default=[256 * KIB, MIB, 4 * MIB], help="comma-separated, e.g. 256K,1M,4M (1M is always run)")
    ap.add_argument("--base-rev", default="1c852b6", help="the baseline commit (format v1), via git archive")
    ap.add_argument("--base-src", default=None, help="use this checked-out baseline src/ instead of --base-rev")
    ap.add_argument("--base-version", type=int, default=1,
                    help="the index version the baseline writes: 1 for 1c852b6; 2 to compare the current format's "
                         "code before and after a change (--base-src of the earlier commit)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--no-check", action="store_true", help="skip checking the loaded values in the first repeat")
    args = ap.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 3)
    if not can_drop_caches():
        print("WARNING: not root: caches cannot be dropped; loads will not be cold", file=sys.stderr)
    shapes = model_shapes(args.quick)
    total = sum(numel(s) for s in shapes.values()) * 4
    scratch = args.dir or tempfile.mkdtemp(prefix="shardckpt-reshard-", dir="/tmp")
    os.makedirs(scratch, exist_ok=True)
    print(f"{len(shapes)} tensors, {total / GIB:.3f} GiB fp32, layout {args.layout}, dir {scratch}, "
          f"{os.cpu_count()} CPUs, loadavg {loadavg()}", flush=True)
    t0 = time.perf_counter()
    try:
        res = run(args, shapes, total, scratch)
    finally:
        if args.dir is None:
            remove(scratch)
        else:
            for f in os.listdir(scratch):
                if f.startswith(("v1-", "v2-", "base-code")):
                    remove(os.path.join(scratch, f))
    summary = report(res, shapes, total, args)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
