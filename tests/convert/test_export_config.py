"""``export(..., config=...)`` (``offline.hf_dir``): a complete model directory that ``from_pretrained`` loads as is,
the config made consistent with the weights, and weights that do not fit the config refused before anything is
written, naming the tensor."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import shardckpt
from shardckpt.errors import CheckpointExistsError
from shardckpt.offline import hf_dir
from shardckpt.offline.export import export
from shardckpt.offline.hf_dir import ConfigMismatchError, check_weights

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))


def _llama_config(**kw):
    kw = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, **kw}
    return transformers.LlamaConfig(**kw)


def _model(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _save(model, path, extra=None) -> None:
    """A FULL checkpoint, as ``shardckpt.save`` writes it: tied weights as two stored tensors."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    shardckpt.save({"model": {**sd, **(extra or {})}}, path)


def _reference(config, path, tokenizer=True):
    config.save_pretrained(path)
    if tokenizer:
        (path / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": {"type": "BPE"}}\n')
        (path / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
        (path / "special_tokens_map.json").write_text('{"bos_token": "<s>"}\n')
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_from_pretrained_loads_the_export_as_is_fp32_logits_equal(tmp_path, tied):
    config = _llama_config(tie_word_embeddings=tied)
    model = _model(config)
    _save(model, tmp_path / "ck")
    report = export(tmp_path / "ck", tmp_path / "out", config=_reference(config, tmp_path / "ref"))
    assert report.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, model(IDS).logits)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "float32" and written["tie_word_embeddings"] is tied
    assert written["architectures"] == ["LlamaForCausalLM"]  # the reference had none; vLLM picks the class by it
    for name in ("tokenizer.json", "generation_config.json", "special_tokens_map.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_bf16_export_sets_the_dtype_and_equals_transformers_own_bf16_save(tmp_path):
    config = _llama_config(tie_word_embeddings=True)
    model = _model(config)
    _save(model, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "out", dtype="bfloat16", config=_reference(config, tmp_path / "ref"),
           max_shard_size="20KB")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.dtype == torch.bfloat16  # the config's dtype, no argument given
    model.to(torch.bfloat16).save_pretrained(tmp_path / "own", max_shard_size="20KB")
    own = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "own").eval()
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, own(IDS).logits)
    ours = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    theirs = json.loads((tmp_path / "own" / "model.safetensors.index.json").read_text())
    assert {k: ours["metadata"][k] for k in theirs["metadata"]} == theirs["metadata"]  # total_parameters, size
    assert set(ours["weight_map"]) == set(theirs["weight_map"])


def test_shard_size_defaults_to_save_pretrained_s(tmp_path):
    import inspect

    default = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert hf_dir.default_max_shard_size() == default
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    assert export(tmp_path / "ck", tmp_path / "out", config=_reference(config, tmp_path / "ref")).files == \
        ("model.safetensors",)


def _refused(tmp_path, config, **kw) -> str:
    with pytest.raises(ConfigMismatchError) as e:
        export(tmp_path / "ck", tmp_path / "out", config=_reference(config, tmp_path / "ref"), **kw)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")  # nothing written
    return str(e.value)


def test_a_missing_tensor_is_refused_before_writing_and_named(tmp_path):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    message = _refused(tmp_path, config, rename_map={r"model\.norm\.weight": None})
    assert "'model.norm.weight' is missing" in message


def test_an_extra_tensor_is_refused_and_named(tmp_path):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck", extra={"head2.weight": torch.zeros(3)})
    assert "'head2.weight' is not a weight of the model" in _refused(tmp_path, config)


@pytest.mark.parametrize("field,value,tensor", [("vocab_size", 80, "model.embed_tokens.weight"),
                                                ("num_attention_heads", 8, "model.layers.0.self_attn.k_proj.weight"),
                                                ("hidden_size", 48, "model.embed_tokens.weight")])
def test_a_shape_that_disagrees_with_the_config_is_refused_and_named(tmp_path, field, value, tensor):
    _save(_model(_llama_config()), tmp_path / "ck")
    message = _refused(tmp_path, _llama_config(**{field: value}))
    assert f"tensor {tensor!r} has shape" in message and f"{field}={value}" in message


