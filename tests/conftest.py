"""Shared pytest fixtures live in plugin modules, one per concern.

Property tests are derandomized: CI runs the same examples every time, so a red run is a
regression and not a new random draw. Explore with fresh random examples locally with
`pytest --hypothesis-profile=explore` (and keep what it finds as an explicit test).
"""

import pytest
from hypothesis import settings

settings.register_profile("cpn", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("cpn")

pytest_plugins = ["tests.databases"]

#: Test files that share something machine-wide, by what they share. Run on two
#: pytest-xdist workers (`pytest -n 2 --dist loadgroup -m "not serial"`, then `-m serial`),
#: the files of one group run on the same worker, one test at a time, never side by side.
#: - netns: network namespaces, veth/bridge names and 198.18.0.0/15 subnets (the demo's,
#:   the emulation tests', the partition test's), and the stale-namespace sweeps that
#:   remove what another test made;
#: - slurm: test clusters whose node crash freezes and kills processes by name.
#: Tests marked `serial` must run alone. `make unit` still runs the suite serially.
SERIAL_GROUPS = {
    "netns": (
        "tests/integration/test_compose.py",
        "tests/integration/test_demo.py",
        "tests/integration/test_partition_netns.py",
        "tests/integration/test_readme.py",
        "tests/unit/test_cli_demo.py",
        "tests/unit/test_wan_emulation.py",
    ),
    "slurm": (
        "tests/integration/test_slurm_agent.py",
        "tests/integration/test_slurm_backend.py",
    ),
}
_GROUP_OF = {path: group for group, paths in SERIAL_GROUPS.items() for path in paths}


def pytest_itemcollected(item: pytest.Item) -> None:
    # Marked as each test is collected: xdist turns the marks into its work units in a
    # collection_modifyitems hook of its own, which may run before any of ours.
    group = _GROUP_OF.get(item.nodeid.split("::")[0])
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))
