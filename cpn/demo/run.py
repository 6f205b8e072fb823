"""Running the demo: processes up, one job over REST, a short DDP baseline, all torn down.

Everything the demo starts is a real process — `cpn serve`, one `cpn agent` per site (the
agents start the workers through the runtime's launcher), and `cpn train --dp-sync flat`
for the DDP baseline — and everything is undone on the way out, whatever the way out:
processes stopped (SIGTERM, then SIGKILL), network namespaces, veths, bridge and qdiscs
removed (`cpn.emulated_wan.EmulatedWan`), the temporary directory deleted unless kept.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import yaml

from api.job_schemas import JobPublic
from cpn import emulated_wan
from cpn.client import ApiError, CpnClient
from cpn.contracts import JobSpec, LinkSpec, Topology
from cpn.costmodel import Placement, Workload, evaluate
from cpn.demo.report import DemoReport, LinkRow, SiteRow
from cpn.errors import CpnError, InputError
from cpn.listen_ports import free_port
from cpn.network import SiteGraph
from cpn.train.report import read_metrics, summarise

#: Issue 12's share of 198.18.0.0/15 and its names: namespaces c12-…, interfaces c12….
PREFIX = "c12"
SUBNET = "198.18.12"
PROBE_PORT = 7000  # in each site's own namespace; loopback takes free ports instead


@dataclass(frozen=True)
class DemoSite:
    name: str
    gpus: int
    gpu_model: str
    memory_gb: float
    uplink_mbit: float  # enforced in namespaces, modelled on loopback
    token: str


SITES = (
    DemoSite("beijing", 2, "A100-80G", 80, 100.0, "demo-beijing-token"),
    DemoSite("shanghai", 1, "A10-24G", 24, 50.0, "demo-shanghai-token"),
    DemoSite("guiyang", 1, "T4-16G", 16, 20.0, "demo-guiyang-token"),
)
#: A virtual GPU's peak, set near what one CPU core does for this model so that the
#: predicted compute time is of the measured order (the GPUs are CPU workers here).
GPU_TFLOPS = 0.005


def demo_job(steps: int) -> dict[str, Any]:
    """A 0.13 M-parameter GPT, data-parallel over 4 workers, top-k at 0.1 % on the WAN:
    it needs every GPU of the three sites, so it is split across all of them."""
    return {
        "name": "demo-gpt",
        "model": {"layers": 2, "hidden": 64, "heads": 2, "seq_len": 32, "vocab": 256},
        "train": {"global_batch": 16, "micro_batch": 4, "dtype": "fp32", "steps": steps,
                  "lr": 0.003},
        "parallel": {"dp": 4, "tp": 1, "pp": 1},
        "compression": {"wan": "topk", "density": 0.001, "warmup_steps": 0},
    }  # fmt: skip


class DemoFailed(CpnError):
    """The demo could not complete; the message says what, and where the logs are."""

    exit_code = 1


class DemoUI(Protocol):
    """What the demo tells its user while it runs (the CLI draws it with rich)."""

    def status(self, message: str) -> None: ...

    def job(self, job: JobPublic, elapsed_s: float) -> None: ...


@dataclass
class DemoSettings:
    steps: int = 60
    ddp_steps: int = 3  # steps of the DDP baseline: its WAN bytes per step are constant
    keep: bool = False  # keep the working directory (database, every log)
    emulate: bool | None = None  # None: namespaces when possible, else loopback
    workdir: Path | None = None  # default: a new temporary directory
    timeout_s: float = 600.0  # for the job and for the baseline, each


def emulation_available() -> tuple[bool, str]:
    return emulated_wan.available(PREFIX)


def leftovers() -> list[str]:
    """Namespaces and root-namespace interfaces of the demo that exist now."""
    return emulated_wan.leftovers(PREFIX, PREFIX)


# ------------------------------------------------------------------------------ processes


@dataclass
class _Procs:
    """Processes started by the demo, stopped in reverse order."""

    workdir: Path
    started: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    finite: set[str] = field(default_factory=set)  # may end on their own (with 0)

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        finite: bool = False,
    ) -> None:
        with (self.workdir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                # Its own session: Ctrl-C reaches the demo alone, which stops everything
                # in order (agents first, so that they end their workers).
                start_new_session=True,
            )
        self.started.append((name, proc))
        if finite:
            self.finite.add(name)

    def pop(self, name: str) -> subprocess.Popen[bytes]:
        """Hand over the process `name` (its caller waits for it and stops it)."""
        i = next(i for i, (n, _) in enumerate(self.started) if n == name)
        return self.started.pop(i)[1]

    def check(self) -> None:
        for name, proc in self.started:
            if proc.poll() is not None and not (name in self.finite and proc.returncode == 0):
                raise DemoFailed(
                    f"{name} exited with {proc.returncode}; its log ends:\n"
                    + self.tail(name)
                    + f"\n(logs in {self.workdir})"
                )

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def stop_all(self) -> None:
        procs = [proc for _, proc in reversed(self.started)]
        self.started.clear()
        self.stop(*procs)

    @staticmethod
    def stop(*procs: subprocess.Popen[bytes]) -> None:
        """SIGTERM each, then SIGKILL the session of any still running after 15 s."""
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            # SIGKILL the whole session: a worker its parent could not stop goes too.
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextmanager
def _cleanup_not_interrupted() -> Iterator[None]:
    """Restores SIGINT's handler once everything is cleaned up: while the demo unwinds,
    SIGINT is ignored (`_ignore_interrupts`), so that a second Ctrl-C cannot cut the
    cleanup short."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        with suppress(ValueError):  # not the main thread: not ours to change
            signal.signal(signal.SIGINT, previous)


