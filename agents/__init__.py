"""The cluster agent (resource layer): discovers a site's GPUs and RDMA NICs, measures the
WAN to other sites, registers with the control plane and keeps its lease, and launches the
workers it is ordered to run.

It talks to the control plane only through the generated protocol code in `proto/` (it
imports nothing from `cpn.registry`, `cpn.control` or `cpn.scheduler`), so it can be
deployed on GPU hosts that run nothing else of cpn.
"""

__version__ = "0.1.0"
