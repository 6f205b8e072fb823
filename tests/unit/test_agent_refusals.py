"""A report or a heartbeat the control plane refuses as invalid costs the agent that one
message, never its session or its lease: a real server, the agent's own ControlLink,
ReportQueue and heartbeat."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import select

from agents.agent import Agent
from agents.config import AgentConfig
from agents.discovery import VirtualGpus
from agents.probe import ProbeResult
from agents.tasks import TaskUpdate
from cpn.registry.models import Task
from proto.cpn.v1 import agent_pb2 as pb
from tests.control_harness import control_server
from tests.processes import TOKENS


def test_refused_reports_and_heartbeats_do_not_end_the_session(tmp_path: Path) -> None:
    with control_server(f"sqlite:///{tmp_path}/cpn.db") as srv:
        agent = Agent(
            AgentConfig(
                site="a",
                control=f"127.0.0.1:{srv.server.port}",
                token=TOKENS["a"],
                agent_id="a-n",
                node_name="n",
                virtual=VirtualGpus(2),
                work_dir=tmp_path,
            )
        )

        async def scenario() -> str:
            agent.inventory = agent.hardware.discover()
            agent.control.connect()
            try:
                await agent.control.register(agent.inventory, "127.0.0.1:1")
                # A report for a job the control plane never ordered is refused...
                agent.reports.put(
                    TaskUpdate(job_id="no-such-job", rank=0, state=pb.TASK_STATE_RUNNING)
                )
                deliver = asyncio.create_task(
                    agent.reports.deliver(agent._request, agent.control.report)
                )
                await asyncio.sleep(1.0)
                assert not deliver.done(), "a refused report ended the delivery"
                deliver.cancel()
                # ... and a heartbeat carrying a measurement from a clock a day ahead is
                # refused too: it goes again without it, and the lease is renewed.
                agent.links.record(
                    "b", ProbeResult(rtt_ms=1.0, bandwidth_gbps=1.0, measured_at=4e9)
                )
                await agent.heartbeat()
                await agent.heartbeat()
                assert agent.links.pending() == []  # the refused one was let go
                return agent.control.lease
            finally:
                await agent.control.close()

        lease = asyncio.run(scenario())
        assert lease
        with srv.registry.read() as s:
            assert list(s.scalars(select(Task))) == []
