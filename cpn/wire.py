"""Sizes of what goes on the wire: fusion buckets, sparse payloads, and the bytes each
member of a collective sends.

The comm library writes these formats and counts these bytes, and the cost model predicts
them; both call the functions here, so a prediction and a measurement can be compared byte
for byte. The per-member counts are what the backends really send (measured with socket
counters, `tests/integration/test_wire_truth.py`), framing aside: totals over a group are
the same for gloo and NCCL, the split between members may differ (see each function).

Sparse payload of one bucket on one rank: exactly `k` values (fp16 by default) followed
by `k` indices, so that gloo's equal-size all_gather works. Indices use the smallest of:
  - `packed`: each index in the fewest whole bytes that hold numel − 1 (3 bytes for a
    4 M-element bucket instead of int32's 4);
  - `bitmap`: one bit per element, cheaper once the density passes 1/(8·width);
  - `int32`: plain 32-bit indices (what packed degenerates to for huge buckets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

#: Tensor fusion: gradients are fused into buckets of at most this many elements
#: (16 MiB in fp32). 2^22 elements keep packed indices at 3 bytes.
DEFAULT_BUCKET_ELEMENTS = 1 << 22


class IndexEncoding(StrEnum):
    PACKED = "packed"
    BITMAP = "bitmap"
    INT32 = "int32"


def fuse(numels: Sequence[int], cap: int = DEFAULT_BUCKET_ELEMENTS) -> list[list[int]]:
    """Group parameter positions into buckets, last parameter first.

    Gradients become ready from the output backwards, so buckets are filled in reverse
    parameter order (as DDP does). A parameter larger than `cap` gets a bucket of its own.
    Returns the positions (into `numels`) of each bucket, in reverse order within it.
    """
    if cap < 1:
        raise ValueError(f"cap: must be ≥ 1, got {cap}")
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for pos in reversed(range(len(numels))):
        n = numels[pos]
        if current and size + n > cap:
            out.append(current)
            current, size = [], 0
        current.append(pos)
        size += n
    if current:
        out.append(current)
    return out


def bucket_numels(numels: Sequence[int], cap: int = DEFAULT_BUCKET_ELEMENTS) -> list[int]:
    return [sum(numels[p] for p in bucket) for bucket in fuse(numels, cap)]


def topk_count(numel: int, density: float) -> int:
    """How many entries of a `numel`-element bucket a rank sends at `density`."""
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(density * numel)))


def index_width(numel: int) -> int:
    """Bytes per packed index for a bucket of `numel` elements."""
    return max(1, math.ceil(max(numel - 1, 1).bit_length() / 8))


def index_encoding(numel: int, k: int) -> IndexEncoding:
    packed = index_width(numel) * k
    bitmap = math.ceil(numel / 8)
    if bitmap < packed:
        return IndexEncoding.BITMAP
    return IndexEncoding.PACKED if index_width(numel) < 4 else IndexEncoding.INT32


def index_bytes(numel: int, k: int) -> int:
    enc = index_encoding(numel, k)
    if enc is IndexEncoding.BITMAP:
        return math.ceil(numel / 8)
    return k * (index_width(numel) if enc is IndexEncoding.PACKED else 4)


def sparse_payload_bytes(numel: int, density: float, value_bytes: int = 2) -> int:
    """Bytes one rank sends for one bucket: k values plus their encoded indices."""
    k = topk_count(numel, density)
    if k == 0:
        return 0
    return k * value_bytes + index_bytes(numel, k)


#: Low-bit values: elements that share one scale (absmax of the block / the largest code).
QUANT_BLOCK_ELEMENTS = 128
#: Bits per value of the low-bit codecs, by the names the API accepts.
QUANT_BITS: dict[str, int] = {"int8": 8, "int4": 4}
#: A block's scale travels as one fp32 (dequantisation is then bit-identical everywhere).
QUANT_SCALE_BYTES = 4


def quant_blocks(numel: int, block: int = QUANT_BLOCK_ELEMENTS) -> int:
    return -(-numel // block) if numel > 0 else 0


def quantized_bytes(numel: int, bits: int, block: int = QUANT_BLOCK_ELEMENTS) -> int:
    """Bytes of a low-bit payload of `numel` values: one fp32 scale per block of `block`
    values, then the codes, `bits` each, packed (int4: two per byte, the last byte
    half-used when `numel` is odd)."""
    if numel <= 0:
        return 0
    if bits not in (4, 8):
        raise ValueError(f"bits: 4 or 8, got {bits}")
    return quant_blocks(numel, block) * QUANT_SCALE_BYTES + math.ceil(numel * bits / 8)


def ring_chunks(numel: int, parts: int) -> list[int]:
    """Element counts of the chunks a ring collective splits a tensor into."""
    base, extra = divmod(numel, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def ring_allreduce_bytes(numel: int, elem_bytes: int, world: int, position: int) -> int:
    """Bytes the member at `position` of a ring all-reduce sends (reduce-scatter, all-gather).

    Each member sends every chunk but one in each phase; over the ring the total is exactly
    2·(world − 1)·numel·elem_bytes.
    """
    if world <= 1:
        return 0
    return 2 * (numel - ring_chunks(numel, world)[position]) * elem_bytes


def broadcast_bytes(nbytes: int, world: int, position: int, backend: str = "gloo") -> int:
    """Bytes the member at `position` (0: the root) sends to broadcast `nbytes`.

    gloo broadcasts down a binomial tree: in round j (mask 2^j) every member below the mask
    sends to the member `mask` above it, so the root sends ⌈log2 n⌉ copies and most leaves
    none. NCCL pipelines along its ring: every member but the last sends one copy (in NCCL's
    ring order, which follows the hardware, so this per-member split is approximate there).
    Either way the group sends (n − 1) copies in all, the cost model's convention.
    """
    if world <= 1:
        return 0
    if backend == "nccl":
        return nbytes if position < world - 1 else 0
    copies = 0
    mask = 1
    while mask < world:
        if position < mask and position + mask < world:
            copies += 1
        mask <<= 1
    return copies * nbytes


def reduce_bytes(nbytes: int, world: int, position: int) -> int:
    """Bytes the member at `position` (0: the root) sends to reduce `nbytes` to the root.

    Along a chain (NCCL's ring reduce, and `cpn.comm`'s own on gloo): every member but the
    root sends the tensor once, (n − 1) copies in all.
    """
    return nbytes if world > 1 and position != 0 else 0


def reduce_scatter_bytes(
    numel: int, elem_bytes: int, world: int, position: int, backend: str = "gloo"
) -> int:
    """Bytes the member at `position` sends to reduce-scatter a `numel`-element tensor.

    NCCL runs a ring reduce-scatter: every member sends n − 1 of the n chunks. gloo has no
    reduce-scatter of its own: torch runs a full ring all-reduce and keeps one chunk, so a
    member sends what `ring_allreduce_bytes` says, twice the ring's share.
    """
    if world <= 1:
        return 0
    if backend == "nccl":
        return (numel - ring_chunks(numel, world)[position]) * elem_bytes
    return ring_allreduce_bytes(numel, elem_bytes, world, position)
