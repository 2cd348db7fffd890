"""Rank functions for ``convert --format dcp``'s FSDP2 test: torch FSDP2 trains and saves with ``shardckpt.save``
(its ``get_state_dict`` state), and a fresh FSDP2 run at another world size loads the converted DCP checkpoint
with torch's own ``dcp.load`` and ``set_state_dict``, then trains on."""
from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardckpt
from tests.runtime import _model
from tests.state_dict._interop import fsdp2_run
from tests.state_dict._train import steps

BEFORE, AFTER = 2, 3


def train_save_and_go_on(path: str) -> list[float]:
    """BEFORE steps, ``shardckpt.save`` of the model and optimizer state, AFTER more steps: their losses."""
    batches = _model.make_batches(BEFORE + AFTER)
    model, optim = fsdp2_run()
    steps(model, optim, batches[:BEFORE])
    msd, osd = get_state_dict(model, optim)
    shardckpt.save({"model": msd, "optim": osd}, path)
    return steps(model, optim, batches[BEFORE:])


def load_dcp_and_go_on(dcp_dir: str) -> list[float]:
    """A fresh FSDP2 run (other initial values) resumed from the DCP checkpoint by torch: the AFTER steps' losses."""
    batches = _model.make_batches(BEFORE + AFTER)
    model, optim = fsdp2_run()
    for p in model.parameters():  # other values than the saved run's start, so that the load must matter
        p.data.add_(1.0)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return steps(model, optim, batches[BEFORE:])
