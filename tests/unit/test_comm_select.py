"""cpn.comm.select: the sampled top-k selection always returns a true top-k set.

Property tests draw a tensor recipe (size, value pattern, seed) rather than the values
themselves, so that tensors past the sampled-path threshold (2¹⁶ elements) stay cheap.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpn.comm import select
from cpn.comm.select import EXACT_BELOW_NUMEL, exact_topk_indices, recall, topk_indices

PATTERNS = ("randn", "ties", "sparse", "equal", "negative", "mirrored", "heavy")


def make(pattern: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if pattern == "randn":
        return torch.randn(n, generator=gen)
    if pattern == "ties":  # few distinct magnitudes, both signs: huge ties at the k-th value
        return torch.randint(-4, 5, (n,), generator=gen).float()
    if pattern == "sparse":  # mostly zeros, like an embedding gradient
        x = torch.zeros(n)
        hot = torch.randint(0, n, (max(1, n // 500),), generator=gen)
        x[hot] = torch.randn(hot.numel(), generator=gen)
        return x
    if pattern == "equal":
        return torch.full((n,), -0.5)
    if pattern == "negative":
        return -torch.rand(n, generator=gen) - 1e-3
    if pattern == "mirrored":  # x and -x tie in magnitude
        half = torch.randn((n + 1) // 2, generator=gen)
        return torch.cat([half, -half])[:n]
    assert pattern == "heavy"
    return torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp() ** 3


def assert_top_k(x: torch.Tensor, k: int, idx: torch.Tensor) -> None:
    n = x.numel()
    assert idx.dtype == torch.int64
    assert idx.shape == (k,)
    if k == 0:
        return
    assert bool((idx[1:] > idx[:-1]).all()), "indices must be strictly ascending (so unique)"
    assert int(idx[0]) >= 0 and int(idx[-1]) < n
    if k < n:
        mag = x.abs()
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[idx] = True
        assert float(mag[chosen].min()) >= float(mag[~chosen].max())


sizes = st.one_of(
    st.integers(1, 300),
    st.integers(EXACT_BELOW_NUMEL, EXACT_BELOW_NUMEL + 70_000),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=st.sampled_from(PATTERNS),
    n=sizes,
    fraction=st.floats(0.0, 1.0),
    small_k=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    sample_size=st.sampled_from([1, 7, 512, select.DEFAULT_SAMPLE_SIZE]),
)
def test_result_is_a_top_k_set(
    pattern: str, n: int, fraction: float, small_k: bool, seed: int, sample_size: int
) -> None:
    # small_k: densities of 0–1 % (the sampled path); otherwise anything up to numel.
    k = round(fraction * (n // 100 if small_k else n))
    x = make(pattern, n, seed)
    gen = torch.Generator().manual_seed(seed)
    idx = topk_indices(x, k, generator=gen, sample_size=sample_size)
    assert_top_k(x, k, idx)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_sampled_path_is_taken_and_exact(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On ordinary data the fast path finds ≥ k candidates itself: no fallback to topk."""
    x = make(pattern, 3 * EXACT_BELOW_NUMEL + 5, seed=1)
    k = 200
    expected = exact_topk_indices(x, k)
    _forbid_fallback(monkeypatch)
    idx = topk_indices(x, k)
    assert_top_k(x, k, idx)
    if pattern in ("randn", "heavy", "negative"):  # distinct magnitudes: one right answer
        assert torch.equal(idx, expected)
        assert recall(idx, expected) == 1.0


def _forbid_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fallback(x: torch.Tensor, k: int) -> torch.Tensor:
        raise AssertionError("fell back to the exact path")

    monkeypatch.setattr(select, "exact_topk_indices", no_fallback)


