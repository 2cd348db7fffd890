"""The classes DeepSpeed's checkpoint pickles name, admitted by name as inert stand-ins.

DeepSpeed's ``*_states.pt`` files are ``torch.save`` archives whose pickles name, besides torch's own tensor
rebuild functions and ``collections.OrderedDict``, three DeepSpeed classes. They are read with
``torch.load(weights_only=True)`` (torch's restricted unpickler) with exactly these three admitted, each as
``(stand_in, "deepspeed.module.Name")``: the pickle's object is built as the stand-in below, DeepSpeed is never
imported (it need not be installed), and any other class or callable in a file is refused, so no code in a
file runs. What the reader uses of them: ``ZeroStageEnum``'s value; ``fragment_address`` and ``LossScaler``
are carried but not needed.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any


class ZeroStageEnum(enum.IntEnum):
    """``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as a call with the stage number)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class FragmentAddress:
    """``deepspeed.utils.tensor_fragment.fragment_address``: where a parameter starts in a rank's partition."""

    def __init__(self, numel: Any = None, start: Any = None) -> None:
        self.numel, self.start = numel, start


class LossScaler:
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (and its dynamic kin): its attributes, nothing else."""


SAFE_GLOBALS = [
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    OrderedDict,
]
