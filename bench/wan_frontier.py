"""The loss / WAN-bytes frontier: every WAN sync mode, AdamW, several seeds, whole runs.

    .venv/bin/python bench/wan_frontier.py --quick        # reduced: tiny GPT, 2 seeds, ~3 min
    .venv/bin/python bench/wan_frontier.py --markdown --chart bench/wan_frontier.png
    .venv/bin/python bench/wan_frontier.py --configs ddp,outer32-int4 --seeds 0,1,2

A GPT (`cpn.train.model`) trained by 3 sites × 2 ranks (six processes, gloo on CPU, one
thread each, through the runtime's launcher; `bench/wan_sync.py`'s worker), AdamW for
every configuration (peak lr 3e-3, linear warm-up, cosine decay), the same model, tokens
and schedule for every configuration of a seed. For each configuration and seed it
measures the WAN bytes per step **over the whole run** (warm-ups and every outer step
included; DDP's by the ring convention, cpn's counted by `WanSyncState.bytes_sent`) and
the final eval loss (rank 0, fixed held-out windows). Configurations:

  - `ddp`: PyTorch DDP, flat ring, fp32 (the baseline: 1×);
  - `dense`, `fp16`, `int8`, `int4`: hierarchical per-step sync, values as named;
  - `topk1`, `topk01`: per-step top-k at 1 % / 0.1 % with error feedback (AdamW, no DGC
    momentum correction), density warm-up over the first tenth of the steps;
  - `outer<H>-<values>`: outer-step sync (DiLoCo: in-site every step, pseudo-gradients
    every H steps, Nesterov outer SGD lr 0.7 / momentum 0.9) with values fp16, int8,
    int4 or top-k (`topk1`: 1 %, `topk10`: 10 %), any H;
  - `outer<H>-<values>-avg`: the same with plain model averaging as the outer step
    (outer lr 1, no momentum), which does better than DiLoCo's outer SGD in runs with
    few outer steps (bench/README.md);
  - `sgd-ddp`, `sgd-dgc-topk<percent>` (e.g. `sgd-dgc-topk0.1`): the other optimiser,
    `bench/wan_sync.py`'s default set-up — momentum SGD (peak lr 0.1, momentum 0.9,
    clipping at 1.0) under DDP, and plain SGD with DGC's momentum correction and local
    clipping in the sync under per-step top-k; compared with `sgd-ddp` of the same seed;
  - `torchft-diloco<H>`: torchft's DiLoCo (`bench/torchft_peer.py`; fp32 pseudo-gradients
    every H steps, Nesterov outer SGD 0.7 / 0.9) on the same model, tokens, sites and
    seeds, if torchft is installed (it is optional: without it these keys are skipped,
    and said so).

The table gives per configuration the bytes, DDP ÷ bytes, the eval loss (mean and range
over seeds) and its excess over DDP's in each seed (same seed); "≤ 2 %" says whether
every seed is within 2 % of DDP. The chart (`--chart`, PNG) draws mean excess loss
against WAN bytes per step, log scale, with the seeds' range as error bars.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torchft_peer
from wan_sync import (
    LEARNING_RATES,
    SITES,
    RankFailed,
    Run,
    Setup,
    SyncConfig,
    ddp_wan_bytes_per_step,
    launch,
    site_of_rank,
)

from cpn.emulated_wan import DEFAULT_PREFIX, SUBNET, EmulatedWan

OUTER_VALUES = {
    "fp16": ("fp16", 1.0),
    "int8": ("int8", 1.0),
    "int4": ("int4", 1.0),
    "topk10": ("topk", 0.1),
    "topk1": ("topk", 0.01),
}
OUTER_KEY = re.compile(r"outer(\d+)-(" + "|".join(OUTER_VALUES) + r")(-avg)?")
SGD_DGC_KEY = re.compile(r"sgd-dgc-topk(\d+(?:\.\d+)?)")
TORCHFT_KEY = re.compile(r"torchft-diloco(\d+)")


def outer_config(key: str) -> SyncConfig | None:
    """`outer<H>-<values>` (DiLoCo's outer SGD: lr 0.7, Nesterov momentum 0.9) or
    `outer<H>-<values>-avg` (plain model averaging: outer lr 1, no momentum), any H ≥ 1;
    None if `key` is not of that form."""
    m = OUTER_KEY.fullmatch(key)
    if m is None or int(m[1]) < 1:
        return None
    every, code, avg = int(m[1]), m[2], m[3] is not None
    value, density = OUTER_VALUES[code]
    name = f"outer H={every} {code.replace('topk', 'top-k ')}" + (
        " %" if code.startswith("topk") else ""
    )
    if avg:
        name += ", averaging"
        return SyncConfig(key, name, "outer", density, every, value, 1.0, 0.0)
    return SyncConfig(key, name, "outer", density, every, value)


def sgd_dgc_config(key: str) -> SyncConfig | None:
    """`sgd-dgc-topk<percent>`: per-step top-k at that density (0 < percent ≤ 100) under
    SGD with DGC's momentum correction; None if `key` is not of that form."""
    m = SGD_DGC_KEY.fullmatch(key)
    if m is None or not 0 < float(m[1]) <= 100:
        return None
    return SyncConfig(key, f"SGD-DGC top-k {m[1]} %", "topk", float(m[1]) / 100)


def torchft_config(key: str) -> SyncConfig | None:
    """`torchft-diloco<H>`: torchft's DiLoCo with H ≥ 1 inner steps per outer step; None
    if `key` is not of that form."""
    m = TORCHFT_KEY.fullmatch(key)
    if m is None or int(m[1]) < 1:
        return None
    return SyncConfig(
        key, f"torchft DiLoCo H={int(m[1])} fp32", "torchft", every=int(m[1]), values="fp32"
    )


def config_of(key: str) -> SyncConfig | None:
    """The configuration a parametrised key names (outer, SGD-DGC, torchft), or None."""
    for parse in (outer_config, sgd_dgc_config, torchft_config):
        config = parse(key)
        if config is not None:
            return config
    return None


def uses_sgd(key: str) -> bool:
    """Whether `key` trains with SGD (`bench/wan_sync.py`'s DGC set-up), not AdamW."""
    return key.startswith("sgd-")


def baseline_of(key: str) -> str:
    """The DDP run each configuration is compared with: its own optimiser's."""
    return "sgd-ddp" if uses_sgd(key) else "ddp"


def setup_for(key: str, setup: Setup) -> Setup:
    """`setup` with the optimiser `key` trains with."""
    if uses_sgd(key):
        return replace(setup, optimizer="sgd", lr=LEARNING_RATES["sgd"])
    return setup


def _configs() -> list[SyncConfig]:
    out = [
        SyncConfig("ddp", "DDP flat ring fp32", None),
        SyncConfig("dense", "hierarchical dense fp32", "none"),
        SyncConfig(
            "dense-blocking", "hierarchical dense fp32, blocking hook", "none", overlap=False
        ),
        SyncConfig("fp16", "hierarchical fp16", "fp16"),
        SyncConfig("int8", "hierarchical int8", "int8"),
        SyncConfig("int4", "hierarchical int4", "int4"),
        SyncConfig("topk1", "hierarchical top-k 1 %", "topk", 0.01),
        SyncConfig("topk01", "hierarchical top-k 0.1 %", "topk", 0.001),
        SyncConfig("sgd-ddp", "SGD: DDP flat ring fp32", None),
    ]
    for every in (8, 32, 128):
        for key in OUTER_VALUES:
            config = outer_config(f"outer{every}-{key}")
            assert config is not None
            out.append(config)
    return out


CONFIGS = _configs()


class _Configs(dict[str, SyncConfig]):
    """The named configurations, and any `outer<H>-<values>[-avg]`, `sgd-dgc-topk<percent>`
    or `torchft-diloco<H>` on demand."""

    def __missing__(self, key: str) -> SyncConfig:
        config = config_of(key)
        if config is None:
            raise KeyError(key)
        self[key] = config
        return config

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and config_of(key) is not None)


