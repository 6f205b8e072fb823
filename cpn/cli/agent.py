"""`cpn agent`: one site's agent — discovery, lease, WAN probes, worker launch."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
from pathlib import Path
from typing import Annotated

import typer

from agents.config import WORKER_PLACEHOLDERS
from cpn.cli import app
from cpn.errors import CpnError, InputError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def _node_name(explicit: str | None) -> str:
    if explicit:
        return explicit
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname().split(".")[0]).strip("-.")
    return name[:64] or "node"


@app.command()
def agent(
    site: Annotated[str, typer.Option(help="The site this agent serves.")],
    control: Annotated[
        str,
        typer.Option(
            help="Control plane gRPC address, HOST:PORT; several, comma-separated, are "
            "tried in turn (control planes sharing one PostgreSQL).",
        ),
    ],
    token: Annotated[
        str,
        typer.Option(
            envvar="CPN_AGENT_TOKEN", help="The site's bearer token (or $CPN_AGENT_TOKEN)."
        ),
    ],
    virtual_gpus: Annotated[
        int,
        typer.Option(
            "--virtual-gpus",
            min=0,
            max=1024,
            help="GPU slots to declare when no GPU is found (CPU-only hosts, demos).",
        ),
    ] = 0,
    gpu_model: Annotated[
        str, typer.Option("--gpu-model", help="Model name of virtual GPUs.")
    ] = "virtual",
    gpu_memory_gb: Annotated[
        float, typer.Option("--gpu-memory-gb", min=0.001, help="Memory of a virtual GPU.")
    ] = 80.0,
    gpu_tflops: Annotated[
        float, typer.Option("--gpu-tflops", min=0.001, help="Peak TFLOP/s of a virtual GPU.")
    ] = 100.0,
    agent_id: Annotated[
        str | None,
        typer.Option(
            "--agent-id",
            help="Stable identity (default SITE-NODE): keep it across restarts.",
            show_default=False,
        ),
    ] = None,
    node_name: Annotated[
        str | None,
        typer.Option(
            "--node-name", help="Name of this node (default: host name).", show_default=False
        ),
    ] = None,
    intra_node_gbps: Annotated[
        float,
        typer.Option(
            "--intra-node-gbps", min=0, help="GPU-to-GPU bandwidth in the node (0: unknown)."
        ),
    ] = 0.0,
    sysfs_root: Annotated[
        Path, typer.Option("--sysfs-root", help="Where sysfs is (RDMA discovery).")
    ] = Path("/sys"),
    probe_host: Annotated[
        str, typer.Option("--probe-host", help="Address the WAN probe listens on.")
    ] = "0.0.0.0",
    probe_port: Annotated[
        int, typer.Option("--probe-port", min=0, max=65535, help="WAN probe port (0: any).")
    ] = 0,
    advertise_host: Annotated[
        str | None,
        typer.Option(
            "--advertise-host",
            help="Address peers reach the probe on "
            "(default: the local address that routes to the control plane).",
            show_default=False,
        ),
    ] = None,
    probe_interval: Annotated[
        float, typer.Option("--probe-interval", min=0.1, help="Seconds between WAN probes.")
    ] = 30.0,
    probe_bytes: Annotated[
        int,
        typer.Option(
            "--probe-bytes", min=1024, max=64 * 1024 * 1024, help="Bytes per throughput probe."
        ),
    ] = 4 * 1024 * 1024,
    worker_command: Annotated[
        str | None,
        typer.Option(
            "--worker-command",
            help="Run this instead of cpn worker for each rank (through torch's elastic "
            "agent, like cpn worker); placeholders {python} {plan} {job} {metrics} "
            "(per-step JSON lines, {rank} left for the worker). A worker finds its plan "
            "rank in $CPN_PLAN_RANKS[$LOCAL_RANK] and may report with agents.status.",
            show_default=False,
        ),
    ] = None,
    work_dir: Annotated[
        Path, typer.Option("--work-dir", help="Where job files and worker logs go.")
    ] = Path("cpn-agent-work"),
    log_level: Annotated[
        str, typer.Option("--log-level", help="debug, info, warning, error.")
    ] = "info",
    tls_ca: Annotated[
        Path | None,
        typer.Option(
            "--tls-ca",
            help="PEM CA certificate(s) to verify the control plane with: connect over TLS.",
            show_default=False,
        ),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="How the site runs workers: local (child processes on this node), slurm "
            "(one batch job per launch on the site's Slurm; the agent serves every node of "
            "the partition; the cluster is found through $SLURM_CONF) or kubernetes (one "
            "Indexed Job per launch in --k8s-namespace; in-cluster or kubeconfig credentials).",
        ),
    ] = "local",
    slurm_partition: Annotated[
        str | None,
        typer.Option(
            "--slurm-partition", help="The Slurm partition cpn may use.", show_default=False
        ),
    ] = None,
    slurm_account: Annotated[
        str | None,
        typer.Option("--slurm-account", help="The Slurm account to charge.", show_default=False),
    ] = None,
    slurm_sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--slurm-sbatch-arg",
            help="One more sbatch option, verbatim (repeatable): --qos=high, --reservation=R.",
            show_default=False,
        ),
    ] = None,
    k8s_namespace: Annotated[
        str | None,
        typer.Option("--k8s-namespace", help="The namespace cpn may use.", show_default=False),
    ] = None,
    k8s_image: Annotated[
        str | None,
        typer.Option(
            "--k8s-image", help="The image with cpn installed, for the pods.", show_default=False
        ),
    ] = None,
    k8s_service_account: Annotated[
        str | None,
        typer.Option(
            "--k8s-service-account", help="The pods' service account.", show_default=False
        ),
    ] = None,
    k8s_work_claim: Annotated[
        str | None,
        typer.Option(
            "--k8s-work-claim",
            help="PersistentVolumeClaim mounted in the pods at --work-dir (shared with the agent).",
            show_default=False,
        ),
    ] = None,
    time_limit: Annotated[
        int,
        typer.Option(
            "--time-limit",
            min=60,
            max=365 * 24 * 3600,
            help="Seconds a launch may run on a site engine (Slurm's --time; checked at start "
            "against the partition's MaxTime).",
        ),
    ] = 24 * 3600,
) -> None:
    """Run a site's agent: discover GPUs (NVML, nvidia-smi, torch.cuda, else virtual
    slots) and RDMA NICs (sysfs), register with the control plane, heartbeat, measure the
    WAN to peer sites, and launch or stop workers as ordered. Reconnects by itself when
    the control plane goes away."""
    from agents.agent import AgentError, run_agent  # noqa: PLC0415
    from agents.backends.slurm import SlurmOptions  # noqa: PLC0415
    from agents.config import AgentConfig, KubernetesSettings  # noqa: PLC0415
    from agents.discovery.gpus import VirtualGpus  # noqa: PLC0415
    from cpn.cli.serve import setup_logging  # noqa: PLC0415
    from cpn.control.validation import is_host_port  # noqa: PLC0415

    if not _NAME.match(site) or len(site) > 64:
        raise InputError(f"--site: {site!r}: use letters, digits and _ . - (start alphanumeric)")
    for address in control.split(","):
        if not is_host_port(address.strip()):
            raise InputError(
                f"--control: {address.strip()!r}: expected HOST:PORT[,HOST:PORT…], port 1–65535"
            )
    node = _node_name(node_name)
    if not _NAME.match(node):
        raise InputError(f"--node-name: {node!r}: use letters, digits and _ . -")
    for placeholder in re.findall(r"{([^}]*)}", worker_command or ""):
        if placeholder not in WORKER_PLACEHOLDERS:
            raise InputError(f"--worker-command: unknown placeholder {{{placeholder}}}")
    if backend not in ("local", "slurm", "kubernetes"):
        raise InputError(f"--backend: {backend!r} is not one of local, slurm, kubernetes")
    k8s = None
    if backend == "kubernetes":
        if not k8s_namespace or not k8s_image:
            raise InputError("--backend kubernetes: --k8s-namespace and --k8s-image are required")
        k8s = KubernetesSettings(k8s_namespace, k8s_image, k8s_service_account, k8s_work_claim)
    elif k8s_namespace or k8s_image or k8s_service_account or k8s_work_claim:
        raise InputError("--k8s-* options need --backend kubernetes")
    slurm = None
    if backend == "slurm":
        if not slurm_partition:
            raise InputError("--backend slurm: --slurm-partition is required")
        slurm = SlurmOptions(
            slurm_partition,
            slurm_account,
            tuple(slurm_sbatch_arg or ()),
            time_limit_s=time_limit,
        )
    elif slurm_partition or slurm_account or slurm_sbatch_arg:
        raise InputError(
            "--slurm-partition, --slurm-account and --slurm-sbatch-arg need --backend slurm"
        )
    config = AgentConfig(
        site=site,
        control=control,
        token=token,
        agent_id=agent_id or f"{site}-{node}",
        node_name=node,
        virtual=VirtualGpus(virtual_gpus, gpu_model, gpu_memory_gb, gpu_tflops),
        intra_node_gbps=intra_node_gbps,
        sysfs_root=sysfs_root,
        probe_host=probe_host,
        probe_port=probe_port,
        advertise_host=advertise_host,
        probe_interval_s=probe_interval,
        probe_bytes=probe_bytes,
        worker_command=worker_command,
        work_dir=work_dir.resolve(),
        tls_ca=tls_ca,
        backend=backend,
        slurm=slurm,
        kubernetes=k8s,
        time_limit_s=time_limit,
    )
    setup_logging(log_level)

    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        await run_agent(config)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    except AgentError as exc:
        raise CpnError(str(exc)) from None
