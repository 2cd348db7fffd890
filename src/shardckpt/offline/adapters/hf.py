"""``hf``: Hugging Face's own names and layouts, both ways: every weight as it is. With ``convert``, an HF
directory becomes a checkpoint a run starts from (its weights under ``model``, as ``load_state`` reads them)."""
from __future__ import annotations

from shardckpt.offline.adapters.base import Adapter, Rule

SAME = Adapter("hf", (Rule(r"(.+)", r"\1"),))

FAMILIES = {"hf": (SAME, SAME)}  # name -> (to HF, from HF)
