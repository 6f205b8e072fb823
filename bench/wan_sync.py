"""Wide-area gradient sync: WAN bytes, loss and step time against PyTorch DDP's flat ring.

    .venv/bin/python bench/wan_sync.py                  # full run, tables (~25 minutes)
    .venv/bin/python bench/wan_sync.py --markdown       # the same as markdown tables
    .venv/bin/python bench/wan_sync.py --json           # one JSON object instead
    .venv/bin/python bench/wan_sync.py --quick          # smoke run: tiny model, few steps
    .venv/bin/python bench/wan_sync.py --configs ddp,topk01 --rate-mbit 50 --no-selection

A small GPT (`cpn.train.model`: 4 layers, hidden 256, 4 heads, seq 64, byte vocabulary;
3.3 M parameters) is trained by 3 sites × 2 ranks, each rank a separate process (gloo on
CPU, one thread) with its own shard of the same generated data (`cpn.train.data`), wrapped
in `torch.nn.parallel.DistributedDataParallel`. Ranks are site-major (0, 1 at site a;
2, 3 at b; 4, 5 at c). Every configuration uses the same seed, data and learning-rate
schedule:

  - DDP flat ring fp32: plain DDP, no hook (gloo's ring all-reduce over all six ranks);
  - hierarchical dense / fp16 / top-k: DDP with `cpn.comm.wan_sync_hook` (reduce to the
    site leader, leaders exchange across sites, broadcast back); top-k at 1 %, 0.1 %,
    0.05 % and 0.01 % with error feedback and DGC's density warm-up (25 % down to the
    target, geometrically) over the first `--warmup` steps.

The optimizer is Deep Gradient Compression's setting (`--optimizer sgd`, the default):
momentum SGD with gradient clipping, except under top-k, where the momentum and the
clipping move into the sync (`WanSyncState(momentum=0.9, clip_norm=1.0)`: momentum
correction and local clipping) and the optimizer is plain SGD. `--optimizer adamw` gives
every configuration AdamW instead (no momentum correction: AdamW keeps its own moments).

It measures
  (a) WAN bytes per step: DDP's by the ring convention (`cpn.wire.ring_allreduce_bytes`
      per DDP bucket, counted on the ranks whose ring successor is at another site), cpn's
      from `WanSyncState.bytes_sent`; the steady state excludes the top-k warm-up. When
      the sites are emulated, also what the sites' uplinks actually sent (veth counters:
      Ethernet frames, TCP/IP headers and ACKs included), to show the counts match the wire;
  (b) the loss after the same steps: training loss (mean of the last 10 % of steps) and an
      eval loss on fixed windows, by rank 0 after training; and whether all six replicas
      ended with bit-identical parameters;
  (c) step time (median over the timed steps of the slowest rank's step) with each
      site's uplink rate-limited, and with no limit: as root the sites are network
      namespaces joined by a bridge, each uplink shaped with `tc tbf`
      (`cpn/emulated_wan.py`, 198.18.0.0/15 addresses), and (a) runs there too;
      otherwise (c) is skipped and (a) runs over loopback (counted bytes only). Top-k
      runs at its target density from the first step here (timing, not loss);
  (d) top-k selection on a 25 M-element tensor against `torch.topk`
      (`bench/topk_selection.py`, one thread as the ranks run).
Targets (DESIGN.md §10): ≥ 1000× fewer WAN bytes than DDP with final loss within 2 %;
≥ 5× faster steps than DDP on the rate-limited WAN and within 1.2× of no limit; selection
≥ 8× faster than torch.topk with recall ≥ 0.9.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

from cpn import wire
from cpn.comm import OuterStep, WanSyncState, wan_sync_hook
from cpn.comm.outer import OUTER_LR, OUTER_MOMENTUM
from cpn.emulated_wan import EmulatedWan, available
from cpn.train.data import BatchSource
from cpn.train.model import GPTConfig, GPTStage
from cpn.train.trainer import learning_rate

SITES = ("a", "b", "c")
RANKS_PER_SITE = 2


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class SyncConfig:
    key: str
    name: str
    compression: str | None  # None: plain DDP, no hook
    density: float = 1.0
    every: int = 0  # compression "outer": inner steps per outer step (H)
    values: str = "fp16"  # compression "outer": how pseudo-gradients cross the WAN
    outer_lr: float = OUTER_LR  # compression "outer": the outer SGD (DiLoCo's 0.7 / 0.9;
    outer_momentum: float = OUTER_MOMENTUM  # lr 1, momentum 0 is plain model averaging)
    overlap: bool = True  # the hook syncs buckets on a comm thread (False: blocking)


CONFIGS = (
    SyncConfig("ddp", "DDP flat ring fp32", None),
    SyncConfig("dense", "hierarchical dense fp32", "none"),
    SyncConfig("fp16", "hierarchical fp16", "fp16"),
    SyncConfig("topk1", "hierarchical top-k 1 %", "topk", 0.01),
    SyncConfig("topk01", "hierarchical top-k 0.1 %", "topk", 0.001),
    SyncConfig("topk005", "hierarchical top-k 0.05 %", "topk", 0.0005),
    SyncConfig("topk001", "hierarchical top-k 0.01 %", "topk", 0.0001),
)
BY_KEY = {c.key: c for c in CONFIGS}
TIMED = ("ddp", "fp16", "topk1", "topk01", "topk005")


@dataclass(frozen=True)
class Setup:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq_len: int = 64
    vocab: int = 256
    batch: int = 4  # sequences per rank per step
    steps: int = 250
    warmup: int = 40  # top-k density warm-up (steps)
    optimizer: str = "sgd"  # "sgd" (momentum SGD; DGC's setting) or "adamw"
    lr: float = 0.1
    momentum: float = 0.9  # SGD's, or DGC's momentum correction under top-k
    clip_norm: float = 1.0  # SGD: gradient clipping (local, before compression, under top-k)
    seed: int = 0
    eval_batches: int = 8
    timing_steps: int = 20  # timed steps per run in (c), after `timing_skip`
    timing_skip: int = 5
    rates_mbit: tuple[float, ...] = (100.0, 50.0)  # uplink limits timed in (c)
    selection_numel: int = 25_000_000
    selection_repeats: int = 5


#: Peak learning rates (linear warm-up, cosine decay), tuned on a single process.
LEARNING_RATES = {"sgd": 0.1, "adamw": 3e-3}

QUICK = Setup(
    layers=2,
    hidden=64,
    heads=2,
    seq_len=32,
    batch=2,
    steps=12,
    warmup=3,
    eval_batches=2,
    timing_steps=4,
    timing_skip=2,
    rates_mbit=(20.0,),
    selection_numel=1_000_000,
    selection_repeats=2,
)
QUICK_TIMED = ("ddp", "topk01")


def site_of_rank() -> list[str]:
    return [s for s in SITES for _ in range(RANKS_PER_SITE)]


# -------------------------------------------------------------------------- rank process


def _read_tx() -> int:
    # Inside `ip netns exec`, /sys shows this site's namespace: wan0 is its uplink.
    return int(Path("/sys/class/net/wan0/statistics/tx_bytes").read_text())


def held_out_loss(model: torch.nn.Module, setup: Setup) -> float:
    """Mean loss on the fixed held-out windows (rank 0, after the last step): the same
    windows for every configuration and peer, so their eval losses compare."""
    held_out = BatchSource(setup.seq_len, setup.vocab, setup.batch, setup.batch, 1, setup.seed)
    with torch.no_grad():
        evals = [
            float(model(*held_out.for_replica(10**6 + i, 0)[0])) for i in range(setup.eval_batches)
        ]
    return statistics.fmean(evals)


def worker(spec_path: Path) -> None:
    """One rank: train `spec["steps"]` steps, write what it measured to rank-<r>.json.

    Started by the runtime's launcher: its rank is its entry in CPN_PLAN_RANKS."""
    ranks = [int(r) for r in os.environ["CPN_PLAN_RANKS"].split(",")]
    rank = ranks[int(os.environ["LOCAL_RANK"])]
    spec = json.loads(spec_path.read_text())
    setup = Setup(**spec["setup"])
    cfg = SyncConfig(**spec["config"])
    out = Path(spec["out"])
    sites: list[str] = spec["site_of_rank"]
    world = len(sites)
    timeout = timedelta(seconds=spec["timeout_s"])
    torch.set_num_threads(1)
    torch.manual_seed(setup.seed)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    model = GPTStage(
        GPTConfig(setup.layers, setup.hidden, setup.heads, setup.seq_len, setup.vocab),
        seed=setup.seed,
    )
    ddp = DistributedDataParallel(model)
    sgd = setup.optimizer == "sgd"
    # Under top-k with SGD, momentum and clipping move into the sync, as in Deep Gradient
    # Compression: momentum correction accumulates velocity (not gradients) in the
    # error-feedback residual, and clipping is local, before the residual. The optimizer
    # is then plain SGD. Everywhere else: momentum SGD with clipping after the sync.
    dgc = sgd and cfg.compression == "topk"
    state = None
    if cfg.compression is not None:
        state = WanSyncState(
            site_of_rank=sites,
            compression=cfg.compression,  # type: ignore[arg-type]
            density=cfg.density,
            warmup_steps=spec["warmup_steps"],
            momentum=setup.momentum if dgc else 0.0,
            clip_norm=setup.clip_norm if dgc else None,
            timeout=timeout,
            seed=setup.seed,
            parameters=model.parameters(),
            overlap=cfg.overlap,
        )
        ddp.register_comm_hook(state, wan_sync_hook)
    outer = None
    if cfg.compression == "outer":
        assert state is not None
        outer = OuterStep(
            state,
            model.parameters(),
            every=cfg.every,
            values=cfg.values,
            density=cfg.density,
            lr=cfg.outer_lr,
            momentum=cfg.outer_momentum,
        )
    optimizer: torch.optim.Optimizer
    if sgd:
        optimizer = torch.optim.SGD(
            model.parameters(), lr=setup.lr, momentum=0.0 if dgc else setup.momentum
        )
    else:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=setup.lr,
            betas=(0.9, 0.95),
        )
    data = BatchSource(
        setup.seq_len, setup.vocab, world * setup.batch, setup.batch, world, setup.seed
    )
    reads_uplink = spec["emulated"] and sites.index(sites[rank]) == rank
    progress = (out / "progress").open("a") if rank == 0 else None
    steps: int = spec["steps"]
    losses: list[float] = []
    seconds: list[float] = []
    wan: list[int] = []
    intra: list[int] = []
    dist.barrier()
    tx_before = _read_tx() if reads_uplink else 0
    for step in range(steps):
        began = time.perf_counter()
        before = state.bytes_sent if state is not None else {}
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(setup.lr, step, steps)
        ((x, y),) = data.for_replica(step, rank)
        loss = ddp(x, y)
        loss.backward()  # DDP syncs the gradients here (through the hook, if any)
        if sgd and not dgc:
            torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if outer is not None:
            outer.after_step()  # every H steps the sites exchange pseudo-gradients
            if step == steps - 1 and outer.inner_steps:
                outer.sync()  # the run ends with one model
        seconds.append(time.perf_counter() - began)
        losses.append(loss.item())
        if state is not None:
            after = state.bytes_sent
            wan.append(after["wan"] - before["wan"])
            intra.append(after["intra_site"] - before["intra_site"])
        if progress is not None:
            progress.write(f"{step + 1}\n")
            progress.flush()
    dist.barrier()
    tx = _read_tx() - tx_before if reads_uplink else None
    eval_loss = None
    if rank == 0:
        eval_loss = held_out_loss(model, setup)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    logging_data = ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
    bucket_bytes = [int(b) for b in re.findall(r"\d+", str(logging_data.get("bucket_sizes", "")))]
    result = {
        "rank": rank,
        "losses": losses,
        "seconds": seconds,
        "wan_bytes": wan,
        "intra_site_bytes": intra,
        "uplink_tx_bytes": tx,
        "eval_loss": eval_loss,
        "params_sha256": digest.hexdigest()[:16],
        "bucket_bytes": bucket_bytes,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    if progress is not None:
        progress.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ launching


class RankFailed(RuntimeError):
    pass


@dataclass
class Run:
    """What the six ranks of one run reported."""

    ranks: list[dict[str, Any]]
    wall_s: float

    @property
    def steps(self) -> int:
        return len(self.ranks[0]["losses"])

    def step_losses(self) -> list[float]:
        return [statistics.fmean(r["losses"][i] for r in self.ranks) for i in range(self.steps)]

    def step_seconds(self) -> list[float]:
        """Each step's slowest rank."""
        return [max(r["seconds"][i] for r in self.ranks) for i in range(self.steps)]

    def wan_per_step(self) -> list[int]:
        return [sum(r["wan_bytes"][i] for r in self.ranks) for i in range(self.steps)]

    def intra_per_step(self) -> list[int]:
        return [sum(r["intra_site_bytes"][i] for r in self.ranks) for i in range(self.steps)]

    def uplink_tx(self) -> int | None:
        tx = [r["uplink_tx_bytes"] for r in self.ranks if r["uplink_tx_bytes"] is not None]
        return sum(tx) if tx else None


#: The rendezvous port in site a's namespace (namespaces have ports of their own).
RDZV_PORT = 29400


#: Seconds a run waits for its ranks to exit after all of them reported.
EXIT_GRACE_S = 20.0


def launch(
    config: SyncConfig,
    setup: Setup,
    steps: int,
    warmup_steps: int,
    wan: EmulatedWan | None,
    workdir: Path,
    on_step: Callable[[int], None] | None = None,
) -> Run:
    """Start the six ranks through the runtime's launcher and wait: one launcher per site,
    inside its network namespace, meeting at site a's rendezvous when `wan` is given;
    else one launcher for all six on loopback (the sites are then labels only)."""
    workdir.mkdir(parents=True)
    sites = site_of_rank()
    spec = {
        "setup": asdict(setup),
        "config": asdict(config),
        "steps": steps,
        "warmup_steps": warmup_steps,
        "out": str(workdir),
        "site_of_rank": sites,
        "emulated": wan is not None,
        "timeout_s": 300.0,
    }
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {"GLOO_SOCKET_IFNAME": wan.interface if wan is not None else "lo"}
    argv = [str(Path(__file__).resolve()), "--worker", str(spec_path)]
    groups = (
        [[r for r, s in enumerate(sites) if s == site] for site in SITES]
        if wan is not None
        else [list(range(len(sites)))]
    )
    procs: list[subprocess.Popen[bytes]] = []
    began = time.monotonic()
    # Generous: a rank that dies or hangs is reported, never waited on for ever.
    deadline = began + 120 + steps * 30
    done_steps = 0
    reported_at: float | None = None
    try:
        for i, ranks in enumerate(groups):
            launch_spec = {
                "argv": argv,
                "plan_ranks": ranks,
                "run_dir": str(workdir / f"site-{i}"),
                "run_id": workdir.name,
                "nnodes": len(groups),
                "rdzv_endpoint": f"{wan.address(0)}:{RDZV_PORT}" if wan else "127.0.0.1:0",
                "is_host": i == 0,
                "env": env,
                "local_addr": wan.address(i) if wan is not None else None,
            }
            path = workdir / f"launch-{i}.json"
            path.write_text(json.dumps(launch_spec))
            prefix = wan.prefix(i) if wan is not None else []
            log = workdir / f"launcher-{i}.log"
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [*prefix, sys.executable, "-m", "cpn.train.launcher", str(path)],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=Path(__file__).resolve().parents[1],
                    )
                )
        while True:
            codes = [p.poll() for p in procs]
            progress = workdir / "progress"
            if on_step is not None and progress.exists():
                n = len(progress.read_text().split())
                if n > done_steps:
                    done_steps = n
                    on_step(n)
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise RankFailed(_failure(workdir, config, failed[0]))
            if all(c == 0 for c in codes):
                break
            # Every rank wrote its report: what a run measures is complete. A rank that
            # then hangs on its way out (seen in gloo's teardown) is ended after a grace.
            reported = all((workdir / f"rank-{r}.json").exists() for r in range(len(sites)))
            if reported and reported_at is None:
                reported_at = time.monotonic()
            if reported_at is not None and time.monotonic() - reported_at > EXIT_GRACE_S:
                break
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"{config.name}: still running at the deadline (logs in {workdir})"
                )
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # its workers die with it (cpn.train.guard)
                p.wait()
    reports = [json.loads((workdir / f"rank-{r}.json").read_text()) for r in range(len(sites))]
    return Run(reports, time.monotonic() - began)


