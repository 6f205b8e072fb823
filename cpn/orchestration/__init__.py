"""Orchestration (ITU-T Y.2501's orchestration & management layer): the job lifecycle.

- `states`: the job state machine; every transition is an event row with its reason;
- `service.JobService`: what the REST API asks — submit (idempotent, quota, "can it ever
  fit?"), list, get with progress, cancel, events, per-step metrics, logs;
- `quotes`: ranked candidate plans with predicted time, WAN bytes and price;
- `admission`: gang admission — plan, GPUs, WAN reservations, rendezvous port, in one
  transaction;
- `loop.Orchestrator`: the loop that admits, launches, follows and ends jobs;
- `tenants`: API keys → tenant and role;
- `metrics`: Prometheus metrics.

It uses the control layer (registry, scheduler, dispatcher); the control layer never
imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cpn.orchestration.errors import (
        Conflict,
        InvalidRequest,
        NeverFits,
        NotFound,
        QuotaExceeded,
        ServiceError,
        Unauthorized,
    )
    from cpn.orchestration.metrics import ServiceMetrics
    from cpn.orchestration.service import JobService, JobView, QuoteChoice
    from cpn.orchestration.tenants import Principal

#: Where each name lives, imported on first use (PEP 562): `cpn keys` needs `tenants`
#: only, and importing the service with it pulled in the scheduler and OR-Tools (2 s of
#: CPU per command).
_HOME = {
    **dict.fromkeys(
        ("Conflict", "InvalidRequest", "NeverFits", "NotFound", "QuotaExceeded",
         "ServiceError", "Unauthorized"),
        "errors",
    ),
    "ServiceMetrics": "metrics",
    **dict.fromkeys(("JobService", "JobView", "QuoteChoice"), "service"),
    "Principal": "tenants",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "Conflict",
    "InvalidRequest",
    "JobService",
    "JobView",
    "NeverFits",
    "NotFound",
    "Principal",
    "QuotaExceeded",
    "QuoteChoice",
    "ServiceError",
    "ServiceMetrics",
    "Unauthorized",
]
