"""An export loads in Hugging Face transformers as its own save does: a Llama trained sharded with the runtime
(FULL_SHARD, ws 2, tied embedding and head), saved as LOCAL and exported: at the job's dtype (fp32)
``from_pretrained`` gives the trained model's own logits bit for bit; in bf16, no missing or unexpected keys,
every weight equal to the job's weight cast, and the same logits as transformers' own bf16 save."""
from __future__ import annotations

import torch
import transformers

import shardckpt
from shardckpt import FullStateDictConfig, StateDictType
from shardckpt.offline.export import export
from tests._dist import run_ranks


def _config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=True)


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))


def _train_sharded_and_save(path: str) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardckpt.runtime import shard

    torch.manual_seed(0)
    model = shard(transformers.LlamaForCausalLM(_config()), wrap=(LlamaDecoderLayer,))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        optim.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
    shardckpt.save_state(model, optim, path, type=StateDictType.LOCAL_STATE_DICT)
    full = shardckpt.get_state_dict(model, type=StateDictType.FULL_STATE_DICT,
                                    config=FullStateDictConfig(rank0_only=True))["model"]
    with torch.no_grad():
        logits = model.eval()(input_ids=IDS).logits  # the trained, sharded model's own answer
    return {"weights": {k: v.clone() for k, v in full.items()}, "logits": logits}


def test_transformers_loads_a_runtime_checkpoints_export_as_its_own_save(tmp_path):
    trained = run_ranks(2, _train_sharded_and_save, str(tmp_path / "local"), timeout=300)[0]
    weights = trained["weights"]

    export(tmp_path / "local", tmp_path / "fp32")  # the same dtype as the job: the same logits
    _config().save_pretrained(tmp_path / "fp32")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, trained["logits"])

    report = export(tmp_path / "local", tmp_path / "hf", dtype="bfloat16", max_shard_size="100KB")
    assert len(report.files) > 1 and report.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    _config().save_pretrained(tmp_path / "hf")
    ours, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16,
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for name, value in ours.state_dict().items():
        assert torch.equal(value, weights[name].to(torch.bfloat16)), name
    own = transformers.LlamaForCausalLM(_config())
    own.load_state_dict(weights)
    own.to(torch.bfloat16).save_pretrained(tmp_path / "hf-own")  # transformers' own bf16 save of the weights
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf-own", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours.eval()(input_ids=IDS).logits, theirs.eval()(input_ids=IDS).logits)