def _failure(workdir: Path, config: SyncConfig, launcher: int) -> str:
    result_path = workdir / f"site-{launcher}" / "result.json"
    try:
        result = json.loads(result_path.read_text())
        first = result["failures"][0]
        tail = "\n    ".join(result.get("tail", [])[-12:]) or "(no output)"
        why = f"rank {first['rank']} exited with {first['status']}: {first['reason']}"
    except (OSError, ValueError, KeyError, IndexError):
        why, tail = f"launcher {launcher} failed", "(see its log)"
    return f"{config.name}: {why} (logs in {workdir}); its log ends:\n    {tail}"


# ------------------------------------------------------------------------------- results


@dataclass
class SyncRow:
    key: str
    name: str
    wan_bytes_per_step: float  # over all steps
    wan_bytes_per_step_steady: float  # after the top-k warm-up
    ddp_over_this: float  # WAN bytes, steady state
    ddp_over_this_all_steps: float
    measured_wan_bytes_per_step: float | None  # veth tx, all sites (emulated only)
    measured_over_counted: float | None
    intra_site_bytes_per_step: float | None
    train_loss: float  # mean of the last 10 % of steps
    eval_loss: float
    loss_vs_ddp: float  # eval loss ÷ DDP's − 1
    replicas_identical: bool
    wall_s: float
    loss_curve: list[float]  # training loss, mean over each tenth of the steps