BY_KEY = _Configs({c.key: c for c in CONFIGS})
DEFAULT_KEYS = (
    "ddp,dense,fp16,int8,int4,topk1,topk01,"
    "outer8-fp16,outer8-int4,outer32-fp16,outer32-int8,outer32-int4,outer32-topk10,"
    "outer128-fp16,outer128-int8,outer128-int4,outer128-topk10,outer128-topk1"
)
QUICK_KEYS = "ddp,fp16,topk1,outer8-int8,outer32-int4,outer128-int4,outer128-topk10"

FULL = Setup(optimizer="adamw", lr=LEARNING_RATES["adamw"], steps=512, warmup=50)
#: Reduced: a 2-layer GPT of 0.13 M parameters, 256 steps (two outer steps at H = 128).
QUICK = Setup(
    layers=2,
    hidden=64,
    heads=2,
    seq_len=32,
    batch=4,
    steps=256,
    warmup=25,
    optimizer="adamw",
    lr=LEARNING_RATES["adamw"],
    eval_batches=8,
)


@dataclass
class Point:
    key: str
    name: str
    seeds: list[int]
    wan_bytes_per_step: float  # whole run, mean over seeds (equal between seeds)
    ddp_over_this: float
    eval_loss: list[float]  # by seed
    vs_ddp: list[float]  # eval loss ÷ its baseline DDP's (same seed) − 1, by seed
    within_2pct: bool
    wall_s: float
    baseline: str = "ddp"  # the DDP run it is compared with (same optimiser)


