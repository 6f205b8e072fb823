"""Sparse payloads, error-feedback compression, the density schedule and argument checks
of cpn.comm, in one process."""

from __future__ import annotations

import datetime
import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cpn import wire
from cpn.comm import (
    SparseSchedule,
    WanSyncState,
    choose_wan_compression,
    codec,
    compress,
    sync_gradients,
)


@st.composite
def sparse_bucket(draw: st.DrawFn) -> tuple[int, torch.Tensor, torch.Tensor]:
    numel = draw(st.integers(1, 70_000))
    k = draw(st.integers(1, min(numel, 3000)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(numel, generator=g)[:k].sort().values
    values = torch.randn(k, generator=g) * 10
    return numel, idx, values


@settings(max_examples=120, deadline=None)
@given(sparse_bucket(), st.sampled_from(["fp16", "bf16", "fp32"]))
def test_payload_round_trips_and_has_the_predicted_size(
    bucket: tuple[int, torch.Tensor, torch.Tensor], value_name: str
) -> None:
    numel, idx, values = bucket
    dtype = codec.VALUE_DTYPES[value_name]
    payload = codec.encode(values, idx, numel, dtype)
    assert payload.dtype == torch.uint8
    assert payload.numel() == k_bytes(numel, idx.numel(), dtype.itemsize)
    got_values, got_idx = codec.decode(payload, numel, idx.numel(), dtype)
    assert torch.equal(got_idx, idx)
    assert torch.equal(got_values, values.to(dtype).to(torch.float32))


def k_bytes(numel: int, k: int, value_bytes: int) -> int:
    return k * value_bytes + wire.index_bytes(numel, k)


def test_every_index_encoding_is_exercised() -> None:
    # packed (3-byte) for a sparse 1M bucket, bitmap for a dense one, int32 for huge ones.
    assert wire.index_encoding(1 << 20, 100) is wire.IndexEncoding.PACKED
    assert wire.index_encoding(1000, 500) is wire.IndexEncoding.BITMAP
    assert wire.index_encoding(1 << 25, 10) is wire.IndexEncoding.INT32
    for numel, k in ((1 << 20, 100), (1000, 500), (1 << 25, 10)):
        idx = torch.linspace(0, numel - 1, k).long()
        vals = torch.arange(idx.numel(), dtype=torch.float32)
        payload = codec.encode(vals, idx, numel, torch.float16)
        assert payload.numel() == k_bytes(numel, idx.numel(), 2)
        assert torch.equal(codec.decode(payload, numel, idx.numel(), torch.float16)[1], idx)


def test_a_payload_of_the_wrong_size_is_rejected() -> None:
    payload = codec.encode(torch.ones(3), torch.tensor([1, 5, 9]), 100, torch.float16)
    with pytest.raises(ValueError, match="payload"):
        codec.decode(payload[:-1], 100, 3, torch.float16)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 100_000),
    st.floats(1e-4, 1.0),
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    st.integers(0, 2**31 - 1),
    st.floats(1e-6, 1e4),
)
def test_compress_conserves_the_accumulator_exactly(
    numel: int, density: float, dtype: torch.dtype, seed: int, scale: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(numel, generator=g) * scale
    before = acc.clone()
    k = wire.topk_count(numel, density)
    idx, sent = compress(acc, k, dtype)
    assert idx.numel() == k == sent.numel()
    assert bool((idx[1:] > idx[:-1]).all())  # sorted, no duplicates
    rebuilt = acc.clone()
    rebuilt[idx] += sent.to(torch.float32)
    assert torch.equal(rebuilt, before)  # sent + residual == accumulated, bit for bit
    # What was sent is the top-k: nothing left behind is larger than what went.
    rest = torch.ones(numel, dtype=torch.bool)
    rest[idx] = False
    if rest.any():
        assert before[idx].abs().min() >= before[rest].abs().max()


def test_compress_saturates_instead_of_sending_infinity() -> None:
    acc = torch.tensor([1e6, -3.0, 0.5])
    idx, sent = compress(acc, 1, torch.float16)
    assert idx.tolist() == [0]
    assert math.isfinite(float(sent[0]))
    assert float(acc[0]) + float(sent[0]) == pytest.approx(1e6)


def test_density_warms_up_geometrically_after_dense_steps() -> None:
    s = SparseSchedule(density=0.001, warmup_steps=4, warmup_density=0.25, dense_steps=2)
    got = [s.at(t) for t in range(8)]
    assert got[:2] == [None, None]
    assert got[2] == pytest.approx(0.25)
    assert got[4] == pytest.approx(math.sqrt(0.25 * 0.001))
    assert got[6:] == [0.001, 0.001]
    assert all(a > b for a, b in itertools.pairwise(got[2:7]))  # type: ignore[operator]
    assert SparseSchedule(density=0.5, warmup_steps=10).at(0) == 0.5  # never ramps *down* to it


def test_wan_compression_is_chosen_by_bandwidth() -> None:
    # 10M elements between 3 sites: 2·(2/3)·10M·4 B = 53 MB per leader, budget 100 ms.
    assert choose_wan_compression(10_000_000, 3, 5.0, 1.0) == "none"  # 85 ms
    assert choose_wan_compression(10_000_000, 3, 3.0, 1.0) == "fp16"  # 142 ms; fp16 71 ms
    assert choose_wan_compression(10_000_000, 3, 0.5, 1.0) == "topk"
    assert choose_wan_compression(10_000_000, 1, 0.01, 1.0) == "none"
    with pytest.raises(ValueError):
        choose_wan_compression(10, 2, 0.0, 1.0)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"density": 0.0}, "density"),
        ({"density": -0.1}, "density"),
        ({"density": 1.5}, "density"),
        ({"compression": "zstd"}, "compression"),
        ({"wire_dtype": torch.int8}, "wire_dtype"),
        ({"wire_dtype": torch.float64}, "wire_dtype"),
        ({"value_dtype": "int8"}, "value_dtype"),
        ({"hierarchy": "ring"}, "hierarchy"),
        ({"hierarchy": "flat", "compression": "topk"}, "hierarchy"),
        ({"momentum": 1.0}, "momentum"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"bucket_elements": 0}, "bucket_elements"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"timeout": datetime.timedelta(0)}, "timeout"),
        ({"timeout": 5}, "timeout: must be a datetime.timedelta"),
        ({"clip_norm": float("nan")}, "clip_norm"),
        ({"clip_norm": float("inf")}, "clip_norm"),
    ],
)
def test_bad_arguments_are_value_errors_naming_the_argument(
    one_rank: object, kwargs: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        WanSyncState(["a"], **kwargs)  # type: ignore[arg-type]


def test_a_site_map_that_does_not_cover_the_world_is_rejected(one_rank: object) -> None:
    with pytest.raises(ValueError, match="site_of_rank"):
        WanSyncState(["a", "b"])
    with pytest.raises(ValueError, match="site_of_rank"):
        WanSyncState([])
    with pytest.raises(ValueError, match=r"site_of_rank\[0\]"):
        WanSyncState([""])


def test_one_rank_sync_is_a_no_op(one_rank: object) -> None:
    state = WanSyncState(["a"], compression="topk", density=0.01)
    grads = [torch.arange(6.0)]
    sync_gradients(state, grads)
    assert torch.equal(grads[0], torch.arange(6.0))
    assert state.bytes_sent == {"intra_node": 0, "intra_site": 0, "wan": 0}
    assert state.step == 1