def test_tied_by_the_config_but_different_in_the_weights_is_refused(tmp_path):
    model = _model(_llama_config(tie_word_embeddings=False))  # trained untied: the head differs
    _save(model, tmp_path / "ck")
    message = _refused(tmp_path, _llama_config(tie_word_embeddings=True))
    assert "'lm_head.weight' differs from 'model.embed_tokens.weight'" in message


def test_check_weights_takes_names_after_renames_and_allocates_nothing():
    config = _llama_config(tie_word_embeddings=True).to_dict()
    model = _model(_llama_config(tie_word_embeddings=True))
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    check = check_weights(shapes, config)
    assert check.total_parameters == model.num_parameters()
    assert check.tie_pairs == {"lm_head.weight": "model.embed_tokens.weight"}
    with pytest.raises(ConfigMismatchError, match="'lm_head.weight' is tied"):
        check_weights({**shapes, "lm_head.weight": shapes["model.embed_tokens.weight"]}, config)
    big = {**config, "vocab_size": 1 << 40}  # a meta-device model: ~10^13 parameters, no memory
    with pytest.raises(ConfigMismatchError, match="model.embed_tokens.weight"):
        check_weights(shapes, big)


def test_a_hf_cache_repository_directory_resolves_to_its_snapshot(tmp_path):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for name, data in {"config.json": config.to_json_string(), "tokenizer_config.json": "{}\n"}.items():
        (repo / "blobs" / name).write_text(data)
        (snap / name).symlink_to(repo / "blobs" / name)  # the cache's layout: links into blobs
    export(tmp_path / "ck", tmp_path / "out", config=repo)
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == "{}\n"
    assert not (tmp_path / "out" / "tokenizer_config.json").is_symlink()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_files_there_are_refused_without_overwrite_and_stale_ones_removed_with(tmp_path):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.model").write_bytes(b"old")
    with pytest.raises(CheckpointExistsError, match="tokenizer.model"):
        export(tmp_path / "ck", tmp_path / "out", config=_reference(config, tmp_path / "ref"))
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == b"old"
    export(tmp_path / "ck", tmp_path / "out", config=tmp_path / "ref", overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "special_tokens_map.json", "tokenizer.json"]


def test_two_exports_of_one_checkpoint_are_byte_identical(tmp_path):
    config = _llama_config(tie_word_embeddings=True)
    _save(_model(config), tmp_path / "ck")
    ref = _reference(config, tmp_path / "ref")
    for out in ("a", "b"):
        export(tmp_path / "ck", tmp_path / out, config=ref, max_shard_size="30KB")
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b")) and "model.safetensors.index.json" in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_without_transformers_the_config_is_copied_with_the_dtype_and_nothing_checked(tmp_path, monkeypatch):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck", extra={"head2.weight": torch.zeros(3)})
    ref = _reference(config, tmp_path / "ref")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    (tmp_path / "mine.json").write_bytes((ref / "config.json").read_bytes())
    export(tmp_path / "ck", tmp_path / "out", config=tmp_path / "mine.json", dtype="float16")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "float16"
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]  # not config.json: alone
    export(tmp_path / "ck", tmp_path / "out2", config=ref / "config.json")  # config.json: its directory's files
    assert "tokenizer.json" in os.listdir(tmp_path / "out2")


def test_a_config_that_is_not_one_is_refused_before_writing(tmp_path):
    _save(_model(_llama_config()), tmp_path / "ck")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(shardckpt.errors.BadArgumentError, match="not a model config"):
        export(tmp_path / "ck", tmp_path / "out", config=tmp_path / "bad.json")
    with pytest.raises(shardckpt.errors.BadArgumentError, match="no config.json"):
        export(tmp_path / "ck", tmp_path / "out", config=tmp_path)
    assert not (tmp_path / "out").exists()


