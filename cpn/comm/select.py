"""Selecting the k largest-magnitude entries of a big 1-D tensor, fast, on the CPU.

Top-k gradient sparsification (Deep Gradient Compression) picks, every step, the k entries
of each gradient bucket with the largest |x|. `torch.topk(x.abs(), k)` does this exactly but
is slow on the CPU for a 25M-element bucket (about 270 ms for k = 25 000 on a 2-core
machine), because it runs a selection over every element and first materialises |x| in a
fresh 100 MB buffer. `topk_indices` returns the same set with a few cheap passes instead:

1. Sample `sample_size` entries uniformly at random (with replacement) and take the r-th
   largest magnitude as a threshold t, r chosen a few standard deviations above the
   k·s/numel sample points expected above the true k-th magnitude, so that with high
   probability somewhat more than k entries have |x| ≥ t (typically 1.1–4 × k).
2. One pass over x, in cache-sized chunks, builds a boolean mask |x| ≥ t, and one more over
   the mask (1 byte per entry) lists its True positions: the candidates.
3. If there are at least k candidates, the exact top-k *among the candidates* (a small
   set: one selection, no sort) is the answer. If there are fewer, the threshold is lowered
   once (a lower sample quantile); if that also fails, the exact path runs.

Whenever step 3 finds ≥ k candidates the result is an exact top-k set: every entry left
out has |x| < t ≤ every candidate, so it cannot beat the k-th candidate. Against
`exact_topk_indices` the recall is therefore 1.0 except where magnitudes tie at the k-th
value, where either answer is correct and they may pick different tied entries. The sample
only decides the *speed* (how many candidates, whether a retry is needed), never the
correctness.

Magnitudes are compared as integers: an IEEE float with its sign bit cleared, read as a
signed integer of the same width, orders exactly as |x| does (−0 and +0 both give 0, NaN
comes above ∞, as in `torch.topk`). This works for float16, bfloat16, float32 and float64
alike, and makes "clear the sign bit, compare" two cheap integer operations.

The passes run in NumPy, on one thread, on purpose. The same passes as torch ops are a few
dozen short intra-op-parallel regions, and on a machine with more runnable threads than
cores each region waits for a descheduled worker: measured on 2 cores with one other busy
process, 300–470 ms a call with 2 torch threads against ~14 ms with 1. NumPy's SIMD loops
on one thread take ~12–18 ms for 25M float32 (about what 2 torch threads take on an idle
machine), bounded by reading x once (~8 ms) and listing the mask (~3 ms), whatever the
load. Tensors not on the CPU take the exact path: `torch.topk` is fast on an accelerator.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "DEFAULT_SAMPLE_SIZE",
    "EXACT_BELOW_NUMEL",
    "EXACT_DENSITY",
    "exact_topk_indices",
    "recall",
    "topk_indices",
]

DEFAULT_SAMPLE_SIZE = 1 << 16
"""Sampled entries for the threshold: 64 Ki random reads cost ~1 ms and put a 0.01 %-density
threshold within a few × k candidates; more samples only tighten an already cheap step."""

EXACT_BELOW_NUMEL = 1 << 16
"""Below this many elements `torch.topk` is already fast and the passes would not pay off."""

EXACT_DENSITY = 1 / 8
"""Above this k/numel the candidate set is a large part of x anyway: use `torch.topk`."""

_CHUNK = 1 << 18
"""Entries per chunk of the mask pass: the scratch buffer (1 MiB of float32 bits) stays in
the core's L2 cache between the chunk's two operations, and nothing of the size of x but
the 1-byte mask is allocated (a fresh 100 MB buffer costs ~25 ms in page faults alone)."""

_SEED = 0x5EED
"""Seed of the per-call generator when none is given: the same input gives the same output."""

_Z_FIRST = 3.0
"""Standard deviations of head-room in the first threshold: it misses ~0.1–0.3 % of the time."""

_Z_RETRY = 8.0
"""Head-room of the retry threshold: with twice the margin and rank a second miss is
practically impossible unless the data tie heavily (then the exact path runs)."""

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}

Bits = npt.NDArray[np.signedinteger[Any]]
"""IEEE bit patterns of floats (or, sign bit cleared, their magnitude keys) as signed ints."""

Positions = npt.NDArray[np.intp]


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() != 1:
        raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if not 0 <= k <= x.numel():
        raise ValueError(f"k must be in [0, x.numel()] = [0, {x.numel()}], got {k}")


def exact_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, sorted ascending) of k entries of 1-D float tensor x with largest |x|.

    The reference: `torch.topk(x.abs(), k)`, sorted by index so that it compares and encodes
    like `topk_indices`. Ties at the k-th magnitude are broken as `torch.topk` breaks them;
    NaN counts as the largest magnitude.
    """
    _check(x, k)
    x = x.detach()
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if k == x.numel():
        return torch.arange(k, device=x.device)
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def topk_indices(
    x: torch.Tensor,
    k: int,
    *,
    generator: torch.Generator | None = None,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
) -> torch.Tensor:
    """Indices (int64, sorted ascending) of exactly k entries of 1-D float x with largest |x|.

    Always a true top-k set (each selected |x| ≥ each unselected |x|), without duplicates;
    among entries tied at the k-th magnitude the lowest indices win on the sampled path.
    NaN counts as the largest magnitude, as in `torch.topk`. k = 0 gives an empty tensor and
    k = numel gives `arange(numel)`. Small tensors (numel < `EXACT_BELOW_NUMEL`), dense
    selections (k > `EXACT_DENSITY` · numel) and tensors off the CPU take the exact
    `torch.topk` path, where the sampled passes would not pay off.

    `generator` (a CPU generator) draws the threshold sample of `sample_size` entries (at
    most numel / 16); without one a fixed-seed generator is made per call, so results are
    deterministic either way. The sample affects only speed, never the result (module
    docstring).

    Raises ValueError if x is not a 1-D floating-point tensor, k is outside [0, numel], or
    sample_size < 1.
    """
    _check(x, k)
    if sample_size < 1:
        raise ValueError(f"sample_size must be ≥ 1, got {sample_size}")
    n = x.numel()
    exact = k in (0, n) or n < EXACT_BELOW_NUMEL or k > EXACT_DENSITY * n
    if exact or x.device.type != "cpu":
        return exact_topk_indices(x, k)
    bits: Bits = x.detach().contiguous().view(_INT_OF_WIDTH[x.element_size()]).numpy()
    if generator is None:
        generator = torch.Generator().manual_seed(_SEED)
    sample_size = min(sample_size, n // 16)  # a bigger share of a small x costs, adds nothing
    positions = torch.randint(0, n, (sample_size,), generator=generator).numpy()
    sample = _magnitude_keys(bits[positions])

    # Sample points above the true k-th magnitude: Binomial(s, k/n), mean `lam`. Taking the
    # r-th largest sample value with r a few standard deviations above `lam` puts the
    # threshold below the k-th magnitude with high probability; `retry` is the fallback.
    lam = k * sample_size / n
    first = min(sample_size, math.ceil(lam + _Z_FIRST * math.sqrt(lam) + 2))
    retry = min(sample_size, math.ceil(2 * lam + _Z_RETRY * math.sqrt(lam) + 8))
    ordered = np.partition(sample, (sample_size - retry, sample_size - first))
    tried = None
    for rank in (first, retry):
        threshold = ordered[sample_size - rank]
        if threshold == tried:
            break  # ties: the lower quantile is the same value and would find the same set
        tried = threshold
        # At t = 0 every zero would pass `|x| ≥ t`: take the nonzero entries instead (a
        # sparse gradient's whole support); if they are fewer than k the answer needs zeros.
        strict = bool(threshold == 0)
        candidates = _mask_positions(bits, threshold, strict=strict)
        if candidates.size >= k:
            chosen = _top_k_of(candidates, _magnitude_keys(bits[candidates]), k)
            return torch.from_numpy(chosen.astype(np.int64, copy=False))
        if strict:
            break
    return exact_topk_indices(x, k)


def _magnitude_keys(bits: Bits) -> Bits:
    """Clears the sign bits in place: the integers now order as the floats' magnitudes."""
    return np.bitwise_and(bits, np.iinfo(bits.dtype).max, out=bits)


def _mask_positions(bits: Bits, threshold: np.signedinteger[Any], *, strict: bool) -> Positions:
    """Ascending positions i with key(bits[i]) ≥ threshold (> threshold if strict)."""
    n = bits.size
    mask = np.empty(n, dtype=np.bool_)
    width = min(_CHUNK, n)
    scratch = np.empty(width, dtype=bits.dtype)
    magnitude = np.iinfo(bits.dtype).max
    compare = np.greater if strict else np.greater_equal
    for start in range(0, n, width):
        stop = min(start + width, n)
        keys = np.bitwise_and(bits[start:stop], magnitude, out=scratch[: stop - start])
        compare(keys, threshold, out=mask[start:stop])
    return np.flatnonzero(mask)


def _top_k_of(candidates: Positions, keys: Bits, k: int) -> Positions:
    """The k of `candidates` (ascending) with the largest magnitude `keys`, kept in order.

    A selection (introselect) finds the k-th largest key v; everything above v is kept, plus
    the first of the entries equal to v that are needed to make k. Masking instead of
    sorting keeps the positions ascending.
    """
    count = candidates.size
    if count == k:
        return candidates
    kth = np.partition(keys, count - k)[count - k]
    above = keys > kth
    tied = keys == kth
    need = k - np.count_nonzero(above)
    chosen: Positions = candidates[above | (tied & (np.cumsum(tied) <= need))]
    return chosen


def recall(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """|approx ∩ exact| / |exact|: the fraction of the exact top-k that a selection found.

    1.0 when exact is empty (nothing to find). Indices are treated as sets.
    """
    wanted = _distinct(exact)
    if wanted.numel() == 0:
        return 1.0
    return int(torch.isin(wanted, approx).sum()) / wanted.numel()


def _distinct(indices: torch.Tensor) -> torch.Tensor:
    ordered = indices.flatten().sort().values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return ordered[first]
