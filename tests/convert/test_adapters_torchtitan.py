"""The torchtitan-llama adapter against torchtitan's own ``Llama3StateDictAdapter`` (torchtitan 0.2.2 from PyPI):
from the DCP checkpoint a torchtitan-style FSDP2 job (torchtitan's Llama model, fully_shard on 2 gloo ranks, a
few training steps) saved, ``export --adapter`` writes what ``to_hf`` gives, bit for bit, names and all; the
way back (``--reverse``) gives what ``from_hf`` gives; and transformers' Llama loads the export with
torchtitan's logits (up to fp32 rounding: the two rotary implementations differ in the last bits)."""
from __future__ import annotations

import json

import torch
import transformers
from safetensors.torch import load_file

from shardckpt.offline.export import INDEX_NAME, export
from tests._dist import run_ranks
from tests.convert import _torchtitan as titan

IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))


def _train_and_save(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = titan.fully_sharded(titan.new_model())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        optim.zero_grad()
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:]).backward()
        optim.step()
    dcp.save(get_model_state_dict(model), checkpoint_id=path)  # what torchtitan's checkpointer saves (model only)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        logits = model(IDS)
    return {"weights": {k: v.clone() for k, v in full.items()}, "logits": logits}


def _hf_config(tie: bool = False) -> transformers.LlamaConfig:
    a = titan.model_args()
    ffn = titan.Transformer(a).layers["0"].feed_forward.w1.weight.shape[0]
    return transformers.LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=ffn,
                                    num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
                                    num_key_value_heads=a.n_kv_heads, rms_norm_eps=a.norm_eps,
                                    rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta},
                                    max_position_embeddings=a.max_seq_len, tie_word_embeddings=tie)


def test_export_of_a_torchtitan_fsdp2_checkpoint_equals_torchtitans_to_hf(tmp_path):
    trained = run_ranks(2, _train_and_save, str(tmp_path / "dcp"), timeout=300)[0]
    want = titan.adapter().to_hf(trained["weights"])
    _hf_config().save_pretrained(tmp_path / "cfg")
    report = export(tmp_path / "dcp", tmp_path / "hf", adapter=f"torchtitan-llama:config={tmp_path / 'cfg'}",
                    max_shard_size="40KB")
    got = {k: v for f in report.files for k, v in load_file(tmp_path / "hf" / f).items()}
    assert list(got) == list(want)  # names and order
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items())
    assert set(json.loads((tmp_path / "hf" / INDEX_NAME).read_text())["weight_map"]) == set(want)

    _hf_config().save_pretrained(tmp_path / "hf")
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=IDS).logits, trained["logits"], rtol=1e-4, atol=1e-5)

    back = export(tmp_path / "hf", tmp_path / "titan", reverse=True,
                  adapter=f"torchtitan-llama-0.2:config={tmp_path / 'cfg'}")
    theirs = titan.adapter().from_hf(dict(got))
    ours = load_file(tmp_path / "titan" / back.files[0])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], v) for k, v in theirs.items())


def test_current_torchtitan_names_export_as_the_older_ones_do(tmp_path):
    weights = titan.new_model(seed=5).state_dict()
    renamed = {k.replace(".attention.w", ".attention.qkv_linear.w").replace("output.", "lm_head.")
               .replace("qkv_linear.wo", "wo"): v for k, v in weights.items()}
    assert "layers.0.attention.qkv_linear.wq.weight" in renamed and "lm_head.weight" in renamed
    torch.save(renamed, tmp_path / "current.pt")
    export(tmp_path / "current.pt", tmp_path / "hf", adapter="torchtitan-llama:n_heads=4,n_kv_heads=2")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = titan.adapter().to_hf(weights)
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
