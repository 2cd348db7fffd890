"""Issue 36, item 4: a Llama-style and a GPT-2-style model trained briefly on 2 gloo ranks, under torch FSDP2
(``fully_shard``) and under shardckpt's runtime (``shardckpt.shard``), saved with ``shardckpt.save``, exported
with ``config=``: ``AutoModelForCausalLM.from_pretrained(out)`` with no argument gives the trained model's
logits bit for bit (fp32 export), and in bf16 exactly transformers' own bf16 model of the trained weights.
vLLM needs a GPU: what it checks statically (config fields, index completeness, dtype consistency) is checked
here instead."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import FullStateDictConfig, StateDictType
from shardckpt.formats.safetensors_header import INDEX_NAME
from shardckpt.offline.export import export
from tests._dist import run_ranks

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))


def _config(family: str):
    if family == "llama":  # untied head
        return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False)
    return transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # tied (default)


def _blocks(model) -> list:
    return list(model.model.layers) if hasattr(model, "model") else list(model.transformer.h)


def _train_and_save(family: str, runtime: str, path: str) -> dict:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    if runtime == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from shardckpt.runtime import shard

        model = shard(model, wrap=(type(_blocks(model)[0]),))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    for _ in range(2):
        optim.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
    if runtime == "fsdp2":
        sd = model.state_dict()  # DTensors
        full = {k: v.full_tensor().detach().clone() for k, v in sd.items()}
    else:
        sd = shardckpt.get_state_dict(model, type=StateDictType.SHARDED_STATE_DICT)["model"]
        full = shardckpt.get_state_dict(model, type=StateDictType.FULL_STATE_DICT,
                                        config=FullStateDictConfig(rank0_only=True))["model"]
        full = {k: v.clone() for k, v in full.items()}
    shardckpt.save({"model": sd}, path)
    with torch.no_grad():
        logits = model.eval()(input_ids=IDS).logits  # the trained, sharded model's own answer
    return {"weights": full, "logits": logits}


COMBOS = [(family, runtime) for family in ("llama", "gpt2") for runtime in ("fsdp2", "shardckpt")]


def _train_all(root: str) -> dict:
    """Every combination in one call on the pool (its start, importing transformers, is most of the time)."""
    return {f"{family}-{runtime}": _train_and_save(family, runtime, f"{root}/{family}-{runtime}")
            for family, runtime in COMBOS}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    return root, run_ranks(2, _train_all, str(root), timeout=600)[0]


def vllm_static_check(out) -> None:
    """What vLLM checks before it loads weights: config.json with model_type and architectures, a dtype that is
    every floating-point tensor's, an index naming every tensor of every file (and only existing files), and
    a tied head that is not also stored."""
    from safetensors import safe_open

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] and config["architectures"] and config["dtype"] == config["torch_dtype"]
    files = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / INDEX_NAME).read_text()) if (out / INDEX_NAME).exists() else None
    seen: dict[str, str] = {}
    nbytes = 0
    for name in files:
        with safe_open(out / name, framework="pt") as f:
            assert f.metadata()["format"] == "pt"
            for key in f.keys():
                t = f.get_tensor(key)
                nbytes += t.nbytes
                seen[key] = name
                if t.is_floating_point():
                    assert str(t.dtype) == f"torch.{config['dtype']}", key
    if index is not None:
        assert index["weight_map"] == seen and set(index["weight_map"].values()) == set(files)
        assert index["metadata"]["total_size"] == nbytes
    else:
        assert files == ["model.safetensors"]
    if config.get("tie_word_embeddings"):
        assert "lm_head.weight" not in seen


@pytest.mark.parametrize("family,runtime", COMBOS)
def test_from_pretrained_loads_the_export_of_a_sharded_run_as_is(tmp_path, trained, family, runtime):
    root, results = trained
    ck, trained = root / f"{family}-{runtime}", results[f"{family}-{runtime}"]
    _config(family).save_pretrained(tmp_path / "ref")  # a reference directory, as a hub snapshot has

    export(ck, tmp_path / "fp32", config=tmp_path / "ref")
    vllm_static_check(tmp_path / "fp32")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=IDS).logits, trained["logits"])

    export(ck, tmp_path / "bf16", dtype="bfloat16", config=tmp_path / "ref", max_shard_size="40KB")
    vllm_static_check(tmp_path / "bf16")
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert ours.dtype == torch.bfloat16
    for name, value in ours.state_dict().items():
        assert torch.equal(value, trained["weights"][name].to(torch.bfloat16)), name
    own = transformers.AutoModelForCausalLM.from_config(_config(family))
    own.load_state_dict(trained["weights"])
    own.to(torch.bfloat16).save_pretrained(tmp_path / "own")  # transformers' own bf16 save of the trained weights
    own = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "own").eval()
    with torch.no_grad():
        logits = ours(input_ids=IDS).logits
        assert torch.equal(logits, own(input_ids=IDS).logits)
        assert torch.allclose(logits.float(), trained["logits"], atol=0.1, rtol=0.05)
