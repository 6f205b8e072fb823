"""The `kubernetes` backend: a site's shards as one Indexed Job, through the official
`kubernetes` Python client.

Per (job, epoch): a headless Service and an Indexed Job of the same name
(`cpn-JOB-eEPOCH`, lower-cased), labelled `cpn/job`, `cpn/epoch`, `cpn/agent`, built from
the client's typed models (`manifests()`). The Job has one pod per node of the launch
(`completions` = `parallelism` = N, `completionMode: Indexed`); a pod's node rank is its
completion index (`$JOB_COMPLETION_INDEX`), which picks its `cpn launch` command. The pod
of index 0 serves the rendezvous at its stable DNS name `NAME-0.NAME.NAMESPACE.svc`
(the Service gives the pods a subdomain); each pod's workers are reached on its own IP
(`$POD_IP`, downward API), so launches never share a port. `backoffLimit: 0` (cpn owns
retries and re-planning), `activeDeadlineSeconds` = the launch's finite time limit, GPUs
as `resources.limits["nvidia.com/gpu"]`, the plan's nodes as a required node affinity
with one pod per node (anti-affinity). The run directory is a PersistentVolumeClaim
mounted at the same path as on the agent.

A create that meets 409 Conflict reads the existing Job: submit is idempotent on (job,
epoch). States come from the Job's conditions and its pods' (`K8S_STATES`); `wait()`
watches the Job from the resourceVersion last read. Capacity is the nodes' allocatable
`nvidia.com/gpu`; a node not Ready, or cordoned, offers none.

No API server runs on the machines cpn is tested on (none in the package registries, no
container engine): the tests are contract tests against a small in-process fake of the
API served over HTTP to this real client (tests/k8s_fake.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.quantity import parse_quantity
from urllib3.exceptions import HTTPError

from agents.backends.base import (
    HEAD_PLACEHOLDER,
    LOCAL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    BackendError,
    Capacity,
    Handle,
    LaunchSpec,
    NodeCapacity,
    NodeShare,
    State,
    Status,
)

#: Native states (the Job's condition, `Failed/<reason>`, or a pod's disruption) → cpn's.
K8S_STATES: dict[str, State] = {
    "Pending": State.PENDING,  # no pod runs yet: unschedulable, pulling images, ...
    "Suspended": State.PENDING,  # the Job is suspended (Kueue, an admin)
    "Starting": State.STARTING,  # some pods run, not all of them are ready yet
    "Running": State.RUNNING,  # every pod of the launch runs
    "Complete": State.SUCCEEDED,  # every index exited 0
    "Failed/BackoffLimitExceeded": State.FAILED,  # a pod failed (backoffLimit 0: the first)
    "Failed/DeadlineExceeded": State.FAILED,  # past activeDeadlineSeconds (the time limit)
    "Failed/PodFailurePolicy": State.FAILED,  # a pod failure policy rule failed the Job
    "Failed/FailedIndexes": State.FAILED,  # an index failed (backoffLimitPerIndex)
    "Deleted": State.CANCELLED,  # the Job is gone: deleted by cpn's stop or by someone else
    "Pod/PreemptionByScheduler": State.PREEMPTED,  # a higher-priority pod took its place
    "Pod/EvictionByEvictionAPI": State.PREEMPTED,  # evicted (a drain, Kueue preemption)
    "Pod/DeletionByTaintManager": State.NODE_LOST,  # its node went NotReady/unreachable
    "Pod/DeletionByPodGC": State.NODE_LOST,  # its node was deleted
    "Pod/TerminationByKubelet": State.NODE_LOST,  # the node's kubelet ended it (pressure)
}

_DNS = re.compile(r"[^a-z0-9-]+")
RDZV_PORT = 29400  # every pod has its own IP: one port for every launch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KubernetesOptions:
    """What the cluster's admin gave cpn: a namespace, a service account, an image with
    cpn installed, and a PersistentVolumeClaim for the run directories."""

    namespace: str
    image: str
    service_account: str | None = None
    work_claim: str | None = None  # the PVC mounted at the agent's work dir
    work_dir: str = "/cpn-work"
    gpu_resource: str = "nvidia.com/gpu"


def resource_name(spec: LaunchSpec) -> str:
    """The Job's and Service's name: DNS-1123, at most 63 characters."""
    name = _DNS.sub("-", spec.key.lower()).strip("-")
    return name[:63].rstrip("-")


def manifests(
    spec: LaunchSpec, options: KubernetesOptions, agent_id: str
) -> tuple[client.V1Service, client.V1Job]:
    """The headless Service and the Indexed Job of one launch, as typed models."""
    name = resource_name(spec)
    labels = {
        "cpn/job": _label(spec.job_id),
        "cpn/epoch": str(spec.epoch),
        "cpn/agent": _label(agent_id),
    }
    nodes = [{"node": n.node, "ranks": list(n.ranks), "gpus": list(n.gpus)} for n in spec.nodes]
    annotations = {
        "cpn/job-id": spec.job_id,
        "cpn/agent-id": agent_id,
        "cpn/run-dir": str(spec.run_dir),
        "cpn/nodes": json.dumps(nodes),
    }
    service = client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=client.V1ObjectMeta(name=name, labels=labels, annotations=annotations),
        spec=client.V1ServiceSpec(
            cluster_ip="None",
            selector={"job-name": name},
            publish_not_ready_addresses=True,
            ports=[client.V1ServicePort(name="rdzv", port=RDZV_PORT)],
        ),
    )
    head = f"{name}-0.{name}.{options.namespace}.svc"
    port = str(spec.rdzv_port or RDZV_PORT)
    cases = []
    for k, argv in enumerate(spec.commands):
        words = []
        for arg in argv:
            filled = arg.replace(HEAD_PLACEHOLDER, head).replace(PORT_PLACEHOLDER, port)
            parts = filled.split(LOCAL_PLACEHOLDER)
            words.append('"$POD_IP"'.join(shlex.quote(p) if p else "" for p in parts) or "''")
        node_dir = shlex.quote(str(spec.node_dir(k)))
        cases.append(
            f"  {k}) mkdir -p {node_dir}; exec {' '.join(words)} > {node_dir}/launcher.log 2>&1 ;;"
        )
    script = 'case "$JOB_COMPLETION_INDEX" in\n' + "\n".join(cases) + "\n  *) exit 3 ;;\nesac\n"
    env = [client.V1EnvVar(name=k, value=v) for k, v in sorted(spec.env.items())]
    env.append(
        client.V1EnvVar(
            name="POD_IP",
            value_from=client.V1EnvVarSource(
                field_ref=client.V1ObjectFieldSelector(field_path="status.podIP")
            ),
        )
    )
    gpus = spec.gpus_per_node
    container = client.V1Container(
        name="launcher",
        image=options.image,
        command=["bash", "-c", script],
        env=env,
        resources=client.V1ResourceRequirements(limits={options.gpu_resource: str(gpus)})
        if gpus
        else None,
        volume_mounts=[client.V1VolumeMount(name="work", mount_path=options.work_dir)]
        if options.work_claim
        else None,
    )
    affinity = client.V1Affinity(
        node_affinity=client.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=client.V1NodeSelector(
                # By the node's name, as `capacity()` reports it: the hostname label
                # differs from it on some clusters (cloud node names). The API allows one
                # value per `metadata.name` requirement, so one term per node (terms OR).
                node_selector_terms=[
                    client.V1NodeSelectorTerm(
                        match_fields=[
                            client.V1NodeSelectorRequirement(
                                key="metadata.name", operator="In", values=[n.node]
                            )
                        ]
                    )
                    for n in spec.nodes
                ]
            )
        ),
        pod_anti_affinity=client.V1PodAntiAffinity(
            required_during_scheduling_ignored_during_execution=[
                client.V1PodAffinityTerm(
                    label_selector=client.V1LabelSelector(match_labels={"job-name": name}),
                    topology_key="kubernetes.io/hostname",
                )
            ]
        ),
    )
    pod = client.V1PodSpec(
        restart_policy="Never",
        # The kubelet's SIGTERM-to-SIGKILL wait, for every end it makes (a stop's delete,
        # whose own grace the Job's garbage collection does not pass on to the pods, the
        # deadline, a preemption): the workers' time to checkpoint, as on other engines.
        termination_grace_period_seconds=max(1, math.ceil(spec.stop_grace_s)),
        subdomain=name,
        service_account_name=options.service_account,
        containers=[container],
        affinity=affinity,
        volumes=[
            client.V1Volume(
                name="work",
                persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(
                    claim_name=options.work_claim
                ),
            )
        ]
        if options.work_claim
        else None,
    )
    job = client.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=client.V1ObjectMeta(name=name, labels=labels, annotations=annotations),
        spec=client.V1JobSpec(
            completion_mode="Indexed",
            completions=len(spec.nodes),
            parallelism=len(spec.nodes),
            backoff_limit=0,
            active_deadline_seconds=spec.time_limit_s,
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels), spec=pod
            ),
        ),
    )
    return service, job


def job_status(job: client.V1Job | None, pods: Sequence[client.V1Pod]) -> Status:
    """A Job (None: not found) and its pods in cpn's words (K8S_STATES)."""
    if job is None:
        return Status(K8S_STATES["Deleted"], "Deleted", "the Job no longer exists")
    st = job.status or client.V1JobStatus()
    wanted = (job.spec.completions if job.spec else None) or 1
    for cond in st.conditions or []:
        if cond.status != "True":
            continue
        if cond.type == "Complete":
            return Status(K8S_STATES["Complete"], "Complete", "", 0, 0)
        if cond.type == "Failed":
            disrupted = _disruption(pods)
            if disrupted is not None:
                native, why = disrupted
                return Status(K8S_STATES[native], native, why, 0, _exit_code(pods))
            native = f"Failed/{cond.reason or 'BackoffLimitExceeded'}"
            state = K8S_STATES.get(native, State.FAILED)
            return Status(state, native, cond.message or cond.reason or "", 0, _exit_code(pods))
        if cond.type == "Suspended":
            return Status(K8S_STATES["Suspended"], "Suspended", cond.message or "")
    active, ready = st.active or 0, st.ready or 0
    if active and ready >= wanted:
        return Status(K8S_STATES["Running"], "Running")
    if active and ready:
        return Status(K8S_STATES["Starting"], "Starting", f"{ready} of {wanted} pods ready")
    reason = ""
    for pod in pods:
        for pc in (pod.status.conditions if pod.status else None) or []:
            if pc.type == "PodScheduled" and pc.status == "False":
                reason = pc.message or pc.reason or ""
    return Status(K8S_STATES["Pending"], "Pending", reason)


