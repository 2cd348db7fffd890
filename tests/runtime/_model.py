"""A tiny transformer for the runtime tests, and a training loop shared by the sharded and reference runs.

Sizes are odd on purpose (nothing divides by 2, 3 or 4); `Block.gate` has one element, fewer than
the world size; `ln1.bias` in every block and `pos` at the root are frozen; the output head is tied
to the token embedding; `Block.mask` is a buffer.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, HIDDEN, SEQ, LAYERS = 13, 14, 2, 23, 5, 2
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has a zero gradient: Adam would amplify noise
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS) + mask[:t, :t]
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.gate = nn.Parameter(torch.full((1,), 0.9))
        self.ln1.bias.requires_grad_(False)
        self.register_buffer("mask", torch.full((SEQ, SEQ), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), self.mask.to(x.dtype))
        return x + self.gate * self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        nn.init.normal_(self.tok.weight, std=0.3)  # tied to the head: keep the first logits moderate
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1, requires_grad=False)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer()


def make_batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def local_slice(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    per = GLOBAL_BATCH // world
    return tuple(t[rank * per:(rank + 1) * per] for t in batch)


def loss_fn(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).float().reshape(-1, VOCAB), targets.reshape(-1))


def train(model: nn.Module, batches: list, *, rank: int = 0, world: int = 1,
          clip: Callable[[], Any] | None = None, lr: float = 1e-2) -> tuple[list[float], list[Any]]:
    """AdamW steps on this rank's slice of each global batch; returns (local losses, what `clip` returned)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, norms = [], []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, *local_slice(batch, rank, world))
        loss.backward()
        if clip is not None:
            norms.append(clip())
        opt.step()
        losses.append(loss.item())
    return losses, norms


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Hugging Face / nanoGPT style: weight decay on parameters of 2+ dimensions except norms', none otherwise."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm)
                   for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in norm_params else no_decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def three_lr_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Three learning rates; the third group holds only the one-element gates, which some ranks own none of."""
    gates = [p for name, p in model.named_parameters() if name.endswith("gate")]
    rest = decay_groups(model)
    for group in rest:
        group["params"] = [p for p in group["params"] if all(p is not g for g in gates)]
    return [{**rest[0], "lr": 1e-2}, {**rest[1], "lr": 3e-3}, {"params": gates, "lr": 3e-2, "weight_decay": 0.0}]
