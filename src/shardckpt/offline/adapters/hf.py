"""``hf``: Hugging Face's own names and layouts, both ways: every weight as it is. With ``convert``, an HF
directory becomes a checkpoint a run starts from (its weights under ``model``, as ``load_state`` reads them).
With ``tie_word_embeddings`` (``hf:config=DIR``, or ``hf:tie_word_embeddings=true``), a directory that leaves
``lm_head.weight`` out (``save_pretrained`` of a tied model) presents it as the embedding, so that
``load({"model": model.state_dict()}, path)`` finds every key the model has."""
from __future__ import annotations

from shardckpt.offline.adapters.base import Adapter, Rule

SAME = Adapter("hf", (Rule(r"(.+)", r"\1"),), retied=("model.embed_tokens.weight", "lm_head.weight"))

FAMILIES = {"hf": (SAME, SAME)}  # name -> (to HF, from HF)
