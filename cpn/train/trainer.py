"""The training loop of one worker of a 3D-parallel plan.

    worker r of a plan: choose the device, join the process group as plan rank r, build
    the process groups (all workers, same order), build this worker's stage of the model,
    shard it for tensor parallelism and move it to the device; then per step: pipeline
    forward/backward of the replica's micro-batches, data-parallel gradient sync with the
    stage's slice of every other replica, AdamW step (skipped, as AMP skips it, when the
    synced gradient is not finite).

Workers are started by `cpn.train.launcher` (torch's elastic agent): `cpn train` runs all
of a plan's workers on this machine, a site agent those on its node. One device per worker:
`cuda:LOCAL_RANK` among the GPUs the launcher made visible, else the CPU; the model, the
batches and every buffer the collectives use live on it, NCCL on a GPU, gloo on the CPU.
Every tensor that crosses between workers goes through `cpn.comm` and is counted in the
worker's one `Traffic`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from cpn.comm import CommError, Traffic, new_groups
from cpn.comm.flag import StepMax
from cpn.contracts.job import Dtype, JobSpec, ParallelSpec, WanCompression, layout_problem
from cpn.contracts.plan import Plan
from cpn.errors import InputError
from cpn.train.checkpoint import CheckpointInfo, CheckpointStore, check_resumable, step_at
from cpn.train.checkpoint_request import CheckpointRequest
from cpn.train.data import BatchSource
from cpn.train.data_parallel import DP_SYNCS, DataParallelSync, DpSync
from cpn.train.layout import Layout
from cpn.train.model import GPTConfig, GPTStage
from cpn.train.parallelize import TensorParallel, parallelize, shard_layouts
from cpn.train.pipeline import PipelineStage, Schedule, StepTimes
from cpn.train.snapshot import WorkerSnapshot
from cpn.train.wan_auto import WanAutoRun
from cpn.wan_schedule import schedule_problem

log = logging.getLogger("cpn.train")

WIRE_DTYPES = {Dtype.FP32: torch.float32, Dtype.BF16: torch.bfloat16, Dtype.FP16: torch.float16}


@dataclass
class TrainOptions:
    schedule: Schedule = Schedule.ONE_F_ONE_B
    #: "hierarchical": cpn.comm's site-aware sync with the job's WAN compression;
    #: "flat": one ring over all replicas (the DDP baseline).
    dp_sync: DpSync = "hierarchical"
    checkpoint_store: str | None = None  # a directory or an fsspec URL
    checkpoint_every: int = 0  # steps; 0: only at the end when a store is given
    async_checkpoint: bool = True  # write in the background while training goes on
    resume: bool = False
    #: One complete checkpoint step to resume from (`STORE/step-NNNNNNNN`), possibly of
    #: another store than `checkpoint_store` (a site agent's order: an earlier epoch's).
    resume_from: str | None = None
    stop_after: int | None = None  # run up to this step (exclusive) instead of train.steps
    metrics_path: Path | None = None  # JSON lines per step; "-" for standard output
    timeout_s: float = 300.0  # how long a collective waits for a peer
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None: cuda:LOCAL_RANK if any, else cpu
    #: A file whose newer mtime asks for a checkpoint soon (the site's warning before a
    #: time limit or a preemption: cpn.train.checkpoint_request); None: no such requests.
    checkpoint_request: Path | None = None
    #: `wan: auto` — the file the site agent writes its newest WAN measurements to
    #: (`cpn.train.wan_auto`); None: the run follows the plan's schedule as planned.
    wan_links: Path | None = None


def check_launch(
    plan: Plan,
    job: JobSpec,
    world_size: int,
    rank: int,
    opts: TrainOptions,
    *,
    checksums: bool = True,
) -> int | None:
    """Everything that can be wrong with a launch, before any process group exists; the
    step a resumed run starts from (None when it does not resume).
    `checksums=False` skips reading the checkpoint's files against their CRC-32s: for
    the workers of a launcher that has just done so (it is the costly part)."""
    par = plan.parallel
    problem = plan.problem_with(job)
    if problem:
        raise InputError(f"plan: {problem}")
    if isinstance(job.parallel, ParallelSpec) and job.parallel != par:
        p = job.parallel
        raise InputError(
            f"plan: layout dp={par.dp} tp={par.tp} pp={par.pp} differs from the job's "
            f"dp={p.dp} tp={p.tp} pp={p.pp}"
        )
    problem = layout_problem(job.model, job.train, par) or plan.derived_problem(job)
    if not problem and job.compression.wan is WanCompression.AUTO and plan.wan_auto:
        problem = schedule_problem(plan.wan_auto.phases)
    if problem:
        raise InputError(f"plan: {problem}")
    if world_size != par.world_size:
        raise InputError(
            f"WORLD_SIZE: {world_size}, but the plan has dp×tp×pp = {par.world_size} workers"
        )
    if not 0 <= rank < world_size:
        raise InputError(f"--rank: {rank} is not in 0..{world_size - 1}")
    if opts.dp_sync not in DP_SYNCS:
        raise InputError(f"--dp-sync: {opts.dp_sync!r} is not one of {', '.join(DP_SYNCS)}")
    choose_device(opts.device, 0)
    # Built here even when not resuming: a store whose filesystem is not installed (s3://
    # without s3fs) is one line now, not a worker failing at its first checkpoint.
    store = None if opts.checkpoint_store is None else CheckpointStore(opts.checkpoint_store)
    if opts.resume_from:
        if opts.resume:
            raise InputError("--resume-from: not with --resume (which resumes from the newest)")
        at, step = step_at(opts.resume_from)
        return check_resumable(at, job, step, checksums=checksums)
    if not opts.resume:
        return None
    if store is None:
        raise InputError("--resume: needs --checkpoint-store")
    return check_resumable(store, job, checksums=checksums)


def nothing_to_train(job: JobSpec, opts: TrainOptions, resume_step: int | None) -> str | None:
    """What to tell the user when the checkpoint a run resumes from is already at (or past)
    the step it would stop at — the run has nothing to do and ends with status 0, since
    the training it was asked for is done — else None."""
    if resume_step is None:
        return None
    total = job.train.steps
    end = total if opts.stop_after is None else min(total, opts.stop_after)
    if resume_step < end:
        return None
    if opts.resume_from:  # the step's own directory, named by the caller
        where = f"checkpoint {opts.resume_from.rstrip('/')}"
    else:
        where = f"checkpoint step {resume_step} in {opts.checkpoint_store}"
    if end < total:
        return (
            f"nothing to train: already trained to step {resume_step} of {total}, "
            f"--stop-after is {opts.stop_after} ({where})"
        )
    return f"nothing to train: already trained to step {resume_step} of {total} ({where})"


def choose_device(requested: str | None, local_rank: int, local_world: int = 1) -> torch.device:
    """The one device a worker uses: as asked, else its GPU if it has one, else the CPU.

    `local_world` is how many workers share this node (torch's LOCAL_WORLD_SIZE): NCCL
    needs a GPU of its own for each, so a node with fewer visible GPUs than workers is
    refused in one line here rather than by NCCL's "duplicate GPU" at the first
    collective. The site agent makes exactly the plan's GPUs visible, one per worker; a
    hand-run `cpn train` on a smaller machine meets this and can pass `--device cpu`.
    """
    if requested is not None:
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise InputError(
                f"--device: {requested!r} is not a device (cpu, cuda, cuda:N)"
            ) from None
        if device.type not in ("cpu", "cuda"):
            raise InputError(f"--device: {requested!r}: only cpu and cuda are supported")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"--device: {requested!r}, but no GPU is visible to this worker")
        if device.type == "cuda" and device.index is None:
            return _gpu_of(local_rank, local_world, f"--device {requested}")
        return device
    if torch.cuda.is_available():
        return _gpu_of(local_rank, local_world, "a worker's default device")
    return torch.device("cpu")


def _gpu_of(local_rank: int, local_world: int, what: str) -> torch.device:
    visible = torch.cuda.device_count()
    local_world = max(local_world, local_rank + 1)  # LOCAL_WORLD_SIZE unset: at least this
    if local_world > visible:
        raise InputError(
            f"{what}: {local_world} workers on this node but {visible} GPU(s) visible; "
            "NCCL needs one GPU per worker (give the node more GPUs, fewer workers, "
            "or --device cpu)"
        )
    return torch.device("cuda", local_rank)


def learning_rate(base: float, step: int, total: int) -> float:
    """Linear warm-up over the first 5 % of steps, then cosine decay to 10 % of `base`."""
    warmup = max(1, total // 20)
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    def __init__(self, plan: Plan, job: JobSpec, rank: int, opts: TrainOptions) -> None:
        #: wan: auto with a schedule to follow (hierarchical sync only: flat is DDP's).
        self.auto_schedule = (
            job.compression.wan is WanCompression.AUTO
            and plan.wan_auto is not None
            and opts.dp_sync == "hierarchical"
        )
        if job.compression.wan is WanCompression.AUTO:
            # The scheduler chose the WAN sync from the measured links; the plan says which
            # (the steady rung here; `train` starts the schedule's phase of its first step).
            job = job.model_copy(update={"compression": plan.compression})
            if plan.wan_auto is not None and rank == 0:
                phases = ", ".join(
                    f"{p.compression.summary} from step {p.start}" for p in plan.wan_auto.schedule()
                )
                log.info("wan: auto chose %s: %s", phases, plan.wan_auto.reason)
        self.plan, self.job, self.rank, self.opts = plan, job, rank, opts
        self.layout = Layout(plan, rank)
        self.traffic = Traffic()
        self.wire_dtype = WIRE_DTYPES[job.train.dtype]
        self.device = choose_device(
            opts.device,
            int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )
        self.store = CheckpointStore(opts.checkpoint_store) if opts.checkpoint_store else None
        self._saving: Future[Any] | None = None
        self._saving_step = 0
        self._checkpoint_group: dist.ProcessGroup | None = None

    # -- set-up ----------------------------------------------------------------------------
    def start(self) -> None:
        """Join the process group as this worker's plan rank and build everything."""
        if not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            try:
                dist.init_process_group(
                    "nccl" if self.device.type == "cuda" else "gloo",
                    rank=self.rank,
                    world_size=self.layout.world,
                    timeout=timedelta(seconds=self.opts.timeout_s),
                )
            except dist.DistError as exc:  # peers that never join, a store that is gone
                cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CommError(
                    "joining the process group", range(self.layout.world), 0, cause
                ) from None
        self._build()

    def _build(self) -> None:
        layout, job, timeout = self.layout, self.job, timedelta(seconds=self.opts.timeout_s)
        # Collective, in the same order on every worker: tensor-parallel groups, then the
        # data-parallel sync's groups, then (when checkpoints are written in the
        # background) a gloo group of their own, so that they never interleave with
        # training collectives.
        tp_group = new_groups(layout.tp_groups, timeout=timeout)
        self.sync = DataParallelSync(
            layout, job, self.traffic, self.wire_dtype, timeout, mode=self.opts.dp_sync
        )
        if self.store is not None and self.opts.async_checkpoint:
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
        cfg = GPTConfig.of(job.model)
        # Built on the CPU from seeded generators (the same weights on any device), then
        # sliced for tensor parallelism and moved to the worker's device.
        stage = GPTStage(cfg, layout.me.stage, self.plan.parallel.pp, seed=job.train.seed)
        tp = TensorParallel(tp_group, self.traffic, self.wire_dtype)
        self.module = parallelize(stage, tp).to(self.device)
        self.sync.attach(list(self.module.parameters()))
        self.pipeline = PipelineStage(
            self.module, layout, tp_group, self.traffic, self.wire_dtype, self.device,
            self.opts.schedule,
        )  # fmt: skip
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=job.train.lr,
            betas=(0.9, 0.95),
            foreach=False,  # elementwise, so a shard updates exactly like the whole tensor
        )
        self.snapshot = WorkerSnapshot(
            self.module,
            self.optimizer,
            self.sync,
            layout,
            shard_layouts(self.module, self.plan.parallel.tp, layout.me.tp_index),
            self.device,
        )
        self.data = BatchSource(
            cfg.seq_len,
            cfg.vocab,
            job.train.global_batch,
            job.train.micro_batch,
            self.plan.parallel.dp,
            job.train.seed,
            self.device,
        )

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        self.start()
        try:
            return self.train(self.resume())
        finally:
            self.close()

    def close(self) -> None:
        """Finish a checkpoint still being written, then leave the process group."""
        try:
            self._finish_checkpoint()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def resume(self) -> int:
        """Load the last complete checkpoint if asked to; the step to start from."""
        if self.opts.resume_from:
            store, step = step_at(self.opts.resume_from)
        elif self.opts.resume and self.store is not None:
            # The files were checked against their CRC-32s before this worker started.
            store, step = self.store, check_resumable(self.store, self.job, checksums=False)
        else:
            return 0
        info = store.info(step)
        if info.files is None:
            log.warning(
                "checkpoint %s has no checksums (written before cpn recorded them): "
                "its files were checked for size only",
                store.step_path(step),
            )
        resumed = self.snapshot.load(store, step)
        p = info.parallel
        log.info(
            "resumed from step %d of %s (written by dp=%d tp=%d pp=%d)",
            resumed.step, store, p.dp, p.tp, p.pp,
        )  # fmt: skip
        if resumed.flushed_sites:
            log.warning(
                "error feedback of sites %s has no place in this layout: flushed with one "
                "dense step",
                ", ".join(resumed.flushed_sites),
            )
        if resumed.dropped_outer_sites:
            log.warning(
                "outer-step error feedback of sites %s dropped (not in this layout)",
                ", ".join(resumed.dropped_outer_sites),
            )
        if resumed.dropped_velocity_sites:
            log.warning(
                "DGC velocities of sites %s dropped (not in this layout)",
                ", ".join(resumed.dropped_velocity_sites),
            )
        return resumed.step

    def _checkpoint(self, step: int) -> None:
        # Imported here, not at the top: half a second of every worker's start-up, for
        # checkpoints only (see cpn.train.snapshot).
        from torch.distributed.checkpoint.state_dict_saver import async_save, save  # noqa: PLC0415

        store = self.store
        assert store is not None
        self._finish_checkpoint()  # one save in flight at a time
        group = self._checkpoint_group
        state = self.snapshot.state_dict(step, copy=group is not None)
        if group is not None:
            self._saving = async_save(state, storage_writer=store.writer(step), process_group=group)  # type: ignore[assignment]
            self._saving_step = step
        else:
            save(state, storage_writer=store.writer(step))
            self._mark_complete(step)

    def _finish_checkpoint(self) -> None:
        if self._saving is None:
            return
        saving, self._saving = self._saving, None
        saving.result()  # on rank 0 (the coordinator) this includes the metadata
        self._mark_complete(self._saving_step)

    def _mark_complete(self, step: int) -> None:
        if self.rank == 0 and self.store is not None:
            self.store.mark_complete(CheckpointInfo.of(step, self.job, self.plan))

    def train(self, start_step: int) -> list[dict[str, Any]]:
        job, me = self.job, self.layout.me
        total = job.train.steps
        end = min(total, self.opts.stop_after) if self.opts.stop_after is not None else total
        params = list(self.module.parameters())
        history: list[dict[str, Any]] = []
        every = self.opts.checkpoint_every
        #: A periodic checkpoint that fell between outer steps: written at the next one.
        #: Under `wan: auto` the outer steps start where the warm-up ends or the rung
        #: moved, so they need not fall on multiples of `every`.
        due = False
        asked = self._asked()
        auto = self._wan_auto(start_step)
        running = job.compression if auto is None else auto.current
        with self._metrics_sink() as sink:
            for step in range(start_step, end):
                self.traffic.step = step
                began = time.perf_counter()
                before = self.traffic.snapshot()
                times = StepTimes()
                for group in self.optimizer.param_groups:
                    group["lr"] = learning_rate(job.train.lr, step, total)
                batches = self.data.for_replica(step, me.replica)
                loss = self.pipeline.run(batches, times)
                sync_start = time.perf_counter()
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                skipped = self.sync.sync(grads)
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                times.dp_sync = time.perf_counter() - sync_start
                if skipped:
                    log.warning("step %d: the gradient is not finite; optimizer step skipped", step)
                else:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                done = step + 1
                outer_start = time.perf_counter()
                # wan: outer — every H steps (and once more at the end of training, so
                # that the run ends with one model) the sites exchange pseudo-gradients.
                outer = self.sync.after_step()
                if done == total:
                    outer = self.sync.finish() or outer
                times.dp_sync += time.perf_counter() - outer_start
                ran, switch, rung = running, None, 0
                if auto is not None:
                    rung = auto.rung
                    switch = auto.after_step(step, self.sync.at_outer_boundary)
                    if switch is not None:
                        self.sync.switch(job.model_copy(update={"compression": switch.after}))
                        running = switch.after
                        if self.rank == 0:
                            log.info(
                                "step %d: wan: auto moves from %s to %s (%s)",
                                done, switch.before.summary, switch.after.summary, switch.why,
                            )  # fmt: skip
                after = self.traffic.snapshot()
                record = {
                    "step": step,
                    "rank": self.rank,
                    "stage": me.stage,
                    "replica": me.replica,
                    "tp_index": me.tp_index,
                    "site": me.site,
                    "device": str(self.device),
                    "loss": loss,
                    "skipped": skipped,
                    "outer_step": outer,
                    "wan_sync": ran.summary,
                    "tokens": len(batches) * job.train.micro_batch * job.model.seq_len,
                    "seconds": {
                        "step": time.perf_counter() - began,
                        "compute": times.compute,
                        "pipeline": times.pipeline,
                        "dp_sync": times.dp_sync,
                    },
                    "bytes": {k: after[k] - before[k] for k in after},
                }
                if auto is not None:
                    record["wan_rung"] = rung
                    if switch is not None:  # from the next step on
                        record["wan_switch"] = switch.record()
                history.append(record)
                if sink is not None:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                wanted = asked is not None and asked.now()
                periodic = bool(every) and done % every == 0
                due = due or periodic
                if self.store is not None and (due or done == end or wanted):
                    if self.sync.at_outer_boundary:
                        due = False
                        self._checkpoint(done)
                        if wanted:  # the site's end is near: written before going on
                            assert asked is not None
                            log.warning("step %d: checkpoint asked for by the site", done)
                            self._finish_checkpoint()
                            asked.done()
                    elif periodic or done == end:
                        # Between outer steps the sites hold different parameters: only
                        # an outer step's result is one model to save.
                        log.warning(
                            "step %d: no checkpoint between outer steps (written at the "
                            "next outer step)",
                            done,
                        )
                if self._saving is not None and self._saving.done():
                    self._finish_checkpoint()  # COMPLETE once written, not at the next save
        if asked is not None:
            asked.close()
        if auto is not None:
            auto.close()
        return history

    def _wan_auto(self, start_step: int) -> WanAutoRun | None:
        """wan: auto — the schedule, its phase of `start_step` in place (collective: the
        flag that agrees on the measured bandwidth, when the run follows a links file)."""
        if not self.auto_schedule:
            return None
        auto = WanAutoRun.of(
            self.plan, self.job, self.layout.me.site, self.opts.wan_links, self.device,
            self.traffic,
        )  # fmt: skip
        first = auto.start(start_step)
        if first != self.job.compression:
            self.sync.switch(self.job.model_copy(update={"compression": first}))
        return auto

    def _asked(self) -> _SiteAsks | None:
        path = self.opts.checkpoint_request
        if path is None or self.store is None:
            return None
        return _SiteAsks(CheckpointRequest(path), StepMax(self.device, self.traffic))

    @contextmanager
    def _metrics_sink(self) -> Iterator[IO[str] | None]:
        path = self.opts.metrics_path
        if path is None:
            yield None
        elif str(path) == "-":
            yield sys.stdout
        else:
            with path.open("a") as sink:
                yield sink


#: Requests this close together are one: a signal reaches a node's launcher and its
#: workers within milliseconds, and each of them touches the request file.
COALESCE_NS = 2_000_000_000


@dataclass
class _SiteAsks:
    """Whether the site asked for a checkpoint, agreed by every rank: the ranks exchange the
    time of the newest request each has seen; a request newer than the last one served
    (by more than COALESCE_NS) is wanted one step after a rank saw it — the exchange
    overlaps a step — and until a checkpoint is written (at the next outer step under
    `wan: outer`). Every rank reads the same agreed times, so all decide alike."""

    request: CheckpointRequest
    flag: StepMax
    served: int = 0
    pending: bool = False

    def now(self) -> bool:
        agreed = self.flag.exchange(self.request.newest())
        if agreed > self.served + COALESCE_NS:
            self.served, self.pending = agreed, True
        return self.pending

    def done(self) -> None:
        self.pending = False

    def close(self) -> None:
        self.flag.close()
