"""Reservations: what other jobs already hold, which the scheduler must leave alone.

`gpus` maps site → node → GPU indices in use; `wan_gbps` maps a link key ("a|b") to the
bandwidth other jobs have reserved on it. The control plane builds this from its
registry; `cpn plan --held FILE` reads it from YAML.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from cpn.contracts.limits import MAX_GBPS, MAX_GPUS_PER_NODE, Name

_GpuIndex = Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE)]
_Reserved = Annotated[float, Field(ge=0, le=MAX_GBPS, allow_inf_nan=False)]


class Reservations(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: dict[Name, dict[Name, list[_GpuIndex]]] = Field(default_factory=dict)
    wan_gbps: dict[str, _Reserved] = Field(default_factory=dict)

    def held(self, site: str, node: str) -> frozenset[int]:
        return frozenset(self.gpus.get(site, {}).get(node, []))
