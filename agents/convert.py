"""From what discovery found to the protocol's messages (and nothing else: the agent
knows the control plane only through `proto/`)."""

from __future__ import annotations

from agents.discovery import DiscoveredGpu, DiscoveredNic
from proto.cpn.v1 import agent_pb2 as pb

GPU_SOURCES = {
    "nvml": pb.GPU_SOURCE_NVML,
    "nvidia-smi": pb.GPU_SOURCE_NVIDIA_SMI,
    "torch-cuda": pb.GPU_SOURCE_TORCH_CUDA,
    "virtual": pb.GPU_SOURCE_VIRTUAL,
}
TRANSPORTS = {
    "infiniband": pb.RDMA_TRANSPORT_INFINIBAND,
    "roce": pb.RDMA_TRANSPORT_ROCE,
    "iwarp": pb.RDMA_TRANSPORT_IWARP,
}
PORT_STATES = {
    "down": pb.PORT_STATE_DOWN,
    "init": pb.PORT_STATE_INIT,
    "armed": pb.PORT_STATE_ARMED,
    "active": pb.PORT_STATE_ACTIVE,
    "active_defer": pb.PORT_STATE_ACTIVE_DEFER,
}


def gpu_message(gpu: DiscoveredGpu) -> pb.Gpu:
    return pb.Gpu(
        index=gpu.index,
        model=gpu.model,
        memory_gb=gpu.memory_gb,
        tflops=gpu.tflops,
        uuid=gpu.uuid[:64],
        source=GPU_SOURCES[gpu.source],
    )


def nic_message(nic: DiscoveredNic) -> pb.RdmaNic:
    return pb.RdmaNic(
        device=nic.device,
        port=nic.port,
        transport=TRANSPORTS[nic.transport],
        roce_version=nic.roce_version,
        rate_gbps=nic.rate_gbps,
        state=PORT_STATES.get(nic.state, pb.PORT_STATE_DOWN),
    )


def node_message(
    name: str, gpus: list[DiscoveredGpu], nics: list[DiscoveredNic], intra_node_gbps: float
) -> pb.Node:
    return pb.Node(
        name=name,
        gpu_count=len(gpus),
        gpus=[gpu_message(g) for g in gpus],
        rdma_nics=[nic_message(n) for n in nics],
        intra_node_gbps=intra_node_gbps,
    )
