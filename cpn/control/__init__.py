"""The control plane's gRPC side (control layer): the agent service, leases, orders.

`ControlServer` serves `cpn.v1.AgentService` (proto/cpn/v1/agent.proto) with per-site
bearer tokens, health and reflection; keeps hot lease state in memory and declares agents
lost when their leases expire; its `dispatcher` is how the orchestration sends launch and
stop orders to agents.
"""

from cpn.control.dispatch import AssignmentDispatcher
from cpn.control.server import ControlServer, PortInUse
from cpn.control.servicer import TaskReport
from cpn.control.settings import ControlSettings
from cpn.control.tokens import SiteTokens

__all__ = [
    "AssignmentDispatcher",
    "ControlServer",
    "ControlSettings",
    "PortInUse",
    "SiteTokens",
    "TaskReport",
]
