"""Pipeline parallelism: one stage's work for a step, GPipe or 1F1B, over send/recv.

Each stage runs every micro-batch forward and backward; activations go to the next stage
and their gradients come back. Sends are non-blocking (waited at the end of the step) and
receives blocking, which is what keeps 1F1B free of deadlock: a stage never waits on a
send. With tensor parallelism each of the tp workers sends only its 1/tp slice of the
boundary tensor to its counterpart, and the receivers all-gather inside their node
(Megatron's scatter/gather), so the hop carries the tensor once, not tp times.

Both schedules run the backward passes in micro-batch order, so they accumulate the
parameter gradients in the same order and give identical results: GPipe runs every
forward first (activation memory for all m micro-batches), 1F1B at most pp − stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.distributed as dist

from cpn.comm import Member, Traffic
from cpn.comm.collectives import all_gather_flat, isend, recv, wait_all
from cpn.train.layout import Layout
from cpn.train.model import GPTStage


class Schedule(StrEnum):
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


@dataclass
class StepTimes:
    """Seconds of one step on this worker, by what it was doing."""

    compute: float = 0.0
    pipeline: float = 0.0  # sending, receiving and gathering boundary tensors
    dp_sync: float = 0.0


@dataclass
class PipelineStage:
    module: GPTStage
    layout: Layout
    tp_group: Member
    traffic: Traffic
    wire_dtype: torch.dtype
    device: torch.device
    schedule: Schedule = Schedule.ONE_F_ONE_B
    # Sends in flight and the buffers they read from (kept alive until they complete).
    _pending: list[tuple[dist.Work | None, torch.Tensor]] = field(default_factory=list)
    _peers: set[int] = field(default_factory=set)

    # -- boundary transfers -------------------------------------------------------------------
    def _send(self, x: torch.Tensor, peer: int, what: str, times: StepTimes) -> None:
        start = time.perf_counter()
        flat = x.detach().reshape(-1).to(self.wire_dtype)
        part = flat.chunk(self.tp_group.size)[self.tp_group.position].contiguous()
        work = isend(part, peer, self.traffic, self.layout.pipeline_class(peer), what=what)
        self._pending.append((work, part))
        self._peers.add(peer)
        times.pipeline += time.perf_counter() - start

    def _recv(self, shape: tuple[int, ...], peer: int, what: str, times: StepTimes) -> torch.Tensor:
        start = time.perf_counter()
        numel = 1
        for d in shape:
            numel *= d
        part = recv(
            (numel // self.tp_group.size,),
            self.wire_dtype,
            self.device,
            peer,
            self.traffic,
            what=what,
        )
        whole = all_gather_flat(
            part, self.tp_group, self.traffic, "intra_node", what=f"{what} (tensor-parallel gather)"
        )
        out = whole.view(shape).to(torch.float32)
        times.pipeline += time.perf_counter() - start
        return out

    def _wait_sends(self, times: StepTimes) -> None:
        start = time.perf_counter()
        ranks = sorted({dist.get_rank(), *self._peers})
        wait_all([work for work, _ in self._pending], self.traffic, ranks)
        self._pending.clear()
        self._peers.clear()
        times.pipeline += time.perf_counter() - start

    # -- one step ----------------------------------------------------------------------------
    def run(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], times: StepTimes
    ) -> float | None:
        """Forward and backward every micro-batch; returns the mean loss on the last stage.

        Gradients accumulate in the parameters' `.grad`, each micro-batch's loss scaled by
        1/m so the result is the gradient of the mean loss.
        """
        m = len(batches)
        mod = self.module
        b, s = batches[0][0].shape
        shape = (b, s, mod.cfg.hidden)
        inputs: list[torch.Tensor | None] = [None] * m
        outputs: list[torch.Tensor | None] = [None] * m
        losses: list[float] = []

        def forward(i: int) -> None:
            tokens, targets = batches[i]
            if mod.first:
                x = tokens
            else:
                assert self.layout.prev_rank is not None
                x = self._recv(
                    shape, self.layout.prev_rank, "pipeline receive of activations", times
                ).requires_grad_()
            start = time.perf_counter()
            out = mod(x, targets if mod.last else None)
            times.compute += time.perf_counter() - start
            inputs[i], outputs[i] = (None if mod.first else x), out
            if mod.last:
                losses.append(float(out.detach()))
            else:
                assert self.layout.next_rank is not None
                self._send(out, self.layout.next_rank, "pipeline send of activations", times)

        def backward(i: int) -> None:
            out = outputs[i]
            assert out is not None
            if mod.last:
                grad = None
                scaled = out / m
            else:
                assert self.layout.next_rank is not None
                grad = self._recv(
                    shape, self.layout.next_rank, "pipeline receive of gradients", times
                )
                scaled = out
            start = time.perf_counter()
            torch.autograd.backward(scaled, grad)
            times.compute += time.perf_counter() - start
            x = inputs[i]
            if x is not None:
                assert self.layout.prev_rank is not None and x.grad is not None
                self._send(x.grad, self.layout.prev_rank, "pipeline send of gradients", times)
            inputs[i] = outputs[i] = None  # free the activations

        if self.schedule is Schedule.GPIPE:
            for i in range(m):
                forward(i)
            for i in range(m):
                backward(i)
        else:
            warmup = min(self.layout.plan.parallel.pp - mod.stage - 1, m)
            for i in range(warmup):
                forward(i)
            for i in range(warmup, m):
                forward(i)
                backward(i - warmup)
            for i in range(m - warmup, m):
                backward(i)
        self._wait_sends(times)
        return sum(losses) / m if mod.last else None
