"""The agent's own view of its health, and its reconnect backoff."""

from __future__ import annotations

import shutil
from itertools import pairwise
from pathlib import Path

from agents.backoff import Backoff
from agents.config import AgentConfig
from agents.discovery import VirtualGpus
from agents.hardware import Hardware
from proto.cpn.v1 import agent_pb2 as pb

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_a_port_going_down_degrades_health(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    shutil.copytree(FIXTURES / "sysfs-infiniband", sysfs)
    hardware = Hardware(
        AgentConfig(
            site="a",
            control="127.0.0.1:1",
            token="t",
            agent_id="a-n",
            node_name="n",
            virtual=VirtualGpus(2),
            sysfs_root=sysfs,
            work_dir=tmp_path,
        )
    )
    inventory = hardware.discover()
    assert [n.device for n in inventory.nodes[0].rdma_nics] == ["mlx5_0", "mlx5_1"]
    assert hardware.check_health() == (pb.HEALTH_OK, "")
    # mlx5_1 was down from the start: not news. mlx5_0 going down is.
    state = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "state"
    state.write_text("1: DOWN\n")
    assert hardware.check_health() == (pb.HEALTH_DEGRADED, "RDMA mlx5_0 port 1 no longer active")
    state.write_text("4: ACTIVE\n")
    assert hardware.check_health() == (pb.HEALTH_OK, "")


def test_backoff_grows_to_its_cap_and_resets() -> None:
    backoff = Backoff(initial_s=0.5, max_s=4.0, current_s=0.5)
    delays = [backoff.next() for _ in range(20)]
    assert 0.4 <= delays[0] <= 0.6
    assert all(later >= earlier * 0.6 for earlier, later in pairwise(delays))
    assert max(delays) <= 4.0  # the cap holds with the jitter: restart grace is sized on it
    backoff.reset()
    assert backoff.next() <= 0.6
