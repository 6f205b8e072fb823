"""What a site engine's agent registers: the nodes the engine offers, and on a node it no
longer offers only the GPUs a running launch of the agent holds there."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agents.agent import site_inventory
from agents.backends import Capacity
from agents.backends.base import NodeCapacity
from agents.backends.local import LocalBackend
from agents.config import AgentConfig

CONFIG = AgentConfig(
    site="b", control="127.0.0.1:1", token="t", agent_id="b-agent", node_name="n",
    work_dir=Path("/nonexistent"),
)  # fmt: skip

nodes = st.lists(st.tuples(st.integers(0, 4), st.booleans()), min_size=0, max_size=5).map(
    lambda specs: Capacity(
        tuple(
            # As the engines report it: a node they do not offer has no GPUs to give.
            NodeCapacity(f"node{i}", gpus if usable else 0, usable, "IDLE" if usable else "DRAIN")
            for i, (gpus, usable) in enumerate(specs)
        )
    )
)
held = st.sets(st.tuples(st.sampled_from([f"node{i}" for i in range(7)]), st.integers(0, 3)))


@given(nodes, held)
def test_a_node_not_offered_keeps_only_the_gpus_a_launch_holds(
    capacity: Capacity, busy: set[tuple[str, int]]
) -> None:
    inventory = site_inventory(capacity, CONFIG, LocalBackend("n"), busy)
    registered = {(n.name, g.index) for n in inventory.nodes for g in n.gpus}
    offered = {(n.name, i) for n in capacity.nodes if n.usable for i in range(n.gpus)}
    known = {n.name for n in capacity.nodes}
    down = {n.name for n in capacity.nodes if not n.usable}
    # Every GPU offered, whether held or not.
    assert offered <= registered
    # Beyond them, exactly the held GPUs of nodes the engine knows but does not offer.
    assert registered - offered == {(node, g) for node, g in busy if node in down}
    # No node without a GPU, none the engine does not know.
    assert all(n.gpus for n in inventory.nodes)
    assert {n.name for n in inventory.nodes} <= known


def test_a_drained_node_under_a_launch_is_registered_with_its_gpus_then_dropped() -> None:
    drained = Capacity((NodeCapacity("node1", 2), NodeCapacity("node2", 0, False, "DRAINING")))
    running = site_inventory(drained, CONFIG, LocalBackend("n"), {("node2", 0), ("node1", 1)})
    assert [(n.name, [g.index for g in n.gpus]) for n in running.nodes] == [
        ("node1", [0, 1]),
        ("node2", [0]),
    ]
    ended = site_inventory(drained, CONFIG, LocalBackend("n"), set())
    assert [n.name for n in ended.nodes] == ["node1"]
