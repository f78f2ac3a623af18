"""The LoRA test's model and data: a small causal transformer built here (no hub download),
adapted with peft's LoRA on its attention projections, and synthetic text from a Markov chain
every client shares (each client draws its own sentences)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, DEPTH, HEADS, CONTEXT = 64, 256, 3, 4, 32
TRAINABLE = ["*lora_*"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """A decoder-only transformer of about 2.4 million parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def adapted(seed: int = 0) -> nn.Module:
    """The base model (the same for every caller) with a LoRA adapter on q and v."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = TinyLM()
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q", "v"], lora_dropout=0.0)
    return get_peft_model(base, config)


def chain() -> torch.Tensor:
    """The language: each token is followed by one of two others, mostly the first."""
    g = torch.Generator().manual_seed(7)
    nxt = torch.randperm(VOCAB, generator=g)
    alt = torch.randperm(VOCAB, generator=g)
    probs = torch.full((VOCAB, VOCAB), 0.02 / VOCAB)
    probs[torch.arange(VOCAB), nxt] += 0.78
    probs[torch.arange(VOCAB), alt] += 0.2
    return probs / probs.sum(1, keepdim=True)


def batches(client: int, seed: int, sentences: int = 96):
    """`sentences` sequences of CONTEXT + 1 tokens for `client`: inputs and next tokens."""
    probs = chain()
    g = torch.Generator().manual_seed(1000 * seed + client)
    tokens = torch.empty(sentences, CONTEXT + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (sentences,), generator=g)
    for i in range(CONTEXT):
        tokens[:, i + 1] = torch.multinomial(probs[tokens[:, i]], 1, generator=g).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]


def held_out_loss(model: nn.Module) -> float:
    """Mean next-token cross-entropy on sentences no client trains on."""
    x, y = batches(client=99, seed=99, sentences=64)
    model.eval()
    with torch.no_grad():
        out = model(x)
        return float(F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)))


def entropy() -> float:
    """The language's entropy per token: the loss a perfect model reaches."""
    p = chain()
    return float(-(p * p.log()).sum(1).mean())
