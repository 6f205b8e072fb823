"""`wan: auto` during the run: the plan's schedule, moved by the measured bandwidth.

The plan (`plan.wan_auto`) holds the schedule the scheduler made from the registry's
measured links — a dense fp16 warm-up, then a rung of `cpn.wan_schedule.LADDER` — and the
figures it rests on (sites, compute time per iteration, target share). The site agent
keeps measuring its WAN links during the run and writes the newest measurement per peer
site to a small JSON file in the launch's run directory (`wan-links.json`, format in
`cpn.train.links_file`); `cpn launch` passes its path to the workers (`--wan-links`).

Every step every rank reads its file (only when its mtime changed) and contributes the
narrowest bandwidth to the job's other sites, in kbit/s, to an asynchronous all-reduce of
the minimum (`cpn.comm.flag.StepMax` over negated values): the ranks agree, one step
later, on one figure without waiting for it. At a decision point — after a step that ends
at an outer boundary (every step for per-step syncs), once the planned warm-up is over —
every rank computes the next rung from that agreed figure with the same pure function the
scheduler uses (`Budget.next_rung`, with its hysteresis), so all ranks switch at the same
step. A switch is logged in one line (rank 0) and written into the step's metrics record
(`wan_switch`); every record names the rung that ran it (`wan_sync`, `wan_rung`).

Once the run is on outer steps it stays on them (the most precise it goes back to is the
first outer rung): under outer steps each site's AdamW moments are its own, and per-step
sync with unequal moments would let the replicas drift apart for good.

The latency of the link is the plan's (the agreed figure is the bandwidth only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cpn.comm.flag import StepMax
from cpn.comm.traffic import Traffic
from cpn.contracts.job import CompressionSpec, JobSpec, WanCompression
from cpn.contracts.plan import Plan
from cpn.train.links_file import LinksFileError, read_narrowest
from cpn.wan_schedule import LADDER, Budget, Link, rung_spec

log = logging.getLogger("cpn.train")

#: Sent by a rank that has no measurement: larger than any link, so it never is the minimum.
UNMEASURED_KBPS = 1 << 62
#: The first outer rung: where a run on outer steps stops going back towards precision.
FIRST_OUTER_RUNG = next(i for i, s in enumerate(LADDER) if s.wan is WanCompression.OUTER)


@dataclass
class _LinksFile:
    """The rank's measured-links file, read again only when it changed."""

    path: Path
    sites: set[str]
    _stamp: tuple[int, int, int] = (-1, -1, -1)
    _gbps: float | None = None
    #: The problem last reported: a bad file is logged once, not at every step or rewrite.
    _reported: str | None = None

    def gbps(self) -> float | None:
        try:
            st = self.path.stat()
        except OSError:
            return self._gbps  # keep the last reading while the agent replaces the file
        # The inode too: the agent replaces the file, and two writes may share an mtime.
        stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._gbps = read_narrowest(self.path, self.sites)
            except LinksFileError as exc:
                # Keep the last good reading: the run goes on as if nothing was measured.
                if str(exc) != self._reported:
                    log.warning("wan: auto: ignoring %s: %s", self.path, exc)
                    self._reported = str(exc)
            else:
                self._reported = None
        return self._gbps


@dataclass(frozen=True)
class Switch:
    step: int  # the last step the old rung ran
    before: CompressionSpec
    after: CompressionSpec
    rung: int
    gbps: float | None
    why: str

    def record(self) -> dict[str, Any]:
        return {
            "from": self.before.summary,
            "to": self.after.summary,
            "rung": self.rung,
            "gbps": self.gbps,
            "why": self.why,
        }


@dataclass
class WanAutoRun:
    """The schedule of one rank: `current` is the compression the next step runs."""

    plan: Plan
    job: JobSpec  # as submitted (wan: auto)
    links: _LinksFile | None
    flag: StepMax | None
    current: CompressionSpec = field(init=False)
    rung: int = field(init=False)
    agreed: float | None = None  # Gbit/s, the minimum over the ranks of the last exchange

    def __post_init__(self) -> None:
        choice = self.plan.wan_auto
        assert choice is not None
        self.choice = choice
        self.budget = Budget(
            self.job, self.plan.parallel, choice.sites, choice.compute_s, choice.target
        )
        self.latency_ms = choice.latency_ms or 0.0

    @classmethod
    def of(
        cls,
        plan: Plan,
        job: JobSpec,
        site: str,
        links_path: Path | None,
        device: torch.device,
        traffic: Traffic,
    ) -> WanAutoRun:
        """Call on every rank alike (the flag is one collective per step when the run
        follows a links file)."""
        links = None
        flag = None
        if links_path is not None:
            others = set(plan.sites_used()) - {site}
            links = _LinksFile(links_path, others)
            flag = StepMax(device, traffic)
        return cls(plan, job, links, flag)

    def start(self, step: int) -> CompressionSpec:
        """The compression of `step` as planned (the start of a run or a resumed one)."""
        phase = self.choice.phase_at(step)
        self.rung, self.current = phase.rung, phase.compression
        return self.current

    def after_step(self, step: int, at_boundary: bool) -> Switch | None:
        """Call after every step on every rank, in the same place; the switch to make
        before step `step + 1` (the same on every rank), or None."""
        if self.flag is not None and self.links is not None:
            gbps = self.links.gbps()
            kbps = UNMEASURED_KBPS if gbps is None else max(1, round(gbps * 1e6))
            agreed = -self.flag.exchange(-kbps)
            if 0 < agreed < UNMEASURED_KBPS:
                self.agreed = agreed / 1e6
        nxt = step + 1
        warmup_end = self.choice.schedule()[-1].start
        if nxt >= self.job.train.steps or not at_boundary:
            return None  # mid-way through an outer step, or the end
        rung, after, why = self.rung, self.current, ""
        planned = self.choice.phase_at(nxt)
        if planned.start == nxt and nxt > 0:  # every planned phase, not just the last
            rung, after = planned.rung, planned.compression
            why = "the end of the planned warm-up" if nxt == warmup_end else "as planned"
        if self.agreed is not None and nxt >= warmup_end:  # measurements after the plan
            link = Link(self.agreed, self.latency_ms)
            moved = self.budget.next_rung(rung, link)
            if self.current.wan is WanCompression.OUTER:
                moved = max(moved, FIRST_OUTER_RUNG)
            if moved != rung:
                rung, after = moved, rung_spec(moved, self.job.train.steps - nxt)
                share = self.budget.share(LADDER[rung], link)
                why = f"measured {self.agreed:g} Gbit/s: {share:.1%} of compute"
        self.rung = rung
        if after == self.current:
            return None
        switch = Switch(step, self.current, after, rung, self.agreed, why)
        self.current = after
        return switch

    def close(self) -> None:
        if self.flag is not None:
            self.flag.close()
