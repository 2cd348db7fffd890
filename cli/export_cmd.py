"""``shardckpt export SRC DST``: the model weights of any readable checkpoint as Hugging Face style safetensors
(``shardckpt.export``; this module prints its result)."""
from __future__ import annotations

import argparse

from shardckpt.api.results import ExportResult
from shardckpt.sizes import format_bytes

EPILOG = """sources: shardckpt checkpoints of any type and world size (LOCAL ones by parameter name), torch DCP
directories, safetensors files or Hugging Face directories, torch.save files. Exported: the `model` entry of a
training checkpoint (names relative to it), else every tensor outside `optim`/`optimizer`; --only picks other
entries. Wrapper prefixes `module.` and `_orig_mod.` are removed; tied weights (LOCAL) are written once:
the summary names them ("1 tied weight written once ...: head.weight = tok.weight"); transformers re-ties them.
Output: model.safetensors, or model-0000i-of-0000N.safetensors and model.safetensors.index.json (written last;
a rerun after a kill keeps the files it had finished, for a shardckpt source),
streamed in slices of at most 64 MiB (two buffers), whatever the model's size; --memory-limit bounds the
process's resident memory instead (e.g. 512MiB: ~265 MiB of Python and torch, the rest buffers).
--config FILE_OR_DIR makes DST a complete model directory that from_pretrained loads as is: config.json (its
dtype/torch_dtype set to the exported dtype, tie_word_embeddings to what is written; tied weights written
once), and, where present beside it, generation_config.json and the tokenizer files (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, tokenizer.model, vocab.json, merges.txt, chat template)
copied as they are. With transformers installed the weights are first checked against its own model for
the config, built on the meta device: a missing, unknown or misshapen tensor is refused, named, before
anything is written; the index gets total_parameters and the shard size save_pretrained's default.

examples:
  shardckpt export /ckpt/step-1000 /export/step-1000 --dtype bfloat16
  shardckpt export /ckpt/step-1000 /export/llama --dtype bfloat16 --config /models/Llama-3.2-1B
  shardckpt export /ckpt/step-1000 /export/llama --config ~/.cache/huggingface/hub/models--meta-llama--Llama-3.2-1B
  shardckpt export runs/example /export/latest --latest   (the latest committed step-* below a run directory)
  shardckpt export /ckpt/step-1000 s3://bucket/model --max-shard-size 2GB -o endpoint_url=http://127.0.0.1:9000
  shardckpt export /dcp/step-500 /export/ema --only ema --strip-prefix ema.
  shardckpt export /ckpt/step-1000 /export/hf --rename-map llama-names.json --memory-limit 1GiB
    with llama-names.json: {"tok\\.weight": "model.embed_tokens.weight",
                            "blocks\\.(\\d+)\\.attn\\.(q|k|v)\\.weight": "model.layers.\\1.self_attn.\\2_proj.weight",
                            "rope\\..*": null}
  shardckpt export /titan/step-1000 /export/hf --adapter torchtitan-llama:config=hf-llama/config.json
    (torchtitan names -> HF's, q/k rotary permutation; n_heads, n_kv_heads, tie_word_embeddings from the config)
"""


def show(result: ExportResult, args: argparse.Namespace) -> None:
    if args.quiet or args.json:
        return
    files = len(result.files)
    extra = ""
    if result.tied:  # named, so that nobody wonders where they went
        pairs = [f"{name} = {kept}" for name, kept in list(result.tied.items())[:3]] + (["..."] * (len(result.tied) > 3))
        count = len(result.tied)
        extra += (f", {count} tied weight{'s' if count > 1 else ''} written once, under the other name "
                  f"(transformers re-ties {'them' if count > 1 else 'it'} on load: {', '.join(pairs)})")
    if result.kept:
        extra += f", {len(result.kept)} finished files of a killed export kept"
    print(f"{result.path}: {files} file{'s' if files > 1 else ''}, {result.tensors} tensors, "
          f"{format_bytes(result.tensor_bytes)} of tensor data, dtype {result.dtype}{extra}, {result.seconds:.1f} s")
