"""The reader fuzzer's cases, per format: each class builds valid small checkpoints once (``__init__``), then
``make(case_dir, i)`` writes case ``i``, a damaged copy, and returns ``(kind, path, what was done, original)``:
``original`` (the undamaged checkpoint's tensors by flattened name) where the format checksums what the case
damaged, so a load that succeeds must give exactly those bytes; else None."""
from __future__ import annotations

import glob
import io
import json
import os
import pickle
import random
import shutil
import zipfile

import torch

import shardckpt
from tests.formats._deepspeed_layout import load_ds, save_ds, write_like_deepspeed
from tests.formats._fuzz_values import (
    flat_tensors, hostile_values, mutate_bytes, mutate_structure, short, with_recursion_limit,
)

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fixtures")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(8, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
                      "i": torch.arange(6, dtype=torch.int64), "z": torch.tensor(3.5), "e": torch.empty(0, 4),
                      "m": torch.tensor([True, False])},
            "step": 7, "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}], "note": "x"}


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _kind(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), list(weights.values()))[0]


def _json_hostile(rng: random.Random):
    """A hostile value that JSON can hold (no shared references in JSON: a tree's size is its text's)."""
    value = hostile_values(rng, shared=False)
    try:
        with_recursion_limit(lambda: json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return rng.choice([10**30, -1, "x", [], {}, 2**64, 1e308, -0.5])
    return value


class SafetensorsCases:
    def __init__(self, base: str, rng: random.Random):
        from safetensors.torch import save_file
        os.makedirs(base)
        self.rng, path = rng, os.path.join(base, "model.safetensors")
        save_file({k: v.contiguous() for k, v in flat_tensors(_state()["model"]).items()}, path, metadata={"format": "pt"})
        raw = open(path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        self.header, self.data, self.raw = json.loads(raw[8:8 + n]), raw[8 + n:], raw

    def make(self, case_dir: str, i: int):
        rng, path = self.rng, os.path.join(case_dir, "model.safetensors")
        kind = _kind(rng, {"header": 6, "deep-header": 1, "length": 1, "bytes": 2})
        if kind == "bytes":
            data, what = mutate_bytes(self.raw, rng)
            _write(path, data)
            return kind, path, what, None
        header, what = json.loads(json.dumps(self.header)), "length"
        if kind == "header":
            header, what = mutate_structure(header, rng, _json_hostile)
        text = with_recursion_limit(lambda: json.dumps(header)).encode()
        if kind == "deep-header":
            depth = rng.choice([900, 100_000])
            text = text[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
            what = f"a value nested {depth} deep"
        n = len(text) if kind != "length" else rng.choice([0, 1, len(text) - 1, len(text) + 1, 2**63, 10**8])
        _write(path, n.to_bytes(8, "little") + text + self.data)
        return kind, path, what if kind != "length" else f"header length {n}", None


def _with_pickle(archive: bytes, data_pkl: bytes) -> bytes:
    """A ``torch.save`` archive with its ``data.pkl`` replaced."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, data_pkl if info.filename.endswith("/data.pkl") else zin.read(info))
    return out.getvalue()


def _hostile_pickle(rng: random.Random) -> tuple[bytes, str]:
    """A pickle no ``torch.save`` writes: nesting far past Python's stack, a huge storage, a huge memo index."""
    pick = rng.randrange(4)
    if pick == 0:
        depth = rng.choice([10_000, 1_000_000])
        return b"\x80\x02" + b"]" * (depth + 1) + b"a" * depth + b".", f"a list nested {depth} deep (opcodes)"
    if pick == 1:  # a persistent id naming a storage of 10**15 elements
        pid = ("storage", None, "0", "cpu", 10**15)
        body = pickle.dumps(pid, protocol=2)[2:-1]
        return b"\x80\x02" + body + b"Q.", "a storage of 10**15 elements"
    if pick == 2:
        return b"\x80\x02h\xff.", "a memo index never stored"
    return b"\x80\x02" + b"(" * 100_000 + b".", "100000 marks"


class TorchSaveCases:
    def __init__(self, base: str, rng: random.Random):
        os.makedirs(base)
        self.rng = rng
        self.path = os.path.join(base, "state.pt")
        torch.save(_state(), self.path)
        self.raw = open(self.path, "rb").read()
        self.legacy = os.path.join(base, "legacy.pt")
        torch.save(_state(), self.legacy, _use_new_zipfile_serialization=False)
        self.legacy_raw = open(self.legacy, "rb").read()
        self.original = flat_tensors(shardckpt.load_full(self.path))

    def make(self, case_dir: str, i: int):
        rng, path = self.rng, os.path.join(case_dir, "state.pt")
        kind = _kind(rng, {"structure": 5, "bytes": 3, "legacy-bytes": 1, "pickle": 1})
        if kind == "structure":
            obj, what = mutate_structure(torch.load(self.path, weights_only=True), rng)
            with_recursion_limit(lambda: torch.save(obj, path))
            return kind, path, what, None
        if kind == "pickle":
            data, what = _hostile_pickle(rng)
            _write(path, _with_pickle(self.raw, data))
            return kind, path, what, None
        data, what = mutate_bytes(self.raw if kind == "bytes" else self.legacy_raw, rng)
        _write(path, data)
        return kind, path, what, self.original if kind == "bytes" else None


class DcpCases:
    def __init__(self, base: str, rng: random.Random):
        import torch.distributed.checkpoint as dcp
        self.rng, self.base = rng, os.path.join(base, "dcp")
        state = _state()
        state["listed"] = [torch.arange(3.0), {"k": torch.ones(2)}]
        dcp.save(state, checkpoint_id=self.base, no_dist=True)
        self.metadata = open(os.path.join(self.base, ".metadata"), "rb").read()
        self.original = flat_tensors(shardckpt.load_full(self.base))

    def _copy(self, case_dir: str) -> str:
        path = os.path.join(case_dir, "dcp")
        shutil.copytree(self.base, path)
        return path

    def make(self, case_dir: str, i: int):
        rng, path = self.rng, self._copy(case_dir)
        kind = _kind(rng, {"metadata": 5, "planner-index": 1, "metadata-bytes": 2, "data-bytes": 1, "files": 1,
                           "value-archive": 1})
        meta = os.path.join(path, ".metadata")
        if kind in ("metadata", "planner-index"):
            md = pickle.loads(self.metadata)  # trusted: torch wrote it above
            md, what = mutate_structure(md, rng) if kind == "metadata" else self._index(md, rng)
            _write(meta, with_recursion_limit(lambda: pickle.dumps(md)))
            return kind, path, what, None
        if kind == "metadata-bytes":
            data, what = mutate_bytes(self.metadata, rng)
            _write(meta, data)
            return kind, path, what, self.original
        data_file = sorted(glob.glob(os.path.join(path, "*.distcp")))[0]
        if kind == "data-bytes":
            data, what = mutate_bytes(open(data_file, "rb").read(), rng)
            _write(data_file, data)
            return kind, path, what, self.original
        if kind == "value-archive":
            return kind, path, self._evil_value(path, rng), None
        how = rng.randrange(3)
        if how == 0:
            os.remove(data_file)
        elif how == 1:
            _write(os.path.join(path, f"__{10**30}_0.distcp"), b"PK\x03\x04" + b"\0" * 100)
        else:
            os.truncate(data_file, rng.randrange(os.path.getsize(data_file)))
        return kind, path, ["data file removed", "stray data file", "data file truncated"][how], None

    @staticmethod
    def _index(md, rng: random.Random):
        """The list entry ``listed.0`` renamed to a list index of ``rng``'s choosing."""
        index = rng.choice([5, 1000, 10**8, 10**10, 2**63, -1])
        key = f"listed.{index}"
        md.state_dict_metadata[key] = md.state_dict_metadata.pop("listed.0")
        md.storage_data = {(type(k)(key, k.offset, k.index) if k.fqn == "listed.0" else k): v
                           for k, v in md.storage_data.items()}
        md.planner_data[key] = ("listed", index)
        del md.planner_data["listed.0"]
        return md, f"list index {index}"

    def _evil_value(self, path: str, rng: random.Random) -> str:
        """The bytes entry ``step`` replaced by a ``torch.save`` of a hostile value, in a file of its own."""
        value = hostile_values(rng)
        buf = io.BytesIO()
        with_recursion_limit(lambda: torch.save(value, buf))
        _write(os.path.join(path, "evil.distcp"), buf.getvalue())
        md = pickle.loads(self.metadata)
        info = next(v for k, v in md.storage_data.items() if k.fqn == "step")
        info.relative_path, info.offset, info.length = "evil.distcp", 0, len(buf.getvalue())
        _write(os.path.join(path, ".metadata"), pickle.dumps(md))
        return f"value 'step' is {short(value)}"


def _deepspeed_extra(rng: random.Random):
    """DeepSpeed's own objects (as the reader's stand-ins), where plain values belong."""
    from shardckpt.formats.deepspeed.unpickle import FragmentAddress, LossScaler, ZeroStageEnum
    return rng.choice([LossScaler(), ZeroStageEnum(3), FragmentAddress(10**30, -1)])


class DeepSpeedCases:
    def __init__(self, base: str, rng: random.Random):
        self.rng, self.bases = rng, []
        for stage in (1, 2, 3):
            self.bases.append(os.path.join(FIXTURES, "deepspeed", f"zero{stage}", "checkpoint"))
        g = torch.Generator().manual_seed(1)
        groups = [{"a": torch.randn((), generator=g), "e": torch.randn(7, 3, generator=g), "b": torch.zeros(0, 3)}]
        for stage in (2, 3):
            path = os.path.join(base, f"like{stage}")
            write_like_deepspeed(path, stage, 3, groups, cut_subgroups=False, buffers={"n": torch.zeros(0)})
            self.bases.append(path)
        self.originals = [flat_tensors(shardckpt.load_full(b)) for b in self.bases]

    def make(self, case_dir: str, i: int):
        rng = self.rng
        b = rng.randrange(len(self.bases))
        path = os.path.join(case_dir, "ds")
        shutil.copytree(self.bases[b], path)
        tag = os.path.join(path, "global_step4") if os.path.isdir(os.path.join(path, "global_step4")) else path
        files = sorted(glob.glob(os.path.join(tag, "*.pt")))
        kind = _kind(rng, {"structure": 6, "names": 2, "bytes": 2})
        victim = rng.choice(files)
        if kind == "structure":
            obj = load_ds(victim)
            obj, what = mutate_structure(obj, rng, lambda r: hostile_values(r, _deepspeed_extra))
            with_recursion_limit(lambda: save_ds(obj, victim))
            return kind, path, f"{os.path.basename(victim)}: {what}", None
        if kind == "bytes":
            data, what = mutate_bytes(open(victim, "rb").read(), rng)
            _write(victim, data)
            return kind, path, f"{os.path.basename(victim)}: {what}", self.originals[b]
        return kind, path, self._names(path, tag, files, rng), None

    @staticmethod
    def _names(path: str, tag: str, files: list[str], rng: random.Random) -> str:
        rank = rng.choice([10**30, 2**64, 5, 3, 10**200])
        how = rng.randrange(7)
        optim = [f for f in files if f.endswith("_optim_states.pt")]
        if how == 0:
            open(os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"), "wb").close()
            return f"stray optim file of rank {rank}"
        if how == 1:
            shutil.copy(optim[0], os.path.join(tag, f"zero_pp_rank_0_mp_rank_{rank}_optim_states.pt"))
            return f"model-parallel rank {rank}"
        if how == 2:
            shutil.copy(optim[-1], os.path.join(tag, "bf16_" + os.path.basename(optim[-1])))
            return "a bf16_ twin"
        if how == 3:
            os.remove(rng.choice(files))
            return "a file removed"
        if how == 4:
            _write(os.path.join(path, "latest"), rng.choice([b"..", b".", b"x" * 4000, b"\0", b"global_step4\n" * 2,
                                                             os.path.basename(optim[0]).encode()]))
            return "latest names something odd"
        if how == 5:
            os.rename(optim[-1], os.path.join(tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
            return f"the last rank renamed rank {rank}"
        _write(rng.choice(files), b"")
        return "an empty file"


FORMATS = {"safetensors": SafetensorsCases, "torch-save": TorchSaveCases, "dcp": DcpCases,
           "deepspeed": DeepSpeedCases}