@dataclass
class Report:
    setup: dict[str, Any]
    points: list[Point] = field(default_factory=list)
    best: dict[str, Any] | None = None


def wan_per_step(config: SyncConfig, run: Run) -> float:
    if config.compression is None:
        return float(ddp_wan_bytes_per_step(run.ranks[0]["bucket_bytes"], site_of_rank()))
    return statistics.fmean(run.wan_per_step())


def run_all(
    keys: Sequence[str],
    seeds: Sequence[int],
    setup: Setup,
    parallel: int,
    log: Any,
    runs_file: Path | None = None,
) -> Report:
    """Every (configuration, seed) run; with `runs_file` each finished run is appended to
    it as one JSON line and runs already there are not run again (a long sweep survives
    an interruption)."""
    report = Report(setup={**asdict(setup), "seeds": list(seeds), "load": [os.getloadavg()[0]]})
    tmp = Path(tempfile.mkdtemp(prefix="cpn-wan-frontier-"))
    results: dict[tuple[str, int], tuple[float, float, float]] = {}
    loads: list[float] = []  # load averages recorded with reused runs
    fingerprint = json.dumps(asdict(setup), sort_keys=True)
    if runs_file is not None and runs_file.exists():
        for line in runs_file.read_text().splitlines():
            row = json.loads(line)
            if row["setup"] == fingerprint:
                results[row["key"], row["seed"]] = tuple(row["result"])
                report.setup["parameters"] = row["parameters"]
                if row["key"] in keys and row["seed"] in seeds:
                    loads.extend(row.get("load", []))
    fingerprints = {k: json.dumps(asdict(setup_for(k, setup)), sort_keys=True) for k in keys}
    if runs_file is not None and runs_file.exists():  # SGD runs: their own setup's rows
        for line in runs_file.read_text().splitlines():
            row = json.loads(line)
            if uses_sgd(row["key"]) and row["setup"] == fingerprints.get(row["key"]):
                results[row["key"], row["seed"]] = tuple(row["result"])
                if row["seed"] in seeds:
                    loads.extend(row.get("load", []))
    jobs = [(BY_KEY[k], s) for s in seeds for k in keys if (k, s) not in results]

    def one(job: tuple[SyncConfig, int]) -> None:
        config, seed = job
        began = time.monotonic()
        load_before = os.getloadavg()[0]
        this = replace(setup_for(config.key, setup), seed=seed)
        where = tmp / f"{config.key}-s{seed}"
        if config.compression == "torchft":
            run = torchft_peer.launch(config, this, where)
        else:
            run = launch(config, this, setup.steps, setup.warmup, None, where)
        result = (
            wan_per_step(config, run),
            float(run.ranks[0]["eval_loss"]),
            time.monotonic() - began,
        )
        results[config.key, seed] = result
        report.setup["parameters"] = run.ranks[0]["parameters"]
        if runs_file is not None:
            row = {
                "setup": fingerprints[config.key],
                "key": config.key,
                "seed": seed,
                "result": result,
            }
            row["parameters"] = run.ranks[0]["parameters"]
            row["load"] = [load_before, os.getloadavg()[0]]
            with runs_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
        log(f"{config.name}, seed {seed}: {result}")

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(one, j) for j in jobs]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()  # a failed run ends the sweep, not after every other run
            raise
    shutil.rmtree(tmp)
    ddp_bytes = statistics.fmean(results["ddp", s][0] for s in seeds)
    for key in keys:
        config = BY_KEY[key]
        wan = statistics.fmean(results[key, s][0] for s in seeds)
        losses = [results[key, s][1] for s in seeds]
        base = baseline_of(key)
        vs = [results[key, s][1] / results[base, s][1] - 1 for s in seeds]
        report.points.append(
            Point(
                key=key,
                name=config.name,
                seeds=list(seeds),
                wan_bytes_per_step=wan,
                ddp_over_this=ddp_bytes / wan if wan else math.inf,
                eval_loss=losses,
                vs_ddp=vs,
                within_2pct=all(v <= 0.02 for v in vs),
                wall_s=sum(results[key, s][2] for s in seeds),
                baseline=base,
            )
        )
    report.best = best_point(report.points)
    report.setup["load"].append(os.getloadavg()[0])
    if loads:  # runs reused from `runs_file`: the load while they ran, not (only) now
        every = [*loads, *(report.setup["load"] if jobs else [])]
        report.setup["load"] = [min(every), max(every)]
    return report


