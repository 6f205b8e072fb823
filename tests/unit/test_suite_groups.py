"""The files `tests/conftest.py` keeps on one xdist worker exist: a renamed file would
otherwise run beside the tests it must not overlap, and fail only now and then."""

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import SERIAL_GROUPS

ROOT = Path(__file__).resolve().parents[2]


def test_every_grouped_file_exists() -> None:
    for group, paths in SERIAL_GROUPS.items():
        for path in paths:
            assert (ROOT / path).is_file(), (group, path)


def test_xdist_keeps_a_group_on_one_worker(tmp_path: Path) -> None:
    """`make unit`'s grouping is silent when it breaks (it did, with pytest 9.2): a group
    marked as tests/conftest.py marks them must run on one worker, and the rest spread."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "def pytest_itemcollected(item):\n"
        "    if 'grouped' in item.nodeid:\n"
        "        item.add_marker(pytest.mark.xdist_group('g'))\n"
    )
    (tmp_path / "test_grouped.py").write_text(
        "import pytest, time\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_g(i): time.sleep(0.2)\n"
    )
    (tmp_path / "test_free.py").write_text(
        "import pytest, time\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_f(i): time.sleep(0.2)\n"
    )
    argv = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v"]
    argv += ["-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path)]
    done = subprocess.run(
        argv, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:]
    workers: dict[str, set[str]] = {"grouped": set(), "free": set()}
    for line in done.stdout.splitlines():
        match = re.match(r"\[(gw\d+)\].*PASSED test_(grouped|free)\.py", line)
        if match:
            workers[match.group(2)].add(match.group(1))
    assert len(workers["grouped"]) == 1, done.stdout[-2000:]
    assert workers["free"], done.stdout[-2000:]
