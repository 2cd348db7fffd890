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
  ZeRO-1: from the saved module, which holds them whole); tied parameters (``shared_params``, or the same
  tensor in the file) as their target; buffers and any other module entry as saved, in their saved dtype;
  a ZeRO-3 placeholder that is none of these is refused by name, never presented (``formats.deepspeed.model``);
- ``optim.state.<name>.<key>``: the optimizer's per-element state (``exp_avg``, ``exp_avg_sq``...) of every
  trainable parameter, located in the same partitions, and its scalars (``step``) per parameter, as a torch
  optimizer keyed by name holds them; ``optim.param_groups``: the saved groups' hyper-parameters, ``params``
  naming each group's parameters (``param_shapes``; tied ones by their primary name, frozen ones in none), a
  tensor hyper-parameter (a tensor ``lr``) presented as the tensor ``optim.param_groups.<g>.<key>``;
- ``deepspeed``: plain facts (ZeRO stage, data-parallel world size, ``global_steps``, DeepSpeed's version and
  config, the LR scheduler's state); a client state's plain top-level values as they are.

Safety: each file is read by ``TorchSaveReader`` with ``torch.load(weights_only=True)`` and exactly the classes
of ``formats.deepspeed.unpickle`` admitted as inert stand-ins: a file naming anything else is refused
(``CorruptCheckpointError`` naming it) before any of it is built, and nothing in it runs. Every field taken
from a pickle is checked before use (``formats.deepspeed.fields``), so damage is a ``CorruptCheckpointError``
naming the file and the field; rank numbers in file names cost nothing beyond the files. Every zip record's
CRC-32 is checked on the first read from a file. Memory: files are memory-mapped; only their pickles are held,
and the pages a read touches are given back after it, so converting never holds more than what the caller's
buffers hold, much less than one rank file. Local paths only (``torch.load`` maps the files).
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, Sequence

import torch

from shardckpt.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.formats.api import Facts, ReadRequest, TensorInfo
from shardckpt.formats.deepspeed.catalog import Catalog
from shardckpt.formats.deepspeed.fields import (
    COUNTS, LIST, MAPPING, NAMED, PADDINGS, TENSORS, plain, root, take,
)
from shardckpt.formats.deepspeed.model import ModelStates, shapes
from shardckpt.formats.deepspeed.partitions import zero3_segments, zero12_segments
from shardckpt.formats.torch_save import TorchSaveReader, local_path
from shardckpt.formats.untrusted import shown
from shardckpt.regions import Run

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
        top = os.path.abspath(local_path(path))
        found = tag_dir(top)
        if found is None:
            raise CheckpointError(f"{top}: no DeepSpeed ZeRO checkpoint here (no *_optim_states.pt files, nor a "
                                  f"'{LATEST}' file naming a directory with them)")
        self.path = found
        self._cat = cat = Catalog(found)
        optim, osd = self._open_optim_files()
        self.world_size = len(optim)
        self.stage = self._stage(osd[0], optim[0])
        model = self._open_model_states()
        m0, f0 = model.m0, model.files[0]
        self._check_model_states(m0, f0)
        group_shapes = [shapes(s, f0.path, f"param_shapes[{g}]")
                        for g, s in enumerate(take(m0, "param_shapes", LIST, f0.path))]
        key = "single_partition_of_fp32_groups" if self.stage <= 2 else "fp32_flat_groups"
        flats = [[r.name for r in take(o, key, TENSORS, f.path)] for o, f in zip(osd, optim)]
        self._flat_numels = [[cat.numel(f, t) for t in fl] for f, fl in zip(optim, flats)]
        flat_dtype = cat.infos_of(optim[0])[flats[0][0]].dtype if flats[0] else torch.float32
        if self.stage <= 2:
            for f, fl in zip(optim, flats):
                if len(fl) != len(group_shapes):
                    raise CorruptCheckpointError(f"{f.path}: {len(fl)} fp32 partitions for {len(group_shapes)} param "
                                                 "groups (param_shapes)")
            paddings = take(osd[0], "param_alignment_paddings", PADDINGS, optim[0].path, default=None)
            segments = zero12_segments(group_shapes, self._flat_numels, paddings, self.path)
            base = [take(o, "base_optimizer_state", MAPPING, f.path) for o, f in zip(osd, optim)]
        else:
            sizes = self._flat_numels
            if any(s != sizes[0] for s in sizes):
                raise CorruptCheckpointError(f"{self.path}: the ranks' fp32_flat_groups differ in size: {sizes}")
            every = {n: s for group in group_shapes for n, s in group.items()}
            segments = zero3_segments(every, sizes[0], self.world_size, self.path)
            base = [take(o, "optimizer_state_dict", MAPPING, f.path) for o, f in zip(osd, optim)]
        trainable = {n: (s, [cat.piece(g, optim[g.source[0]], flats[g.source[0]][g.source[1]])
                             for g in segments[n]], flat_dtype)
                     for group in group_shapes for n, s in group.items()}
        model_tree = model.model_tree(trainable)
        optim_tree = self._optim(group_shapes, segments, base, optim)
        self._tree = {"model": model_tree, "optim": optim_tree, "deepspeed": self._facts(m0)}
        for name, value in m0.items():
            if name not in _ENGINE_KEYS and name not in self._tree and plain(value):
                self._tree[name] = value

    # --- files ---------------------------------------------------------------------------------------------

    def _open_optim_files(self) -> tuple[list[TorchSaveReader], list[dict]]:
        """Every rank's optimizer states file, in rank order, and its ``optimizer_state_dict``."""
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
        # ranks 0 .. n-1 for the n files here (a rank number beyond them is a missing rank, however large)
        missing = [r for r in range(len(by_rank)) if r not in by_rank]
        if missing:
            raise CorruptCheckpointError(f"{self.path}: the optimizer state files of rank(s) {shown(missing)} are "
                                         f"missing (found ranks {shown(sorted(by_rank))})")
        files = [self._cat.open(by_rank[r]) for r in range(len(by_rank))]
        osd = [take(root(f.tree(), f.path), "optimizer_state_dict", MAPPING, f.path) for f in files]
        count = take(osd[0], "partition_count", COUNTS, files[0].path)
        count = max(count) if isinstance(count, (list, tuple)) else count
        if count != len(files):
            raise CorruptCheckpointError(f"{files[0].path}: partition_count is {count!r}, but {len(files)} ranks' "
                                         "optimizer state files are here (a save that did not finish, or another "
                                         "save's files mixed in?)")
        return files, osd

    def _open_model_states(self) -> ModelStates:
        """The model states that name the parameters (ZeRO-3: rank 0's; the other ranks' are opened only for their
        pieces of frozen parameters, ``ModelStates.rank_files``)."""
        if self.stage <= 2:
            return ModelStates(self._cat, self.stage, self.world_size, self._cat.open(MODEL_FILE_12), MODEL_FILE_3)
        for r in range(1, self.world_size):
            if not os.path.isfile(os.path.join(self.path, MODEL_FILE_3.format(r))):
                raise CorruptCheckpointError(f"{os.path.join(self.path, MODEL_FILE_3.format(r))}: missing (the "
                                             f"DeepSpeed checkpoint in {self.path} needs it)")
        return ModelStates(self._cat, self.stage, self.world_size, self._cat.open(MODEL_FILE_3.format(0)),
                           MODEL_FILE_3)

    @staticmethod
    def _stage(osd: dict, f: TorchSaveReader) -> int:
        stage = osd.get("zero_stage")
        if stage is None and "single_partition_of_fp32_groups" in osd:
            stage = 1  # DeepSpeed's bf16 optimizer (ZeRO-1 layout) does not record it
        if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2, 3):
            raise IncompatibleCheckpointError(f"{f.path}: zero_stage is {shown(stage)}; ZeRO stages 1, 2 and 3 are "
                                              "read")
        return int(stage)

    def _check_model_states(self, m0: dict, f: TorchSaveReader) -> None:
        mp = m0.get("mp_world_size", 1)
        if mp not in (None, 1) or isinstance(mp, bool):
            raise IncompatibleCheckpointError(f"{f.path}: mp_world_size is {shown(mp)}; tensor- and pipeline-"
                                              "parallel DeepSpeed checkpoints are not read (only data-parallel ZeRO)")
        dp = m0.get("dp_world_size")
        if dp is not None and (dp != self.world_size or isinstance(dp, bool)):
            raise CorruptCheckpointError(f"{f.path}: dp_world_size is {shown(dp)}, but {self.world_size} ranks' "
                                         "optimizer state files are here")

    # --- what the reader presents ----------------------------------------------------------------------------

    def _optim(self, group_shapes: list[dict], segments: dict[str, list[Run]], base: list[dict],
               optim: list[TorchSaveReader]) -> dict:
        states = [take(b, "state", MAPPING, f.path, field="the optimizer's 'state'", default={})
                  for b, f in zip(base, optim)]
        groups = take(base[0], "param_groups", LIST, optim[0].path, field="the optimizer's 'param_groups'")
        if len(groups) != len(group_shapes) or not all(NAMED.test(g) for g in groups):
            raise CorruptCheckpointError(f"{optim[0].path}: the optimizer records {shown(groups)} as its param "
                                         f"groups, for {len(group_shapes)} groups of parameters (param_shapes)")
        state: dict[str, Any] = {}
        if any(states):
            for g, group in enumerate(group_shapes):
                for name in group:
                    state[name] = self._param_state(name, segments[name], g if self.stage <= 2 else 0, states, optim)
        param_groups = [{**{k: self._cat.value(v, ("optim", "param_groups", g, k), optim[0])
                            for k, v in group.items() if k != "params"}, "params": list(shapes_)}
                        for g, (group, shapes_) in enumerate(zip(groups, group_shapes))]
        return {"state": state, "param_groups": param_groups}

    def _param_state(self, name: str, segments: list[Run], flat: int, states: list[dict],
                     optim: list[TorchSaveReader]) -> dict:
        """A parameter's optimizer state: per-element tensors from its segments (source: rank, flat), scalars from
        its first flat's (``flat`` for a parameter without elements)."""
        cat, first = self._cat, segments[0].source[1] if segments else flat
        entry = states[0].get(first)
        if not NAMED.test(entry):
            raise CorruptCheckpointError(f"{optim[0].path}: the optimizer's state of flat group {first} (holding "
                                         f"{name!r}) is {'missing' if entry is None else shown(entry)}, not a "
                                         "mapping by name")
        out: dict[str, Any] = {}
        for key, value in entry.items():
            where = ("optim", "state", name, key)
            stored = cat.infos_of(optim[0])[value.name] if isinstance(value, TensorRef) else None
            if stored is None or stored.shape == ():
                out[key] = cat.value(value, where, optim[0])  # a scalar (step), a 0-d tensor, a plain value
                continue
            pieces = []
            for s in segments:
                rank, flat = s.source
                ref = states[rank].get(flat)
                ref = ref.get(key) if isinstance(ref, dict) else None
                if not isinstance(ref, TensorRef) or \
                        cat.infos_of(optim[rank])[ref.name].shape != (self._flat_numels[rank][flat],):
                    raise CorruptCheckpointError(f"{optim[rank].path}: the optimizer's {key!r} of flat group "
                                                 f"{flat} is missing or not shaped like its partition")
                pieces.append(cat.piece(s, optim[rank], ref.name))
            out[key] = cat.present(f"optim.state.{name}.{key}", cat.infos[f"model.{name}"].shape, pieces,
                                   stored.dtype)
        return out

    def _facts(self, m0: dict) -> dict:
        facts = {"zero_stage": self.stage, "world_size": self.world_size, "tag": os.path.basename(self.path)}
        for key in ("global_steps", "global_samples", "skipped_steps", "ds_version", "ds_config", "lr_scheduler"):
            if plain(m0.get(key)):
                facts[key] = m0.get(key)
        return facts

    # --- the read interface ----------------------------------------------------------------------------------

    def tensors(self) -> Mapping[str, TensorInfo]:
        return dict(self._cat.infos)

    def facts(self) -> Facts:
        return Facts("DeepSpeed", self.path, world_size=self.world_size)

    def tree(self) -> Any:
        return self._tree

    def read(self, requests: Sequence[ReadRequest]) -> None:
        self._cat.read(requests)
