"""torchtitan's Llama 3 (the model class, its args and its own ``Llama3StateDictAdapter``), importable on CPU.

torchtitan 0.2.2 imports ``torchtitan.models.moe.kernels`` (a triton kernel for MoE token permutation) when
the package is imported; triton has no CPU build. The Llama model never calls it, so a stand-in module that
has the one name is put in its place before torchtitan is imported."""
from __future__ import annotations

import sys
import types

import torch

if "torchtitan.models.moe.kernels" not in sys.modules:
    try:
        import triton  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("torchtitan.models.moe.kernels")
        stand_in.generate_permute_indices = None  # type: ignore[attr-defined]
        sys.modules["torchtitan.models.moe.kernels"] = stand_in

from torchtitan.models.llama3.model.args import TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.model.model import Transformer  # noqa: E402
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402

ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=16, max_seq_len=32)


def model_args() -> TransformerModelArgs:
    return TransformerModelArgs(**ARGS)


def new_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(model_args())
    with torch.no_grad():
        model.init_weights()
    return model


def adapter() -> Llama3StateDictAdapter:
    return Llama3StateDictAdapter(model_args(), None)


def fully_sharded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` under FSDP2 as torchtitan's ``apply_fsdp`` wraps it: each block, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)
