"""Prometheus metrics of the service (prometheus-client), served at GET /metrics.

Counters and histograms are updated where things happen (submission, admission); the
gauges that describe the registry (jobs by state, agents alive, WAN) are read from the
database when Prometheus scrapes, so they are never stale and cost nothing in between.
Each `ServiceMetrics` has its own `CollectorRegistry`, so that several control planes in
one process (tests) do not share series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from cpn.registry import Registry
from cpn.registry.models import Agent, Job, JobState, JobStep, WanLink, utcnow

#: Seconds from submission to SCHEDULED: from an idle cluster's few milliseconds to a
#: queue's hours.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)


class _RegistryCollector(Collector):
    def __init__(self, registry: Registry, heartbeats: Callable[[], int]) -> None:
        self.registry = registry
        self.heartbeats = heartbeats

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("cpn_jobs", "Jobs by state", labels=["state"])
        alive = GaugeMetricFamily("cpn_agents_alive", "Agents whose lease is live")
        link_bw = GaugeMetricFamily(
            "cpn_wan_link_bandwidth_gbps",
            "WAN bandwidth as the agents measured it",
            labels=["site", "peer"],
        )
        wan = CounterMetricFamily(
            "cpn_wan_bytes",
            "WAN bytes sent by jobs' workers, by link: each step's measured WAN bytes split "
            "over the links in proportion to the plan's per-link prediction",
            labels=["link"],
        )
        beats = CounterMetricFamily("cpn_heartbeats", "Agent heartbeats received")
        beats.add_metric([], self.heartbeats())
        with self.registry.read() as session:
            counts = {
                state: int(n)
                for state, n in session.execute(select(Job.state, func.count()).group_by(Job.state))
            }
            for state in JobState:
                jobs.add_metric([state.value], counts.get(state, 0))
            now = utcnow()
            agents = session.scalars(select(Agent)).all()
            alive.add_metric([], sum(1 for a in agents if a.alive_at(now)))
            for link in session.scalars(select(WanLink)):
                link_bw.add_metric([link.site.name, link.peer_site.name], link.bandwidth_gbps)
            per_link: dict[str, float] = {}
            sums = (
                select(JobStep.job_id, func.sum(JobStep.bytes_wan).label("sent"))
                .group_by(JobStep.job_id)
                .subquery()
            )
            measured = session.execute(
                select(Job.plan, sums.c.sent)
                .join(sums, sums.c.job_id == Job.id)
                .where(Job.plan.is_not(None))
            )
            for plan, sent in list(measured):
                links = (plan or {}).get("bytes_per_iteration", {}).get("wan_links", {})
                total = sum(links.values())
                for key, b in links.items():
                    if total:
                        per_link[key] = per_link.get(key, 0.0) + float(sent or 0) * b / total
        for key, value in sorted(per_link.items()):
            wan.add_metric([key], value)
        yield from (jobs, alive, beats, wan, link_bw)


class ServiceMetrics:
    def __init__(self, registry: Registry, heartbeats: Callable[[], int] = lambda: 0) -> None:
        self.prometheus = CollectorRegistry()
        self.submitted = Counter("cpn_jobs_submitted", "Jobs accepted", registry=self.prometheus)
        self.refused = Counter(
            "cpn_jobs_refused", "Submissions refused", ["reason"], registry=self.prometheus
        )
        self.scheduling_latency = Histogram(
            "cpn_scheduling_latency_seconds",
            "Seconds from submission to SCHEDULED",
            buckets=LATENCY_BUCKETS,
            registry=self.prometheus,
        )
        self.admission_seconds = Histogram(
            "cpn_admission_seconds",
            "Seconds one admission attempt took (planning included)",
            registry=self.prometheus,
        )
        self.prometheus.register(_RegistryCollector(registry, heartbeats))
