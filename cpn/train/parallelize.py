"""Megatron-style tensor parallelism applied to a `GPTStage`, apart from the model.

Within a tensor-parallel group of `tp` workers (one node):
  - qkv and the MLP's first linear are *column-parallel*: each worker holds a slice of the
    output features (for qkv, its heads' rows of each of q, k and v) and needs the whole
    input: `f` (identity forward, all-reduce of the input gradient backward);
  - the two output projections are *row-parallel*: each worker multiplies its slice of the
    input features, the partial outputs are summed by `g` (all-reduce forward, identity
    backward), then the bias, held whole, is added;
  - the token embedding and the output head are split over the (padded) vocabulary; the
    embedding's partial lookups are summed by `g`, and the loss is a parallel
    cross-entropy (three fp32 all-reduces of one value per token) that never gathers the
    logits. Padded vocabulary entries are masked out of the softmax.
LayerNorms, position embeddings and row-parallel biases stay whole on every worker; their
gradients come out equal on all of them, because their inputs and output gradients are.

A shard's weights are slices of the single-process model's weights, so a tp-way run
computes what one worker would, up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cpn.comm import Member, Traffic
from cpn.comm.collectives import all_reduce
from cpn.gpt_shapes import padded_vocab
from cpn.train.model import Block, GPTStage


@dataclass
class TensorParallel:
    """What tensor-parallel modules need: the group, the byte counter, the wire dtype."""

    group: Member
    traffic: Traffic
    wire_dtype: torch.dtype

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.position

    def all_reduce(
        self,
        x: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        wire_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Sum (or `op`) over the tensor-parallel group, sent in the wire dtype (a new tensor)."""
        if self.group.size == 1:
            return x.clone()
        sent = x.detach().to(wire_dtype or self.wire_dtype)
        total = all_reduce(
            sent, self.group, self.traffic, "intra_node", op=op, what="tensor-parallel all-reduce"
        )
        return total.to(x.dtype)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_reduce(grad), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyToTP.apply(x, tp)  # type: ignore[no-untyped-call, no-any-return]


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp)  # type: ignore[no-untyped-call, no-any-return]


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone())
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(bias.clone())  # whole: added after the reduction
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.tp) + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


class _ParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over tokens with the logits split by vocabulary (Megatron)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        start: int,
        vocab: int,
        tp: TensorParallel,
    ) -> torch.Tensor:
        logits = logits.float()
        width = logits.shape[1]
        columns = torch.arange(start, start + width, device=logits.device)
        logits = logits.masked_fill(columns >= vocab, float("-inf"))  # padded entries
        peak = tp.all_reduce(logits.max(dim=1).values, dist.ReduceOp.MAX, torch.float32)
        shifted = logits - peak.unsqueeze(1)
        exp = shifted.exp()
        total = tp.all_reduce(exp.sum(dim=1), wire_dtype=torch.float32)
        local = targets - start
        mine = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1)
        rows = torch.arange(len(targets), device=logits.device)
        picked = torch.where(mine, shifted[rows, index], torch.zeros((), device=logits.device))
        picked = tp.all_reduce(picked, wire_dtype=torch.float32)
        loss = total.log() - picked
        ctx.save_for_backward(exp / total.unsqueeze(1), mine, index)
        return loss.mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, mine, index = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(len(index), device=g.device)
        g[rows, index] -= mine.to(g.dtype)
        return g * (grad / len(index)), None, None, None, None


