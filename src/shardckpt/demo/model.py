"""The demo's model and data: a small decoder-only transformer and a synthetic task it can visibly learn.

Each sequence counts upward modulo ``VOCAB`` with a stride of its own (one of ``STRIDES``), from a random
start. The first token carries no information, the second reveals the stride, and every later token
follows from the previous one and the stride: a model that learns the pattern drives the loss from
ln(VOCAB) ~ 4.9 towards ln(VOCAB)/SEQ + ln(len(STRIDES))/SEQ ~ 0.2. Batches depend only on the step, so a
run resumed at another world size sees exactly the batches an uninterrupted run would.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardckpt.demo.config import ModelShape

VOCAB, SEQ = 128, 32
STRIDES = (1, 3, 5, 7, 11, 13)
GLOBAL_BATCH = 24  # divides by 1, 2, 3 and 4 ranks


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; the unit the runtime shards (``wrap=(Block,)``)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.attn_norm = nn.LayerNorm(shape.dim)
        self.qkv = nn.Linear(shape.dim, 3 * shape.dim)
        self.proj = nn.Linear(shape.dim, shape.dim)
        self.mlp_norm = nn.LayerNorm(shape.dim)
        self.up = nn.Linear(shape.dim, 4 * shape.dim)
        self.down = nn.Linear(4 * shape.dim, shape.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class DemoTransformer(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a head tied to the embedding."""

    def __init__(self, shape: ModelShape = ModelShape()) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, shape.dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, shape.dim))
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as in most LMs: the export writes it once
        nn.init.normal_(self.embed.weight, std=shape.dim ** -0.5)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def global_batch(step: int) -> torch.Tensor:
    """The ``GLOBAL_BATCH`` sequences of ``SEQ + 1`` tokens for ``step`` (inputs and shifted targets)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (GLOBAL_BATCH, 1), generator=g)]
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def loss_of(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1))
