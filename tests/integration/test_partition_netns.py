"""A site cut off by the network, for real: each site's agent and workers run in a network
namespace of their own (cpn.emulated_wan, the control plane in the root namespace on the
bridge), and one site's link is set down, then up again. Its job is planned again on the
other site and resumes from the checkpoint fixed at the fence; the cut-off agent stops its
own workers after a lease TTL without the control plane, and when the link comes back it
registers again and nothing of the old epoch is used. Needs root and iproute2 (skipped
otherwise); every namespace, veth and bridge is removed however the test ends."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cpn import emulated_wan
from cpn.emulated_wan import EmulatedWan
from tests.processes import wait_until, worker_pids
from tests.service_harness import cluster, make_key, tiny_job

pytestmark = pytest.mark.slow

#: This test's own namespaces, interface names and /24 (nobody else uses them).
PREFIX, IFPREFIX, SUBNET = "chaos11", "c11", "198.18.40"
POSSIBLE, WHY_NOT = emulated_wan.available(PREFIX)


def _link(wan: EmulatedWan, site: int, state: str) -> None:
    """Set a site's uplink (its only way out of its namespace) down or up."""
    subprocess.run(
        ["ip", "-n", wan.namespace(site), "link", "set", wan.interface, state],
        check=True,
        timeout=30,
    )


@pytest.mark.skipif(not POSSIBLE, reason=f"no network namespaces here: {WHY_NOT}")
def test_a_site_whose_link_is_cut_is_fenced_and_its_job_resumes_elsewhere(
    tmp_path: Path,
) -> None:
    steps, every, ttl = 200, 5, 3.0
    doc = tiny_job("cut-link", dp=1, pp=2, steps=steps, recovery={"checkpoint_every": every})
    store = tmp_path / "checkpoints"
    env = {"CPN_CHECKPOINT_ROOT": str(store), "CPN_STOP_GRACE_S": "4"}
    with EmulatedWan(
        2, None, prefix=PREFIX, subnet=SUBNET, ifprefix=IFPREFIX, host_link=True
    ) as wan:
        sites = {"a": 0, "b": 1}
        with cluster(
            tmp_path,
            {"a": 1, "b": 2},
            env=env,
            lease_ttl=ttl,
            control_host=wan.host_address,
            agent_prefix={s: wan.prefix(i) for s, i in sites.items()},
            agent_extra={s: ["--probe-host", wan.address(i)] for s, i in sites.items()},
            agent_env={s: {"GLOO_SOCKET_IFNAME": wan.interface} for s in sites},
        ) as c:
            client = c.client(make_key(c.db_url, "alice"))
            job_id = client.submit(doc).id
            first = store / job_id / "e1"
            wait_until((first / f"step-{2 * every:08d}" / "COMPLETE").exists, 120, "checkpoints")
            wait_until(lambda: client.job(job_id).progress.step > 2 * every, 60, "steps")
            placed = client.job(job_id).plan
            assert placed is not None and placed.sites_used() == ["b"]
            _link(wan, sites["b"], "down")
            try:
                wait_until(lambda: client.job(job_id).epoch == 2, 60, "the job planned again")
                fence = next(e for e in client.events(job_id) if e.data.get("to") == "rescheduling")
                fenced_at = int(fence.data["checkpoint"]["step"])
                assert "lease expired" in fence.message, fence.message
                # Cut off, site b's agent stops its own workers after a TTL.
                wait_until(lambda: not worker_pids(job_id, "work-b"), 30, "site b to fence itself")
                assert "fenced: no lease renewal" in c.agents["b"].text()
            finally:
                _link(wan, sites["b"], "up")
            # Back: site b registers again (the topology has both sites again).
            wait_until(lambda: len(client.topology().sites) == 2, 60, "site b back")
            done = wait_until(
                lambda: (j := client.job(job_id)).state.value in ("succeeded", "failed") and j,
                180,
                "the job to end",
            )
            assert done.state.value == "succeeded", (done.reason, done.failure)
            assert done.plan is not None and done.plan.sites_used() == ["a"]
            # One loss of infrastructure; the old epoch's end counted as nothing more.
            assert (done.epoch, done.losses, done.restarts) == (2, 1, 0)
            # Epoch 2 resumed from the checkpoint fixed at the fence.
            metrics = (tmp_path / "work-a" / job_id / "rank-0.metrics.jsonl").read_text()
            ran = [json.loads(line)["step"] for line in metrics.splitlines()]
            assert ran == list(range(fenced_at, steps))
            series = client.metrics(job_id)
            assert [s.step for s in series.steps] == list(range(steps))
    assert emulated_wan.leftovers(PREFIX, IFPREFIX) == []  # namespaces, veths, bridge
