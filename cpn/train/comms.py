"""Counted communication: every byte a worker sends, by link class.

The runtime's measured bytes are checked against the cost model's prediction for the plan,
so each collective here counts what its algorithm sends by the cost model's convention
(ring all-reduce: 2·(n − 1)/n of the tensor per member, by chunk; ring all-gather: n − 1
chunks per member; point-to-point: the tensor). Payloads travel in a *wire dtype* (the
job's dtype) while compute stays in fp32 on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cpn import wire
from cpn.comm.groups import Member

#: The runtime's groups are the comm library's: a process group as one member sees it.
Group = Member

LINK_CLASSES = ("intra_node", "intra_site", "wan")


@dataclass
class ByteCounters:
    """Bytes this worker sent, cumulative, by link class."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINK_CLASSES, 0))

    def add(self, link_class: str, nbytes: int) -> None:
        self.sent[link_class] += nbytes

    def snapshot(self) -> dict[str, int]:
        return dict(self.sent)


def all_reduce(
    x: torch.Tensor,
    group: Group,
    counters: ByteCounters,
    link_class: str,
    wire_dtype: torch.dtype,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """Sum (or `op`) of `x` over the group, sent in `wire_dtype`; a new tensor."""
    if group.size == 1:
        return x.clone()
    buf = x.detach().to(wire_dtype).contiguous()
    dist.all_reduce(buf, op=op, group=group.handle)
    counters.add(
        link_class,
        wire.ring_allreduce_bytes(buf.numel(), buf.element_size(), group.size, group.position),
    )
    return buf.to(x.dtype)


def all_gather_flat(
    chunk: torch.Tensor, group: Group, counters: ByteCounters, link_class: str
) -> torch.Tensor:
    """Concatenation of every member's equal-sized chunk, in group order."""
    if group.size == 1:
        return chunk.clone()
    parts = [torch.empty_like(chunk) for _ in range(group.size)]
    dist.all_gather(parts, chunk.contiguous(), group=group.handle)
    counters.add(link_class, (group.size - 1) * chunk.numel() * chunk.element_size())
    return torch.cat(parts)


def isend(x: torch.Tensor, dst: int, counters: ByteCounters, link_class: str) -> dist.Work | None:
    counters.add(link_class, x.numel() * x.element_size())
    return dist.isend(x.contiguous(), dst)


def recv(shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=dtype)
    dist.recv(out, src)
    return out