def test_verify_against_the_source_expects_the_config_s_tie_and_checks_its_values(tmp_path):
    from shardckpt.offline.verify_export import verify_export

    config = _llama_config(tie_word_embeddings=True)
    model = _model(config)
    _save(model, tmp_path / "ck")
    export(tmp_path / "ck", tmp_path / "out", config=_reference(config, tmp_path / "ref"))
    assert verify_export(tmp_path / "out", against=tmp_path / "ck").ok
    untied = {k: v.detach().clone() for k, v in model.state_dict().items()}
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1  # a source whose head is not the embedding
    shardckpt.save({"model": untied}, tmp_path / "other")
    check = verify_export(tmp_path / "out", against=tmp_path / "other")
    assert not check.ok and any("lm_head.weight: left out as tied" in p for p in check.problems)


def test_a_model_type_transformers_does_not_know_is_exported_unchecked_with_a_warning_only_with_auto_map(
        tmp_path, caplog):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    (tmp_path / "ref").mkdir()
    own = {"model_type": "my-own-llm", "hidden_size": 32}
    (tmp_path / "ref" / "config.json").write_text(json.dumps(own))
    with pytest.raises(shardckpt.errors.BadArgumentError, match="does not know model_type 'my-own-llm'.*no auto_map"):
        export(tmp_path / "ck", tmp_path / "out", config=tmp_path / "ref")
    assert not (tmp_path / "out").exists()
    own["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}  # trust_remote_code: its own code
    (tmp_path / "ref" / "config.json").write_text(json.dumps(own))
    with caplog.at_level("WARNING", logger="shardckpt.offline.hf_dir"):
        export(tmp_path / "ck", tmp_path / "out", config=tmp_path / "ref")
    assert "does not know model_type 'my-own-llm'" in caplog.text
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == {**own, "dtype": "float32", "torch_dtype": "float32", "tie_word_embeddings": False}


@pytest.mark.parametrize("change, match", [
    ({"model_type": None}, "not a model config"),
    ({"model_type": 3}, "not a model config"),
    ({"model_type": ""}, "not a model config"),
    ({"hidden_size": "32"}, "transformers builds no model from it .*hidden_size"),
    ({"num_attention_heads": 0}, "transformers builds no model from it"),
])
def test_a_config_transformers_cannot_build_is_refused_in_one_line_naming_it(tmp_path, change, match):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    ref = _reference(config, tmp_path / "ref")
    fields = {k: v for k, v in {**json.loads((ref / "config.json").read_text()), **change}.items() if v is not None}
    (ref / "config.json").write_text(json.dumps(fields))
    with pytest.raises(shardckpt.errors.BadArgumentError, match=match) as e:
        export(tmp_path / "ck", tmp_path / "out", config=ref)
    assert "\n" not in str(e.value) and (match.startswith("not") or str(ref / "config.json") in str(e.value))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["num_hidden_layers", "n_layer", "num_layers"])
def test_a_layer_count_above_the_weights_is_refused_before_transformers_builds_it(tmp_path, field, monkeypatch):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    ref = _reference(config, tmp_path / "ref")
    (ref / "config.json").write_text(json.dumps({**json.loads((ref / "config.json").read_text()), field: 10**9}))
    monkeypatch.setattr(transformers.AutoConfig, "for_model", None)  # building it would hang: never reached
    with pytest.raises(ConfigMismatchError, match=f"{field} is 1000000000, .* at most 2 layers"):
        export(tmp_path / "ck", tmp_path / "out", config=ref)
    with pytest.raises(ConfigMismatchError, match=field):
        check_weights({"model.layers.0.w": ((1,), torch.float32)}, {"model_type": "llama", field: 3})
    assert not (tmp_path / "out").exists()


def test_overwrite_without_a_config_removes_the_old_export_s_directory_files(tmp_path):
    config = _llama_config()
    _save(_model(config), tmp_path / "ck")
    ref = _reference(config, tmp_path / "ref")
    export(tmp_path / "ck", tmp_path / "out", config=ref, max_shard_size="20KB")
    assert "tokenizer.json" in os.listdir(tmp_path / "out")
    export(tmp_path / "ck", tmp_path / "out", dtype="float16", overwrite=True)
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]  # no config.json saying float32 beside fp16


def test_an_export_without_a_config_leaves_files_in_a_directory_with_no_export(tmp_path):
    _save(_model(_llama_config()), tmp_path / "ck")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    export(tmp_path / "ck", tmp_path / "out", overwrite=True)
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