def best_point(points: Sequence[Point]) -> dict[str, Any] | None:
    """The fewest WAN bytes within 2 % of its DDP in every seed (baselines left out)."""
    good = [p for p in points if p.key not in ("ddp", "sgd-ddp") and p.within_2pct]
    if not good:
        return None
    best = max(good, key=lambda p: p.ddp_over_this)
    return {"key": best.key, "ddp_over_this": best.ddp_over_this, "vs_ddp": best.vs_ddp}


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def rows(report: Report) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for p in sorted(report.points, key=lambda p: -p.wan_bytes_per_step):
        ratio = p.ddp_over_this
        out.append(
            (
                p.name,
                _bytes(p.wan_bytes_per_step),
                f"{ratio:,.0f}×" if ratio >= 100 else f"{ratio:.2f}×",
                f"{statistics.fmean(p.eval_loss):.4f} ({min(p.eval_loss):.4f}–"
                f"{max(p.eval_loss):.4f})",
                " / ".join(f"{v:+.2%}" for v in p.vs_ddp),
                "yes" if p.within_2pct else "no",
            )
        )
    return out


COLUMNS = (
    "sync",
    "WAN/step (whole run)",
    "DDP ÷ this",
    "eval loss (range)",
    "vs DDP by seed (same optimiser)",
    "≤ 2 %",
)


def headline(report: Report) -> str:
    s = report.setup
    return (
        f"GPT {s['layers']}×{s['hidden']} ({s.get('parameters', 0) / 1e6:.2f} M parameters), "
        f"3 sites × 2 ranks, {s['steps']} steps, batch {s['batch']}×{s['seq_len']} per rank, "
        f"AdamW peak lr {s['lr']:g}, seeds {', '.join(map(str, s['seeds']))}; loopback, "
        f"bytes counted; load average {s['load'][0]:.1f} → {s['load'][1]:.1f}"
    )


def print_markdown(report: Report) -> None:
    print(f"{headline(report)}\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---:|" * (len(COLUMNS) - 1))
    for row in rows(report):
        print("| " + " | ".join(row) + " |")
    print()
    if report.best:
        b = report.best
        print(
            f"Best point within 2 % of DDP in every seed: {BY_KEY[b['key']].name}, "
            f"{b['ddp_over_this']:,.0f}× fewer WAN bytes per step than DDP "
            f"(loss {', '.join(f'{v:+.2%}' for v in b['vs_ddp'])})."
        )
    else:
        print("No configuration is within 2 % of DDP in every seed.")