@dataclass
class TimingRow:
    key: str
    name: str
    rate_mbit: float
    limited_step_s: float
    unlimited_step_s: float
    ddp_over_this: float  # limited
    limited_over_unlimited: float


@dataclass
class Report:
    setup: dict[str, Any]
    sync: list[SyncRow] = field(default_factory=list)
    timing: list[TimingRow] = field(default_factory=list)
    timing_skipped: str | None = None
    selection: list[dict[str, Any]] = field(default_factory=list)
    selection_skipped: str | None = None
    targets: list[dict[str, Any]] = field(default_factory=list)


def ddp_wan_bytes_per_step(bucket_bytes: Sequence[int], sites: Sequence[str]) -> int:
    """WAN bytes of one step of DDP's gloo ring all-reduce over `sites` (site-major ranks).

    Each rank sends its ring share of every bucket to the next rank; that traffic is on
    the WAN when the next rank is at another site.
    """
    world = len(sites)
    total = 0
    for rank in range(world):
        if sites[(rank + 1) % world] == sites[rank]:
            continue
        for nbytes in bucket_bytes:
            total += wire.ring_allreduce_bytes(nbytes // 4, 4, world, rank)
    return total


def sync_row(config: SyncConfig, run: Run, warmup_steps: int, ddp: SyncRow | None) -> SyncRow:
    sites = site_of_rank()
    steps = run.steps
    if config.compression is None:
        per = float(ddp_wan_bytes_per_step(run.ranks[0]["bucket_bytes"], sites))
        wan_all, wan_steady, intra = per, per, None
    else:
        wan = run.wan_per_step()
        wan_all = statistics.fmean(wan)
        steady = wan[warmup_steps:] if config.compression == "topk" else wan
        wan_steady = statistics.fmean(steady or wan)
        intra = statistics.fmean(run.intra_per_step())
    tx = run.uplink_tx()
    measured = tx / steps if tx is not None else None
    losses = run.step_losses()
    tail = max(1, steps // 10)
    eval_loss = run.ranks[0]["eval_loss"]
    ddp_steady = ddp.wan_bytes_per_step_steady if ddp else wan_steady
    return SyncRow(
        key=config.key,
        name=config.name,
        wan_bytes_per_step=wan_all,
        wan_bytes_per_step_steady=wan_steady,
        ddp_over_this=ddp_steady / wan_steady if wan_steady else math.inf,
        ddp_over_this_all_steps=ddp_steady / wan_all if wan_all else math.inf,
        measured_wan_bytes_per_step=measured,
        measured_over_counted=measured / wan_all if measured is not None and wan_all else None,
        intra_site_bytes_per_step=intra,
        train_loss=statistics.fmean(losses[-tail:]),
        eval_loss=eval_loss,
        loss_vs_ddp=eval_loss / ddp.eval_loss - 1 if ddp else 0.0,
        replicas_identical=len({r["params_sha256"] for r in run.ranks}) == 1,
        wall_s=run.wall_s,
        loss_curve=[statistics.fmean(c) for c in tenths(losses)],
    )


def tenths(xs: Sequence[float]) -> list[list[float]]:
    """`xs` cut into ten consecutive parts (fewer when shorter), none empty."""
    parts = [list(xs[i * len(xs) // 10 : (i + 1) * len(xs) // 10]) for i in range(10)]
    return [p for p in parts if p]


def median_step(run: Run, skip: int) -> float:
    return statistics.median(run.step_seconds()[skip:])


def judge(report: Report) -> None:
    targets = report.targets
    ddp = next((r for r in report.sync if r.key == "ddp"), None)
    if ddp is not None:
        cpn_rows = [r for r in report.sync if r.key != "ddp"]
        good = [r for r in cpn_rows if r.ddp_over_this >= 1000 and abs(r.loss_vs_ddp) <= 0.02]
        sparse = [r for r in cpn_rows if BY_KEY[r.key].compression == "topk"] or cpn_rows
        targets.append(
            {
                "target": "≥ 1000× fewer WAN bytes/step than DDP flat fp32 (steady state), "
                "eval loss within 2 %",
                "met": bool(good) if cpn_rows else None,
                "detail": "; ".join(
                    f"{r.name}: {r.ddp_over_this:,.0f}×, loss {r.loss_vs_ddp:+.2%}"
                    + (" (both met)" if r in good else "")
                    for r in sparse
                )
                or "no cpn configuration ran",
            }
        )
    if report.timing:
        for rate in report.setup["rates_mbit"]:
            rows = [t for t in report.timing if t.key != "ddp" and t.rate_mbit == rate]
            if not rows:
                continue
            best_t = max(rows, key=lambda t: t.ddp_over_this)
            targets.append(
                {
                    "target": f"≥ 5× faster steps than DDP, uplinks at {rate:g} Mbit/s, and "
                    "within 1.2× of the same run with no WAN limit",
                    "met": best_t.ddp_over_this >= 5 and best_t.limited_over_unlimited <= 1.2,
                    "detail": f"{best_t.name}: {best_t.ddp_over_this:.1f}× faster than DDP, "
                    f"{best_t.limited_over_unlimited:.2f}× its unlimited step",
                }
            )
    else:
        targets.append(
            {
                "target": "step time on a rate-limited WAN",
                "met": None,
                "detail": f"not measured: {report.timing_skipped}",
            }
        )
    if report.selection:
        ok = [s for s in report.selection if s["speedup"] >= 8 and s["recall"] >= 0.9]
        targets.append(
            {
                "target": "selection ≥ 8× faster than torch.topk with recall ≥ 0.9",
                "met": len(ok) == len(report.selection),
                "detail": ", ".join(
                    f"k={int(s['k']):,}: {s['speedup']:.1f}×, recall {s['recall']:.3f}"
                    for s in report.selection
                ),
            }
        )
    else:
        targets.append(
            {
                "target": "selection ≥ 8× faster than torch.topk with recall ≥ 0.9",
                "met": None,
                "detail": f"not measured: {report.selection_skipped}",
            }
        )


# --------------------------------------------------------------------------------- output


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ratio(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.2f}×"


Section = tuple[str, tuple[str, ...], list[tuple[str, ...]]]


def sections(report: Report) -> tuple[list[Section], list[str]]:
    """The report's tables (title, columns, rows) and the lines for the parts skipped."""
    s = report.setup
    out: list[Section] = []
    skipped: list[str] = []
    out.append(
        (
            "(a) WAN bytes per step and (b) loss after the same steps",
            (
                "sync",
                "WAN/step",
                "WAN/step steady",
                "DDP ÷ this",
                "veth/step",
                "veth ÷ counted",
                "train loss",
                "eval loss",
                "vs DDP",
                "replicas equal",
            ),
            [
                (
                    r.name,
                    _bytes(r.wan_bytes_per_step),
                    _bytes(r.wan_bytes_per_step_steady),
                    _ratio(r.ddp_over_this),
                    _bytes(r.measured_wan_bytes_per_step),
                    "–" if r.measured_over_counted is None else f"{r.measured_over_counted:.3f}",
                    f"{r.train_loss:.4f}",
                    f"{r.eval_loss:.4f}",
                    f"{r.loss_vs_ddp:+.2%}",
                    "yes" if r.replicas_identical else "NO",
                )
                for r in report.sync
            ],
        )
    )
    if report.timing:
        out.append(
            (
                f"(c) step time, median of {s['timing_steps']} steps (slowest rank each), "
                "each site's uplink limited vs no limit",
                ("uplink", "sync", "limited", "no limit", "DDP ÷ this", "limited ÷ no limit"),
                [
                    (
                        f"{t.rate_mbit:g} Mbit/s",
                        t.name,
                        f"{t.limited_step_s * 1e3:.0f} ms",
                        f"{t.unlimited_step_s * 1e3:.0f} ms",
                        f"{t.ddp_over_this:.2f}×",
                        f"{t.limited_over_unlimited:.2f}×",
                    )
                    for t in report.timing
                ],
            )
        )
    else:
        skipped.append(f"(c) step time on a rate-limited WAN: skipped — {report.timing_skipped}")
    if report.selection:
        out.append(
            (
                "(d) top-k selection vs torch.topk",
                ("elements", "k", "torch.topk", "cpn", "speedup", "recall"),
                [
                    (
                        f"{int(row['numel']):,}",
                        f"{int(row['k']):,}",
                        f"{row['torch_topk_ms']:.1f} ms",
                        f"{row['cpn_ms']:.1f} ms",
                        f"{row['speedup']:.1f}×",
                        f"{row['recall']:.3f}",
                    )
                    for row in report.selection
                ],
            )
        )
    else:
        skipped.append(f"(d) selection: skipped — {report.selection_skipped}")
    return out, skipped


def headline(report: Report) -> str:
    s = report.setup
    return (
        f"GPT {s['layers']}×{s['hidden']} ({s['parameters'] / 1e6:.2f} M parameters), "
        f"3 sites × 2 ranks, {s['steps']} steps, batch {s['batch']}×{s['seq_len']} per rank, "
        f"{s['optimizer']} (peak lr {s['lr']:g}), top-k warm-up {s['warmup']} steps; "
        f"{s['network']}; load average {' → '.join(map(str, s['load_average']))}"
    )


def print_report(report: Report, console: Console) -> None:
    console.print(f"[bold]Wide-area gradient sync[/]: {headline(report)}")
    tables, skipped = sections(report)
    for title, cols, rows in tables:
        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="left" if c == "sync" else "right")
        for row in rows:
            t.add_row(*row)
        console.print(t)
    for line in skipped:
        console.print(line)
    console.print("[bold]Targets[/]")
    for tg in report.targets:
        mark = {True: "[green]met[/]", False: "[red]not met[/]", None: "[yellow]n/a[/]"}[tg["met"]]
        console.print(f"  {mark}  {tg['target']} — {tg['detail']}")


def print_markdown(report: Report) -> None:
    print(f"{headline(report)}\n")
    tables, skipped = sections(report)
    for title, cols, rows in tables:
        print(f"{title}:\n")
        print("| " + " | ".join(cols) + " |")
        print("|" + "".join("---|" if c == "sync" else "---:|" for c in cols))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        print()
    for line in skipped:
        print(f"{line}\n")
    for tg in report.targets:
        mark = {True: "met", False: "not met", None: "n/a"}[tg["met"]]
        print(f"- {tg['target']}: **{mark}** — {tg['detail']}")


# ----------------------------------------------------------------------------------- main


def selection(setup: Setup) -> tuple[list[dict[str, Any]], str | None]:
    try:
        module = importlib.import_module("topk_selection")
    except ImportError as exc:
        return [], f"bench/topk_selection.py is not importable ({exc})"
    # One intra-op thread, as the ranks run (OMP_NUM_THREADS=1): on a loaded machine a
    # second thread waits for a core, which would measure the scheduler, not the selection.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = module.selection_benchmark(
            numel=setup.selection_numel,
            densities=(0.01, 0.001, 0.0001),
            repeats=setup.selection_repeats,
            seed=setup.seed,
        )
    finally:
        torch.set_num_threads(threads)
    return [dict(r) for r in rows], None


def run_bench(args: argparse.Namespace, err: Console) -> Report:
    setup = QUICK if args.quick else Setup()
    if args.steps is not None:
        setup = replace(setup, steps=args.steps)
    if args.optimizer is not None:
        setup = replace(setup, optimizer=args.optimizer, lr=LEARNING_RATES[args.optimizer])
    if args.lr is not None:
        setup = replace(setup, lr=args.lr)
    if args.warmup is not None:
        setup = replace(setup, warmup=args.warmup)
    if args.rate_mbit is not None:
        rates = tuple(float(r) for r in args.rate_mbit.split(","))
        setup = replace(setup, rates_mbit=rates)
    configs = [BY_KEY[k] for k in args.configs.split(",")] if args.configs else list(CONFIGS)
    if configs[0].key != "ddp":
        configs = [BY_KEY["ddp"], *(c for c in configs if c.key != "ddp")]
    ok, why = (False, "--no-emulation") if args.no_emulation else available()
    network = (
        "sites emulated in network namespaces (cpn/emulated_wan.py)"
        if ok
        else f"loopback, counted bytes only ({why})"
    )
    report = Report(
        setup={
            **asdict(setup),
            "network": network,
            "emulated": ok,
            # The machine may be shared: its load says how much the times can be trusted.
            "load_average": [round(os.getloadavg()[0], 1)],
        }
    )
    tmp = Path(tempfile.mkdtemp(prefix="cpn-wan-sync-"))
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )
    with progress, EmulatedWan(len(SITES), None) if ok else nullcontext() as wan:

        def one(config: SyncConfig, label: str, steps: int, warmup: int) -> Run:
            task = progress.add_task(f"{label}: {config.name}", total=steps)
            run = launch(
                config,
                setup,
                steps,
                warmup,
                wan,
                tmp / f"{len(progress.tasks):02d}-{config.key}",
                on_step=lambda n: progress.update(task, completed=n),
            )
            progress.update(task, completed=steps)
            return run

        ddp_row: SyncRow | None = None
        for config in configs:
            run = one(config, "bytes+loss", setup.steps, setup.warmup)
            report.setup["parameters"] = run.ranks[0]["parameters"]
            row = sync_row(config, run, setup.warmup, ddp_row)
            ddp_row = ddp_row or row
            report.sync.append(row)
        if args.no_timing:
            report.timing_skipped = "--no-timing"
        elif wan is None:
            report.timing_skipped = (
                f"needs emulated sites (root, ip, tc with tbf): {why}; "
                "the byte counts are from the counters only"
            )
        else:
            wanted = args.timed.split(",") if args.timed else QUICK_TIMED if args.quick else TIMED
            timed = [c for c in configs if c.key in wanted]
            steps = setup.timing_skip + setup.timing_steps
            median: dict[tuple[float | None, str], float] = {}
            for rate in (None, *setup.rates_mbit):
                wan.set_uplink(rate)
                label = f"{rate:g} Mbit/s" if rate else "no limit"
                for config in timed:
                    # Top-k at its target density from the first step: timing, not loss.
                    run = one(config, label, steps, 0)
                    median[rate, config.key] = median_step(run, setup.timing_skip)
            wan.set_uplink(None)
            for rate in setup.rates_mbit:
                for config in timed:
                    limited = median[rate, config.key]
                    report.timing.append(
                        TimingRow(
                            key=config.key,
                            name=config.name,
                            rate_mbit=rate,
                            limited_step_s=limited,
                            unlimited_step_s=median[None, config.key],
                            ddp_over_this=median[rate, "ddp"] / limited,
                            limited_over_unlimited=limited / median[None, config.key],
                        )
                    )
    shutil.rmtree(tmp)  # kept when a rank failed: its log is there
    if args.no_selection:
        report.selection_skipped = "--no-selection"
    else:
        with err.status("(d) top-k selection vs torch.topk"):
            report.selection, report.selection_skipped = selection(setup)
    report.setup["load_average"].append(round(os.getloadavg()[0], 1))
    judge(report)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    ap.add_argument("--save-json", type=Path, help="also write the JSON object to this file")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--steps", type=int, help="training steps for (a) and (b)")
    ap.add_argument("--warmup", type=int, help="top-k density warm-up steps")
    ap.add_argument(
        "--optimizer",
        choices=sorted(LEARNING_RATES),
        help="sgd (default; momentum SGD, DGC's momentum correction under top-k) or adamw",
    )
    ap.add_argument("--lr", type=float, help="peak learning rate (default: by optimizer)")
    ap.add_argument("--no-timing", action="store_true", help="skip (c)")
    ap.add_argument(
        "--rate-mbit", help="uplink limits per site timed in (c), comma-separated (100,50)"
    )
    ap.add_argument("--configs", help=f"comma-separated subset of {','.join(BY_KEY)}")
    ap.add_argument(
        "--timed", help=f"configurations timed in (c), default {','.join(TIMED)} (ddp is needed)"
    )
    ap.add_argument("--no-emulation", action="store_true", help="loopback even as root")
    ap.add_argument("--no-selection", action="store_true", help="skip (d)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        # Leave without the interpreter's teardown: torch 2.x can deadlock there, DDP's
        # Reducer joining a gloo thread that waits for the GIL (seen once in ~20 runs,
        # after the rank had written its result).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    err = Console(stderr=True)
    try:
        report = run_bench(args, err)
    except RankFailed as exc:
        err.print(f"[red]error:[/] {exc}")
        raise SystemExit(1) from None
    if args.save_json is not None:
        args.save_json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    elif args.markdown:
        print_markdown(report)
    else:
        # Wide tables: keep them whole when the output is a file or a pipe.
        print_report(report, Console() if sys.stdout.isatty() else Console(width=200))


if __name__ == "__main__":
    main()
