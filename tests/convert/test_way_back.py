"""The way back: Hugging Face weights as the start of a sharded run. ``convert HF-DIR CKPT --world-size 3 --type
sharded --adapter hf`` (or a family's adapter with ``--reverse``) gives a checkpoint that 3 gloo ranks load,
each reading only its own shard of every tensor: into shardckpt's runtime (``load_state``), into torch FSDP2
(``get_model_state_dict`` / ``load`` / ``set_model_state_dict``) with logits equal to transformers'
``from_pretrained``, and into torchtitan's Llama under FSDP2 in its own names and q/k layout (weights equal to
torchtitan's ``from_hf``; logits to HF's within fp32 rounding: the rotary implementations differ)."""
from __future__ import annotations

import torch
import transformers

import shardckpt
from shardckpt.offline.convert import convert
from tests._dist import run_ranks
from tests.convert import _torchtitan as titan
from tests.convert.test_adapters_torchtitan import _hf_config

IDS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))


def _counting_reads() -> list[int]:
    """Bytes asked of the native reader in this process from now on (restored by ``_stop_counting``)."""
    from shardckpt.formats.native import NativeReader

    seen: list[int] = []
    real = NativeReader.read

    def spy(self, requests):
        seen.extend(r.dest.nbytes for r in requests)
        return real(self, requests)

    NativeReader.read, spy.real = spy, real
    return seen


def _stop_counting() -> None:
    from shardckpt.formats.native import NativeReader

    NativeReader.read = NativeReader.read.real


def _own_bytes(state: dict) -> int:
    return sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes for v in state.values())


def _fsdp2(model: torch.nn.Module, blocks) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _load_into_fsdp2(path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(7)  # other values, all overwritten
    model = transformers.LlamaForCausalLM(_hf_config())
    model = _fsdp2(model, model.model.layers)
    state = get_model_state_dict(model)
    seen = _counting_reads()
    try:
        shardckpt.load({"model": state}, path)
    finally:
        _stop_counting()
    set_model_state_dict(model, state)
    with torch.no_grad():
        logits = model.eval()(input_ids=IDS).logits
    return {"logits": logits, "read": sum(seen), "own": _own_bytes(state)}


def _load_into_runtime(path: str) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardckpt.runtime import shard

    torch.manual_seed(8)
    model = shard(transformers.LlamaForCausalLM(_hf_config()), wrap=(LlamaDecoderLayer,))
    seen = _counting_reads()
    try:
        shardckpt.load_state(model, None, path)
    finally:
        _stop_counting()
    with torch.no_grad():
        logits = model.eval()(input_ids=IDS).logits
    return {"logits": logits, "read": sum(seen)}


def _load_into_torchtitan(path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, set_model_state_dict,
    )

    model = titan.new_model(seed=9)
    model = _fsdp2(model, model.layers.values())
    state = get_model_state_dict(model)
    seen = _counting_reads()
    try:
        shardckpt.load({"model": state}, path)
    finally:
        _stop_counting()
    set_model_state_dict(model, state)
    with torch.no_grad():
        logits = model(IDS)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"logits": logits, "read": sum(seen), "own": _own_bytes(state),
            "weights": {k: v.clone() for k, v in full.items()}}


def test_hf_weights_start_a_sharded_run_at_ws3(tmp_path):
    torch.manual_seed(0)
    _hf_config().save_pretrained(tmp_path / "hf")
    transformers.LlamaForCausalLM(_hf_config()).save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(input_ids=IDS).logits
    total = sum(v.nbytes for v in reference.state_dict().values())

    result = convert(tmp_path / "hf", tmp_path / "start", world_size=3, type="sharded", adapter="hf")
    assert result.world_size == 3 and result.type == "sharded"
    for r in run_ranks(3, _load_into_fsdp2, str(tmp_path / "start"), timeout=300):
        assert torch.equal(r["logits"], want)
        assert r["read"] == r["own"] < total / 2  # its own shard of every tensor, nothing more
    for r in run_ranks(3, _load_into_runtime, str(tmp_path / "start"), timeout=300):
        assert torch.equal(r["logits"], want)
        assert r["read"] < total / 2

    convert(tmp_path / "hf", tmp_path / "titan", world_size=3, type="sharded", reverse=True,
            adapter=f"torchtitan-llama-0.2:config={tmp_path / 'hf'}")
    theirs = titan.adapter().from_hf(dict(reference.state_dict()))
    ranks = run_ranks(3, _load_into_torchtitan, str(tmp_path / "titan"), timeout=300)
    weights = ranks[0]["weights"]  # the full state dict is rank 0's (cpu_offload)
    assert weights.keys() == theirs.keys() and all(torch.equal(weights[k], v) for k, v in theirs.items())
    for r in ranks:
        assert r["read"] == r["own"] < total / 2
        torch.testing.assert_close(r["logits"], want, rtol=1e-4, atol=1e-5)
