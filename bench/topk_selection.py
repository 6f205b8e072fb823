"""Top-k selection benchmark: cpn's sampled-threshold selection against `torch.topk`.

    .venv/bin/python bench/topk_selection.py              # 25M elements; 1 %, 0.1 %, 0.01 %
    .venv/bin/python bench/topk_selection.py --threads 1  # as cpn's workers run (OMP_NUM_THREADS=1)
    .venv/bin/python bench/topk_selection.py --json       # one JSON object instead of tables

For each density d it selects the k = ceil(d · numel) largest-magnitude entries of one
float32 tensor two ways, interleaved in the same run so that a busy machine slows both
alike: `torch.topk(x.abs(), k)` (the baseline, what sparsifying a gradient bucket costs
without cpn) and `cpn.comm.select.topk_indices(x, k)`. It reports the median times, the
speedup (baseline / cpn) and the recall of cpn's set against the exact one (1.0 unless
magnitudes tie at the k-th value, which continuous data practically never do).

Two inputs: *gradient*, a model-gradient-like tensor (layers of random sizes whose scales
span three decades, each entry a Gaussian times a lognormal factor, so the magnitudes are
heavy-tailed and far from one Gaussian), and *randn*, plain standard normal entries.

cpn's passes run single-threaded in NumPy (see cpn/comm/select.py for why), so `--threads`
only changes the baseline: `torch.topk` on a 1-D tensor selects on one thread either way,
but `x.abs()` before it uses the intra-op threads.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from cpn.comm.select import exact_topk_indices, recall, topk_indices

Data = Literal["gradient", "randn"]


def gradient_like(numel: int, seed: int = 0) -> torch.Tensor:
    """A float32 tensor shaped like a flattened model gradient (see the module docstring).

    Per-layer scales vary over 10⁻³…1 and a lognormal factor (σ = 1) fattens the tails, so
    the top-k threshold is set by a few layers and the sample has to find it.
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    x.mul_(torch.randn(numel, generator=gen).exp_())
    layers = max(1, min(64, numel // 1024))
    cuts = torch.randint(1, numel, (layers - 1,), generator=gen).sort().values.tolist()
    bounds = [0, *cuts, numel]
    scales = torch.pow(10.0, -3 * torch.rand(layers, generator=gen)).tolist()
    for lo, hi, scale in zip(bounds, bounds[1:], scales, strict=False):
        x[lo:hi].mul_(scale)
    return x


def _make(data: Data, numel: int, seed: int) -> torch.Tensor:
    if data == "gradient":
        return gradient_like(numel, seed)
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def selection_benchmark(
    numel: int = 25_000_000,
    densities: Sequence[float] = (0.01, 0.001, 0.0001),
    repeats: int = 5,
    seed: int = 0,
    *,
    data: Data = "gradient",
) -> list[dict[str, float]]:
    """One row per density: numel, k, torch_topk_ms and cpn_ms (medians), speedup, recall.

    Both selections run once untimed first (warm-up: allocator, thread pool), then
    `repeats` times each, alternating, so that load from elsewhere on the machine lands on
    both. `threads` records torch's intra-op thread count (the baseline's `x.abs()` uses it).
    """
    if numel < 1 or repeats < 1:
        raise ValueError(f"numel and repeats must be ≥ 1, got {numel} and {repeats}")
    x = _make(data, numel, seed)
    rows: list[dict[str, float]] = []
    for density in densities:
        k = min(numel, max(1, math.ceil(density * numel)))
        approx = topk_indices(x, k)
        exact = exact_topk_indices(x, k)

        def baseline(k: int = k) -> object:
            return torch.topk(x.abs(), k)

        def ours(k: int = k) -> object:
            return topk_indices(x, k)

        baseline_ms: list[float] = []
        ours_ms: list[float] = []
        for _ in range(repeats):
            baseline_ms.append(_ms(baseline))
            ours_ms.append(_ms(ours))
        torch_ms = statistics.median(baseline_ms)
        cpn_ms = statistics.median(ours_ms)
        rows.append(
            {
                "numel": float(numel),
                "k": float(k),
                "density": density,
                "torch_topk_ms": torch_ms,
                "cpn_ms": cpn_ms,
                "speedup": torch_ms / cpn_ms,
                "recall": recall(approx, exact),
                "threads": float(torch.get_num_threads()),
            }
        )
    return rows


def _print_table(data: Data, rows: list[dict[str, float]]) -> None:
    print(f"\n{data}: {int(rows[0]['numel']):,} float32 elements" if rows else data)
    print(
        f"{'density':>8} {'k':>9} {'torch.topk ms':>14} {'cpn ms':>8} {'speedup':>8} {'recall':>7}"
    )
    for r in rows:
        print(
            f"{r['density']:>8.2%} {int(r['k']):>9,} {r['torch_topk_ms']:>14.1f} "
            f"{r['cpn_ms']:>8.1f} {r['speedup']:>7.1f}× {r['recall']:>7.4f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's, one per core); cpn's workers run with 1",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    inputs: tuple[Data, ...] = ("gradient", "randn")
    results = {
        data: selection_benchmark(args.numel, repeats=args.repeats, seed=args.seed, data=data)
        for data in inputs
    }
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), **results}, indent=2))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    for data in inputs:
        _print_table(data, results[data])


if __name__ == "__main__":
    main()
