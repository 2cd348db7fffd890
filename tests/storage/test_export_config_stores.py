"""``export(..., config=...)`` on every backend (local disk, ``memory://``, ``s3://`` on moto): the config and
tokenizer files land beside the weights, before the index; an overwrite replaces them and removes stale ones;
a failed overwrite leaves the old export and its files whole (local disk: everything moved back)."""
from __future__ import annotations

import json

import pytest
import torch

import shardckpt
from shardckpt.offline import safetensors_files
from shardckpt.offline.export import export
from shardckpt.offline.verify_export import verify_export
from shardckpt.io import open_storage

transformers = pytest.importorskip("transformers")


def _setup(tmp_path):
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    shardckpt.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}, tmp_path / "ck")
    config.save_pretrained(tmp_path / "ref")
    (tmp_path / "ref" / "tokenizer.json").write_text('{"a": 1}\n')
    return config


def _names(backend) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in backend.fs.ls(backend.root, detail=False))


def test_config_files_land_and_an_overwrite_replaces_them(tmp_path, backend):
    _setup(tmp_path)
    opts = {"dst_storage_options": backend.options}
    export(tmp_path / "ck", backend.url, config=tmp_path / "ref", max_shard_size="4KB", **opts)
    assert "config.json" in _names(backend) and "tokenizer.json" in _names(backend)
    assert verify_export(open_storage(backend.url, backend.options), against=tmp_path / "ck").ok
    (tmp_path / "ref" / "tokenizer.json").unlink()
    export(tmp_path / "ck", backend.url, config=tmp_path / "ref", max_shard_size="4KB", overwrite=True,
           dtype="bfloat16", **opts)
    assert "tokenizer.json" not in _names(backend)  # stale: the new reference has none
    written = json.loads(backend.fs.cat_file(f"{backend.root}/config.json"))
    assert written["dtype"] == "bfloat16"


def test_a_failed_local_overwrite_leaves_the_old_config_in_place(tmp_path, monkeypatch):
    _setup(tmp_path)
    export(tmp_path / "ck", tmp_path / "out", config=tmp_path / "ref", max_shard_size="4KB")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    real, seen = safetensors_files.rename, []

    def failing(storage, old, new):  # the commit's renames: fail once, at the last one (the new index)
        seen.append(new)
        if new == "model.safetensors.index.json" and old.startswith(".export-tmp-") and not old.endswith(".old"):
            raise OSError("injected")
        return real(storage, old, new)

    monkeypatch.setattr(safetensors_files, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        export(tmp_path / "ck", tmp_path / "out", config=tmp_path / "ref", max_shard_size="4KB", overwrite=True,
               dtype="bfloat16")
    assert "config.json" in seen  # it was moved into place, then back
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
