"""The training loop of one worker of a 3D-parallel plan.

    rank r of a plan: build the process groups (all workers, same order), build this
    worker's stage of the model and shard it for tensor parallelism, then per step:
    pipeline forward/backward of the replica's micro-batches, data-parallel gradient sync
    with the stage's slice of every other replica, AdamW step.

Launch one worker per rank (`cpn worker --plan plan.json --job job.yaml --rank R` with
MASTER_ADDR, MASTER_PORT and WORLD_SIZE set), or all of them on this machine with
`cpn train --plan plan.json --job job.yaml`. Gloo on CPU, NCCL where there is a GPU.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from cpn.contracts.job import Dtype, JobSpec, ParallelSpec, layout_problem
from cpn.contracts.plan import Plan
from cpn.errors import InputError
from cpn.train import checkpoint
from cpn.train.comms import ByteCounters
from cpn.train.data import BatchSource
from cpn.train.dp import FlatAllReduce, GradientSync
from cpn.train.layout import Layout, new_groups
from cpn.train.model import GPTConfig, GPTStage
from cpn.train.parallelize import TensorParallel, parallelize
from cpn.train.pipeline import PipelineStage, Schedule, StepTimes
from cpn.train.wan_sync import HierarchicalSync

WIRE_DTYPES = {Dtype.FP32: torch.float32, Dtype.BF16: torch.bfloat16, Dtype.FP16: torch.float16}

#: Called with each step's metrics (the agent forwards them to the control plane).
StepCallback = Callable[[dict[str, Any]], None]


@dataclass
class TrainOptions:
    schedule: Schedule = Schedule.ONE_F_ONE_B
    #: "hierarchical": cpn.comm's site-aware sync with the job's WAN compression;
    #: "flat": one ring over all replicas (the DDP baseline).
    dp_sync: str = "hierarchical"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # steps; 0: only at the end when a directory is given
    resume: bool = False
    stop_after: int | None = None  # run up to this step (exclusive) instead of train.steps
    metrics_path: Path | None = None  # JSON lines per step; "-" for standard output
    timeout_s: float = 300.0
    on_step: StepCallback | None = field(default=None, repr=False)


def check_launch(plan: Plan, job: JobSpec, world_size: int, rank: int, opts: TrainOptions) -> None:
    """Everything that can be wrong with a launch, before any process group exists."""
    par = plan.parallel
    if plan.job != job.name:
        raise InputError(f"plan: it is for job {plan.job!r}, the job file is {job.name!r}")
    if isinstance(job.parallel, ParallelSpec) and job.parallel != par:
        p = job.parallel
        raise InputError(
            f"plan: layout dp={par.dp} tp={par.tp} pp={par.pp} differs from the job's "
            f"dp={p.dp} tp={p.tp} pp={p.pp}"
        )
    problem = layout_problem(job.model, job.train, par)
    if problem:
        raise InputError(f"plan: {problem}")
    if world_size != par.world_size:
        raise InputError(
            f"WORLD_SIZE: {world_size}, but the plan has dp×tp×pp = {par.world_size} workers"
        )
    if not 0 <= rank < world_size:
        raise InputError(f"--rank: {rank} is not in 0..{world_size - 1}")
    if opts.dp_sync not in {"hierarchical", "flat"}:
        raise InputError(f"--dp-sync: {opts.dp_sync!r} is not one of hierarchical, flat")
    if opts.resume:
        if opts.checkpoint_dir is None:
            raise InputError("--resume: needs --checkpoint-dir")
        if checkpoint.latest_complete(opts.checkpoint_dir) is None:
            raise InputError(f"--resume: no complete checkpoint in {opts.checkpoint_dir}")


def learning_rate(base: float, step: int, total: int) -> float:
    """Linear warm-up over the first 5 % of steps, then cosine decay to 10 % of `base`."""
    warmup = max(1, total // 20)
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    def __init__(self, plan: Plan, job: JobSpec, rank: int, opts: TrainOptions) -> None:
        self.plan, self.job, self.rank, self.opts = plan, job, rank, opts
        self.layout = Layout(plan, rank)
        self.counters = ByteCounters()
        self.wire_dtype = WIRE_DTYPES[job.train.dtype]

    # -- set-up ----------------------------------------------------------------------------
    def _init_process_group(self) -> None:
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(
                backend,
                rank=self.rank,
                world_size=self.layout.world,
                timeout=timedelta(seconds=self.opts.timeout_s),
            )
        if torch.cuda.is_available():
            torch.cuda.set_device(self.layout.me.gpu % torch.cuda.device_count())

    def _build(self) -> None:
        layout, job = self.layout, self.job
        tp_group = new_groups(layout.tp_groups, self.rank)
        self.sync = self._gradient_sync()
        cfg = GPTConfig.of(job.model)
        stage = GPTStage(cfg, layout.me.stage, self.plan.parallel.pp, seed=job.train.seed)
        tp = TensorParallel(tp_group, self.counters, self.wire_dtype)
        self.module = parallelize(stage, tp)
        self.pipeline = PipelineStage(
            self.module, layout, tp_group, self.counters, self.wire_dtype, self.opts.schedule
        )
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=job.train.lr,
            betas=(0.9, 0.95),
            foreach=False,  # elementwise, so a shard updates exactly like the whole tensor
        )
        self.data = BatchSource(
            cfg.seq_len,
            cfg.vocab,
            job.train.global_batch,
            job.train.micro_batch,
            self.plan.parallel.dp,
            job.train.seed,
        )

    def _gradient_sync(self) -> GradientSync:
        layout = self.layout
        if self.opts.dp_sync == "flat" or self.plan.parallel.dp == 1:
            # With one replica there is nothing to sync: the flat sync is then a no-op.
            group = new_groups(layout.dp_groups, self.rank)
            return FlatAllReduce(group, layout, self.counters, self.wire_dtype)
        return HierarchicalSync(
            layout,
            self.job,
            self.counters,
            self.wire_dtype,
            timeout=timedelta(seconds=self.opts.timeout_s),
        )

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        self._init_process_group()
        try:
            self._build()
            start_step = self._resume()
            return self._train(start_step)
        finally:
            dist.destroy_process_group()

    def _resume(self) -> int:
        root = self.opts.checkpoint_dir
        if not self.opts.resume or root is None:
            return 0
        step = checkpoint.latest_complete(root)
        assert step is not None  # checked by check_launch
        state = checkpoint.load(root, step, self.rank)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["dp_sync"])
        torch.set_rng_state(state["rng"])
        return int(state["step"])

    def _checkpoint(self, step: int) -> None:
        root = self.opts.checkpoint_dir
        assert root is not None
        checkpoint.save(
            root,
            step,
            self.rank,
            {
                "step": step,
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "dp_sync": self.sync.state_dict(),
                "rng": torch.get_rng_state(),
                "worker": {
                    "rank": self.rank,
                    "stage": self.layout.me.stage,
                    "replica": self.layout.me.replica,
                    "tp_index": self.layout.me.tp_index,
                },
            },
        )
        dist.barrier()
        if self.rank == 0:
            checkpoint.mark_complete(root, step)

    def _train(self, start_step: int) -> list[dict[str, Any]]:
        job, me = self.job, self.layout.me
        total = job.train.steps
        end = min(total, self.opts.stop_after) if self.opts.stop_after is not None else total
        params = list(self.module.parameters())
        history: list[dict[str, Any]] = []
        sink: IO[str] | None = None
        if self.opts.metrics_path is not None:
            # "-" is standard output (JSON lines), for agents that read the worker's output.
            sink = (
                sys.stdout
                if str(self.opts.metrics_path) == "-"
                else self.opts.metrics_path.open("a")
            )
        every = self.opts.checkpoint_every
        try:
            for step in range(start_step, end):
                began = time.perf_counter()
                before = self.counters.snapshot()
                times = StepTimes()
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate(job.train.lr, step, total)
                batches = self.data.for_replica(step, me.replica)
                loss = self.pipeline.run(batches, times)
                sync_start = time.perf_counter()
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                self.sync.sync(grads)
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                times.dp_sync = time.perf_counter() - sync_start
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                after = self.counters.snapshot()
                record = {
                    "step": step,
                    "rank": self.rank,
                    "stage": me.stage,
                    "replica": me.replica,
                    "tp_index": me.tp_index,
                    "site": me.site,
                    "loss": loss,
                    "tokens": len(batches) * job.train.micro_batch * job.model.seq_len,
                    "seconds": {
                        "step": time.perf_counter() - began,
                        "compute": times.compute,
                        "pipeline": times.pipeline,
                        "dp_sync": times.dp_sync,
                    },
                    "bytes": {k: after[k] - before[k] for k in after},
                }
                history.append(record)
                if sink is not None:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                if self.opts.on_step is not None:
                    self.opts.on_step(record)
                done = step + 1
                if self.opts.checkpoint_dir is not None and (
                    (every and done % every == 0) or done == end
                ):
                    self._checkpoint(done)
        finally:
            if sink is not None and sink is not sys.stdout:
                sink.close()
        return history


def world_from_env() -> tuple[int, int | None]:
    """WORLD_SIZE (required) and RANK (optional) from the torch.distributed environment."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        if not os.environ.get(name):
            raise InputError(f"{name}: not set (the usual torch.distributed environment)")
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"]) if os.environ.get("RANK") else None
    except ValueError as exc:
        raise InputError(f"WORLD_SIZE/RANK: not an integer ({exc})") from None
    return world, rank