def _ignore_interrupts() -> None:
    with suppress(ValueError):  # not the main thread: not ours to change
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _wait(what: str, condition: Callable[[], Any], timeout: float, procs: _Procs) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs.check()
        try:
            result = condition()
        except (httpx.HTTPError, ApiError, OSError):
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise DemoFailed(
        f"timed out after {timeout:.0f} s waiting for {what} (logs in {procs.workdir})"
    )


CPN = [sys.executable, "-m", "cpn"]


# ------------------------------------------------------------------------------- the demo


def _prepare_workdir(workdir: Path) -> None:
    """Create `--workdir`, or refuse it (InputError) before anything starts.

    An earlier run's database would hold its jobs and sites and its logs would mix with
    this run's: a directory that is not empty is refused rather than half-reused.
    """
    try:  # exists() too raises, under a directory this user may not enter
        there, is_dir = workdir.exists(), workdir.is_dir()
        earlier = is_dir and any(workdir.iterdir())
    except OSError as exc:
        raise InputError(f"--workdir {workdir}: cannot list it ({exc.strerror})") from None
    if there:
        if not is_dir:
            raise InputError(f"--workdir {workdir}: not a directory")
        if earlier:
            raise InputError(
                f"--workdir {workdir}: not empty (an earlier demo's files?); "
                "give a new or empty directory"
            )
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--workdir {workdir}: cannot create it ({exc.strerror})") from None


