"""Low-bit values (cpn.comm.quant): round-trip error bounds, payload sizes and error
feedback conservation, property-tested (derandomized, bounded examples)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpn import wire
from cpn.comm import quant

SETTINGS = settings(derandomize=True, max_examples=150, deadline=None)


@st.composite
def vectors(draw: st.DrawFn) -> torch.Tensor:
    """fp32 vectors mixing scales (per-block scales must cope), zeros and exact ties."""
    numel = draw(st.integers(0, 1500))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * magnitude
    if numel and draw(st.booleans()):
        x[torch.rand(numel, generator=g) < 0.3] = 0.0  # sparse-ish blocks, some all-zero
    if numel and draw(st.booleans()):
        # Heavy tails: one block element far larger than the rest.
        x[int(torch.randint(numel, (1,), generator=g))] *= 1000
    return x


@SETTINGS
@given(vectors(), st.sampled_from([4, 8]), st.sampled_from([1, 7, 32, 128]))
def test_round_trip_is_within_half_a_step_and_has_the_predicted_size(
    x: torch.Tensor, bits: int, block: int
) -> None:
    payload, sent = quant.quantize(x, bits, block)
    assert payload.dtype == torch.uint8
    assert payload.numel() == wire.quantized_bytes(x.numel(), bits, block)
    got = quant.dequantize(payload, x.numel(), bits, block)
    assert torch.equal(got, sent)  # the receiver decodes exactly what the sender kept
    if x.numel() == 0:
        return
    nblocks = wire.quant_blocks(x.numel(), block)
    padded = torch.zeros(nblocks * block)
    padded[: x.numel()] = x.abs()
    step = (padded.view(nblocks, block).amax(1) / quant.max_code(bits)).repeat_interleave(block)
    step = step[: x.numel()]
    # Half a step, with the few ulps fp32 division and multiplication can add.
    assert bool(((got - x).abs() <= step * (0.5 + 1e-6)).all())
    # Each code stays in its range: no value beyond the block's largest magnitude.
    assert bool((got.abs() <= step * quant.max_code(bits) * (1 + 1e-6)).all())


@SETTINGS
@given(st.lists(vectors(), min_size=1, max_size=4), st.sampled_from([4, 8]))
def test_error_feedback_sent_plus_residual_is_the_accumulator_exactly(
    grads: list[torch.Tensor], bits: int
) -> None:
    numel = min(g.numel() for g in grads)
    acc = torch.zeros(numel)
    for g in grads:
        acc += g[:numel]
        before = acc.clone()
        payload, sent = quant.quantize_feedback(acc, bits)
        assert torch.equal(sent + acc, before)  # nothing lost, bit for bit
        assert torch.equal(quant.dequantize(payload, numel, bits), sent)


def test_int4_packs_two_codes_per_byte_and_int8_one() -> None:
    x = torch.tensor([1.0, -1.0, 0.5, 7.0, -7.0])
    assert wire.quantized_bytes(5, 4, 128) == 4 + 3
    assert wire.quantized_bytes(5, 8, 128) == 4 + 5
    assert wire.quantized_bytes(300, 8, 128) == 3 * 4 + 300
    payload, sent = quant.quantize(x, 4, 128)
    assert payload.numel() == 7
    assert sent.tolist() == [1.0, -1.0, 0.0, 7.0, -7.0]  # scale 1: 0.5 rounds to even (0)
    _, sent8 = quant.quantize(x, 8, 128)
    assert torch.allclose(sent8, x, atol=7 / 127 / 2)


def test_a_poisoned_payload_decodes_to_nan_and_sizes_are_checked() -> None:
    payload, _ = quant.quantize(torch.ones(300), 8)
    quant.poison(payload, 300)
    assert bool(quant.dequantize(payload, 300, 8).isnan().all())
    with pytest.raises(ValueError, match="payload: 10 bytes, expected"):
        quant.dequantize(torch.zeros(10, dtype=torch.uint8), 300, 8)
    with pytest.raises(ValueError, match="bits: 4 or 8"):
        quant.quantize(torch.ones(3), 2)
    inf = torch.ones(10)
    inf[3] = float("inf")
    _, sent = quant.quantize(inf, 8)
    assert not bool(torch.isfinite(sent).all())  # a non-finite block never looks finite
