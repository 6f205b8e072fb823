"""Reservations: what other jobs already hold, which the scheduler must leave alone.

`gpus` maps site → node → GPU indices in use; `wan_gbps` maps a link key ("a|b") to the
bandwidth other jobs have reserved on it. The control plane builds this from its
registry; `cpn plan --held FILE` reads it from YAML.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Reservations(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: dict[str, dict[str, list[int]]] = Field(default_factory=dict)
    wan_gbps: dict[str, float] = Field(default_factory=dict)

    def held(self, site: str, node: str) -> frozenset[int]:
        return frozenset(self.gpus.get(site, {}).get(node, []))