def run_demo(settings: DemoSettings, ui: DemoUI) -> DemoReport:
    """Run the demo to its report; raises `DemoFailed` (after cleaning up) if it cannot."""
    if settings.steps < 2:
        raise DemoFailed("--steps: at least 2 (a loss curve needs two points)")
    possible, why = emulation_available()
    emulate = possible if settings.emulate is None else settings.emulate
    if settings.emulate is False:
        why = "--no-emulate"
    if emulate and not possible:
        raise DemoFailed(f"--emulate: cannot emulate sites here: {why}")
    began = time.monotonic()
    made_workdir = settings.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="cpn-demo-")) if made_workdir else settings.workdir
    assert workdir is not None
    if not made_workdir:
        _prepare_workdir(workdir)
    ui.status(f"working directory {workdir}")
    failed = False
    try:
        with ExitStack() as stack:
            stack.enter_context(_cleanup_not_interrupted())
            wan: emulated_wan.EmulatedWan | None = None
            if emulate:
                ui.status("building three sites: network namespaces on a bridge, uplinks "
                          "shaped with tc tbf")  # fmt: skip
                sites = emulated_wan.EmulatedWan(
                    len(SITES),
                    [s.uplink_mbit for s in SITES],
                    prefix=PREFIX,
                    subnet=SUBNET,
                    ifprefix=PREFIX,
                    host_link=True,
                )
                try:
                    wan = stack.enter_context(sites)
                except emulated_wan.EmulationBusyError as exc:
                    raise DemoFailed(
                        f"another cpn demo is running on this machine ({exc}): wait for it "
                        "to end, or run this one on loopback with --no-emulate"
                    ) from None
                except RuntimeError as exc:  # ip or tc failed
                    raise DemoFailed(f"cannot build the emulated sites: {exc}") from None
            procs = _Procs(workdir)
            stack.callback(procs.stop_all)
            stack.callback(_ignore_interrupts)  # runs first on the way out
            return _run(settings, ui, workdir, wan, procs, why, began)
    except DemoFailed:
        failed = True  # the message points at the logs: they stay
        raise
    finally:
        if made_workdir and not settings.keep and not failed:
            shutil.rmtree(workdir, ignore_errors=True)
        elif settings.keep or failed:
            ui.status(f"kept {workdir}: the database, every process's log, the workers' files")


def _run(
    settings: DemoSettings,
    ui: DemoUI,
    workdir: Path,
    wan: emulated_wan.EmulatedWan | None,
    procs: _Procs,
    why_not_emulated: str,
    began: float,
) -> DemoReport:
    host = wan.host_address if wan is not None else "127.0.0.1"
    grpc_port, http_port = free_port(host), free_port(host)
    db_url = f"sqlite:///{workdir}/cpn.db"
    tokens = workdir / "site-tokens.yaml"
    tokens.write_text("".join(f"{s.name}: {s.token}\n" for s in SITES))
    url = f"http://{host}:{http_port}"
    ui.status(f"starting the control plane (SQLite, HTTP {url})")
    procs.start(
        "serve",
        [*CPN, "serve", "--database-url", db_url, "--site-tokens", str(tokens),
         "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--host", host],
        env={"CPN_SCHEDULE_INTERVAL_S": "0.2", "CPN_STOP_GRACE_S": "5"},
    )  # fmt: skip
    _wait(
        "the control plane to be ready",
        lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200,
        90,
        procs,
    )
    key = _admin_key(db_url)
    for i, site in enumerate(SITES):
        ui.status(
            f"starting site {site.name}: {site.gpus} virtual {site.gpu_model}"
            + (f", uplink {site.uplink_mbit:g} Mbit/s" if wan is not None else "")
        )
        if wan is not None:
            prefix, probe_host, probe_port = wan.prefix(i), wan.address(i), PROBE_PORT
            env = {"GLOO_SOCKET_IFNAME": wan.interface}
        else:
            prefix, probe_host, probe_port = [], "127.0.0.1", free_port("127.0.0.1")
            env = {}
        procs.start(
            f"agent-{site.name}",
            [*prefix, *CPN, "agent", "--site", site.name, "--control", f"{host}:{grpc_port}",
             "--token", site.token, "--node-name", f"{site.name}-0",
             "--virtual-gpus", str(site.gpus), "--gpu-model", site.gpu_model,
             "--gpu-memory-gb", str(site.memory_gb), "--gpu-tflops", str(GPU_TFLOPS),
             "--probe-host", probe_host, "--probe-port", str(probe_port),
             "--probe-interval", "5", "--probe-bytes", str(1 << 20),
             "--work-dir", str(workdir / f"work-{site.name}")],
            env=env,
        )  # fmt: skip
    with CpnClient(url, key) as client:
        ui.status("waiting for every site and the WAN links between them to be measured")
        pairs = len(SITES) * (len(SITES) - 1) // 2

        def measured() -> Topology | None:
            topo = client.topology()
            done = len(topo.sites) == len(SITES) and len(topo.links) == pairs
            return topo if done else None

        topology: Topology = _wait("the three sites and their links", measured, 120, procs)
        spec = demo_job(settings.steps)
        job = client.submit(spec)
        ui.status(f"submitted job {job.id} over REST: {settings.steps} steps on 4 GPUs")
        baseline = _DdpBaseline(spec, workdir / "ddp", settings, procs)
        job = _follow(client, job.id, ui, procs, settings.timeout_s, baseline)
        metrics = client.metrics(job.id)
    if job.state.value != "succeeded":
        failure = job.failure
        detail = (
            f"rank {failure.rank} at {failure.site}: {failure.message}\n    "
            + "\n    ".join(failure.last_lines[-10:])
            if failure is not None
            else job.reason
        )
        raise DemoFailed(f"job {job.id} {job.state.value}: {detail}\n(logs in {workdir})")
    ui.status("waiting for the plain DDP baseline to finish")
    ddp_per_step = baseline.result()
    return _report(
        job, metrics.steps, topology, spec, ddp_per_step, settings, wan, why_not_emulated,
        time.monotonic() - began,
    )  # fmt: skip


