"""Explicit conversion between the protocol's enums and the registry's strings.

Each table is complete for the values the protocol defines; a value that is unset
(`*_UNSPECIFIED`) or unknown to this build (a newer agent) is rejected with the field
named, never silently mapped to something.
"""

from __future__ import annotations

from typing import TypeVar

from cpn.control.errors import InvalidField
from cpn.registry.models import TaskState
from proto.cpn.v1 import agent_pb2 as pb

T = TypeVar("T")

RDMA_TRANSPORTS: dict[int, str] = {
    pb.RDMA_TRANSPORT_INFINIBAND: "infiniband",
    pb.RDMA_TRANSPORT_ROCE: "roce",
    pb.RDMA_TRANSPORT_IWARP: "iwarp",
}
PORT_STATES: dict[int, str] = {
    pb.PORT_STATE_DOWN: "down",
    pb.PORT_STATE_INIT: "init",
    pb.PORT_STATE_ARMED: "armed",
    pb.PORT_STATE_ACTIVE: "active",
    pb.PORT_STATE_ACTIVE_DEFER: "active_defer",
}
GPU_SOURCES: dict[int, str] = {
    pb.GPU_SOURCE_NVML: "nvml",
    pb.GPU_SOURCE_NVIDIA_SMI: "nvidia-smi",
    pb.GPU_SOURCE_TORCH_CUDA: "torch-cuda",
    pb.GPU_SOURCE_VIRTUAL: "virtual",
}
HEALTH: dict[int, str] = {
    pb.HEALTH_OK: "ok",
    pb.HEALTH_DEGRADED: "degraded",
    pb.HEALTH_FAILING: "failing",
}
TASK_STATES: dict[int, TaskState] = {
    pb.TASK_STATE_STARTING: TaskState.STARTING,
    pb.TASK_STATE_RUNNING: TaskState.RUNNING,
    pb.TASK_STATE_SUCCEEDED: TaskState.SUCCEEDED,
    pb.TASK_STATE_FAILED: TaskState.FAILED,
    pb.TASK_STATE_STOPPED: TaskState.STOPPED,
    pb.TASK_STATE_PENDING: TaskState.PENDING,
    pb.TASK_STATE_CANCELLED: TaskState.CANCELLED,
    pb.TASK_STATE_PREEMPTED: TaskState.PREEMPTED,
    pb.TASK_STATE_NODE_LOST: TaskState.NODE_LOST,
}


def _lookup(table: dict[int, T], value: int, field: str, what: str) -> T:
    if value in table:
        return table[value]
    if value == 0:
        raise InvalidField(field, f"{what} must be set")
    raise InvalidField(field, f"unknown {what} {value}")


def rdma_transport(value: int, field: str) -> str:
    return _lookup(RDMA_TRANSPORTS, value, field, "transport")


def port_state(value: int, field: str) -> str:
    return _lookup(PORT_STATES, value, field, "port state")


def gpu_source(value: int, field: str) -> str:
    return _lookup(GPU_SOURCES, value, field, "GPU source")


def health(value: int, field: str) -> str:
    return _lookup(HEALTH, value, field, "health")


def task_state(value: int, field: str) -> TaskState:
    return _lookup(TASK_STATES, value, field, "task state")
