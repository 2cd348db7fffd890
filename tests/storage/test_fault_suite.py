"""Fault suite, corruption part (issue 16, item 4): random mutations of committed checkpoints, each checked
against every consumer, with a table of counts.

A trial copies a pristine checkpoint (format v2 raw, or v3 compressed, small blocks so that chunks have
several), applies one seeded random mutation, then runs ``verify``, ``load_full``, ``load`` (into a state
dict), ``convert`` and ``export``. Each consumer must either raise a ``CheckpointError`` subclass or give
exactly the original values. A trial is

- ``detected``: ``verify`` fails and the consumers refuse (one that reads none of the damaged bytes, such as
  ``export`` of the model when only optimizer state is hit, gives the exact values);
- ``harmless``: the mutation cannot change a value (e.g. an extra file no manifest names, a flipped gap
  byte between chunks) and every consumer gives the original values;
- ``silently wrong``: some consumer gave other values without an error (must be 0);
- ``unexpected``: some consumer raised another exception type (must be 0).

    SHARDCKPT_FAULT_TRIALS=2000 python -m pytest tests/storage/test_fault_suite.py -s    # long run
"""
from __future__ import annotations

import os
import random
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

import shardckpt
from shardckpt import CheckpointError
from shardckpt.checkpoint.verify import verify
from shardckpt.offline.convert import convert
from shardckpt.offline.export import export
from tests._helpers import flip_byte
from tests.checkpoint.cases import block_size
from tests.storage._util import assert_tree_equal, zeros_like_tree

TRIALS = int(os.environ.get("SHARDCKPT_FAULT_TRIALS", "200"))
KINDS = ("flip data", "flip index", "flip manifest", "truncate", "append", "delete", "extra file",
         "swap files", "file from another checkpoint", "manifest from another checkpoint")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": (torch.randn(64, 96, generator=g) * 0.02).bfloat16(),
                      "b": torch.randn(96, generator=g), "ids": torch.arange(300) * seed,
                      "mask": torch.rand(50, generator=g) > 0.5, "scalar": torch.tensor(float(seed))},
            "optim": {"state": {"0": {"exp_avg": torch.randn(64, 96, generator=g)}}}, "step": seed}


def _pristine(root: str, compress: str | None) -> tuple[str, str]:
    """Two checkpoints of the same structure and different values (A and B)."""
    paths = []
    for seed in (1, 2):
        path = os.path.join(root, f"{compress or 'raw'}-{seed}")
        with block_size(2048):
            shardckpt.save(_state(seed), path, compress=compress)
        paths.append(path)
    return paths[0], paths[1]


