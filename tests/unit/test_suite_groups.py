"""The files `tests/conftest.py` keeps on one xdist worker exist: a renamed file would
otherwise run beside the tests it must not overlap, and fail only now and then."""

from pathlib import Path

from tests.conftest import SERIAL_GROUPS

ROOT = Path(__file__).resolve().parents[2]


def test_every_grouped_file_exists() -> None:
    for group, paths in SERIAL_GROUPS.items():
        for path in paths:
            assert (ROOT / path).is_file(), (group, path)
