"""Every tensor that moves between ranks moves here: counted by link class, failing clearly.

Tensor-parallel all-reduces, pipeline sends and receives, the flat ring and the hierarchical
gradient sync all call these functions, so a worker has one byte counter (`Traffic`) and one
error (`CommError`, naming the step, the operation and the ranks).

Counted bytes are what the backend really writes to its sockets, payload only (gloo adds a
few dozen bytes of framing per message), as `cpn.wire` describes per member:
  - ring all-reduce: `wire.ring_allreduce_bytes` (both backends run a ring);
  - all-gather: every member sends its chunk n − 1 times;
  - broadcast: `wire.broadcast_bytes` (gloo: a binomial tree; NCCL: a pipelined chain);
  - reduce: every member but the root sends the tensor once. NCCL's reduce does exactly that;
    gloo's own reduce does not (a ring reduce-scatter, then a gather at the root: every
    member sends (n − 1)/n of the tensor more than the chain, measured), so on gloo the
    reduce here is a pipelined chain of point-to-point sends, whose traffic is the cost
    model's (n − 1) copies on any backend;
  - reduce-scatter: `wire.reduce_scatter_bytes` (gloo runs a whole all-reduce for it);
  - send / receive: the tensor, by the sender.
Buffers are allocated on the input's device, so the same code runs gloo on the CPU and NCCL
on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from cpn import wire
from cpn.comm.errors import CommError
from cpn.comm.groups import Member
from cpn.comm.traffic import LinkClass, Traffic

T = TypeVar("T")

#: Elements per message of the chain reduce: small enough that the chain pipelines (a
#: member forwards one chunk while the next arrives), large enough that framing is noise.
CHAIN_CHUNK_ELEMENTS = 1 << 18


def guarded(operation: str, ranks: Sequence[int], traffic: Traffic, fn: Callable[[], T]) -> T:
    """Run one collective; any backend failure becomes `CommError`."""
    try:
        return fn()
    except (RuntimeError, ValueError) as exc:  # gloo/NCCL errors surface as RuntimeError
        if isinstance(exc, CommError):
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CommError(operation, ranks, traffic.step, first) from exc


def all_reduce(
    x: torch.Tensor,
    member: Member,
    traffic: Traffic,
    link: LinkClass,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    what: str = "all-reduce",
) -> torch.Tensor:
    """Sum (or `op`) of `x` over the group, in x's dtype; a new tensor (x itself alone)."""
    if member.size == 1:
        return x
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    guarded(what, member.ranks, traffic, lambda: dist.all_reduce(buf, op=op, group=member.handle))
    traffic.add(
        link,
        wire.ring_allreduce_bytes(buf.numel(), buf.element_size(), member.size, member.position),
    )
    return buf


def reduce_to_first(
    x: torch.Tensor, member: Member, traffic: Traffic, link: LinkClass, *, what: str = "reduce"
) -> torch.Tensor:
    """Sum over the group, valid on position 0 only (elsewhere: scratch)."""
    if member.size == 1:
        return x
    buf = x.contiguous()
    if member.backend == "nccl":
        guarded(
            what,
            member.ranks,
            traffic,
            lambda: dist.reduce(buf, dst=member.group_rank(0), group=member.handle),
        )
    else:
        guarded(what, member.ranks, traffic, lambda: _chain_reduce(buf, member))
    traffic.add(
        link, wire.reduce_bytes(buf.numel() * buf.element_size(), member.size, member.position)
    )
    return buf


def _chain_reduce(buf: torch.Tensor, member: Member) -> None:
    """buf ← Σ over the group at position 0, along the chain n−1 → … → 1 → 0, by chunks.

    Hand-written because gloo's reduce sends more than a chain (module docstring) and the
    cost model, like NCCL, assumes (n − 1) copies. Each member adds the running sum of the
    members after it to its own chunk and forwards it; chunk c + 1 arrives while chunk c
    is on its way, so the chain costs about one tensor's transfer, not n − 1.
    """
    flat = buf.view(-1)
    pos, last = member.position, member.size - 1
    before = member.group_rank(pos - 1) if pos > 0 else None
    after = member.group_rank(pos + 1) if pos < last else None
    scratch = torch.empty(
        min(CHAIN_CHUNK_ELEMENTS, flat.numel()), dtype=buf.dtype, device=buf.device
    )
    sends: list[dist.Work] = []
    for start in range(0, flat.numel(), CHAIN_CHUNK_ELEMENTS):
        chunk = flat[start : start + CHAIN_CHUNK_ELEMENTS]
        if after is not None:
            incoming = scratch[: chunk.numel()]
            dist.recv(incoming, src=after, group=member.handle)
            chunk.add_(incoming)
        if before is not None:
            work = dist.isend(chunk, dst=before, group=member.handle)
            if work is not None:
                sends.append(work)
    for work in sends:
        work.wait()


