"""What a host has: GPUs (NVML, nvidia-smi, torch.cuda or declared virtual slots) and RDMA
NIC ports (sysfs)."""

from agents.discovery.gpus import DiscoveredGpu, GpuDiscovery, VirtualGpus, discover_gpus
from agents.discovery.rdma import DiscoveredNic, discover_rdma

__all__ = [
    "DiscoveredGpu",
    "DiscoveredNic",
    "GpuDiscovery",
    "VirtualGpus",
    "discover_gpus",
    "discover_rdma",
]
