"""DeepSpeed ZeRO-1, -2 and -3 checkpoints behind the one read interface, by parameter name.

The path is a checkpoint directory (``save_checkpoint``'s, whose ``latest`` file names the tag) or a tag
directory (``global_step*/``) holding ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` for every data-parallel
rank ``r`` (``bf16_`` prefixed too) and the model states (ZeRO-1/2: ``mp_rank_00_model_states.pt``; ZeRO-3:
``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank). Tensor- and pipeline-parallel checkpoints
(``mp_rank`` other than 00) are refused.

It reads as the FULL checkpoint of the trained model (the names of ``model.state_dict()``):

- ``model.<name>``: trainable parameters from the fp32 partitions, assembled as DeepSpeed's ``zero_to_fp32``
  assembles them (``formats.deepspeed.partitions``), so the values are bit for bit its output; frozen
  parameters from ``frozen_param_fragments`` (ZeRO-1/2 checkpoints that lack them, as DeepSpeed 0.19 writes
  ZeRO-1: from the saved module, which holds them whole); tied parameters (``shared_params``) as their
  target; buffers and any other module entry as saved, in their saved dtype;
- ``optim.state.<name>.<key>``: the optimizer's per-element state (``exp_avg``, ``exp_avg_sq``...) of every
  trainable parameter, located in the same partitions, and its scalars (``step``) per parameter, as a torch
  optimizer keyed by name holds them; ``optim.param_groups``: the saved groups' hyper-parameters, ``params``
  naming each group's parameters (``param_shapes``; tied ones by their primary name, frozen ones in none);
- ``deepspeed``: plain facts (ZeRO stage, data-parallel world size, ``global_steps``, DeepSpeed's version and
  config, the LR scheduler's state); a client state's plain top-level values as they are.

Safety: each file is read by ``TorchSaveReader`` with ``torch.load(weights_only=True)`` and exactly the classes
of ``formats.deepspeed.unpickle`` admitted as inert stand-ins: a file naming anything else is refused
(``CorruptCheckpointError`` naming it) before any of it is built, and nothing in it runs. Every zip record's
CRC-32 is checked on the first read from a file. Memory: files are memory-mapped; only their pickles are held,
and the pages a read touches are given back after it, so converting never holds more than what the caller's
buffers hold, much less than one rank file. Local paths only (``torch.load`` maps the files).
"""
from __future__ import annotations

import bisect
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.format.validate import MAX_NUMEL
from shardckpt.formats.api import ReadRequest, TensorInfo
from shardckpt.formats.deepspeed.partitions import Segment, zero3_pieces, zero3_segments, zero12_segments
from shardckpt.formats.deepspeed.unpickle import SAFE_GLOBALS
from shardckpt.formats.requests import check_requests
from shardckpt.formats.torch_save import TorchSaveReader, local_path
from shardckpt.regions import FlatRange, contiguous_runs

LATEST = "latest"
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE_12 = "mp_rank_00_model_states.pt"
MODEL_FILE_3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
# The model states' own keys; any other top-level key is the client state save_checkpoint was given.
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
}


@dataclass(frozen=True)
class _Piece:
    """Elements ``[at, at + count)`` of a presented tensor (row-major) are elements ``[start, start + count)`` of
    stored tensor ``tensor`` (flattened) of file ``file``."""

    file: int
    tensor: str
    start: int
    at: int
    count: int


def tag_dir(path: str) -> str | None:
    """The tag directory a DeepSpeed checkpoint at local ``path`` reads from; None when ``path`` holds none."""
    if not os.path.isdir(path):
        return None
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest) and os.path.getsize(latest) < 4096:
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read().strip()
        if tag and "/" not in tag and tag not in (".", "..") and _has_optim_files(os.path.join(path, tag)):
            return os.path.join(path, tag)
    return path if _has_optim_files(path) else None


def _has_optim_files(path: str) -> bool:
    return os.path.isdir(path) and any(OPTIM_FILE.match(n) for n in os.listdir(path))