def _disruption(pods: Sequence[client.V1Pod]) -> tuple[str, str] | None:
    for pod in pods:
        for cond in (pod.status.conditions if pod.status else None) or []:
            if cond.type == "DisruptionTarget" and cond.status == "True":
                native = f"Pod/{cond.reason}"
                if native in K8S_STATES:
                    who = pod.metadata.name if pod.metadata else "?"
                    return native, f"pod {who}: {cond.message or cond.reason}"
    return None


def _exit_code(pods: Sequence[client.V1Pod]) -> int | None:
    for pod in pods:
        for cs in (pod.status.container_statuses if pod.status else None) or []:
            term = cs.state.terminated if cs.state else None
            if term is not None and term.exit_code:
                return int(term.exit_code)
    return None


def _label(value: str) -> str:
    """A label value: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", value)[:63].strip("-._")


def _gpu_count(quantity: object) -> int | None:
    """A node's allocatable GPUs: None if it is not a whole number of devices.

    Extended resources are whole quantities, but the field is a free string that a
    misconfigured device plugin can fill with anything; one such node must not stop the
    agent reporting the others. Parsed by the client's own quantity parser ("8", "8e0").
    """
    if quantity is None:
        return 0
    try:
        value = parse_quantity(quantity)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError):
        return None
    if value < 0 or value != int(value):
        return None
    return int(value)


@dataclass
class KubernetesBackend:
    options: KubernetesOptions
    agent_id: str
    api: client.ApiClient
    name: str = "kubernetes"
    site_wide: bool = True
    poll_interval_s: float = 1.0
    _known: dict[tuple[str, int], Handle] = field(default_factory=dict)
    _versions: dict[str, str] = field(default_factory=dict)  # Job name → resourceVersion
    _removals: set[asyncio.Task[None]] = field(default_factory=set)  # forget()'s deletes

    @property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            raise BackendError(f"kubernetes: {what}: {exc.status} {_api_reason(exc)}") from None
        except (HTTPError, OSError) as exc:
            raise BackendError(f"kubernetes: {what}: cannot reach the API server ({exc})") from None

    async def check(self) -> None:
        ns = self.options.namespace
        await self._call(f"namespace {ns!r}", self.batch.list_namespaced_job, ns, limit=1)
        capacity = await self.capacity()
        if not capacity.nodes:
            raise BackendError("kubernetes: no node offers a GPU")

    async def capacity(self) -> Capacity:
        nodes = await self._call("list nodes", self.core.list_node)
        out = []
        for n in nodes.items:
            status = n.status or client.V1NodeStatus()
            gpus = _gpu_count((status.allocatable or {}).get(self.options.gpu_resource))
            ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
            cordoned = bool(n.spec and n.spec.unschedulable)
            address = next(
                (a.address for a in status.addresses or [] if a.type == "InternalIP"), ""
            )
            usable = ready and not cordoned and gpus is not None
            state = "Ready" if ready else "NotReady"
            if cordoned:
                state += ",SchedulingDisabled"
            if gpus is None:  # reported, so the operator sees why the node holds nothing
                state += f",UnreadableAllocatable({self.options.gpu_resource})"
            out.append(
                NodeCapacity(n.metadata.name, (gpus or 0) if usable else 0, usable, state, address)
            )
        return Capacity(tuple(n for n in out if n.gpus or not n.usable))

    async def submit(self, spec: LaunchSpec) -> Handle:
        key = (spec.job_id, spec.epoch)
        if key in self._known:
            return self._known[key]
        service, job = manifests(spec, self.options, self.agent_id)
        name, ns = resource_name(spec), self.options.namespace
        creates: tuple[tuple[str, Any, Any], ...] = (
            ("create service", self.core.create_namespaced_service, service),
            ("create job", self.batch.create_namespaced_job, job),
        )
        for what, fn, body in creates:
            try:
                await asyncio.to_thread(fn, ns, body)
            except ApiException as exc:
                if exc.status != 409:  # 409: it exists, from an earlier submit of this launch
                    raise BackendError(
                        f"kubernetes: {what} {name}: {exc.status} {_api_reason(exc)}"
                    ) from None
            except (HTTPError, OSError) as exc:
                raise BackendError(
                    f"kubernetes: {what}: cannot reach the API server ({exc})"
                ) from None
        handle = Handle(spec.job_id, spec.epoch, name, spec.run_dir, spec.nodes)
        self._known[key] = handle
        return handle

    async def _job(self, name: str) -> client.V1Job | None:
        try:
            job = await asyncio.to_thread(
                self.batch.read_namespaced_job, name, self.options.namespace
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise BackendError(
                f"kubernetes: read job {name}: {exc.status} {_api_reason(exc)}"
            ) from None
        except (HTTPError, OSError) as exc:
            raise BackendError(f"kubernetes: cannot reach the API server ({exc})") from None
        self._versions[name] = (job.metadata.resource_version if job.metadata else None) or ""
        return job

    async def poll(self, handle: Handle) -> Status:
        job = await self._job(handle.native_id)
        pods: Sequence[client.V1Pod] = []
        if job is not None:
            listed = await self._call(
                "list pods",
                self.core.list_namespaced_pod,
                self.options.namespace,
                label_selector=f"job-name={handle.native_id}",
            )
            pods = listed.items
        return job_status(job, pods)

    async def wait(self, handle: Handle, timeout_s: float) -> None:
        """Watch the Job from the resourceVersion last read: back at its first change."""
        version = self._versions.get(handle.native_id)
        if not version:
            await asyncio.sleep(timeout_s)
            return

        def watch_once() -> None:
            w = watch.Watch()  # type: ignore[no-untyped-call]
            try:
                for _ in w.stream(  # type: ignore[no-untyped-call]
                    self.batch.list_namespaced_job,
                    self.options.namespace,
                    field_selector=f"metadata.name={handle.native_id}",
                    resource_version=version,
                    timeout_seconds=max(1, int(timeout_s)),
                ):
                    break
            except (ApiException, HTTPError, OSError):
                time.sleep(min(timeout_s, 1.0))  # 410 Gone or a lost stream: poll again
            finally:
                w.stop()  # type: ignore[no-untyped-call]

        await asyncio.to_thread(watch_once)

    async def cancel(self, handle: Handle, grace_s: float) -> None:
        """Delete the Job (its pods get SIGTERM, then SIGKILL after the grace) and its
        Service; returns once the Job is gone."""
        ns, name = self.options.namespace, handle.native_id
        body = client.V1DeleteOptions(
            propagation_policy="Foreground", grace_period_seconds=int(grace_s)
        )
        for fn in (self.batch.delete_namespaced_job, self.core.delete_namespaced_service):
            try:
                await asyncio.to_thread(fn, name, ns, body=body)
            except ApiException as exc:
                if exc.status != 404:
                    raise BackendError(
                        f"kubernetes: delete {name}: {exc.status} {_api_reason(exc)}"
                    ) from None
        deadline = time.monotonic() + grace_s + 30
        while await self._job(name) is not None:
            if time.monotonic() > deadline:
                raise BackendError(f"kubernetes: job {name} still exists after delete")
            await asyncio.sleep(0.5)

    def logs(self, handle: Handle, node_rank: int) -> Path:
        return handle.run_dir / f"node-{node_rank}" / "launcher.log"

    async def adopt(self) -> Sequence[Handle]:
        listed = await self._call(
            "list jobs",
            self.batch.list_namespaced_job,
            self.options.namespace,
            label_selector=f"cpn/agent={_label(self.agent_id)}",
        )
        handles = []
        for job in listed.items:
            meta = job.metadata
            notes = meta.annotations or {}
            if notes.get("cpn/agent-id") != self.agent_id:
                continue  # (ended ones too: their final states may not be reported yet)
            try:
                nodes = tuple(
                    NodeShare(str(n["node"]), tuple(n["ranks"]), tuple(n["gpus"]))
                    for n in json.loads(notes["cpn/nodes"])
                )
                epoch = int(meta.labels["cpn/epoch"])
                handle = Handle(
                    notes["cpn/job-id"], epoch, meta.name, Path(notes["cpn/run-dir"]), nodes
                )
            except (KeyError, ValueError, TypeError):
                continue  # not a Job this agent made whole: nothing to adopt
            self._known[(handle.job_id, handle.epoch)] = handle
            handles.append(handle)
        return handles

    def forget(self, handle: Handle) -> None:
        """Drop the launch, and delete its ended Job (with its pods) and Service: nothing
        else removes them (no TTL: an agent down for a while must still find the end it
        has not reported), so every (job, epoch) stayed in the namespace for good. The
        workers' files are on the work volume, not in the pods."""
        self._known.pop((handle.job_id, handle.epoch), None)
        self._versions.pop(handle.native_id, None)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not called from the agent's loop: nothing to schedule on
            return
        task = loop.create_task(self._remove(handle.native_id))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _remove(self, name: str) -> None:
        ns = self.options.namespace
        body = client.V1DeleteOptions(propagation_policy="Background")
        for what, fn in (
            ("job", self.batch.delete_namespaced_job),
            ("service", self.core.delete_namespaced_service),
        ):
            try:
                await asyncio.to_thread(fn, name, ns, body=body)
            except ApiException as exc:
                if exc.status != 404:  # gone already is what was wanted
                    log.warning("kubernetes: delete %s %s: %s %s", what, name, exc.status,
                                _api_reason(exc))  # fmt: skip
            except (HTTPError, OSError) as exc:
                log.warning("kubernetes: delete %s %s: cannot reach the API server (%s)",
                            what, name, exc)  # fmt: skip


def _api_reason(exc: ApiException) -> str:
    """The API's own message (its Status body), else the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
        return str(body.get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)
