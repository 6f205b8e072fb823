"""A small GPT (nanoGPT-shaped), built one pipeline stage at a time.

The architecture and every parameter's name and shape are those of `cpn.gpt_shapes`, which
the cost model uses; `tests/unit/test_train_model.py` checks the two agree. Differences
from nanoGPT, each for a reason:
  - the output head is untied from the token embedding, so that pipeline stages never
    need to share a weight (a tied head needs an extra gradient all-reduce between the
    first and last stage);
  - no dropout, so that a parallel run can follow a single-process run exactly;
  - every parameter is initialised from a generator seeded by (seed, parameter name),
    so any stage or tensor-parallel rank builds exactly the weights a single process
    would, whatever subset it holds.

Tensor parallelism is not here: `cpn.train.parallelize` rewrites these modules into their
Megatron-style shards, apart from the model definition (as torchtitan does).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cpn.contracts.job import ModelSpec
from cpn.gpt_shapes import stage_layers

#: Standard deviation of the normal initialisation (GPT-2); output projections are scaled
#: down by sqrt(2·layers) so the residual stream does not grow with depth.
INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int

    @classmethod
    def of(cls, spec: ModelSpec) -> GPTConfig:
        return cls(spec.layers, spec.hidden, spec.heads, spec.seq_len, spec.vocab)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Widths are read from the weights, so the same code runs a tensor-parallel shard
        # (which holds heads/tp heads) and the whole layer.
        width = self.qkv.weight.shape[0] // 3
        q, k, v = self.qkv(x).split(width, dim=2)
        heads = width // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class OutputHead(nn.Module):
    """Final projection to the vocabulary and the cross-entropy loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.vocab = cfg.vocab
        self.weight = nn.Parameter(torch.empty(cfg.vocab, cfg.hidden))

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPTStage(nn.Module):
    """The part of the GPT that pipeline stage `stage` of `pp` holds.

    Stage 0 takes token ids and owns the embeddings; the last stage owns the final
    LayerNorm and the head and returns the mean cross-entropy; the others map hidden
    states to hidden states. With pp = 1 this is the whole model.
    """

    def __init__(self, cfg: GPTConfig, stage: int = 0, pp: int = 1, seed: int = 0) -> None:
        super().__init__()
        self.cfg, self.stage, self.pp = cfg, stage, pp
        self.first, self.last = stage == 0, stage == pp - 1
        if self.first:
            self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleDict(
            {str(i): Block(cfg) for i in stage_layers(cfg.layers, pp, stage)}
        )
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.lm_head = OutputHead(cfg)
        init_parameters(self, cfg, seed)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            assert targets is not None, "the last stage needs the targets"
            return self.lm_head(self.ln_f(x), targets)  # type: ignore[no-any-return]
        return x


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A generator that depends only on the seed and the parameter's name."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: GPTConfig, seed: int) -> None:
    """GPT-2 initialisation, each parameter from its own (seed, name) generator."""
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif ".ln_" in name or name.startswith("ln_f"):
            p.fill_(1.0)  # LayerNorm weight
        else:
            std = INIT_STD
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                std /= math.sqrt(2 * cfg.layers)
            p.copy_(torch.randn(p.shape, generator=parameter_generator(seed, name)) * std)