class DeepSpeedReader:
    """A ``CheckpointReader`` over a DeepSpeed ZeRO checkpoint (see the module's docstring)."""

    transient_read_bytes = TorchSaveReader.transient_read_bytes  # a read reads its files one after the other

    def __init__(self, path: str | os.PathLike):
        root = os.path.abspath(local_path(path))
        found = tag_dir(root)
        if found is None:
            raise CheckpointError(f"{root}: no DeepSpeed ZeRO checkpoint here (no *_optim_states.pt files, nor a "
                                  f"'{LATEST}' file naming a directory with them)")
        self.path = found
        self._files: list[TorchSaveReader] = []
        self._index: dict[int, int] = {}  # id(file reader) -> its place in _files
        self._file_infos: list[Mapping[str, TensorInfo]] = []  # each file's tensors
        optim = self._open_optim_files()
        osd = [self._dict(f, "optimizer_state_dict") for f in optim]
        self.world_size = len(optim)
        self.stage = self._stage(osd[0], optim[0])
        model = self._open_model_files()
        m0 = model[0].tree()
        self._check_model_states(m0, model[0])
        self._infos: dict[str, TensorInfo] = {}
        self._pieces: dict[str, list[_Piece]] = {}
        group_shapes = [self._shapes(s, model[0], f"param_shapes[{g}]")
                        for g, s in enumerate(self._list(m0, "param_shapes", model[0]))]
        flats = [self._refs(o, "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups", f)
                 for o, f in zip(osd, optim)]
        self._flat_numels = [[self._numel(f, t) for t in fl] for f, fl in zip(optim, flats)]
        self._flat_dtype = self._infos_of(optim[0])[flats[0][0]].dtype if flats[0] else torch.float32
        if self.stage <= 2:
            for f, fl in zip(optim, flats):
                if len(fl) != len(group_shapes):
                    raise CorruptCheckpointError(f"{f.path}: {len(fl)} fp32 partitions for {len(group_shapes)} param "
                                                 "groups (param_shapes)")
            segments = zero12_segments(group_shapes, self._flat_numels, self._paddings(osd[0], optim[0]), self.path)
            base = [self._dict(o, "base_optimizer_state", f) for o, f in zip(osd, optim)]
        else:
            sizes = self._flat_numels
            if any(s != sizes[0] for s in sizes):
                raise CorruptCheckpointError(f"{self.path}: the ranks' fp32_flat_groups differ in size: {sizes}")
            shapes = {n: s for group in group_shapes for n, s in group.items()}
            segments = zero3_segments(shapes, sizes[0], self.world_size, self.path)
            base = [self._dict(o, "optimizer_state_dict", f) for o, f in zip(osd, optim)]
        trainable = {n: s for group in group_shapes for n, s in group.items()}
        model_tree = self._model(m0, model, trainable, segments, flats, optim)
        optim_tree = self._optim(group_shapes, segments, base, optim)
        self._tree = {"model": model_tree, "optim": optim_tree, "deepspeed": self._facts(m0)}
        for key, value in m0.items():
            if key not in _ENGINE_KEYS and key not in self._tree and _plain(value):
                self._tree[key] = value

    # --- files ---------------------------------------------------------------------------------------------

    def _open(self, name: str) -> TorchSaveReader:
        full = os.path.join(self.path, name)
        if not os.path.isfile(full):
            raise CorruptCheckpointError(f"{full}: missing (the DeepSpeed checkpoint in {self.path} needs it)")
        reader = TorchSaveReader(full, safe_globals=SAFE_GLOBALS)
        self._index[id(reader)] = len(self._files)
        self._files.append(reader)
        self._file_infos.append(reader.tensors())
        return reader

    def _infos_of(self, f: TorchSaveReader) -> Mapping[str, TensorInfo]:
        """``f.tensors()``, listed once per file."""
        return self._file_infos[self._index[id(f)]]

    def _open_optim_files(self) -> list[TorchSaveReader]:
        by_rank: dict[int, str] = {}
        for name in sorted(os.listdir(self.path)):
            m = OPTIM_FILE.match(name)
            if not m:
                continue
            if int(m.group(2)) != 0:
                raise IncompatibleCheckpointError(f"{self.path}: {name} belongs to model-parallel rank "
                                                  f"{int(m.group(2))}; tensor- and pipeline-parallel DeepSpeed "
                                                  "checkpoints are not read (only data-parallel ZeRO)")
            if int(m.group(1)) in by_rank:
                raise CorruptCheckpointError(f"{self.path}: two optimizer state files for rank {m.group(1)}: "
                                             f"{by_rank[int(m.group(1))]} and {name}")
            by_rank[int(m.group(1))] = name
        missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank))
        if missing:
            raise CorruptCheckpointError(f"{self.path}: the optimizer state files of rank(s) {missing} are missing "
                                         f"(found ranks {sorted(by_rank)})")
        files = [self._open(by_rank[r]) for r in range(len(by_rank))]
        count = self._dict(files[0], "optimizer_state_dict").get("partition_count")
        count = max(count) if isinstance(count, list) and count else count
        if count != len(files):
            raise CorruptCheckpointError(f"{files[0].path}: partition_count is {count!r}, but {len(files)} ranks' "
                                         "optimizer state files are here (a save that did not finish, or another "
                                         "save's files mixed in?)")
        return files

    def _open_model_files(self) -> list[TorchSaveReader]:
        """The model states that name the parameters (ZeRO-3: rank 0's; the other ranks' are opened only for their
        pieces of frozen parameters, ``_rank_model_files``: unpickling them is most of the opening time)."""
        if self.stage <= 2:
            return [self._open(MODEL_FILE_12)]
        for r in range(1, self.world_size):
            if not os.path.isfile(os.path.join(self.path, MODEL_FILE_3.format(r))):
                raise CorruptCheckpointError(f"{os.path.join(self.path, MODEL_FILE_3.format(r))}: missing (the "
                                             f"DeepSpeed checkpoint in {self.path} needs it)")
        return [self._open(MODEL_FILE_3.format(0))]

    def _rank_model_files(self, model: list[TorchSaveReader]) -> list[TorchSaveReader]:
        """Every rank's model states (ZeRO-3), opened once."""
        while len(model) < self.world_size:
            model.append(self._open(MODEL_FILE_3.format(len(model))))
        return model

    def _stage(self, osd: dict, f: TorchSaveReader) -> int:
        stage = osd.get("zero_stage")
        if stage is None and "single_partition_of_fp32_groups" in osd:
            stage = 1  # DeepSpeed's bf16 optimizer (ZeRO-1 layout) does not record it
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2, 3):
            raise IncompatibleCheckpointError(f"{f.path}: zero_stage is {stage!r}; ZeRO stages 1, 2 and 3 are read")
        return int(stage)

    def _check_model_states(self, m0: dict, f: TorchSaveReader) -> None:
        mp = m0.get("mp_world_size", 1)
        if mp not in (None, 1):
            raise IncompatibleCheckpointError(f"{f.path}: mp_world_size is {mp!r}; tensor- and pipeline-parallel "
                                              "DeepSpeed checkpoints are not read (only data-parallel ZeRO)")
        dp = m0.get("dp_world_size")
        if dp is not None and dp != self.world_size:
            raise CorruptCheckpointError(f"{f.path}: dp_world_size is {dp!r}, but {self.world_size} ranks' optimizer "
                                         "state files are here")

    # --- checked access to what the pickles hold -------------------------------------------------------------

    def _dict(self, node: Any, key: str, f: TorchSaveReader | None = None) -> dict:
        if isinstance(node, TorchSaveReader):
            node, f = node.tree(), node
        value = node.get(key) if isinstance(node, dict) else None
        if not isinstance(value, dict):
            raise CorruptCheckpointError(f"{f.path}: {key!r} is missing or not a mapping")
        return value

    def _list(self, node: dict, key: str, f: TorchSaveReader) -> list:
        value = node.get(key)
        if not isinstance(value, (list, tuple)):
            raise CorruptCheckpointError(f"{f.path}: {key!r} is missing or not a list")
        return list(value)

    def _refs(self, node: dict, key: str, f: TorchSaveReader) -> list[str]:
        refs = self._list(node, key, f)
        if not all(isinstance(r, TensorRef) for r in refs):
            raise CorruptCheckpointError(f"{f.path}: {key!r} is not a list of tensors")
        return [r.name for r in refs]

    @staticmethod
    def _paddings(osd: dict, f: TorchSaveReader) -> list[list[int]] | None:
        """``param_alignment_paddings`` (per group, per parameter), or None where DeepSpeed did not record them."""
        paddings = osd.get("param_alignment_paddings")
        if paddings is None:
            return None
        if not isinstance(paddings, list) or not all(isinstance(g, list) and all(type(p) is int and p >= 0 for p in g)
                                                     for g in paddings):
            raise CorruptCheckpointError(f"{f.path}: param_alignment_paddings is not a list of lists of counts")
        return paddings

    def _numel(self, f: TorchSaveReader, tensor: str) -> int:
        info = self._infos_of(f)[tensor]
        if len(info.shape) != 1:
            raise CorruptCheckpointError(f"{f.path}: {tensor!r} has shape {list(info.shape)}; a flat partition is 1-D")
        return info.shape[0]

    def _shapes(self, node: Any, f: TorchSaveReader, what: str) -> dict[str, tuple[int, ...]]:
        if not isinstance(node, dict):
            raise CorruptCheckpointError(f"{f.path}: {what} is not a mapping of parameter shapes")
        out = {}
        for name, shape in node.items():
            if not isinstance(name, str) or not isinstance(shape, (tuple, list)) or \
                    not all(type(s) is int and s >= 0 for s in shape) or \
                    math.prod(max(s, 1) for s in shape) > MAX_NUMEL:
                raise CorruptCheckpointError(f"{f.path}: {what} gives {name!r} the shape {shape!r}")
            out[name] = tuple(shape)
        return out

    # --- what the reader presents ----------------------------------------------------------------------------

    def _present(self, name: str, shape: tuple[int, ...], pieces: list[_Piece], dtype: torch.dtype) -> TensorRef:
        """Present tensor ``name`` of ``shape`` and ``dtype`` as ``pieces``, which must tile it in order."""
        covered = 0
        for p in pieces:
            stored = self._file_infos[p.file][p.tensor]
            if stored.dtype != dtype or p.at != covered or p.start + p.count > math.prod(stored.shape):
                raise CorruptCheckpointError(f"{self._files[p.file].path}: {p.tensor!r} ({stored.dtype}, "
                                             f"{math.prod(stored.shape)} elements) cannot hold elements [{p.at}, "
                                             f"{p.at + p.count}) of {name!r} ({dtype})")
            covered += p.count
        if covered != math.prod(shape):
            raise CorruptCheckpointError(f"{self.path}: {name!r} (shape {list(shape)}) has {covered} elements saved")
        self._infos[name] = TensorInfo(name, dtype, shape, None)
        self._pieces[name] = pieces
        return TensorRef(name)

    def _whole(self, f: TorchSaveReader, ref: TensorRef) -> tuple[list[_Piece], tuple[int, ...], torch.dtype]:
        """A stored tensor presented whole: its pieces, shape and dtype."""
        info = self._infos_of(f)[ref.name]
        n = math.prod(info.shape)
        return ([_Piece(self._index[id(f)], ref.name, 0, 0, n)] if n else []), info.shape, info.dtype

    def _model(self, m0: dict, model: list[TorchSaveReader], trainable: dict, segments: dict[str, list[Segment]],
               flats: list[list[str]], optim: list[TorchSaveReader]) -> dict:
        module = self._dict(m0, "module", model[0])
        frozen = m0.get("frozen_param_shapes") or {}
        frozen = self._shapes(frozen, model[0], "frozen_param_shapes")
        shared = m0.get("shared_params") or {}
        if not isinstance(shared, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()):
            raise CorruptCheckpointError(f"{model[0].path}: shared_params is not a mapping of names")
        out: dict[str, Any] = {}
        names = list(module) + [n for n in list(trainable) + list(frozen) if n not in module]
        for name in [n for n in names if n not in shared] + [n for n in names if n in shared]:
            key = f"model.{name}"
            if name in trainable:
                pieces = [_Piece(self._index[id(optim[s.rank])], flats[s.rank][s.flat], s.start, s.at, s.count)
                          for s in segments[name]]
                out[name] = self._present(key, trainable[name], pieces, self._flat_dtype)
            elif name in frozen:
                pieces, dtype = self._frozen(name, frozen[name], model, module)
                out[name] = self._present(key, frozen[name], pieces, dtype)
            elif name in shared:
                target = f"model.{shared[name]}"
                if target not in self._pieces:
                    raise CorruptCheckpointError(f"{model[0].path}: shared_params ties {name!r} to {shared[name]!r}, "
                                                 "which the checkpoint does not hold")
                out[name] = self._present(key, self._infos[target].shape, self._pieces[target],
                                          self._infos[target].dtype)
            elif isinstance(module[name], TensorRef):
                pieces, shape, dtype = self._whole(model[0], module[name])
                out[name] = self._present(key, shape, pieces, dtype)
            else:
                out[name] = module[name]
        return {n: out[n] for n in names}

    def _frozen(self, name: str, shape: tuple, model: list[TorchSaveReader],
                module: dict) -> tuple[list[_Piece], torch.dtype]:
        if self.stage == 3:
            model = self._rank_model_files(model)
        fragments = [f.tree().get("frozen_param_fragments") or {} for f in model]
        if self.stage <= 2:
            ref = fragments[0].get(name, module.get(name))  # ZeRO-1 may not keep fragments: the module holds it whole
            if not isinstance(ref, TensorRef) or self._infos_of(model[0])[ref.name].shape != shape:
                raise CorruptCheckpointError(f"{model[0].path}: the frozen parameter {name!r} (shape {list(shape)}) "
                                             "is not saved whole")
            pieces, _, dtype = self._whole(model[0], ref)
            return pieces, dtype
        refs = [frag.get(name) for frag in fragments]
        if not all(isinstance(r, TensorRef) for r in refs):
            raise CorruptCheckpointError(f"{self.path}: the frozen parameter {name!r} lacks a rank's piece "
                                         "(frozen_param_fragments)")
        sizes = [math.prod(self._infos_of(f)[r.name].shape) for f, r in zip(model, refs)]
        return [_Piece(self._index[id(model[s.rank])], refs[s.rank].name, s.start, s.at, s.count)
                for s in zero3_pieces(name, shape, sizes, self.path)], self._infos_of(model[0])[refs[0].name].dtype

    def _optim(self, group_shapes: list[dict], segments: dict[str, list[Segment]], base: list[dict],
               optim: list[TorchSaveReader]) -> dict:
        states = [b.get("state") or {} for b in base]
        groups = base[0].get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(group_shapes) or \
                not all(isinstance(g, dict) for g in groups):
            raise CorruptCheckpointError(f"{optim[0].path}: the optimizer records "
                                         f"{len(groups) if isinstance(groups, list) else groups!r} param groups for "
                                         f"{len(group_shapes)} groups of parameters (param_shapes)")
        state: dict[str, Any] = {}
        if any(states):
            for g, group in enumerate(group_shapes):
                for name in group:
                    state[name] = self._param_state(name, segments[name], g if self.stage <= 2 else 0, states, optim)
        param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(shapes)}
                        for g, shapes in zip(groups, group_shapes)]
        return {"state": state, "param_groups": param_groups}

    def _param_state(self, name: str, segments: list[Segment], flat: int, states: list[dict],
                     optim: list[TorchSaveReader]) -> dict:
        """A parameter's optimizer state: per-element tensors from its segments, scalars from its first flat's
        (``flat`` for a parameter without elements)."""
        first = segments[0].flat if segments else flat
        entry = states[0].get(first)
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{optim[0].path}: no optimizer state for flat group {first} (holding "
                                         f"{name!r})")
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if not isinstance(value, TensorRef):
                out[key] = value
                continue
            stored = self._infos_of(optim[0])[value.name]
            if stored.shape == ():
                pieces, _, dtype = self._whole(optim[0], value)
                out[key] = self._present(f"optim.state.{name}.{key}", (), pieces, dtype)
                continue
            pieces = []
            for s in segments:
                ref = states[s.rank].get(s.flat, {}).get(key) if isinstance(states[s.rank].get(s.flat), dict) else None
                if not isinstance(ref, TensorRef) or \
                        self._infos_of(optim[s.rank])[ref.name].shape != (self._flat_numels[s.rank][s.flat],):
                    raise CorruptCheckpointError(f"{optim[s.rank].path}: the optimizer's {key!r} of flat group "
                                                 f"{s.flat} is missing or not shaped like its partition")
                pieces.append(_Piece(self._index[id(optim[s.rank])], ref.name, s.start, s.at, s.count))
            out[key] = self._present(f"optim.state.{name}.{key}", self._infos[f"model.{name}"].shape, pieces,
                                     stored.dtype)
        return out

    def _facts(self, m0: dict) -> dict:
        facts = {"zero_stage": self.stage, "world_size": self.world_size, "tag": os.path.basename(self.path)}
        for key in ("global_steps", "global_samples", "skipped_steps", "ds_version", "ds_config", "lr_scheduler"):
            if _plain(m0.get(key)):
                facts[key] = m0.get(key)
        return facts

    # --- the read interface ----------------------------------------------------------------------------------

    def tensors(self) -> Mapping[str, TensorInfo]:
        return dict(self._infos)

    def tree(self) -> Any:
        return self._tree

    def read(self, requests: Sequence[ReadRequest]) -> None:
        checked = check_requests(self._infos, requests, self.path)
        per_file: dict[int, list[ReadRequest]] = defaultdict(list)
        for c in checked:
            pieces = self._pieces[c.info.name]
            starts = [p.at for p in pieces]  # in order: the pieces tile the tensor
            for start, local, count in contiguous_runs(c.region, c.info.shape):
                # only the pieces the run overlaps (a row-wise region of a ZeRO-3 tensor has many runs, many pieces)
                for j in range(max(0, bisect.bisect_right(starts, start) - 1), len(pieces)):
                    p = pieces[j]
                    if p.at >= start + count:
                        break
                    lo, hi = max(start, p.at), min(start + count, p.at + p.count)
                    if lo < hi:
                        per_file[p.file].append(ReadRequest(p.tensor, FlatRange(p.start + lo - p.at, p.start + hi - p.at),
                                                            c.flat[local + lo - start:local + hi - start]))
        for f, reqs in per_file.items():
            self._files[f].read(reqs)


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data (what a checkpoint's tree holds besides tensors), all the way down."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if not all(isinstance(k, (str, int, float, bool, type(None))) for k in node):
                return False
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif not isinstance(node, (str, int, float, bool, type(None))):
            return False
    return True