def _admin_key(db_url: str) -> str:
    """An admin key for the demo's own tenant, made as `cpn keys create --admin` makes it."""
    from cpn.orchestration.tenants import create_key  # noqa: PLC0415
    from cpn.registry import Registry  # noqa: PLC0415
    from cpn.registry.models import Role  # noqa: PLC0415

    registry = Registry(db_url)
    try:
        with registry.write() as session:
            return create_key(session, "demo", role=Role.ADMIN).key
    finally:
        registry.dispose()


def _follow(
    client: CpnClient,
    job_id: str,
    ui: DemoUI,
    procs: _Procs,
    timeout: float,
    baseline: _DdpBaseline,
) -> JobPublic:
    began = time.monotonic()
    while True:
        procs.check()
        try:
            job = client.job(job_id)
        except ApiError:
            # A process that died explains a refused request better than the request does.
            time.sleep(1)
            procs.check()
            raise
        if job.plan is not None and not baseline.started:
            # The baseline needs only the plan: it starts now, beside the job, and the
            # workers of both start up together (most of a short run is start-up).
            baseline.start(job)
            ui.status(
                f"plain DDP baseline started beside the job: {baseline.settings.ddp_steps} "
                "steps of the same plan with one flat ring (cpn train --dp-sync flat)"
            )
        ui.job(job, time.monotonic() - began)
        if job.state.value in ("succeeded", "failed", "cancelled"):
            return job
        if time.monotonic() - began > timeout:
            raise DemoFailed(f"job {job_id}: still {job.state.value} after {timeout:.0f} s")
        time.sleep(0.3)


class _DdpBaseline:
    """WAN bytes per step of the same job under plain DDP: a short run of the same plan
    with one flat ring over every replica (what DDP's gloo all-reduce sends), counted by
    link class by cpn.comm. Runs on this machine's loopback, beside the job."""

    name = "ddp-baseline"

    def __init__(
        self, spec: dict[str, Any], where: Path, settings: DemoSettings, procs: _Procs
    ) -> None:
        self.spec, self.where, self.settings, self.procs = spec, where, settings, procs
        self.started = False

    def start(self, job: JobPublic) -> None:
        assert job.plan is not None
        self.where.mkdir(parents=True)
        plan_path, job_path = self.where / "plan.json", self.where / "job.yaml"
        plan_path.write_text(job.plan.model_dump_json())
        job_path.write_text(yaml.safe_dump(self.spec, sort_keys=False))
        argv = [*CPN, "train", "--plan", str(plan_path), "--job", str(job_path),
                "--workdir", str(self.where / "run"), "--dp-sync", "flat",
                "--stop-after", str(self.settings.ddp_steps)]  # fmt: skip
        self.procs.start(self.name, argv, finite=True)
        self.started = True

    def result(self) -> float:
        if not self.started:
            raise DemoFailed("the DDP baseline never started (the job had no plan)")
        proc = self.procs.pop(self.name)
        try:
            code = proc.wait(self.settings.timeout_s)
        except subprocess.TimeoutExpired:
            raise DemoFailed(f"the DDP baseline ran past {self.settings.timeout_s:.0f} s") from None
        finally:
            self.procs.stop(proc)
        if code != 0:
            raise DemoFailed(f"the DDP baseline exited with {code}:\n{self.procs.tail(self.name)}")
        steps = summarise(read_metrics(self.where / "run"))
        if len(steps) != self.settings.ddp_steps:
            raise DemoFailed(
                f"the DDP baseline reported {len(steps)} of {self.settings.ddp_steps} steps"
            )
        return statistics.fmean(s.bytes.get("wan", 0) for s in steps)


