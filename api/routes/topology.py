"""/v1/topology: the live network as the scheduler sees it, in the topology contract
(docs/contracts.md), so that `cpn plan --topology` can read it; and what jobs hold, in the
reservations format `cpn plan --held` reads."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import PrincipalDep, SessionDep
from cpn.contracts import Reservations, Topology
from cpn.orchestration.errors import NotFound
from cpn.registry import EmptyRegistry, build_topology

router = APIRouter(prefix="/v1/topology", tags=["topology"])


def _live(session: SessionDep) -> tuple[Topology, Reservations]:
    try:
        return build_topology(session)
    except EmptyRegistry as exc:
        raise NotFound(f"topology: {exc}") from None


@router.get("", response_model=Topology, responses={404: {"description": "No live site"}})
def get_topology(session: SessionDep, _principal: PrincipalDep) -> Topology:
    """Sites with live agents, their nodes and GPUs, and the WAN links the agents measured."""
    return _live(session)[0]


@router.get("/reservations", response_model=Reservations)
def get_reservations(session: SessionDep, _principal: PrincipalDep) -> Reservations:
    """GPUs (site → node → indices) and WAN bandwidth (link → Gb/s) jobs hold now."""
    return _live(session)[1]
