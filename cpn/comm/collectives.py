"""Collectives that count what they send, by link class, and fail clearly.

Counting follows the cost model's conventions (`cpn.costmodel`) so that a measurement
and a prediction can be compared byte for byte:
  - reduce / broadcast over n members: every non-root sends (reduce) or the root sends
    n − 1 times (broadcast) one message of the tensor;
  - ring all-reduce: `wire.ring_allreduce_bytes` per member;
  - ring all-gather, reduce-scatter: each member sends n − 1 chunks.
A collective that fails (a peer died, or did not answer within the groups' timeout)
raises `WanSyncError` saying which step of the sync and which group, never hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from cpn import wire
from cpn.comm.groups import Member

T = TypeVar("T")

LINK_CLASSES = ("intra_site", "wan")


class WanSyncError(RuntimeError):
    """A gradient-sync collective failed: a peer is dead, stuck or misconfigured."""


class Counter(dict[str, int]):
    """Bytes sent, by link class."""

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(LINK_CLASSES, 0))

    def add(self, link_class: str, nbytes: int) -> None:
        self[link_class] += nbytes


def guarded(what: str, member: Member, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except (RuntimeError, ValueError) as exc:  # gloo/NCCL errors surface as RuntimeError
        raise WanSyncError(
            f"gradient sync failed during {what} among ranks {list(member.ranks)}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__} "
            "(a peer may have died or stalled past the timeout)"
        ) from exc


def reduce_to_first(x: torch.Tensor, member: Member, counter: Counter, link: str) -> torch.Tensor:
    """Sum over the group, valid on position 0 only (elsewhere: scratch)."""
    if member.size == 1:
        return x
    buf = x.contiguous()
    guarded(
        "the reduce inside the site",
        member,
        lambda: dist.reduce(buf, dst=member.group_rank(0), group=member.handle),
    )
    if member.position != 0:
        counter.add(link, buf.numel() * buf.element_size())
    return buf


def broadcast_from_first(
    x: torch.Tensor, member: Member, counter: Counter, link: str
) -> torch.Tensor:
    if member.size == 1:
        return x
    buf = x.contiguous()
    guarded(
        "the broadcast inside the site",
        member,
        lambda: dist.broadcast(buf, src=member.group_rank(0), group=member.handle),
    )
    if member.position == 0:
        counter.add(link, (member.size - 1) * buf.numel() * buf.element_size())
    return buf


def ring_all_reduce(x: torch.Tensor, member: Member, counter: Counter, link: str) -> torch.Tensor:
    if member.size == 1:
        return x
    buf = x.contiguous()
    guarded("the all-reduce", member, lambda: dist.all_reduce(buf, group=member.handle))
    counter.add(
        link,
        wire.ring_allreduce_bytes(buf.numel(), buf.element_size(), member.size, member.position),
    )
    return buf


def all_gather(x: torch.Tensor, member: Member, counter: Counter, link: str) -> list[torch.Tensor]:
    """Every member's equal-sized `x`, in group order."""
    if member.size == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(member.size)]
    guarded(
        "the all-gather",
        member,
        lambda: dist.all_gather(parts, x.contiguous(), group=member.handle),
    )
    counter.add(link, (member.size - 1) * x.numel() * x.element_size())
    return parts


def reduce_scatter(x: torch.Tensor, member: Member, counter: Counter, link: str) -> torch.Tensor:
    """This member's chunk of the sum; `x.numel()` must divide by the group size."""
    if member.size == 1:
        return x
    out = torch.empty(x.numel() // member.size, dtype=x.dtype)
    guarded(
        "the reduce-scatter inside the site",
        member,
        lambda: dist.reduce_scatter_tensor(out, x.contiguous(), group=member.handle),
    )
    counter.add(link, (member.size - 1) * out.numel() * out.element_size())
    return out


def all_gather_into(x: torch.Tensor, member: Member, counter: Counter, link: str) -> torch.Tensor:
    if member.size == 1:
        return x
    out = torch.empty(x.numel() * member.size, dtype=x.dtype)
    guarded(
        "the all-gather inside the site",
        member,
        lambda: dist.all_gather_into_tensor(out, x.contiguous(), group=member.handle),
    )
    counter.add(link, (member.size - 1) * x.numel() * x.element_size())
    return out
