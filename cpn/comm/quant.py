"""Low-bit values on the WAN: int8 and int4 with one scale per block, and error feedback.

A payload of `numel` fp32 values (`cpn.wire.quantized_bytes` gives its size; the cost
model predicts from the same function):

  - one fp32 scale per block of `block` values: the block's largest |value| ÷ the largest
    code (127 for int8, 7 for int4), so every value of the block maps into the codes;
  - the codes, symmetric and rounded to nearest: int8 one byte each (two's complement);
    int4 two per byte, low nibble first, each stored as code + 8 (1..15), the last byte
    half-used when `numel` is odd.

A value comes back as `code × scale`, computed in fp32 on every rank alike, so all sites
decode the same numbers. Its error is at most half a step, `scale / 2` (property-tested).

Error feedback (as for top-k): the sender keeps what the codes could not carry,
`residual = acc − sent`, and adds it to what it sends next time. The subtraction is exact
in fp32: where the code is 0 the residual is `acc` itself, elsewhere `sent` is within half
a step of `acc` and at least one step away from 0, so the two are within a factor of two
(Sterbenz) — `sent + residual == acc` bit for bit (property-tested).

A block holding an inf or a NaN has a non-finite scale and decodes to NaN; senders that
know their input is not finite set every scale to NaN (`poison`), so receivers see it.
"""

from __future__ import annotations

import torch

from cpn import wire


def max_code(bits: int) -> int:
    """The largest code magnitude: 127 for int8, 7 for int4 (symmetric, no −128/−8)."""
    return (1 << (bits - 1)) - 1


def _check(bits: int, block: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits: 4 or 8, got {bits}")
    if block < 1:
        raise ValueError(f"block: must be ≥ 1, got {block}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` (1-D) zero-padded to whole blocks, as (blocks, block)."""
    n = x.numel()
    nblocks = wire.quant_blocks(n, block)
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.view(nblocks, block)


def quantize(
    x: torch.Tensor, bits: int, block: int = wire.QUANT_BLOCK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload as uint8, the values it decodes to as fp32) of the 1-D tensor `x`."""
    _check(bits, block)
    n = x.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        return empty, torch.empty(0, dtype=torch.float32, device=x.device)
    qmax = max_code(bits)
    blocks = _blocks(x.reshape(-1).to(torch.float32), block)
    # Divided by a tensor, not a Python number: CUDA divides by a scalar as a multiply by
    # its reciprocal, one ulp off the CPU's quotient in some blocks; a tensor divisor is
    # IEEE division on both, so a GPU worker sends the bytes a CPU worker would.
    peak = blocks.abs().amax(dim=1)
    scale = peak / torch.full_like(peak, qmax)
    # A block of zeros (or of values whose scale underflows) sends zeros.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    codes = torch.round(blocks / safe).clamp_(-qmax, qmax)
    codes = torch.where(torch.isfinite(codes), codes, torch.zeros_like(codes))
    sent = (codes * scale.unsqueeze(1)).reshape(-1)[:n]
    flat = codes.reshape(-1)[:n].to(torch.int8)
    if bits == 8:
        packed = flat.view(torch.uint8)
    else:
        nibbles = (flat + 8).to(torch.uint8)
        if n % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8, device=x.device)])
        pairs = nibbles.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
    payload = torch.cat([scale.contiguous().view(torch.uint8), packed.reshape(-1)])
    return payload, sent


def dequantize(
    payload: torch.Tensor, numel: int, bits: int, block: int = wire.QUANT_BLOCK_ELEMENTS
) -> torch.Tensor:
    """The fp32 values of a payload `quantize` wrote for `numel` values."""
    _check(bits, block)
    expected = wire.quantized_bytes(numel, bits, block)
    if payload.numel() != expected:
        raise ValueError(f"payload: {payload.numel()} bytes, expected {expected}")
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=payload.device)
    nblocks = wire.quant_blocks(numel, block)
    split = nblocks * wire.QUANT_SCALE_BYTES
    scale = payload[:split].clone().view(torch.float32)
    raw = payload[split:]
    if bits == 8:
        codes = raw.clone().view(torch.int8).to(torch.float32)
    else:
        lo = (raw & 0x0F).to(torch.int16) - 8
        hi = (raw >> 4).to(torch.int16) - 8
        codes = torch.stack([lo, hi], dim=1).reshape(-1)[:numel].to(torch.float32)
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=payload.device)
    padded[:numel] = codes
    return (padded.view(nblocks, block) * scale.unsqueeze(1)).reshape(-1)[:numel]


def quantize_feedback(
    acc: torch.Tensor, bits: int, block: int = wire.QUANT_BLOCK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the fp32 accumulator `acc` and leave in it what was not sent.

    Returns (payload, sent); afterwards `sent + acc == acc_before` exactly.
    """
    payload, sent = quantize(acc, bits, block)
    acc -= sent
    return payload, sent


def poison(payload: torch.Tensor, numel: int, block: int = wire.QUANT_BLOCK_ELEMENTS) -> None:
    """Set every scale of `payload` to NaN: the step's input was not finite."""
    split = wire.quant_blocks(numel, block) * wire.QUANT_SCALE_BYTES
    payload[:split].view(torch.float32).fill_(float("nan"))
