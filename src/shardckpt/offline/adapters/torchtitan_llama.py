"""``torchtitan-llama``: torchtitan's Llama 3 <-> Hugging Face's ``LlamaForCausalLM``, as torchtitan's own
``Llama3StateDictAdapter.to_hf`` / ``from_hf`` do it: renames, and the q/k rotary permutation.

Both torchtitan's current names (0.3: ``layers.N.attention.qkv_linear.wq``, ``lm_head``) and the older ones
(0.2: ``layers.N.attention.wq``, ``output``) are read; the way back writes the current ones
(``torchtitan-llama``) or the older ones (``torchtitan-llama-0.2``). Options: ``n_heads``, ``n_kv_heads`` (config.json: ``num_attention_heads``,
``num_key_value_heads``; checked against wq's and wk's shapes: head_dim = dim // n_heads, as torchtitan's Llama
has it), ``tie_word_embeddings`` (``lm_head.weight`` then written once, as the embedding; on
the way back, an HF directory without it gives torchtitan's head as the embedding, as ``from_hf`` does).
"""
from __future__ import annotations

from shardckpt.offline.adapters.base import Adapter, RopePermute, Rule

OPTIONS = {"n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads"}
L = r"layers\.(\d+)\."
HF = r"model.layers.\1."
ATTN = r"attention\.(?:qkv_linear\.)?"

TO_HF = Adapter("torchtitan-llama", (
    Rule(r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    Rule(L + ATTN + r"wq\.weight", HF + "self_attn.q_proj.weight", RopePermute("n_heads", width_heads="n_heads")),
    Rule(L + ATTN + r"wk\.weight", HF + "self_attn.k_proj.weight", RopePermute("n_kv_heads", width_heads="n_heads")),
    Rule(L + ATTN + r"wv\.weight", HF + "self_attn.v_proj.weight"),
    Rule(L + r"attention\.wo\.weight", HF + "self_attn.o_proj.weight"),
    Rule(L + r"feed_forward\.w1\.weight", HF + "mlp.gate_proj.weight"),
    Rule(L + r"feed_forward\.w3\.weight", HF + "mlp.up_proj.weight"),
    Rule(L + r"feed_forward\.w2\.weight", HF + "mlp.down_proj.weight"),
    Rule(L + r"attention_norm\.weight", HF + "input_layernorm.weight"),
    Rule(L + r"ffn_norm\.weight", HF + "post_attention_layernorm.weight"),
    Rule(r"norm\.weight", "model.norm.weight"),
    Rule(r"(?:output|lm_head)\.weight", "lm_head.weight"),
    Rule(r"freqs_cis", None),  # a buffer older torchtitan saved; HF recomputes it
), OPTIONS, tied=("model.embed_tokens.weight", "lm_head.weight"))


def from_hf(qkv: str, head: str, name: str) -> Adapter:
    H, T = r"model\.layers\.(\d+)\.", r"layers.\1."
    return Adapter(name, (
        Rule(r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
        Rule(H + r"self_attn\.q_proj\.weight", T + qkv + "wq.weight", RopePermute("n_heads", True, "n_heads")),
        Rule(H + r"self_attn\.k_proj\.weight", T + qkv + "wk.weight", RopePermute("n_kv_heads", True, "n_heads")),
        Rule(H + r"self_attn\.v_proj\.weight", T + qkv + "wv.weight"),
        Rule(H + r"self_attn\.o_proj\.weight", T + "attention.wo.weight"),
        Rule(H + r"mlp\.gate_proj\.weight", T + "feed_forward.w1.weight"),
        Rule(H + r"mlp\.up_proj\.weight", T + "feed_forward.w3.weight"),
        Rule(H + r"mlp\.down_proj\.weight", T + "feed_forward.w2.weight"),
        Rule(H + r"input_layernorm\.weight", T + "attention_norm.weight"),
        Rule(H + r"post_attention_layernorm\.weight", T + "ffn_norm.weight"),
        Rule(H + r"self_attn\.rotary_emb\.inv_freq", None),
        Rule(r"model\.norm\.weight", "norm.weight"),
        Rule(r"lm_head\.weight", head + ".weight"),
    ), OPTIONS, retied=("tok_embeddings.weight", head + ".weight"))


FAMILIES = {  # name -> (to HF, from HF)
    "torchtitan-llama": (TO_HF, from_hf("attention.qkv_linear.", "lm_head", "torchtitan-llama (from HF)")),
    "torchtitan-llama-0.2": (TO_HF, from_hf("attention.", "output", "torchtitan-llama-0.2 (from HF)")),
}
