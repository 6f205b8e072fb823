"""Hierarchical gradient sync of one fused bucket: reduce in the site, exchange across
sites (dense or top-k), bring the result back into the site.

Leader hierarchy (what the cost model predicts byte for byte):
  1. reduce the bucket to the site leader (`wire_dtype`);
  2. leaders exchange: a ring all-reduce (dense; fp16/bf16 if asked) or, under top-k, a
     ring all-gather of each leader's sparse payload (`cpn.comm.codec`), each leader
     summing every site's entries;
  3. broadcast the sum from the leader to its site.
Sharded hierarchy: reduce-scatter in the site, every local rank exchanges its own shard
with the same local rank of the other sites (in parallel, so every rank's uplink works),
all-gather in the site.

Top-k with error feedback (Deep Gradient Compression, Lin et al. 2018), on the ranks that
exchange: `acc += g` (or, with momentum correction, `u = m·u + g; acc += u`), send the k
largest |acc| as `value_dtype`, keep `acc − sent` as the residual: what was not sent, or
was lost to rounding, is sent later rather than dropped. Sent + residual equals the
accumulator exactly (fp16 rounding error is exactly representable in fp32).

A gradient that is not finite never enters that memory. A leader whose site sum holds an
inf or a NaN sends NaN values instead of its top-k (dense modes carry the inf or NaN by
themselves), so every rank of the group sees a non-finite result; then nobody commits the
step's residuals or velocities, the result is returned as it is (an AMP GradScaler, or the
runtime, sees it and skips the optimizer step) and `state.skipped_steps` counts it.

Narrow wires do not overflow where the mean fits: with fp16/bf16 on the wire the bucket is
scaled by 1/n before it is cast (as PyTorch's fp16 hook divides first), and casts saturate
finite values at the dtype's largest value instead of turning them into inf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cpn import wire
from cpn.comm import codec, quant
from cpn.comm.collectives import (
    all_gather,
    all_gather_flat,
    all_reduce,
    broadcast_from_first,
    reduce_scatter,
    reduce_to_first,
)
from cpn.comm.groups import Member
from cpn.comm.select import topk_indices
from cpn.comm.state import WanSyncState
from cpn.comm.traffic import LinkClass

_DENSE_WAN_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

Commit = Callable[[], None]


def _nothing() -> None:
    return None


def saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` cast to `dtype`, finite values clamped to its range; inf and NaN kept as they are."""
    if dtype == torch.float32 or not dtype.is_floating_point:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return torch.where(torch.isfinite(x), x.clamp(-limit, limit), x).to(dtype)


