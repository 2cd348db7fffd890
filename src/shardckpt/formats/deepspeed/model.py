"""The model a DeepSpeed checkpoint holds, by parameter name: ``model_tree``.

Each entry of the saved ``module`` is presented as what it is:

- a trainable parameter (``param_shapes``): from the fp32 partitions (the caller's ``trainable`` pieces);
- a frozen one (``frozen_param_shapes``): from ``frozen_param_fragments`` (ZeRO-1/2 checkpoints without them:
  the saved module, which holds it whole);
- a tied one: as its target, named by ``shared_params`` or, where DeepSpeed did not record the tie, found in
  the file itself: ``torch.save`` keeps a tensor saved under two names one tensor (the same view of the same
  storage), so an entry that is the same tensor as a trainable or frozen parameter is that parameter;
- a buffer (``buffer_names``), or any other entry: as saved, in its saved dtype (0-element ones too).

Under ZeRO-3 every parameter in ``module`` is an empty placeholder (shape ``(0,)``), never a value. A placeholder
that none of the above resolves (a frozen parameter of a DeepSpeed that did not record them, a tie without
``shared_params`` whose placeholder is not shared in the file) has no value anywhere in the checkpoint: it is
refused by name (``IncompatibleCheckpointError``) rather than presented as a 0-element tensor.
"""
from __future__ import annotations

import math
from typing import Any

from shardckpt.errors import CorruptCheckpointError, IncompatibleCheckpointError
from shardckpt.format.tree import TensorRef
from shardckpt.format.validate import MAX_NUMEL
from shardckpt.formats.deepspeed.catalog import Catalog
from shardckpt.formats.deepspeed.fields import MAPPING, NAME_MAP, NAMED, NAMES, TENSOR_MAP, root, take
from shardckpt.formats.deepspeed.partitions import zero3_pieces
from shardckpt.formats.torch_save import TorchSaveReader
from shardckpt.formats.untrusted import shown
from shardckpt.regions import Run


def shapes(node: Any, where: str, what: str) -> dict[str, tuple[int, ...]]:
    """A mapping of parameter names to shapes (``param_shapes[g]``, ``frozen_param_shapes``), checked."""
    if not isinstance(node, dict):
        raise CorruptCheckpointError(f"{where}: {what} is {shown(node)}, not a mapping of parameter shapes")
    out = {}
    for name, shape in node.items():
        if not isinstance(name, str) or not isinstance(shape, (tuple, list)) or \
                not all(type(s) is int and s >= 0 for s in shape) or \
                math.prod(max(s, 1) for s in shape) > MAX_NUMEL:
            raise CorruptCheckpointError(f"{where}: {what} gives {shown(name)} the shape {shown(shape)}")
        out[name] = tuple(shape)
    return out