def chart(report: Report, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for p in report.points:
        mean = statistics.fmean(p.vs_ddp) * 100
        lo, hi = min(p.vs_ddp) * 100, max(p.vs_ddp) * 100
        marker = (
            "s" if p.key.endswith("ddp") else "o" if p.key.startswith("outer")
            else "D" if p.key.startswith("torchft") else "^"
        )  # fmt: skip
        colour = "tab:red" if uses_sgd(p.key) else "tab:green" if "torchft" in p.key else "tab:blue"
        ax.errorbar(
            p.wan_bytes_per_step,
            mean,
            yerr=[[mean - lo], [hi - mean]],
            fmt=marker,
            capsize=3,
            color=colour,
        )
        below = p.key == "sgd-ddp"  # it shares DDP's point (same bytes, 0 %)
        ax.annotate(p.key, (p.wan_bytes_per_step, mean), fontsize=7,
                    xytext=(4, -10 if below else 3), textcoords="offset points")  # fmt: skip
    ax.axhline(2.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("WAN bytes per step, whole run (log)")
    ax.set_ylabel("final eval loss vs DDP, % (mean; bars: seeds' range)")
    if any(uses_sgd(p.key) for p in report.points):
        ax.text(
            0.01, 0.98, "blue: cpn, AdamW; green: torchft, AdamW (both vs AdamW's DDP); "
            "red: SGD (vs SGD's DDP)",
            transform=ax.transAxes, fontsize=7, va="top",
        )  # fmt: skip
    ax.set_title(textwrap.fill(headline(report), 130), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge(paths: Sequence[Path]) -> Report:
    """One report from several `--json` reports of the same setup and seeds (runs split
    to keep each short): their points, DDP's once."""
    docs = [json.loads(p.read_text()) for p in paths]
    first = docs[0]
    for other in docs[1:]:
        same = ("layers", "hidden", "steps", "seeds", "lr")
        if any(other["setup"][k] != first["setup"][k] for k in same):
            raise SystemExit(f"--merge: reports of different setups ({', '.join(same)})")
    setup = dict(first["setup"])
    setup["load"] = [
        min(d["setup"]["load"][0] for d in docs),
        max(d["setup"]["load"][1] for d in docs),
    ]
    report = Report(setup=setup)
    seen: set[str] = set()
    for doc in docs:
        for point in doc["points"]:
            if point["key"] not in seen:
                seen.add(point["key"])
                report.points.append(Point(**point))
    report.best = best_point(report.points)
    return report


def with_baselines(keys: Sequence[str]) -> list[str]:
    """`keys` with the DDP runs they are compared with, baselines first."""
    needed = ["ddp", *(["sgd-ddp"] if any(uses_sgd(k) for k in keys) else [])]
    return [*(b for b in needed if b not in keys), *keys]


def print_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def timing(
    keys: Sequence[str],
    setup: Setup,
    skip: int,
    rounds: int,
    log: Any,
    rates_mbit: Sequence[float],
    netns_prefix: str = DEFAULT_PREFIX,
    subnet: str = SUBNET,
) -> None:
    """Step time per configuration (median over steps after `skip` of the slowest rank,
    and the mean, which counts the outer steps' bursts), run round-robin `rounds` times so
    that the machine's load falls on every configuration alike. With `rates_mbit` the
    sites are emulated (`cpn/emulated_wan.py`, root; namespaces `netns_prefix`-…,
    addresses in `subnet`.0/24) and each configuration runs with no limit and with every
    uplink at each of those rates, in every round; else on loopback. Prints markdown."""
    tmp = Path(tempfile.mkdtemp(prefix="cpn-wan-timing-"))
    medians: dict[tuple[str, float | None], list[float]] = {}
    means: dict[tuple[str, float | None], list[float]] = {}
    load = [os.getloadavg()[0]]
    rates: list[float | None] = [None, *rates_mbit]
    emulated = (
        EmulatedWan(len(SITES), None, prefix=netns_prefix, subnet=subnet)
        if rates_mbit
        else nullcontext()
    )
    with emulated as wan:
        for r in range(rounds):
            for rate in rates:
                if wan is not None:
                    wan.set_uplink(rate)
                for key in keys:
                    where = tmp / f"{key}-{rate}-{r}"
                    run = launch(BY_KEY[key], setup, setup.steps, 0, wan, where)
                    steps = run.step_seconds()[skip:]
                    medians.setdefault((key, rate), []).append(statistics.median(steps))
                    means.setdefault((key, rate), []).append(statistics.fmean(steps))
                    log(f"{key} {rate} round {r}: {medians[key, rate][-1] * 1e3:.1f} ms")
    shutil.rmtree(tmp)
    load.append(os.getloadavg()[0])
    network = "emulated sites" if rates_mbit else "loopback"
    print(
        f"Step time ({network}), GPT {setup.layers}×{setup.hidden}, {setup.steps} steps "
        f"(after {skip}; slowest rank per step), {rounds} rounds; load average "
        f"{load[0]:.1f} → {load[1]:.1f}\n"
    )
    print("| uplink | sync | median step | mean step | rounds (median) | ÷ DDP | ÷ no limit |")
    print("|---|---|---:|---:|---|---:|---:|")
    for rate in rates:
        ddp = statistics.median(medians["ddp", rate])
        for key in keys:
            m = statistics.median(medians[key, rate])
            mean = statistics.median(means[key, rate])
            each = ", ".join(f"{x * 1e3:.0f}" for x in medians[key, rate])
            free = statistics.median(medians[key, None])
            label = "no limit" if rate is None else f"{rate:g} Mbit/s"
            print(
                f"| {label} | {BY_KEY[key].name} | {m * 1e3:.1f} ms | {mean * 1e3:.1f} ms | "
                f"{each} | {m / ddp:.2f}× | {m / free:.2f}× |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="reduced: tiny GPT, fewer configs")
    ap.add_argument("--configs", help=f"comma-separated subset of {','.join(BY_KEY)}")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (6 processes each)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the report as JSON here")
    ap.add_argument(
        "--runs", type=Path, help="append each run here (JSON lines); runs found are reused"
    )
    ap.add_argument("--chart", type=Path, help="write the frontier chart (PNG) here")
    ap.add_argument(
        "--timing",
        action="store_true",
        help="step times instead (default configs ddp,dense,dense-blocking; --steps 40)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="--timing: rounds")
    ap.add_argument(
        "--merge", type=Path, nargs="+", help="render these --json reports as one (no runs)"
    )
    ap.add_argument(
        "--rate-mbit",
        type=float,
        nargs="+",
        default=[],
        help="--timing: also with every uplink at each of these rates (emulated sites: root)",
    )
    ap.add_argument(
        "--netns-prefix", default=DEFAULT_PREFIX, help="--timing: emulated sites' namespaces"
    )
    ap.add_argument(
        "--subnet", default=SUBNET, help="--timing: emulated sites' /24 (inside 198.18.0.0/15)"
    )
    args = ap.parse_args()
    setup = QUICK if args.quick else FULL
    if args.steps:
        setup = replace(setup, steps=args.steps, warmup=max(1, args.steps // 10))
    if args.merge:
        report = merge(args.merge)
        if args.chart:
            chart(report, args.chart)
        print_markdown(report)
        return
    if args.timing:
        keys = (args.configs or "ddp,dense,dense-blocking").split(",")
        steps = args.steps or 40
        if any(BY_KEY[k].compression == "torchft" for k in keys):
            raise SystemExit("--timing: torchft-diloco runs on loopback only")
        timing(
            keys,
            replace(setup, steps=steps),
            steps // 4,
            args.rounds,
            print_err,
            args.rate_mbit,
            args.netns_prefix,
            args.subnet,
        )
        return
    keys = (args.configs or (QUICK_KEYS if args.quick else DEFAULT_KEYS)).split(",")
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(BY_KEY)})")
    keys = with_baselines(keys)
    why = torchft_peer.unavailable()
    if why is not None and any(k.startswith("torchft-") for k in keys):
        print_err(f"skipping {', '.join(k for k in keys if k.startswith('torchft-'))}: {why}")
        keys = [k for k in keys if not k.startswith("torchft-")]
    seeds = [int(s) for s in (args.seeds or "0,1,2").split(",")]

    try:
        report = run_all(keys, seeds, setup, args.parallel, print_err, args.runs)
    except RankFailed as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    if args.chart:
        chart(report, args.chart)
    if args.markdown:
        print_markdown(report)
    else:
        print(headline(report))
        for row in rows(report):
            print("  ".join(row))


if __name__ == "__main__":
    main()
