"""The sparse payload one site leader sends for one bucket: k values, then k indices.

Layout (`cpn.wire` defines the sizes; the cost model predicts them from the same
functions): `k` values in the value dtype (fp16 or bf16, 2 bytes each), then the indices
in the encoding `wire.index_encoding(numel, k)` picks: `packed` (each index in the fewest
whole little-endian bytes that hold numel − 1), `bitmap` (one bit per element, once that is
smaller) or `int32`. Indices are sorted, so a bitmap decodes to the same order. Every
leader sends exactly `k` entries, so all payloads of a bucket have the same length (gloo's
`all_gather` rejects uneven sizes).
"""

from __future__ import annotations

import torch

from cpn import wire

#: Value dtypes a payload may carry, and the names the API accepts for them.
VALUE_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)


def payload_bytes(numel: int, k: int, value_dtype: torch.dtype) -> int:
    if k == 0:
        return 0
    return k * value_dtype.itemsize + wire.index_bytes(numel, k)


def _to_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(-1)


def encode(
    values: torch.Tensor, indices: torch.Tensor, numel: int, value_dtype: torch.dtype
) -> torch.Tensor:
    """Payload (uint8) of `values` at sorted, unique `indices` of a `numel`-element bucket."""
    k = indices.numel()
    if values.numel() != k:
        raise ValueError(f"values: {values.numel()} entries for {k} indices")
    device = values.device
    if k == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    vals = _to_bytes(values.to(value_dtype))
    enc = wire.index_encoding(numel, k)
    if enc is wire.IndexEncoding.BITMAP:
        nbytes = (numel + 7) // 8
        bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=device)
        bits[indices] = 1
        idx = (bits.view(nbytes, 8) * _bit_weights(device)).sum(dim=1, dtype=torch.uint8)
    elif enc is wire.IndexEncoding.INT32:
        idx = _to_bytes(indices.to(torch.int32))
    else:
        width = wire.index_width(numel)
        # Little-endian bytes of each index, lowest first; int64's own bytes, truncated.
        idx = indices.to(torch.int64).contiguous().view(torch.uint8).view(k, 8)[:, :width]
        idx = idx.reshape(-1)
    return torch.cat([vals, idx.contiguous()])


def decode(
    payload: torch.Tensor, numel: int, k: int, value_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values as fp32, indices as int64) from a payload `encode` wrote."""
    device = payload.device
    if k == 0:
        return torch.empty(0, device=device), torch.empty(0, dtype=torch.int64, device=device)
    expected = payload_bytes(numel, k, value_dtype)
    if payload.numel() != expected:
        raise ValueError(f"payload: {payload.numel()} bytes, expected {expected}")
    split = k * value_dtype.itemsize
    values = payload[:split].clone().view(value_dtype).to(torch.float32)
    raw = payload[split:]
    enc = wire.index_encoding(numel, k)
    if enc is wire.IndexEncoding.BITMAP:
        bits = (raw.unsqueeze(1) & _bit_weights(device)).ne(0).reshape(-1)[:numel]
        indices = bits.nonzero().reshape(-1)
    elif enc is wire.IndexEncoding.INT32:
        indices = raw.clone().view(torch.int32).to(torch.int64)
    else:
        width = wire.index_width(numel)
        wide = torch.zeros(k, 8, dtype=torch.uint8, device=device)
        wide[:, :width] = raw.view(k, width)
        indices = wide.view(torch.int64).reshape(-1)
    if indices.numel() != k:
        raise ValueError(f"payload: decodes to {indices.numel()} indices, expected {k}")
    return values, indices