class ParallelOutputHead(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, vocab: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.start, self.vocab, self.tp = start, vocab, tp

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(copy_to_tp(x, self.tp), self.weight)
        return _ParallelCrossEntropy.apply(  # type: ignore[no-untyped-call, no-any-return]
            logits.flatten(0, 1), targets.flatten(), self.start, self.vocab, self.tp
        )


def _head_rows(full: torch.Tensor, hidden: int, tp: int, rank: int) -> torch.Tensor:
    """This worker's rows of a fused [q; k; v] tensor: its heads' slice of each."""
    width = hidden // tp
    return torch.cat(
        [full[i * hidden + rank * width : i * hidden + (rank + 1) * width] for i in range(3)]
    )


def _slice(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank]


def _padded_rows(weight: torch.Tensor, tp: int) -> torch.Tensor:
    rows = padded_vocab(weight.shape[0], tp)
    if rows == weight.shape[0]:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


@torch.no_grad()
def parallelize(stage: GPTStage, tp: TensorParallel) -> GPTStage:
    """Rewrite `stage` in place into this worker's tensor-parallel shard."""
    n, r, h = tp.size, tp.rank, stage.cfg.hidden
    if n == 1:
        return stage
    for block in stage.blocks.values():
        assert isinstance(block, Block)
        qkv, proj = block.attn.qkv, block.attn.proj
        block.attn.qkv = ColumnParallelLinear(  # type: ignore[assignment]
            _head_rows(qkv.weight, h, n, r), _head_rows(qkv.bias, h, n, r), tp
        )
        block.attn.proj = RowParallelLinear(  # type: ignore[assignment]
            _slice(proj.weight, 1, n, r), proj.bias, tp
        )
        fc, out = block.mlp.fc, block.mlp.proj
        block.mlp.fc = ColumnParallelLinear(  # type: ignore[assignment]
            _slice(fc.weight, 0, n, r), _slice(fc.bias, 0, n, r), tp
        )
        block.mlp.proj = RowParallelLinear(  # type: ignore[assignment]
            _slice(out.weight, 1, n, r), out.bias, tp
        )
    vocab = stage.cfg.vocab
    if stage.first:
        table = _padded_rows(stage.wte.weight, n)
        part = table.shape[0] // n
        stage.wte = VocabParallelEmbedding(  # type: ignore[assignment]
            table[r * part : (r + 1) * part], r * part, tp
        )
    if stage.last:
        table = _padded_rows(stage.lm_head.weight, n)
        part = table.shape[0] // n
        stage.lm_head = ParallelOutputHead(  # type: ignore[assignment]
            table[r * part : (r + 1) * part], r * part, vocab, tp
        )
    return stage


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter of this worker's shard sits in the whole model's parameter.

    Checkpoints store whole parameters (`torch.distributed.checkpoint`, keyed by name and
    global offsets) so that any dp × tp × pp layout can load any other's. A shard's local
    tensor is a `torch.chunk`-ordered piece of a *logical* whole tensor along `dim`:
      - fused qkv rows are [q; k; v], each split by heads, so the logical shape is
        (3, hidden, ...) split along dim 1, and the local (3·w, ...) tensor is viewed as
        (3, w, ...);
      - vocabulary-parallel tables are padded to a multiple of tp; the logical tensor is
        the unpadded (vocab, hidden) table and the local view drops the padding rows
        (they are never looked up and their logits are masked, so they stay zero);
      - everything held whole (`dim` None) is its own logical tensor.
    """

    shape: tuple[int, ...]  # the logical whole tensor
    dim: int | None  # the dimension split over the tensor-parallel group; None: held whole
    fused_qkv: bool = False
    rows: int | None = None  # vocabulary tables: the real (unpadded) rows of the local piece

    def local_view(self, local: torch.Tensor) -> torch.Tensor:
        """This worker's piece of the logical tensor, as a view of `local` (writes go through)."""
        if self.fused_qkv:
            return local.view(3, local.shape[0] // 3, *local.shape[1:])
        if self.rows is not None:
            return local[: self.rows]
        return local


def shard_layouts(stage: GPTStage, tp: int, tp_rank: int) -> dict[str, ShardLayout]:
    """The `ShardLayout` of every parameter of `stage` (parallelized or not), by name."""
    cfg, h = stage.cfg, stage.cfg.hidden
    out: dict[str, ShardLayout] = {}
    for name, p in stage.named_parameters():
        leaf = name.split(".")
        kind = ".".join(leaf[-3:-1]) if len(leaf) >= 3 else leaf[0]
        if name in ("wte.weight", "lm_head.weight"):
            part = padded_vocab(cfg.vocab, tp) // tp
            rows = max(0, min(part, cfg.vocab - tp_rank * part))
            out[name] = ShardLayout((cfg.vocab, h), 0, rows=rows)
        elif kind == "attn.qkv":
            out[name] = ShardLayout((3, h, *p.shape[1:]), 1, fused_qkv=True)
        elif kind == "mlp.fc":
            out[name] = ShardLayout((4 * h, *p.shape[1:]), 0)
        elif kind in ("attn.proj", "mlp.proj") and leaf[-1] == "weight":
            out[name] = ShardLayout((h, p.shape[1] * tp), 1)
        else:  # LayerNorms, position embeddings, row-parallel biases: whole everywhere
            out[name] = ShardLayout(tuple(p.shape), None)
    return out