def broadcast_from_first(
    x: torch.Tensor, member: Member, traffic: Traffic, link: LinkClass, *, what: str = "broadcast"
) -> torch.Tensor:
    if member.size == 1:
        return x
    buf = x.contiguous()
    guarded(
        what,
        member.ranks,
        traffic,
        lambda: dist.broadcast(buf, src=member.group_rank(0), group=member.handle),
    )
    traffic.add(
        link,
        wire.broadcast_bytes(
            buf.numel() * buf.element_size(), member.size, member.position, member.backend
        ),
    )
    return buf


def all_gather(
    x: torch.Tensor, member: Member, traffic: Traffic, link: LinkClass, *, what: str = "all-gather"
) -> list[torch.Tensor]:
    """Every member's equal-sized `x`, in group order."""
    if member.size == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(member.size)]
    guarded(
        what,
        member.ranks,
        traffic,
        lambda: dist.all_gather(parts, x.contiguous(), group=member.handle),
    )
    traffic.add(link, (member.size - 1) * x.numel() * x.element_size())
    return parts


def all_gather_flat(
    x: torch.Tensor, member: Member, traffic: Traffic, link: LinkClass, *, what: str = "all-gather"
) -> torch.Tensor:
    """Concatenation of every member's equal-sized 1-D `x`, in group order."""
    if member.size == 1:
        return x
    out = torch.empty(x.numel() * member.size, dtype=x.dtype, device=x.device)
    guarded(
        what,
        member.ranks,
        traffic,
        lambda: dist.all_gather_single(out, x.contiguous(), group=member.handle),
    )
    traffic.add(link, (member.size - 1) * x.numel() * x.element_size())
    return out


def reduce_scatter(
    x: torch.Tensor,
    member: Member,
    traffic: Traffic,
    link: LinkClass,
    *,
    what: str = "reduce-scatter",
) -> torch.Tensor:
    """This member's chunk of the sum; `x.numel()` must divide by the group size."""
    if member.size == 1:
        return x
    out = torch.empty(x.numel() // member.size, dtype=x.dtype, device=x.device)
    guarded(
        what,
        member.ranks,
        traffic,
        lambda: dist.reduce_scatter_single(out, x.contiguous(), group=member.handle),
    )
    traffic.add(
        link,
        wire.reduce_scatter_bytes(
            x.numel(), x.element_size(), member.size, member.position, member.backend
        ),
    )
    return out


def isend(
    x: torch.Tensor, peer: int, traffic: Traffic, link: LinkClass, *, what: str = "send"
) -> dist.Work | None:
    """Start sending `x` to global rank `peer`; wait on the returned work (`wait_all`)."""
    buf = x.contiguous()
    work = guarded(what, (dist.get_rank(), peer), traffic, lambda: dist.isend(buf, peer))
    traffic.add(link, buf.numel() * buf.element_size())
    return work


def recv(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    peer: int,
    traffic: Traffic,
    *,
    what: str = "receive",
) -> torch.Tensor:
    """A tensor of `shape` from global rank `peer` (the sender counts the bytes)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    guarded(what, (peer, dist.get_rank()), traffic, lambda: dist.recv(out, peer))
    return out


def wait_all(works: Sequence[dist.Work | None], traffic: Traffic, ranks: Sequence[int]) -> None:
    """Wait for sends `isend` started; a failed one is a `CommError`."""

    def wait() -> None:
        for work in works:
            if work is not None:
                work.wait()

    guarded("send", ranks, traffic, wait)