def _files(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _flip(file: str, rng: random.Random) -> None:
    size = os.path.getsize(file)
    if size:
        flip_byte(file, rng.randrange(size), 1 << rng.randrange(8))


def _mutate(path: str, other: str, kind: str, rng: random.Random) -> str:
    """Apply one mutation of ``kind``; returns what it did (for messages)."""
    files = _files(path)
    data = [f for f in files if f.endswith(".bin")]
    indexes = [f for f in files if f.endswith(".index.json")]
    pick = rng.choice
    if kind == "flip data":
        f = pick(data)
        _flip(os.path.join(path, f), rng)
    elif kind == "flip index":
        f = pick(indexes)
        _flip(os.path.join(path, f), rng)
    elif kind == "flip manifest":
        f = "manifest.json"
        _flip(os.path.join(path, f), rng)
    elif kind == "truncate":
        f = pick(files)
        size = os.path.getsize(os.path.join(path, f))
        os.truncate(os.path.join(path, f), rng.randrange(size) if size else 0)
    elif kind == "append":
        f = pick(files)
        with open(os.path.join(path, f), "ab") as out:
            out.write(rng.randbytes(rng.randint(1, 64)))
    elif kind == "delete":
        f = pick(files)
        os.unlink(os.path.join(path, f))
    elif kind == "extra file":
        f = os.path.join(os.path.dirname(pick(data)), "rank-99999-0.bin")
        open(os.path.join(path, f), "wb").write(rng.randbytes(100))
    elif kind == "swap files":
        a, b = rng.sample(data, 2) if rng.random() < 0.5 else rng.sample(indexes, 2)
        f = f"{a}<->{b}"
        pa, pb = os.path.join(path, a), os.path.join(path, b)
        os.rename(pa, pa + ".x")
        os.rename(pb, pa)
        os.rename(pa + ".x", pb)
    elif kind == "file from another checkpoint":
        f = pick(data + indexes)
        theirs = [g for g in _files(other) if os.path.basename(g) == os.path.basename(f)]
        shutil.copyfile(os.path.join(other, theirs[0]), os.path.join(path, f))
    else:
        f = "manifest.json"
        shutil.copyfile(os.path.join(other, f), os.path.join(path, f))
    return f"{kind} {f}"


def _consumers(path: str, out: str, want: dict) -> dict[str, str]:
    """Each consumer's outcome: "refused", "exact", "WRONG", or "UNEXPECTED <type>"."""
    def load_into() -> dict:
        sd = zeros_like_tree(want)
        shardckpt.load(sd, path)
        return sd

    def converted() -> dict:
        convert(path, os.path.join(out, "converted"), overwrite=True)
        return shardckpt.load_full(os.path.join(out, "converted"))

    def exported() -> dict:
        export(path, os.path.join(out, "exported"), overwrite=True)
        return {"model": load_file(os.path.join(out, "exported", "model.safetensors"))}

    calls = {"load_full": lambda: shardckpt.load_full(path), "load": load_into, "convert": converted,
             "export": exported}
    outcomes = {}
    for name, call in calls.items():
        try:
            got = call()
        except CheckpointError:
            outcomes[name] = "refused"
            continue
        except Exception as e:  # noqa: BLE001 - counted: must be none
            outcomes[name] = f"UNEXPECTED {type(e).__name__}: {e}"
            continue
        expected = {"model": want["model"]} if name == "export" else want
        try:
            assert_tree_equal(got, expected)
            outcomes[name] = "exact"
        except AssertionError:
            outcomes[name] = "WRONG"
    return outcomes


def _verified(path: str) -> bool | str:
    """``verify``'s verdict; a manifest it cannot read is a failed check (``CheckpointError``), not a crash."""
    try:
        return verify(path).ok
    except CheckpointError:
        return False
    except Exception as e:  # noqa: BLE001 - counted: must be none
        return f"UNEXPECTED {type(e).__name__}: {e}"


def _classify(verified: bool | str, outcomes: dict[str, str]) -> str:
    values = set(outcomes.values()) | ({verified} if isinstance(verified, str) else set())
    if "WRONG" in values:
        return "silently wrong"
    if any(v.startswith("UNEXPECTED") for v in values):
        return "unexpected"
    if not verified and "refused" in values:
        return "detected"  # a consumer that reads none of the damage (export: the model only) may succeed
    if verified and values == {"exact"}:
        return "harmless"
    return "inconsistent"  # verify and the loads disagree (verify passes and a load refuses, or the reverse)


@pytest.mark.timeout(1800)
def test_random_mutations_are_detected_or_harmless(tmp_path, capsys):
    rng = random.Random(16)
    sources = {c: _pristine(str(tmp_path), c) for c in (None, "zstd")}
    table: dict[str, Counter] = {kind: Counter() for kind in KINDS}
    problems = []
    for trial in range(TRIALS):
        compress = None if trial % 2 == 0 else "zstd"
        pristine, other = sources[compress]
        kind = KINDS[trial % len(KINDS)] if trial < 2 * len(KINDS) else rng.choice(KINDS)
        path = str(tmp_path / "trial")
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(pristine, path)
        what = _mutate(path, other, kind, rng)
        report_ok, outcomes = _verified(path), _consumers(path, str(tmp_path / "out"), _state(1))
        verdict = _classify(report_ok, outcomes)
        table[kind][verdict] += 1
        if verdict not in ("detected", "harmless"):
            problems.append((trial, compress, what, report_ok, outcomes))
        assert verify(pristine).ok  # the source is never touched
    with capsys.disabled():
        print(f"\nfault suite, corruption: {TRIALS} trials")
        print(f"  {'mutation':32s} {'trials':>6s} {'detected':>8s} {'harmless':>8s} {'wrong':>6s} {'unexpected':>10s} "
              f"{'inconsistent':>12s}")
        for kind, c in table.items():
            print(f"  {kind:32s} {sum(c.values()):6d} {c['detected']:8d} {c['harmless']:8d} {c['silently wrong']:6d} "
                  f"{c['unexpected']:10d} {c['inconsistent']:12d}")
    assert not problems, problems[:5]