class ModelStates:
    """The model states files of one checkpoint: rank 0's (``files[0]``), and for ZeRO-3 every rank's, opened on
    first need (``rank_files``: unpickling them is most of the opening time)."""

    def __init__(self, cat: Catalog, stage: int, world_size: int, first: TorchSaveReader, rank_name: str):
        self.cat, self.stage, self.world_size, self.rank_name = cat, stage, world_size, rank_name
        self.files = [first]
        self.m0 = root(first.tree(), first.path)

    def rank_files(self) -> list[TorchSaveReader]:
        while len(self.files) < self.world_size:
            self.files.append(self.cat.open(self.rank_name.format(len(self.files))))
        return self.files

    def model_tree(self, trainable: dict[str, tuple[tuple[int, ...], list[Run], Any]]) -> dict:
        """``{name: value}`` in the module's order; ``trainable``: each trainable parameter's shape, pieces, dtype."""
        f0, cat = self.files[0], self.cat
        module = take(self.m0, "module", NAMED, f0.path)
        frozen = shapes(take(self.m0, "frozen_param_shapes", MAPPING, f0.path, default={}), f0.path,
                        "frozen_param_shapes")
        shared = take(self.m0, "shared_params", NAME_MAP, f0.path, default={})
        buffers = set(take(self.m0, "buffer_names", NAMES, f0.path, default=()))
        names = list(module) + [n for n in list(trainable) + list(frozen) if n not in module]
        out: dict[str, Any] = {}
        later = []
        for name in names:
            if name in trainable:
                shape, pieces, dtype = trainable[name]
                out[name] = cat.present(f"model.{name}", shape, pieces, dtype)
            elif name in frozen:
                pieces, dtype = self._frozen(name, frozen[name], module)
                out[name] = cat.present(f"model.{name}", frozen[name], pieces, dtype)
            elif name in shared or (name not in buffers and isinstance(module[name], TensorRef)):
                later.append(name)  # a tie, once every parameter is presented
            else:
                out[name] = cat.value(module[name], ("model", name), f0)
        ties = self._ties(module, [n for n in names if n in trainable or n in frozen])
        placeholders = []
        for name in later:
            target = shared.get(name) or ties.get(name)
            if target is not None:
                if f"model.{target}" not in cat.infos:
                    raise CorruptCheckpointError(f"{f0.path}: shared_params ties {name!r} to {target!r}, which the "
                                                 "checkpoint does not hold")
                out[name] = cat.alias(f"model.{name}", f"model.{target}")
            elif self.stage == 3 and not math.prod(cat.infos_of(f0)[module[name].name].shape):
                placeholders.append(name)
            else:
                out[name] = cat.value(module[name], ("model", name), f0)
        if placeholders:
            raise IncompatibleCheckpointError(
                f"{f0.path}: the ZeRO-3 checkpoint holds no value for parameter(s) {shown(placeholders)}: the saved "
                "module has only DeepSpeed's empty placeholder for them, and neither param_shapes, "
                "frozen_param_shapes nor shared_params lists them (a frozen parameter saved by a DeepSpeed that did "
                "not record frozen parameters, or a tie it did not record); a buffer would be in buffer_names")
        return {n: out[n] for n in names}

    def _ties(self, module: dict, params: list[str]) -> dict[str, str]:
        """Module entries that are, in the file, the same tensor as parameter ``params`` (name -> parameter)."""
        f0 = self.files[0]
        owner: dict[tuple, str] = {}
        for name in params:
            ref = module.get(name)
            key = f0.view_key(ref.name) if isinstance(ref, TensorRef) else None
            if key is not None:
                owner.setdefault(key, name)
        ties = {}
        for name, ref in module.items():
            key = f0.view_key(ref.name) if isinstance(ref, TensorRef) and name not in params else None
            if key is not None and key in owner:
                ties[name] = owner[key]
        return ties

    def _frozen(self, name: str, shape: tuple, module: dict) -> tuple[list[Run], Any]:
        cat = self.cat
        model = self.rank_files() if self.stage == 3 else self.files
        fragments = [take(root(f.tree(), f.path), "frozen_param_fragments", TENSOR_MAP, f.path, default={})
                     for f in model]
        if self.stage <= 2:
            ref = fragments[0].get(name, module.get(name))  # ZeRO-1 may not keep fragments: the module holds it whole
            if not isinstance(ref, TensorRef) or cat.infos_of(model[0])[ref.name].shape != shape:
                raise CorruptCheckpointError(f"{model[0].path}: the frozen parameter {name!r} (shape {list(shape)}) "
                                             "is not saved whole")
            pieces, _, dtype = cat.whole(model[0], ref)
            return pieces, dtype
        refs = [frag.get(name) for frag in fragments]
        if not all(isinstance(r, TensorRef) for r in refs):
            raise CorruptCheckpointError(f"{self.cat.path}: the frozen parameter {name!r} lacks a rank's piece "
                                         "(frozen_param_fragments)")
        sizes = [math.prod(cat.infos_of(f)[r.name].shape) for f, r in zip(model, refs)]
        return [cat.piece(s, model[s.source[0]], refs[s.source[0]].name)
                for s in zero3_pieces(name, shape, sizes, cat.path)], cat.infos_of(model[0])[refs[0].name].dtype
