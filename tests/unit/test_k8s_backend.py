"""The Kubernetes backend: contract tests against an in-process fake of the API
(tests/k8s_fake.py) served over HTTP to the official `kubernetes` client. No API server
runs on the machines cpn is tested on, so no test here runs a pod: they check the
manifests, the calls (create, get, list, watch, delete; 409 on a second create), and the
state table on the Job and pod objects the API returns."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from agents.backends import BackendError, LaunchSpec, NodeShare, State
from agents.backends.base import HEAD_PLACEHOLDER, LOCAL_PLACEHOLDER, PORT_PLACEHOLDER
from agents.backends.kubernetes import (
    K8S_STATES,
    KubernetesBackend,
    KubernetesOptions,
    manifests,
    resource_name,
)
from tests.k8s_fake import FakeApi, fake_api

NS = "cpn-jobs"
OPTIONS = KubernetesOptions(NS, "registry.example/cpn:1", "cpn-runner", "cpn-work", "/work")


@pytest.fixture
def k8s() -> Iterator[tuple[FakeApi, KubernetesBackend]]:
    with fake_api({NS}) as (api, url):
        api.add_node("gpu-a", 8)
        api.add_node("gpu-b", 8)
        api.add_node("gpu-c", 8, ready=False)
        api.add_node("cpu-1", 0)
        config = client.Configuration(host=url)
        yield api, KubernetesBackend(OPTIONS, "site-k-agent", client.ApiClient(config))


def _spec(job: str = "Job_1", epoch: int = 2) -> LaunchSpec:
    argv = (
        "python", "-m", "cpn", "launch", "--rdzv-endpoint",
        f"{HEAD_PLACEHOLDER}:{PORT_PLACEHOLDER}", "--local-addr", LOCAL_PLACEHOLDER,
    )  # fmt: skip
    return LaunchSpec(
        job_id=job,
        nodes=(NodeShare("gpu-a", (0, 1), (0, 1)), NodeShare("gpu-b", (2, 3), (0, 1))),
        commands=((*argv, "--ranks", "0,1"), (*argv, "--ranks", "2,3")),
        run_dir=Path("/work") / job,
        env={"CPN_JOB_ID": job},
        time_limit_s=3600,
        epoch=epoch,
        stop_grace_s=45.5,
    )


def _wire(model: object) -> Any:
    """A typed model as the client sends it to the API."""
    return client.ApiClient().sanitize_for_serialization(model)  # type: ignore[no-untyped-call]


def test_manifests_from_typed_models() -> None:
    service, job = manifests(_spec(), OPTIONS, "site-k-agent")
    name = resource_name(_spec())
    assert name == "cpn-job-1-e2"
    assert isinstance(job, client.V1Job) and isinstance(service, client.V1Service)
    # What the API gets: the client's own serialisation of the typed models.
    svc = _wire(service)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"job-name": name}
    doc = _wire(job)
    spec = doc["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 3600
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == name
    assert pod["serviceAccountName"] == "cpn-runner"
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert container["env"][-1]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    script = container["command"][2]
    head = f"{name}-0.{name}.{NS}.svc:29400"
    assert (
        f"  0) mkdir -p /work/Job_1/node-0; exec python -m cpn launch --rdzv-endpoint {head} "
        '--local-addr "$POD_IP" --ranks 0,1 > /work/Job_1/node-0/launcher.log 2>&1 ;;' in script
    )
    assert "--ranks 2,3 > /work/Job_1/node-1/launcher.log" in script
    hosts = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    # By node name (the hostname label differs on some clusters), and the workers' stop
    # grace on the pods, where the kubelet reads it (outside review of stop 26).
    # The API refuses a `metadata.name` field selector with more than one value (outside
    # review: a two-value one made every multi-node launch a 422): one term per node.
    assert hosts["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        for node in ("gpu-a", "gpu-b")
    ]
    assert pod["terminationGracePeriodSeconds"] == 46
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "cpn-work"
    labels = doc["metadata"]["labels"]
    assert labels == {"cpn/job": "Job_1", "cpn/epoch": "2", "cpn/agent": "site-k-agent"}


def test_capacity_counts_ready_uncordoned_gpus(k8s: tuple[FakeApi, KubernetesBackend]) -> None:
    _, backend = k8s
    asyncio.run(backend.check())
    cap = asyncio.run(backend.capacity())
    assert [(n.name, n.gpus, n.usable) for n in cap.nodes] == [
        ("gpu-a", 8, True), ("gpu-b", 8, True), ("gpu-c", 0, False),
    ]  # fmt: skip
    assert cap.gpus == 16


@pytest.mark.parametrize("quantity", ["eight", "", "0.5", "-1", "1Ki"])
def test_a_node_with_an_unreadable_gpu_count_is_reported_not_fatal(
    k8s: tuple[FakeApi, KubernetesBackend], quantity: str
) -> None:
    """A device plugin's odd allocatable string, or a node with no status yet, leaves that
    node unusable and named; the agent still reports the rest (it used to stop at start)."""
    api, backend = k8s
    api.add_node("gpu-odd", quantity)
    api.add_bare_node("gpu-new")
    cap = asyncio.run(backend.capacity())
    by_name = {n.name: n for n in cap.nodes}
    if quantity == "1Ki":  # 1024: a whole quantity in the API's notation is a count
        assert (by_name["gpu-odd"].gpus, by_name["gpu-odd"].usable) == (1024, True)
    else:
        odd = by_name["gpu-odd"]
        assert (odd.gpus, odd.usable) == (0, False)
        assert odd.state == "Ready,UnreadableAllocatable(nvidia.com/gpu)"
    new = by_name["gpu-new"]
    assert (new.gpus, new.usable, new.state, new.address) == (0, False, "NotReady", "")
    assert cap.gpus == 16 + (1024 if quantity == "1Ki" else 0)


def test_submit_is_idempotent_and_adopt_finds_it(k8s: tuple[FakeApi, KubernetesBackend]) -> None:
    api, backend = k8s
    handle = asyncio.run(backend.submit(_spec()))
    assert asyncio.run(backend.submit(_spec())) is handle
    # A restarted agent (a new backend) submitting the same launch meets 409 and reuses it.
    again = KubernetesBackend(OPTIONS, "site-k-agent", backend.api)
    assert asyncio.run(again.submit(_spec())).native_id == handle.native_id
    creates = [p for m, p in api.requests if m == "POST" and p.endswith("/jobs")]
    assert len(creates) == 2 and len(api.objects["jobs"]) == 1
    found = asyncio.run(KubernetesBackend(OPTIONS, "site-k-agent", backend.api).adopt())
    assert [(h.job_id, h.epoch, h.native_id, h.nodes) for h in found] == [
        ("Job_1", 2, handle.native_id, handle.nodes)
    ]
    assert asyncio.run(KubernetesBackend(OPTIONS, "other", backend.api).adopt()) == []
    # One that ended while the agent was away is adopted too: its end is still to report.
    api.set_job(NS, handle.native_id, {"conditions": [{"type": "Complete", "status": "True"}]})
    (ended,) = asyncio.run(KubernetesBackend(OPTIONS, "site-k-agent", backend.api).adopt())
    assert asyncio.run(again.poll(ended)).state is State.SUCCEEDED


def test_every_state_from_job_and_pod_objects(k8s: tuple[FakeApi, KubernetesBackend]) -> None:
    api, backend = k8s
    handle = asyncio.run(backend.submit(_spec()))
    name = handle.native_id

    def status(job: dict[str, Any], *pods: dict[str, Any]) -> tuple[State, str, str]:
        api.objects["pods"].clear()
        for i, pod in enumerate(pods):
            api.add_pod(NS, name, i, pod)
        api.set_job(NS, name, job)
        s = asyncio.run(backend.poll(handle))
        return s.state, s.native, s.reason

    unschedulable = {
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/4 nodes: GPUs"}
        ]
    }  # fmt: skip
    assert status({}, unschedulable) == (State.PENDING, "Pending", "0/4 nodes: GPUs")
    assert status({"active": 2, "ready": 1})[:2] == (State.STARTING, "Starting")
    assert status({"active": 2, "ready": 2})[:2] == (State.RUNNING, "Running")
    suspended = {"conditions": [{"type": "Suspended", "status": "True", "message": "Kueue"}]}
    assert status(suspended)[:2] == (State.PENDING, "Suspended")
    complete = {"conditions": [{"type": "Complete", "status": "True"}]}
    assert status(complete)[:2] == (State.SUCCEEDED, "Complete")
    assert asyncio.run(backend.poll(handle)).exit_code == 0
    failed = {
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
             "message": "Job has reached the specified backoff limit"}
        ]
    }  # fmt: skip
    exited = {"containerStatuses": [{"name": "launcher", "ready": False, "restartCount": 0,
              "image": "i", "imageID": "", "state": {"terminated": {"exitCode": 7}}}]}  # fmt: skip
    assert status(failed, exited)[:2] == (State.FAILED, "Failed/BackoffLimitExceeded")
    assert asyncio.run(backend.poll(handle)).exit_code == 7
    deadline = {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}
    assert status(deadline)[:2] == (State.FAILED, "Failed/DeadlineExceeded")
    for reason, state in (
        ("PreemptionByScheduler", State.PREEMPTED),
        ("EvictionByEvictionAPI", State.PREEMPTED),
        ("DeletionByTaintManager", State.NODE_LOST),
    ):
        pod = {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": reason}]}
        assert status(failed, pod)[:2] == (state, f"Pod/{reason}")
    assert all(native in K8S_STATES for native in ("Complete", "Deleted", "Pending"))


def test_cancel_deletes_and_wait_watches(k8s: tuple[FakeApi, KubernetesBackend]) -> None:
    api, backend = k8s
    handle = asyncio.run(backend.submit(_spec()))
    assert asyncio.run(backend.poll(handle)).state is State.PENDING
    # wait() watches from the resourceVersion poll() read: a change ends it at once.
    threading.Timer(
        0.3, lambda: api.set_job(NS, handle.native_id, {"active": 2, "ready": 2})
    ).start()
    started = time.monotonic()
    asyncio.run(backend.wait(handle, 5))
    assert time.monotonic() - started < 3
    assert asyncio.run(backend.poll(handle)).state is State.RUNNING
    watched = [p for m, p in api.requests if "watch=" in p.lower()]
    assert watched and "resourceVersion=" in watched[0]
    asyncio.run(backend.cancel(handle, 1))
    assert api.job(NS, handle.native_id) is None and not api.objects["services"]
    s = asyncio.run(backend.poll(handle))
    assert (s.state, s.native) == (State.CANCELLED, "Deleted")


def test_errors_are_one_line(tmp_path: Path) -> None:
    with fake_api({"elsewhere"}) as (_, url):
        backend = KubernetesBackend(OPTIONS, "a", client.ApiClient(client.Configuration(host=url)))
        with pytest.raises(
            BackendError, match=rf'^kubernetes: namespace {NS!r}: 404 namespaces "{NS}" not found$'
        ):
            asyncio.run(backend.check())
    gone = client.Configuration(host=url)  # the server is shut down now
    gone.retries = False
    backend = KubernetesBackend(OPTIONS, "a", client.ApiClient(gone))
    with pytest.raises(BackendError, match=r"^kubernetes: .*cannot reach the API server"):
        asyncio.run(backend.check())


def test_the_agent_builds_it_from_a_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agents.agent import make_backend  # noqa: PLC0415
    from agents.config import AgentConfig, KubernetesSettings  # noqa: PLC0415
    from agents.hardware import Hardware  # noqa: PLC0415

    with fake_api({NS}) as (api, url):
        api.add_node("gpu-a", 4)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{url}'}}}}]\n"
            "users: [{name: me, user: {token: t0ken}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
        )
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        config = AgentConfig(
            site="k", control="127.0.0.1:1", token="x", agent_id="k-agent", node_name="n",
            backend="kubernetes", kubernetes=KubernetesSettings(NS, "img", None, "claim"),
            work_dir=tmp_path / "work",
        )  # fmt: skip
        backend = make_backend(config, Hardware(config))
        assert backend.site_wide and backend.name == "kubernetes"
        asyncio.run(backend.check())
        assert [(n.name, n.gpus) for n in asyncio.run(backend.capacity()).nodes] == [("gpu-a", 4)]


def test_without_the_kubernetes_package_the_agent_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is an optional extra (`pip install cpn` and the Docker image lack it): one line
    naming the extra, not a ModuleNotFoundError traceback (outside review)."""
    from agents.agent import AgentError, make_backend  # noqa: PLC0415
    from agents.config import AgentConfig, KubernetesSettings  # noqa: PLC0415
    from agents.hardware import Hardware  # noqa: PLC0415

    for name in [m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` now fails
    config = AgentConfig(
        site="k", control="127.0.0.1:1", token="x", agent_id="k-agent", node_name="n",
        backend="kubernetes", kubernetes=KubernetesSettings(NS, "img", None, None),
        work_dir=tmp_path / "work",
    )  # fmt: skip
    with pytest.raises(AgentError, match=r"pip install 'cpn\[kubernetes\]'"):
        make_backend(config, Hardware(config))


def test_a_launch_forgotten_after_its_end_leaves_nothing_in_the_namespace(
    k8s: tuple[FakeApi, KubernetesBackend],
) -> None:
    """Every (job, epoch) made a Job, its pods and a Service that nothing removed: once the
    agent has reported the end and forgets the launch, they are deleted."""
    api, backend = k8s
    handle = asyncio.run(backend.submit(_spec()))
    api.set_job(NS, handle.native_id, {"succeeded": 2, "conditions": [
        {"type": "Complete", "status": "True"}]})  # fmt: skip
    assert asyncio.run(backend.poll(handle)).state is State.SUCCEEDED

    async def forget_then_settle() -> None:
        backend.forget(handle)  # from the agent's loop, as launches.py calls it
        while backend._removals:  # the deletes it scheduled
            await asyncio.sleep(0.05)

    asyncio.run(forget_then_settle())
    assert api.job(NS, handle.native_id) is None and not api.objects["services"]
    assert asyncio.run(backend.adopt()) == []  # nothing left for a restarted agent
