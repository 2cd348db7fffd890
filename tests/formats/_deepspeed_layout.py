"""DeepSpeed's ZeRO checkpoint layout written from given tensors, independently of the reader, for layouts and
sizes the real fixtures (``fixtures/deepspeed``) do not show: several param groups, alignment padding, sub-groups
cutting through parameters, 0-d and empty parameters, big files. Plain values only (``zero_stage`` an int), as
``formats.deepspeed.partitions``' docstring describes the layout."""
from __future__ import annotations

import contextlib
import os
import sys
import types

import torch

from shardckpt.formats.deepspeed.unpickle import SAFE_GLOBALS


def write_like_deepspeed(path: str, stage: int, world: int, groups: list[dict[str, torch.Tensor]],
                         cut_subgroups: bool = True, buffers: dict[str, torch.Tensor] | None = None) -> None:
    """A ZeRO-``stage`` checkpoint of ``world`` ranks at ``path`` holding ``groups`` (param groups: name -> fp32
    tensor); Adam-like state ``exp_avg = 2 t``, ``exp_avg_sq = t * t``, ``step = 3``. ``cut_subgroups``: ZeRO-3's
    sub-groups cut through a parameter (DeepSpeed cuts between parameters; its ``zero_to_fp32`` reads only that).
    ``buffers``: the module's buffers (``buffer_names``), saved as they are."""
    os.makedirs(path)
    shapes = [{n: torch.Size(t.shape) for n, t in g.items()} for g in groups]
    flats: list[list[torch.Tensor]] = [[] for _ in range(world)]
    paddings = []
    if stage <= 2:
        for group in groups:
            pads = [i % 2 for i in range(len(group))]  # alignment padding after every other parameter
            parts = [x for (t, p) in zip(group.values(), pads) for x in (t.reshape(-1), torch.full((p,), 9.0))]
            flat = torch.cat(parts)
            flat = torch.cat([flat, torch.full((-len(flat) % (2 * world),), 9.0)])
            paddings.append(pads)
            for r, chunk in enumerate(flat.chunk(world)):
                flats[r].append(chunk.clone())
    else:
        for r in range(world):
            pieces = []
            for t in [t for group in groups for t in group.values()]:
                part = -(-t.numel() // world)
                padded = torch.cat([t.reshape(-1), torch.full((part * world - t.numel(),), 9.0)])
                pieces.append(padded[r * part:(r + 1) * part])
            mine = torch.cat(pieces)
            flats[r] = [s.clone() for s in mine.split([4, len(mine) - 4])] if cut_subgroups else [mine]
    module = {n: (t if stage <= 2 else torch.empty(0)) for g in groups for n, t in g.items()}
    module.update(buffers or {})
    model = {"module": module, "buffer_names": list(buffers or {}), "param_shapes": shapes, "frozen_param_shapes": None,
             "shared_params": {}, "dp_world_size": world, "mp_world_size": 1, "global_steps": 3}
    for r in range(world) if stage == 3 else [None]:
        name = "mp_rank_00_model_states.pt" if r is None else f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        torch.save(model, os.path.join(path, name))
    for r in range(world):
        state = {i: {"step": torch.tensor(3.0), "exp_avg": f * 2, "exp_avg_sq": f * f} for i, f in enumerate(flats[r])}
        groups_saved = [{"lr": 0.1 * (g + 1), "params": [g]} for g in range(len(groups))]
        if stage <= 2:
            osd = {"zero_stage": stage, "partition_count": [world] * len(groups),
                   "single_partition_of_fp32_groups": flats[r], "param_alignment_paddings": paddings,
                   "base_optimizer_state": {"state": state, "param_groups": groups_saved}}
        else:
            osd = {"zero_stage": 3, "partition_count": world, "fp32_flat_groups": flats[r],
                   "optimizer_state_dict": {"state": state, "param_groups": groups_saved}}
        torch.save({"optimizer_state_dict": osd}, os.path.join(path, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


@contextlib.contextmanager
def _pickled_as_deepspeed():
    """While it lasts, ``pickle`` names the stand-ins of ``formats.deepspeed.unpickle`` as DeepSpeed's own classes
    (a module of that name holding each), so that a file read with them saves back as DeepSpeed wrote it."""
    saved = []
    for entry in SAFE_GLOBALS:
        if not isinstance(entry, tuple):
            continue
        cls, full = entry
        module_name, name = full.rsplit(".", 1)
        parts = module_name.split(".")
        for i in range(1, len(parts) + 1):  # importing a module imports its parents
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        module = sys.modules[module_name]
        saved.append((cls, cls.__module__, cls.__qualname__, module_name, name))
        setattr(module, name, cls)
    try:
        for cls, _, _, module_name, name in saved:
            cls.__module__, cls.__qualname__ = module_name, name
        yield
    finally:
        for cls, module, qualname, module_name, _ in saved:
            cls.__module__, cls.__qualname__ = module, qualname
        for module_name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
            if not hasattr(sys.modules[module_name], "__file__"):  # one made above, not a real DeepSpeed
                del sys.modules[module_name]


def load_ds(path: str):
    """A DeepSpeed file as the reader admits it (DeepSpeed's classes as stand-ins), memory-mapped: tensors saved
    under two names stay one tensor, as DeepSpeed saved them."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(path, weights_only=True, mmap=True)


def save_ds(obj, path: str) -> None:
    """``obj`` saved at ``path`` as DeepSpeed would name its classes (through a temporary file: ``path`` may be
    mapped by the ``load_ds`` that read ``obj``)."""
    with _pickled_as_deepspeed():
        torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def resave(path: str, edit) -> None:
    """Apply ``edit`` to the object DeepSpeed file ``path`` holds, and save it back."""
    obj = load_ds(path)
    edit(obj)
    save_ds(obj, path)
