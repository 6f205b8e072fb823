"""What a site engine's agent registers: the nodes the engine offers, and on a node it no
longer offers the GPUs a started launch of the agent holds there (numbered from 0, as the
protocol wants: up to the highest held) — a registration the control plane accepts."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agents.agent import site_inventory
from agents.backends import Capacity
from agents.backends.base import NodeCapacity
from agents.backends.local import LocalBackend
from agents.config import AgentConfig
from cpn.control import validation
from proto.cpn.v1 import agent_pb2 as pb

CONFIG = AgentConfig(
    site="b", control="127.0.0.1:1", token="t", agent_id="b-agent", node_name="n",
    work_dir=Path("/nonexistent"),
)  # fmt: skip

nodes = st.lists(st.tuples(st.integers(0, 8), st.booleans()), min_size=0, max_size=5).map(
    lambda specs: Capacity(
        tuple(
            # As the engines report it: a node they do not offer has no GPUs to give.
            NodeCapacity(f"node{i}", gpus if usable else 0, usable, "IDLE" if usable else "DRAIN")
            for i, (gpus, usable) in enumerate(specs)
        )
    )
)
held = st.sets(st.tuples(st.sampled_from([f"node{i}" for i in range(7)]), st.integers(0, 7)))


def _registered(inventory: pb.Inventory) -> set[tuple[str, int]]:
    return {(n.name, g.index) for n in inventory.nodes for g in n.gpus}


@given(nodes, held)
def test_a_node_not_offered_keeps_the_gpus_a_launch_holds_and_registers(
    capacity: Capacity, busy: set[tuple[str, int]]
) -> None:
    inventory = site_inventory(capacity, CONFIG, LocalBackend("n"), busy)
    registered = _registered(inventory)
    offered = {(n.name, i) for n in capacity.nodes if n.usable for i in range(n.gpus)}
    down = {n.name for n in capacity.nodes if not n.usable}
    kept = {(node, g) for node, g in busy if node in down}
    # Every GPU offered and every held GPU of a node not offered; on such a node nothing
    # beyond the highest held GPU; no node without a GPU, none the engine does not know.
    assert offered | kept <= registered
    for node in down:
        top = max((g for name, g in kept if name == node), default=-1)
        assert {g for name, g in registered if name == node} == set(range(top + 1))
    assert {name for name, _ in registered - offered} <= down
    # The control plane takes it (GPU indices 0..count-1 on each node, as validated).
    if inventory.nodes:
        request = pb.RegisterRequest(
            site="b", agent_id="b-agent", inventory=inventory, probe_address="127.0.0.1:9"
        )
        assert len(validation.register_request(request).nodes) == len(inventory.nodes)


def test_a_drained_node_under_a_launch_is_registered_with_its_gpus_then_dropped() -> None:
    drained = Capacity((NodeCapacity("node1", 2), NodeCapacity("node2", 0, False, "DRAINING")))
    running = site_inventory(drained, CONFIG, LocalBackend("n"), {("node2", 1), ("node1", 1)})
    assert [(n.name, [g.index for g in n.gpus]) for n in running.nodes] == [
        ("node1", [0, 1]),
        ("node2", [0, 1]),
    ]
    ended = site_inventory(drained, CONFIG, LocalBackend("n"), set())
    assert [n.name for n in ended.nodes] == ["node1"]
