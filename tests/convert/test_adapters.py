"""Adapters (``offline.adapters``): every output tensor, read whole or by any region, equals the same transform done
in memory with torch (the rotary permutation as torchtitan writes it, splits with ``torch.split``, merges with
``torch.cat``); each family's declared inverse undoes it bit for bit; the fused family's split loads in
transformers' Llama with the logits of transformers' own Phi-3; bad input is refused naming the tensor."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from shardckpt.errors import BadArgumentError, IncompatibleCheckpointError
from shardckpt.formats.api import ReadRequest
from shardckpt.formats.detect import open_reader
from shardckpt.offline.adapters import apply, names, register, resolve
from shardckpt.offline.adapters.base import Adapter, Part, RopePermute, Rule
from shardckpt.offline.export import INDEX_NAME, export
from shardckpt.regions import Box, FlatRange, full_region


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:  # torchtitan's _permute (HF's conversion script)
    d0, d1 = w.shape[0], w.shape[1] if w.dim() > 1 else 1
    return w.view(heads, d0 // heads // 2, 2, d1).transpose(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:  # torchtitan's _reverse_permute
    d0, d1 = w.shape[0], w.shape[1] if w.dim() > 1 else 1
    return w.view(heads, 2, d0 // heads // 2, d1).transpose(1, 2).reshape(w.shape)


def _titan(dtype=torch.float32, layers=2, heads=4, kv=2, dim=16, new_names=False) -> dict:
    g = torch.Generator().manual_seed(0)
    hd = dim // heads
    attn = "attention.qkv_linear." if new_names else "attention."
    sd = {"tok_embeddings.weight": torch.randn(10, dim, generator=g)}
    for i in range(layers):
        sd |= {f"layers.{i}.{attn}wq.weight": torch.randn(heads * hd, dim, generator=g),
               f"layers.{i}.{attn}wk.weight": torch.randn(kv * hd, dim, generator=g),
               f"layers.{i}.{attn}wv.weight": torch.randn(kv * hd, dim, generator=g),
               f"layers.{i}.attention.wo.weight": torch.randn(dim, heads * hd, generator=g),
               f"layers.{i}.feed_forward.w1.weight": torch.randn(24, dim, generator=g),
               f"layers.{i}.feed_forward.w2.weight": torch.randn(dim, 24, generator=g),
               f"layers.{i}.feed_forward.w3.weight": torch.randn(24, dim, generator=g),
               f"layers.{i}.attention_norm.weight": torch.randn(dim, generator=g),
               f"layers.{i}.ffn_norm.weight": torch.randn(dim, generator=g)}
    sd |= {"norm.weight": torch.randn(dim, generator=g),
           ("lm_head.weight" if new_names else "output.weight"): torch.randn(10, dim, generator=g)}
    return {k: v.to(dtype) for k, v in sd.items()}


def _titan_to_hf(sd: dict, heads=4, kv=2) -> dict:
    out = {}
    for k, v in sd.items():
        k = k.replace("attention.qkv_linear.", "attention.")
        if k.endswith("wq.weight"):
            v = permute(v, heads)
        elif k.endswith("wk.weight"):
            v = permute(v, kv)
        out[k] = v
    table = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight"}
    parts = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj",
             "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
             "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    renamed = {}
    for k, v in out.items():
        if k in table:
            renamed[table[k]] = v
            continue
        _, i, rest = k.split(".", 2)
        renamed[f"model.layers.{i}.{parts[rest.removesuffix('.weight')]}.weight"] = v
    return renamed


def _read_all(reader) -> dict:
    out = {}
    for name, info in reader.tensors().items():
        t = torch.empty(info.shape, dtype=info.dtype)
        reader.read([ReadRequest(name, full_region(info.shape), t)])
        out[name] = t
    return out


def test_rope_permutation_is_torchtitans_and_its_inverse_undoes_it():
    w = torch.arange(8 * 3 * 5, dtype=torch.float32).view(24, 5)
    for heads in (1, 2, 3, 6):
        to_hf, = RopePermute("h").pieces("w", (24, 5), {"h": heads})
        back, = RopePermute("h", inverse=True).pieces("w", (24, 5), {"h": heads})
        assert torch.equal(w[[to_hf.order(r) for r in range(24)]], permute(w, heads))
        assert torch.equal(w[[back.order(r) for r in range(24)]], unpermute(w, heads))
        assert torch.equal(unpermute(permute(w, heads), heads), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_names", [False, True])
def test_torchtitan_llama_equals_the_in_memory_conversion_whole_and_by_any_region(tmp_path, dtype, new_names):
    sd = _titan(dtype, new_names=new_names)
    torch.save({"model": sd}, tmp_path / "titan.pt")
    reader = apply(open_reader(tmp_path / "titan.pt"), "torchtitan-llama:n_heads=4,n_kv_heads=2")
    want = {f"model.{k}": v for k, v in _titan_to_hf(sd).items()}
    assert list(reader.tensors()) == list(want)
    assert all(torch.equal(got, want[k]) for k, got in _read_all(reader).items())
    q = want["model.model.layers.1.self_attn.q_proj.weight"]
    for region, expect in [(FlatRange(5, 61), q.reshape(-1)[5:61]), (Box((3, 2), (9, 7)), q[3:12, 2:9]),
                           (FlatRange(0, 0), q.reshape(-1)[:0])]:
        got = torch.empty(region.numel, dtype=dtype)
        reader.read([ReadRequest("model.model.layers.1.self_attn.q_proj.weight", region, got)])
        assert torch.equal(got, expect.reshape(-1))
    for name, want_t in want.items():  # in slices of 37 elements, across rows and heads, several per read
        flat = torch.empty(want_t.numel(), dtype=dtype)
        bounds = list(range(0, want_t.numel(), 37)) + [want_t.numel()]
        reader.read([ReadRequest(name, FlatRange(lo, hi), flat[lo:hi]) for lo, hi in zip(bounds, bounds[1:])])
        assert torch.equal(flat, want_t.reshape(-1)), name


def test_export_with_an_adapter_then_its_inverse_gives_the_source_back(tmp_path):
    sd = _titan()
    save_file(sd, tmp_path / "titan.safetensors")
    report = export(tmp_path / "titan.safetensors", tmp_path / "hf", adapter="torchtitan-llama:n_heads=4,n_kv_heads=2",
                    max_shard_size="2KB", slice_bytes=100)
    assert len(report.files) > 1
    hf = {k: v for f in report.files for k, v in load_file(tmp_path / "hf" / f).items()}
    assert hf.keys() == _titan_to_hf(sd).keys() and all(torch.equal(hf[k], v) for k, v in _titan_to_hf(sd).items())
    export(tmp_path / "hf", tmp_path / "back", adapter="torchtitan-llama-0.2:n_heads=4,n_kv_heads=2", reverse=True)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], v) for k, v in sd.items())
    export(tmp_path / "hf", tmp_path / "new", adapter="torchtitan-llama:n_heads=4,n_kv_heads=2", reverse=True)
    assert "layers.0.attention.qkv_linear.wq.weight" in load_file(tmp_path / "new" / "model.safetensors")


def test_tied_embeddings_are_written_once_and_the_index_names_only_written_tensors(tmp_path):
    sd = _titan(new_names=True)
    torch.save(sd, tmp_path / "titan.pt")
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "tie_word_embeddings": True}))
    report = export(tmp_path / "titan.pt", tmp_path / "hf", max_shard_size="1KB",
                    adapter=f"torchtitan-llama:config={tmp_path}")
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    written = {k for f in report.files for k in load_file(tmp_path / "hf" / f)}
    assert "lm_head.weight" not in written and set(index["weight_map"]) == written
    assert written == set(_titan_to_hf(sd)) - {"lm_head.weight"}
    back = export(tmp_path / "hf", tmp_path / "back", reverse=True, adapter=f"torchtitan-llama:config={tmp_path}")
    titan = load_file(tmp_path / "back" / back.files[0])  # the head is the embedding again, as from_hf gives it
    assert torch.equal(titan["lm_head.weight"], sd["tok_embeddings.weight"]) and titan.keys() == sd.keys()


def _phi3_config(tie=False):
    return transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tie, pad_token_id=0,
                                   eos_token_id=1, bos_token_id=1)


def test_phi3_fused_split_loads_in_transformers_llama_with_phi3s_own_logits(tmp_path):
    torch.manual_seed(0)
    phi3 = transformers.Phi3ForCausalLM(_phi3_config()).eval()
    phi3.save_pretrained(tmp_path / "phi3")
    export(tmp_path / "phi3", tmp_path / "llama", adapter=f"phi3-fused:config={tmp_path / 'phi3'}",
           max_shard_size="20KB", slice_bytes=64)
    c = _phi3_config()
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters,
                             tie_word_embeddings=False).save_pretrained(tmp_path / "llama")
    llama, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32,
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # one fused matmul against three: equal up to fp32 rounding
        torch.testing.assert_close(llama.eval()(input_ids=ids).logits, phi3(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-6)
    own, split = phi3.state_dict(), llama.state_dict()
    for i in range(2):  # every weight bit for bit: torch.split of the fused ones
        q, k, v = torch.split(own[f"model.layers.{i}.self_attn.qkv_proj.weight"], [32, 16, 16])
        gate, up = torch.split(own[f"model.layers.{i}.mlp.gate_up_proj.weight"], [48, 48])
        for name, want in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                           ("mlp.gate_proj", gate), ("mlp.up_proj", up)):
            assert torch.equal(split[f"model.layers.{i}.{name}.weight"], want), name
    export(tmp_path / "llama", tmp_path / "back", adapter="phi3-fused:n_heads=4,n_kv_heads=2", reverse=True)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == own.keys() and all(torch.equal(back[n], own[n]) for n in own)


def test_a_registered_family_merges_by_any_region_and_edge_shapes_pass(tmp_path):
    register("test-merge", Adapter("merge", (Rule(r"a", "ab", Part(0, 2)), Rule(r"b", "ab", Part(1, 2)),
                                             Rule(r"(.+)", r"\1"))), Adapter("none", ()))
    assert "test-merge" in names()
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(2, 4, generator=g), "scalar": torch.tensor(7.0),
          "empty": torch.empty(0, 3), "one": torch.randn(1, generator=g).to(torch.bfloat16)}
    torch.save(sd, tmp_path / "m.pt")
    reader = apply(open_reader(tmp_path / "m.pt"), "test-merge")
    got = {k.removeprefix("model."): v for k, v in _read_all(reader).items()}
    assert list(got) == ["ab", "scalar", "empty", "one"]
    assert torch.equal(got["ab"], torch.cat([sd["a"], sd["b"]])) and torch.equal(got["scalar"], sd["scalar"])
    assert got["empty"].shape == (0, 3) and torch.equal(got["one"], sd["one"])
    part = torch.empty(9)
    reader.read([ReadRequest("model.ab", FlatRange(8, 17), part)])  # across the two parts
    assert torch.equal(part, torch.cat([sd["a"], sd["b"]]).reshape(-1)[8:17])


def test_bad_adapters_and_sources_are_refused_naming_the_tensor(tmp_path):
    torch.save(_titan() | {"extra.weight": torch.zeros(2)}, tmp_path / "extra.pt")
    with pytest.raises(IncompatibleCheckpointError, match="'extra.weight'.*no rule"):
        apply(open_reader(tmp_path / "extra.pt"), "torchtitan-llama:n_heads=4,n_kv_heads=2")
    torch.save(_titan(), tmp_path / "titan.pt")
    with pytest.raises(BadArgumentError, match="n_heads"):
        apply(open_reader(tmp_path / "titan.pt"), "torchtitan-llama")
    with pytest.raises(IncompatibleCheckpointError, match="wq.weight.*heads"):
        apply(open_reader(tmp_path / "titan.pt"), "torchtitan-llama:n_heads=3,n_kv_heads=2")
    with pytest.raises(BadArgumentError, match="unknown"):
        resolve("no-such-family")
    with pytest.raises(BadArgumentError, match="key=value"):
        resolve("torchtitan-llama:n_heads")
    with pytest.raises(BadArgumentError, match="config"):
        resolve(f"torchtitan-llama:config={tmp_path / 'missing.json'}")
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 2)}, tmp_path / "q.safetensors")
    with pytest.raises(IncompatibleCheckpointError, match="parts \\[1, 2\\]"):
        apply(open_reader(tmp_path / "q.safetensors"), "phi3-fused:n_heads=2,n_kv_heads=1", reverse=True)
    save_file({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(5, 2)}, tmp_path / "qkv.safetensors")
    with pytest.raises(IncompatibleCheckpointError, match="qkv_proj"):
        apply(open_reader(tmp_path / "qkv.safetensors"), "phi3-fused:n_heads=2,n_kv_heads=1")
    with pytest.raises(BadArgumentError, match="reverse"):
        export(tmp_path / "titan.pt", tmp_path / "out", reverse=True)


def test_the_cli_exports_with_an_adapter_and_converts_back_under_model(tmp_path):
    from shardckpt.cli.main import main

    sd = _titan()
    save_file(sd, tmp_path / "titan.safetensors")
    adapter = "torchtitan-llama-0.2:n_heads=4,n_kv_heads=2"
    assert main(["export", str(tmp_path / "titan.safetensors"), str(tmp_path / "hf"), "--adapter", adapter,
                 "--quiet"]) == 0
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(hf[k], v) for k, v in _titan_to_hf(sd).items())
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--world-size", "2", "--type", "sharded",
                 "--adapter", adapter, "--reverse", "--quiet"]) == 0
    import shardckpt

    back = shardckpt.load_full(tmp_path / "ckpt")
    assert list(back) == ["model"] and all(torch.equal(back["model"][k], v) for k, v in sd.items())
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "x"), "--adapter", "nope", "--quiet"]) == 2


@pytest.mark.parametrize("spec", ["n_heads=2,n_kv_heads=2", "n_heads=4,n_kv_heads=1", "n_heads=1,n_kv_heads=1"])
def test_head_options_that_divide_the_rows_but_not_the_model_are_refused_both_ways(tmp_path, spec):
    # 4 heads, 2 kv, dim 16: a wrong count that still divides the rows would permute the wrong rows, silently
    torch.save(_titan(), tmp_path / "titan.pt")
    save_file(_titan_to_hf(_titan()), tmp_path / "hf.safetensors")
    with pytest.raises(IncompatibleCheckpointError, match=r"w[qk]\.weight.*check the adapter's head options"):
        apply(open_reader(tmp_path / "titan.pt"), f"torchtitan-llama:{spec}")
    with pytest.raises(IncompatibleCheckpointError, match=r"[qk]_proj\.weight.*check the adapter's head options"):
        apply(open_reader(tmp_path / "hf.safetensors"), f"torchtitan-llama:{spec}", reverse=True)


def test_phi3_head_options_that_divide_the_rows_but_not_the_columns_are_refused(tmp_path):
    # 4 heads, 2 kv, hidden 32: qkv rows 64 = (6 + 2) x 8 too, but 32 columns are not 6 heads
    save_file({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(64, 32)}, tmp_path / "qkv.safetensors")
    for spec in ("n_heads=6,n_kv_heads=1", "n_heads=2,n_kv_heads=3"):
        with pytest.raises(IncompatibleCheckpointError, match="qkv_proj.*check n_heads and n_kv_heads"):
            apply(open_reader(tmp_path / "qkv.safetensors"), f"phi3-fused:{spec}")
    apply(open_reader(tmp_path / "qkv.safetensors"), "phi3-fused:n_heads=4,n_kv_heads=2")


def test_head_options_that_disagree_with_the_config_are_refused_before_anything_is_written(tmp_path):
    # n_heads=2, n_kv_heads=1 fits the shapes of a 4-head, 2-kv model (head_dim 8): only the config tells
    torch.save(_titan(), tmp_path / "titan.pt")
    transformers.LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path / "ref")
    for spec, where in (("n_heads=2,n_kv_heads=1", "--config"), (f"config={tmp_path / 'ref'},n_heads=2", "ref")):
        with pytest.raises(BadArgumentError, match=f"n_heads=2, but the config .*{where}.*num_attention_heads=4"):
            export(tmp_path / "titan.pt", tmp_path / "out", adapter=f"torchtitan-llama:{spec}", config=tmp_path / "ref")
        assert not (tmp_path / "out").exists()
    with pytest.raises(BadArgumentError, match="n_kv_heads=1, but the config .*num_key_value_heads=2"):
        resolve("torchtitan-llama:n_heads=4,n_kv_heads=1", config={"num_attention_heads": 4, "num_key_value_heads": 2})
    _, opts = resolve("torchtitan-llama:n_heads=4", config={"num_attention_heads": 4})  # agreeing: as given
    assert opts == {"n_heads": 4}


def test_a_tied_hf_directory_converts_back_with_lm_head_as_the_embedding(tmp_path):
    import shardckpt
    from shardckpt.offline.convert import convert

    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")  # no lm_head.weight in the file
    convert(tmp_path / "hf", tmp_path / "ck", world_size=3, type="sharded", adapter=f"hf:config={tmp_path / 'hf'}")
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(config).eval()
    target = {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}
    shardckpt.load({"model": target}, tmp_path / "ck")  # every key the model has, lm_head included
    assert torch.equal(target["lm_head.weight"], model.model.embed_tokens.weight)
    fresh.load_state_dict(target)
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)