def test_lower_threshold_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample that overshoots (its top 3 are the 3 largest entries, k = 10) is retried
    at a lower sample quantile instead of falling back to a full topk."""
    n, k, sample_size = 2 * EXACT_BELOW_NUMEL, 10, 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    # The positions topk_indices will sample, drawn the same way from the same seed.
    sampled = torch.randint(0, n, (sample_size,), generator=torch.Generator().manual_seed(5))
    x[sampled[:3]] = torch.tensor([100.0, 101.0, 102.0])
    expected = exact_topk_indices(x, k)
    _forbid_fallback(monkeypatch)
    idx = topk_indices(x, k, generator=torch.Generator().manual_seed(5), sample_size=sample_size)
    assert torch.equal(idx, expected)


def test_sparse_gradient_uses_its_support(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample of zeros gives threshold 0: the nonzero entries are the candidates."""
    x = torch.zeros(2 * EXACT_BELOW_NUMEL)
    x[::400] = torch.linspace(0.5, 1.0, x[::400].numel())
    expected = exact_topk_indices(x, 100)
    _forbid_fallback(monkeypatch)
    assert torch.equal(topk_indices(x, 100, sample_size=64), expected)


def test_sparse_gradient_with_too_few_nonzeros_includes_zeros() -> None:
    x = torch.zeros(2 * EXACT_BELOW_NUMEL)
    support = x[::1000].numel()
    x[::1000] = torch.linspace(-1, 1, support)  # an even count: no exact zero among them
    k = support + 50
    idx = topk_indices(x, k)
    assert_top_k(x, k, idx)
    assert int((x[idx] != 0).sum()) == support


def test_nan_and_inf_rank_above_everything_as_in_torch_topk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(2 * EXACT_BELOW_NUMEL, generator=torch.Generator().manual_seed(2))
    special = torch.tensor([5, 77_000, 130_000, 9])
    x[special] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    expected = exact_topk_indices(x, 60)
    _forbid_fallback(monkeypatch)
    idx = topk_indices(x, 60)
    assert torch.equal(idx, expected)
    assert set(special.tolist()) <= set(idx.tolist())


def test_deterministic_with_and_without_generator() -> None:
    x = make("ties", 2 * EXACT_BELOW_NUMEL, seed=3)
    assert torch.equal(topk_indices(x, 300), topk_indices(x, 300))
    a = topk_indices(x, 300, generator=torch.Generator().manual_seed(9))
    b = topk_indices(x, 300, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)


def test_edges() -> None:
    x = torch.randn(2 * EXACT_BELOW_NUMEL)
    empty = topk_indices(x, 0)
    assert empty.dtype == torch.int64 and empty.numel() == 0
    assert torch.equal(topk_indices(x, x.numel()), torch.arange(x.numel()))
    assert torch.equal(topk_indices(torch.tensor([3.0]), 1), torch.tensor([0]))
    assert torch.equal(topk_indices(torch.tensor([1.0, -5.0, 2.0]), 2), torch.tensor([1, 2]))
    # Non-contiguous input, other float dtypes, and a tensor that requires grad.
    strided = torch.randn(4 * EXACT_BELOW_NUMEL)[::2]
    assert torch.equal(topk_indices(strided, 40), exact_topk_indices(strided, 40))
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        y = torch.randn(2 * EXACT_BELOW_NUMEL, dtype=dtype, requires_grad=True)
        assert_top_k(y.detach(), 50, topk_indices(y, 50))


@pytest.mark.parametrize(
    ("x", "k", "match"),
    [
        (torch.randn(10), -1, "k must be"),
        (torch.randn(10), 11, "k must be"),
        (torch.randn(2, 5), 1, "x must be 1-D"),
        (torch.randn(()), 0, "x must be 1-D"),
        (torch.arange(10), 1, "floating-point"),
    ],
)
def test_bad_arguments(x: torch.Tensor, k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        topk_indices(x, k)
    with pytest.raises(ValueError, match=match):
        exact_topk_indices(x, k)


def test_bad_sample_size() -> None:
    with pytest.raises(ValueError, match="sample_size"):
        topk_indices(torch.randn(10), 1, sample_size=0)


def test_recall() -> None:
    assert recall(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4, 5])) == 0.5
    assert recall(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == 1.0
    assert recall(torch.tensor([], dtype=torch.int64), torch.tensor([7])) == 0.0
    assert recall(torch.tensor([7, 7]), torch.tensor([7, 7])) == 1.0