# ------------------------------------------------------------------------------ the report


def _report(
    job: JobPublic,
    steps: list[Any],
    topology: Topology,
    spec: dict[str, Any],
    ddp_per_step: float,
    settings: DemoSettings,
    wan: emulated_wan.EmulatedWan | None,
    why_not_emulated: str,
    wall_s: float,
) -> DemoReport:
    plan = job.plan
    assert plan is not None
    ranks: dict[str, list[int]] = {s.name: [] for s in SITES}
    for rank in plan.ranks():
        ranks[rank.site].append(rank.rank)
    sites = [SiteRow(s.name, s.gpus, s.gpu_model, s.uplink_mbit, ranks[s.name]) for s in SITES]
    links = [
        LinkRow(link.key, link.bandwidth_gbps * 1000, link.latency_ms) for link in topology.links
    ]
    progress = job.progress
    # The same placement timed on the WAN the namespaces enforce (each link as slow as
    # the slower of its two uplinks): on loopback that is the WAN time modelled.
    uplink = {s.name: s.uplink_mbit for s in SITES}
    modelled = topology.model_copy(
        update={
            "links": [
                LinkSpec(
                    a=link.a, b=link.b, transport=link.transport, latency_ms=link.latency_ms,
                    bandwidth_gbps=min(uplink[link.a], uplink[link.b]) / 1000,
                )
                for link in topology.links
            ]
        }
    )  # fmt: skip
    job_spec = JobSpec.model_validate(spec)
    shards = [Placement(s.replica, s.stage, s.site, s.node) for s in plan.shards]
    at_uplinks = evaluate(Workload.of(job_spec), modelled, SiteGraph(modelled), shards)
    seconds = [s.seconds for s in steps]
    if wan is not None:
        network = "emulated"
        note = (
            f"each site in its own network namespace ({PREFIX}-s0…s2, {SUBNET}.0/24) on a "
            "bridge, each uplink rate-limited with tc tbf ("
            + ", ".join(f"{s.name} {s.uplink_mbit:g} Mbit/s" for s in SITES)
            + "). This kernel has no netem: latency is not emulated; the prediction uses "
            "the round-trip times the agents measured."
        )
    else:
        network = "loopback"
        note = (
            f"loopback ({why_not_emulated}): WAN time is modelled, not enforced — the bytes "
            "are counted exactly, the uplinks ("
            + ", ".join(f"{s.name} {s.uplink_mbit:g} Mbit/s" for s in SITES)
            + ") are not imposed; run as root on Linux to have them enforced."
        )
    return DemoReport(
        network=network,
        network_note=note,
        job_id=job.id,
        job_name=job.name,
        steps=progress.step,
        workers=plan.parallel.world_size,
        compression=f"top-k {job_spec.compression.effective_density:.1%} on the WAN",
        sites=sites,
        links=links,
        predicted_wan_bytes=progress.bytes["wan"].predicted or 0,
        measured_wan_bytes=progress.bytes["wan"].measured,
        predicted_intra_site_bytes=progress.bytes["intra_site"].predicted or 0,
        measured_intra_site_bytes=progress.bytes["intra_site"].measured,
        predicted_step_s=plan.predicted_iteration_seconds,
        predicted_wan_s=plan.breakdown.dp_sync,
        modelled_step_s=at_uplinks.iteration_seconds,
        modelled_wan_s=at_uplinks.dp_sync,
        measured_step_s=statistics.median(seconds) if seconds else 0.0,
        ddp_steps=settings.ddp_steps,
        ddp_wan_bytes_per_step=ddp_per_step,
        losses=[s.loss if s.loss is not None else float("nan") for s in steps],
        step_seconds=seconds,
        wan_bytes_per_step=[int(s.bytes.get("wan", 0)) for s in steps],
        wall_s=wall_s,
    )