def compress(
    acc: torch.Tensor, k: int, value_dtype: torch.dtype, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Take the top-k of `acc` out of it: returns (sorted indices, values as sent).

    `acc` keeps the residual: acc_after[idx] = acc[idx] − float(sent), so that
    float(sent) + acc_after == acc exactly. Values beyond `value_dtype`'s range are sent
    saturated; what did not fit stays in the residual.
    """
    idx = topk_indices(acc, k, generator=generator)
    sent = saturate(acc[idx], value_dtype)
    acc[idx] -= sent.to(torch.float32)
    return idx, sent


def _gather_state(
    store: dict[int, torch.Tensor],
    state: WanSyncState,
    slots: Sequence[int],
    sizes: Sequence[int],
    device: torch.device,
) -> torch.Tensor:
    return torch.cat([state.buffer(store, s, n, device) for s, n in zip(slots, sizes, strict=True)])


def _scatter_state(
    store: dict[int, torch.Tensor], slots: Sequence[int], sizes: Sequence[int], flat: torch.Tensor
) -> None:
    offset = 0
    for s, n in zip(slots, sizes, strict=True):
        store[s].copy_(flat[offset : offset + n])
        offset += n


class _Window:
    """The part [lo, hi) of a bucket's per-parameter state one rank exchanges."""

    def __init__(
        self, state: WanSyncState, slots: Sequence[int], sizes: Sequence[int], lo: int, hi: int
    ) -> None:
        self.state, self.slots, self.sizes, self.lo, self.hi = state, slots, sizes, lo, hi

    def load(
        self, store: dict[int, torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a copy of the whole bucket's state, its [lo, hi) view): edit, then `save`."""
        full = _gather_state(store, self.state, self.slots, self.sizes, device)
        return full, full[self.lo : self.hi]

    def save(self, store: dict[int, torch.Tensor], full: torch.Tensor) -> None:
        _scatter_state(store, self.slots, self.sizes, full)


def send_with_feedback(
    state: WanSyncState,
    acc: torch.Tensor,
    member: Member,
    *,
    finite: bool,
    density: float | None,
    bits: int | None,
    seed_step: int,
    what: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum over `member` of what each member sends of its accumulator `acc` (fp32).

    `bits` (8 or 4): every value, quantised (`cpn.comm.quant`); else the top-k at
    `density` (`compress`, `cpn.comm.codec`). Payloads are all-gathered and summed in group
    order, so every member gets the same sum. `acc` keeps what was not sent (error
    feedback). When `finite` is False the payload says so (NaN values or scales), so
    every member sees a non-finite sum. Returns (sum, the top-k indices or None).
    """
    numel, traffic = acc.numel(), state.traffic
    total = torch.zeros(numel, device=acc.device)
    if bits is not None:
        payload, _ = quant.quantize_feedback(acc, bits, state.quant_block)
        if not finite:
            quant.poison(payload, numel, state.quant_block)
        for part in all_gather(payload, member, traffic, "wan", what=f"{what} (int{bits})"):
            total += quant.dequantize(part, numel, bits, state.quant_block)
        return total, None
    assert density is not None
    k = wire.topk_count(numel, density)
    gen = torch.Generator().manual_seed(state.seed * 1_000_003 + seed_step)
    idx, values = compress(acc, k, state.value_dtype, gen)
    if not finite:
        values.fill_(float("nan"))  # tells every site that this step is void
    payload = codec.encode(values, idx, numel, state.value_dtype)
    for part in all_gather(payload, member, traffic, "wan", what=f"{what} (top-k)"):
        vals, where = codec.decode(part, numel, k, state.value_dtype)
        total.index_add_(0, where, vals)
    return total, idx


def _exchange(
    state: WanSyncState, v: torch.Tensor, window: _Window, member: Member, sum_of: int
) -> tuple[torch.Tensor, Commit]:
    """Sum over sites of `v` (this rank's site's sum over `sum_of` ranks of its window).

    Returns the sum (fp32) and what commits this step's error-feedback memory; the caller
    commits only once it knows the whole result is finite.
    """
    traffic = state.traffic
    if not state.feedback:
        dtype = _DENSE_WAN_DTYPES.get(state.compression, state.wire_dtype)
        total = all_reduce(saturate(v, dtype), member, traffic, "wan", what="the WAN exchange")
        return total.to(torch.float32), _nothing

    finite = bool(torch.isfinite(v).all())
    if finite and state.clip_norm is not None:
        # Local gradient clipping (DGC): bound the site's mean gradient, scaled to the
        # share of the bucket this rank holds.
        share = (window.hi - window.lo) / max(sum(window.sizes), 1)
        # v sums `sum_of` ranks' gradients, each already divided by the group size when
        # the buckets are prescaled: the limit is in the same units.
        summed = sum_of / state.averaged_over if state.prescaled else sum_of
        limit = state.clip_norm * summed * share**0.5
        norm = float(v.norm())
        if norm > limit:
            v = v * (limit / norm)
    res_full, acc = window.load(state.residuals, v.device)
    if state.momentum > 0:
        vel_full, u = window.load(state.velocities, v.device)
        u.mul_(state.momentum).add_(v)
        acc += u
    else:
        acc += v

    def commit() -> None:
        window.save(state.residuals, res_full)
        if state.momentum > 0:
            window.save(state.velocities, vel_full)

    density = state.schedule.at(state.step) if state.sparse else 1.0
    if state.flush_next or density is None:
        # Dense fp16 step: send the whole accumulator, keep its rounding error. fp16 must
        # hold what a mean holds, not a sum: unless the buckets are prescaled already, the
        # step sends the accumulator divided by the group size rounded up to a power of
        # two (exact: the residual stays exact, and the fp16 sum rounds as the unscaled
        # one would, shifted by whole binary orders) and scales the sum back.
        scale = 1 if state.prescaled else 1 << (state.averaged_over - 1).bit_length()
        sent = saturate(acc / scale, torch.float16)
        acc -= sent.to(torch.float32) * scale
        if not finite:
            sent.fill_(float("nan"))
        total = all_reduce(sent, member, traffic, "wan", what="the WAN exchange (dense step)")
        return total.to(torch.float32) * scale, commit

    total, idx = send_with_feedback(
        state,
        acc,
        member,
        finite=finite,
        density=density,
        bits=state.quant_bits,
        seed_step=state.step,
        what="the WAN exchange",
    )
    if state.momentum > 0:
        # Momentum factor masking: sent entries restart their velocity (all of them when
        # every value is sent, quantised).
        if idx is None:
            u.zero_()
        else:
            u[idx] = 0.0
    return total, commit


def _flat(state: WanSyncState, flat: torch.Tensor) -> tuple[torch.Tensor, Commit]:
    g = state.groups
    nxt = g.ranks[(g.flat.position + 1) % g.world]
    link: LinkClass = "wan" if g.site_of_rank(nxt) != g.site else "intra_site"
    total = all_reduce(
        saturate(flat, state.wire_dtype), g.flat, state.traffic, link, what="the flat ring"
    )
    return total.to(torch.float32), _nothing


def _leader(
    state: WanSyncState, flat: torch.Tensor, slots: Sequence[int], sizes: Sequence[int]
) -> tuple[torch.Tensor, Commit]:
    g = state.groups
    site_sum = reduce_to_first(
        saturate(flat, state.wire_dtype),
        g.local,
        state.traffic,
        "intra_site",
        what="the reduce inside the site",
    )
    commit = _nothing
    if g.leaders is not None:  # this rank leads its site
        total = site_sum.to(torch.float32)
        if g.leaders.size > 1 and not state.in_site_only:
            window = _Window(state, slots, sizes, 0, flat.numel())
            total, commit = _exchange(state, total, window, g.leaders, g.local.size)
        out = saturate(total, state.wire_dtype)
    else:
        out = torch.empty(flat.numel(), dtype=state.wire_dtype, device=flat.device)
    result = broadcast_from_first(
        out, g.local, state.traffic, "intra_site", what="the broadcast inside the site"
    )
    return result.to(torch.float32), commit


def _sharded(
    state: WanSyncState, flat: torch.Tensor, slots: Sequence[int], sizes: Sequence[int]
) -> tuple[torch.Tensor, Commit]:
    g = state.groups
    assert g.shard is not None
    c, numel = g.local.size, flat.numel()
    padded = -(-numel // c) * c
    buf = torch.zeros(padded, dtype=state.wire_dtype, device=flat.device)
    buf[:numel] = saturate(flat, state.wire_dtype)
    mine = reduce_scatter(
        buf, g.local, state.traffic, "intra_site", what="the reduce-scatter inside the site"
    ).to(torch.float32)
    chunk = padded // c
    lo = min(g.local.position * chunk, numel)
    hi = min(lo + chunk, numel)
    window = _Window(state, slots, sizes, lo, hi)
    # Padding never holds gradient; exchange only the real part of the shard.
    real, commit = _exchange(state, mine[: hi - lo], window, g.shard, c)
    mine = torch.zeros(chunk, dtype=state.wire_dtype, device=flat.device)
    mine[: hi - lo] = saturate(real, state.wire_dtype)
    whole = all_gather_flat(
        mine, g.local, state.traffic, "intra_site", what="the all-gather inside the site"
    )
    return whole[:numel].to(torch.float32), commit


def sync_flat(
    state: WanSyncState,
    flat: torch.Tensor,
    slots: Sequence[int],
    sizes: Sequence[int],
) -> torch.Tensor:
    """Average of one fused bucket over the data-parallel group (a new fp32 tensor).

    `slots`/`sizes`: the parameters the bucket holds, in order (their slots key the
    error-feedback state). Does not advance `state.step`. A non-finite average leaves the
    error-feedback state untouched and marks the step (`state.end_step` counts it).
    """
    world = state.groups.world
    if flat.numel() == 0 or world == 1:
        out = flat.to(torch.float32).clone()
        if not bool(torch.isfinite(out).all()):  # nothing to average, still a void step
            state.mark_not_finite()
        return out
    x = flat.to(torch.float32)
    n = state.averaged_over
    if state.prescaled:
        x = x / n
    if state.hierarchy == "flat":
        total, commit = _flat(state, x)
    elif state.hierarchy == "sharded" and len(state.groups.sites) > 1:
        total, commit = _sharded(state, x, slots, sizes)
    else:
        total, commit = _leader(state, x, slots, sizes)
    if bool(torch.isfinite(total).all()):
        commit()
    else:
        state.mark_not_finite()
    return total if state.prescaled else total / n


def sync_gradients(state: WanSyncState, grads: Sequence[torch.Tensor]) -> bool:
    """Average `grads` over the data-parallel group, in place; one step of the schedule.

    The call the 3D runtime makes per stage: gradients are fused into the buckets
    `cpn.wire.fuse` defines (the cost model predicts bytes from the same buckets); the
    position of a gradient in `grads` is its slot for the error-feedback state. Returns
    True when the step's gradient was not finite somewhere in the group: the averages
    then hold inf or NaN, nothing entered the residuals, and the optimizer step should be
    skipped.
    """
    if state.groups.world == 1:  # nothing to average; only the finiteness matters
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            state.mark_not_finite()
        return state.end_step()
    numels = [g.numel() for g in grads]
    for bucket in wire.fuse(numels, state.bucket_elements):
        sizes = [numels[i] for i in bucket]
        if sum(sizes) == 0:
            continue
        flat = torch.cat([grads[i].detach().reshape(-1).to(torch.float32) for i in bucket])
        avg = sync_flat(state, flat, bucket, sizes)
        offset = 0
        for i, n in zip(bucket, sizes, strict=True):
            grads[i].copy_(avg[offset : offset + n].view_as(grads[i]))
            offset += n
    return state.end_step()
