"""``phi3-fused``: fused projections (Phi-3's ``self_attn.qkv_proj``, ``mlp.gate_up_proj``) <-> the separate ones
of Hugging Face's ``LlamaForCausalLM`` (``q_proj`` / ``k_proj`` / ``v_proj``, ``gate_proj`` / ``up_proj``): a
split along dim 0, and a merge back. Options: ``n_heads``, ``n_kv_heads`` (config.json:
``num_attention_heads``, ``num_key_value_heads``); the q, k and v rows are ``n_heads``, ``n_kv_heads`` and
``n_kv_heads`` heads."""
from __future__ import annotations

from shardckpt.errors import IncompatibleCheckpointError
from shardckpt.offline.adapters.base import Adapter, Opts, Part, Rule, Shape, Split, option

OPTIONS = {"n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads"}
L = r"(model\.layers\.\d+\.)"


def qkv_rows(shape: Shape, opts: Opts) -> list[int]:
    heads, kv = option(opts, "n_heads", "qkv_proj"), option(opts, "n_kv_heads", "qkv_proj")
    hidden = shape[1] if len(shape) == 2 else 0
    head = hidden // heads  # head_dim = hidden // n_heads: a wrong count that divides the rows is refused here
    if hidden % heads or shape[0] != (heads + 2 * kv) * head:
        raise IncompatibleCheckpointError(f"qkv_proj of shape {list(shape)}: its rows are not {heads} + 2 x {kv} "
                                          f"heads of {hidden} columns / {heads}; check n_heads and n_kv_heads")
    return [heads * head, kv * head, kv * head]


def halves(shape: Shape, opts: Opts) -> list[int]:
    rows = shape[0] if shape else 0
    return [rows // 2, rows - rows // 2] if rows % 2 == 0 else [rows, -1]  # an odd count: refused by Split


TO_HF = Adapter("phi3-fused", (
    Rule(L + r"self_attn\.qkv_proj\.weight", (r"\1self_attn.q_proj.weight", r"\1self_attn.k_proj.weight",
                                                r"\1self_attn.v_proj.weight"), Split(qkv_rows, 3)),
    Rule(L + r"mlp\.gate_up_proj\.weight", (r"\1mlp.gate_proj.weight", r"\1mlp.up_proj.weight"), Split(halves, 2)),
    Rule(r"(.+)", r"\1"),
), OPTIONS, tied=("model.embed_tokens.weight", "lm_head.weight"))

FROM_HF = Adapter("phi3-fused (from HF)", (
    Rule(L + r"self_attn\.q_proj\.weight", r"\1self_attn.qkv_proj.weight", Part(0, 3)),
    Rule(L + r"self_attn\.k_proj\.weight", r"\1self_attn.qkv_proj.weight", Part(1, 3)),
    Rule(L + r"self_attn\.v_proj\.weight", r"\1self_attn.qkv_proj.weight", Part(2, 3)),
    Rule(L + r"mlp\.gate_proj\.weight", r"\1mlp.gate_up_proj.weight", Part(0, 2)),
    Rule(L + r"mlp\.up_proj\.weight", r"\1mlp.gate_up_proj.weight", Part(1, 2)),
    Rule(r"(.+)", r"\1"),
), OPTIONS)


FAMILIES = {"phi3-fused": (TO_HF, FROM_HF)}  # name -> (to HF, from HF)
