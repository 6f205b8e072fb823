"""`wan: auto` as a schedule (`cpn.wan_schedule`): the rung follows the bandwidth
monotonically, the warm-up fits the whole run's budget, the rung moves with hysteresis,
the outer optimizer follows the number of outer steps, and the plan contract checks the
schedule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cpn.contracts import JobSpec
from cpn.contracts.job import CompressionSpec, WanCompression
from cpn.contracts.plan import WanAutoChoice, WanPhase
from cpn.wan_schedule import (
    HYSTERESIS,
    LADDER,
    MAX_WARMUP_SHARE,
    NESTEROV_MIN_OUTER_STEPS,
    WARMUP_RUNG,
    Budget,
    Link,
    outer_optimizer,
    plan_phases,
    rung_of,
    rung_spec,
    schedule_problem,
)


def _job(steps: int = 1000) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "auto",
            "model": {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 1024, "vocab": 1000},
            "train": {"global_batch": 1024, "micro_batch": 8, "dtype": "bf16", "steps": steps},
            "parallel": {"dp": 2, "tp": 1, "pp": 1},
            "compression": {"wan": "auto"},
        }
    )


def _budget(steps: int = 1000, compute_s: float = 0.5, target: float = 0.1) -> Budget:
    job = _job(steps)
    return Budget(job, job.fixed_parallel, 2, compute_s, target)


gbps = st.floats(min_value=1e-4, max_value=400, allow_nan=False)
latency = st.floats(min_value=0, max_value=200, allow_nan=False)


@given(a=gbps, b=gbps, ms=latency)
def test_the_rung_grows_as_the_bandwidth_falls(a: float, b: float, ms: float) -> None:
    budget = _budget()
    wide, narrow = max(a, b), min(a, b)
    assert budget.rung(Link(wide, ms)) <= budget.rung(Link(narrow, ms))


@settings(max_examples=60, deadline=None)
@given(g=gbps, ms=latency, steps=st.integers(1, 200_000), target=st.floats(0.01, 1))
def test_the_warm_up_fits_the_whole_runs_budget(
    g: float, ms: float, steps: int, target: float
) -> None:
    budget = _budget(steps, target=target)
    link = Link(g, ms)
    phases = plan_phases(budget, link, steps)
    last = phases[-1]
    assert phases[0].start == 0 and last.rung == budget.rung(link)
    warm = last.start
    assert warm <= steps * MAX_WARMUP_SHARE
    if warm:
        assert [p.rung for p in phases] == [WARMUP_RUNG, last.rung]
        spent = warm * budget.wan_seconds(LADDER[WARMUP_RUNG], link) + (
            steps - warm
        ) * budget.wan_seconds(LADDER[last.rung], link)
        assert spent <= target * budget.compute_s * steps * (1 + 1e-9)
    else:
        assert len(phases) == 1


def test_the_warm_up_is_what_the_budget_spares() -> None:
    budget = _budget(100_000)
    # A link that just needs outer steps affords a warm-up; a very narrow one none.
    assert plan_phases(budget, Link(1, 10), 100_000)[-1].start > 1000
    assert plan_phases(budget, Link(0.0001, 10), 100_000)[-1].start == 0
    # A precise rung needs no warm-up.
    assert plan_phases(budget, Link(100, 1), 100_000) == plan_phases(budget, Link(100, 1), 10)[:1]


@given(current=st.integers(0, len(LADDER) - 1), g=gbps, ms=latency)
def test_moves_with_hysteresis(current: int, g: float, ms: float) -> None:
    budget = _budget()
    link = Link(g, ms)
    nxt = budget.next_rung(current, link)
    # Never less aggressive than the link needs; a move settles (no flapping on the
    # same figure); back towards precision only with room to spare.
    assert nxt >= budget.rung(link)
    assert budget.next_rung(nxt, link) == nxt
    if nxt < current:
        assert budget.rung(Link(g / HYSTERESIS, ms)) == nxt


def test_a_small_recovery_does_not_move_back() -> None:
    budget = _budget()
    # Without latency a rung's share is ∝ 1 / bandwidth: rung 2 (outer H=8) just fits at
    # `edge`. A link a little above it wants rung 2, but a run on rung 3 goes back only
    # when rung 2 would fit at half the bandwidth.
    edge = budget.share(LADDER[2], Link(1, 0)) / budget.target
    assert budget.rung(Link(edge * 1.05, 0)) == 2
    assert budget.rung(Link(edge * 0.95, 0)) == 3
    assert budget.next_rung(3, Link(edge * 1.05, 0)) == 3
    assert budget.next_rung(3, Link(edge * HYSTERESIS * 1.05, 0)) == 2
    assert budget.next_rung(2, Link(edge * 0.95, 0)) == 3  # more aggressive at once


def test_the_outer_optimizer_follows_the_number_of_outer_steps() -> None:
    assert outer_optimizer(3) == (1.0, 0.0)  # averaging: +0.5 % where Nesterov was +2.2–3.1 %
    assert outer_optimizer(NESTEROV_MIN_OUTER_STEPS - 1) == (1.0, 0.0)
    assert outer_optimizer(NESTEROV_MIN_OUTER_STEPS) == (0.7, 0.9)
    few = rung_spec(4, 512)  # H = 128: 4 outer steps
    many = rung_spec(4, 128 * NESTEROV_MIN_OUTER_STEPS)
    assert (few.outer_lr, few.outer_momentum) == (1.0, 0.0)
    assert (many.outer_lr, many.outer_momentum) == (0.7, 0.9)
    assert rung_of(few) == rung_of(many) == 4
    assert rung_spec(1, 512) == LADDER[1]  # per-step rungs have no outer optimizer


def _choice(phases: list[WanPhase]) -> WanAutoChoice:
    return WanAutoChoice(compression=phases[-1].compression, summary="s", reason="r", phases=phases)


def test_the_plan_contract_checks_the_schedule() -> None:
    fp16, outer = LADDER[1], rung_spec(4, 100)
    ok = _choice(
        [WanPhase(start=0, rung=1, compression=fp16), WanPhase(start=5, rung=4, compression=outer)]
    )
    assert ok.phase_at(4).compression == fp16 and ok.phase_at(5).compression == outer
    with pytest.raises(ValidationError, match="the first starts at step 0"):
        _choice([WanPhase(start=3, rung=1, compression=fp16)])
    with pytest.raises(ValidationError, match="start steps must increase"):
        _choice(
            [
                WanPhase(start=0, rung=1, compression=fp16),
                WanPhase(start=0, rung=4, compression=outer),
            ]
        )
    with pytest.raises(ValidationError, match="says wan: auto"):
        _choice([WanPhase(start=0, rung=1, compression=CompressionSpec(wan=WanCompression.AUTO))])
    with pytest.raises(ValidationError, match="the last phase must run"):
        WanAutoChoice(
            compression=fp16,
            summary="s",
            reason="r",
            phases=[WanPhase(start=0, rung=4, compression=outer)],
        )
    # A choice recorded before schedules existed is one phase from step 0.
    old = WanAutoChoice(compression=outer, summary="s", reason="r")
    assert old.schedule() == [WanPhase(start=0, rung=0, compression=outer)]


@settings(max_examples=200)
@given(
    phases=st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 100), st.integers(0, len(LADDER) - 1)),
        min_size=1,
        max_size=5,
    )
)
def test_a_hand_edited_schedule_runs_as_written_or_is_one_line(
    phases: list[tuple[int, int, int]],
) -> None:
    # (start offset, rung said, rung run): whatever a hand edits, the launch either
    # refuses it in one line naming the phase or gets a schedule the runtime can follow.
    built, start = [], 0
    for i, (gap, said, ran) in enumerate(phases):
        start = 0 if i == 0 else start + 1 + gap
        built.append(WanPhase(start=start, rung=said, compression=rung_spec(ran, 100)))
    problem = schedule_problem(built)
    followable = all(p.rung == rung_of(p.compression) for p in built) and all(
        b.compression.wan is not WanCompression.OUTER
        or (p.start - b.start) % b.compression.outer_every == 0
        for b, p in itertools.pairwise(built)
    )
    assert (problem is None) == followable
    if problem is not None:
        assert problem.startswith("wan_auto.phases: the phase from step ") and "\n" not in problem


def test_the_launch_refuses_a_schedule_the_runtime_cannot_follow() -> None:
    fp16, int8 = LADDER[1], rung_spec(3, 100)
    ok = [WanPhase(start=0, rung=1, compression=fp16), WanPhase(start=5, rung=3, compression=int8)]
    assert schedule_problem(ok) is None
    lying = [WanPhase(start=0, rung=4, compression=fp16), ok[1]]
    assert schedule_problem(lying) == (
        "wan_auto.phases: the phase from step 0 says rung 4 but runs fp16 (rung 1)"
    )
    off = [WanPhase(start=0, rung=99, compression=fp16), ok[1]]
    assert schedule_problem(off) == (
        "wan_auto.phases: the phase from step 0 has rung 99; the ladder has 0..5"
    )
    odd = [WanPhase(start=0, rung=1, compression=CompressionSpec(wan=WanCompression.INT8)), ok[1]]
    assert schedule_problem(odd) == (
        "wan_auto.phases: the phase from step 0 runs int8, which is no rung of the ladder"
    )
    between = [
        WanPhase(start=0, rung=3, compression=int8),
        WanPhase(start=5, rung=1, compression=fp16),
    ]
    assert schedule_problem(between) == (
        "wan_auto.phases: the phase from step 5 starts between outer steps of the phase "
        "before (H=32 from step 0)"
    )
    assert schedule_problem([*between[:1], between[1].model_copy(update={"start": 64})]) is None
