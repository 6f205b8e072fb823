"""`wan: auto`'s measured-links file as a hostile or careless host leaves it: whatever is
at the path, a rank's reading is a bandwidth in (0, MAX_GBPS], nothing, or one
`LinksFileError` line — never another exception (a rank that raises leaves the others
waiting in the step's agreement), never a blocking read, and a bad file is logged once,
not at every step."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpn.contracts.limits import MAX_GBPS
from cpn.train.links_file import MAX_LINKS_BYTES, LinksFileError, read_narrowest, write_links
from cpn.train.wan_auto import _LinksFile

PEERS = {"west"}


def _read(path: Path) -> float | None:
    try:
        return read_narrowest(path, PEERS)
    except LinksFileError:
        return None


def _json(draw_value: object) -> bytes:
    return json.dumps(draw_value, allow_nan=True).encode()


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
bandwidths = st.one_of(st.floats(), st.integers(), st.booleans(), st.text(max_size=3), st.none())


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.one_of(
        st.binary(max_size=200),
        values.map(_json),
        st.builds(lambda g: _json({"links": {"west": {"bandwidth_gbps": g}}}), bandwidths),
    )
)
def test_any_content_is_a_bandwidth_in_range_nothing_or_one_line(
    tmp_path: Path, data: bytes
) -> None:
    path = tmp_path / "wan-links.json"
    path.write_bytes(data)
    try:
        got = read_narrowest(path, PEERS)
    except LinksFileError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert got is None or (math.isfinite(got) and 0 < got <= MAX_GBPS)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "not JSON"),
        (b'{"site": "east", "links": {"west": {"bandwidth_gbps": 0.', "not JSON"),
        (b"[" * 100_000, "not JSON"),  # beyond the parser's recursion
        (b"[1, 2]", 'no "links" object'),
        (b'{"links": {"west": {"bandwidth_gbps": 1e300}}}', "is not in (0, 1e+06]"),
        (b'{"links": {"west": {"bandwidth_gbps": 1e13}}}', "is not in (0, 1e+06]"),
        (b'{"links": {"west": {"bandwidth_gbps": NaN}}}', "is not in"),
        (b'{"links": {"west": {"bandwidth_gbps": -Infinity}}}', "is not in"),
        (b'{"links": {"west": {"bandwidth_gbps": 0}}}', "is not in"),
        (b'{"links": {"west": {"bandwidth_gbps": true}}}', "not a number"),
        (b'{"links": {"west": 5}}', "not a number"),
        (b" " * (MAX_LINKS_BYTES + 1), "more than"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "wan-links.json"
    path.write_bytes(content)
    with pytest.raises(LinksFileError, match=re.escape(problem)):
        read_narrowest(path, PEERS)


def test_what_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes it: a plain read would block the rank for ever
    (tmp_path / "dir").mkdir()
    (tmp_path / "zero").symlink_to("/dev/zero")  # a read that never ends
    results: dict[str, str] = {}

    def read_all() -> None:
        for name in ("fifo", "dir", "zero"):
            with pytest.raises(LinksFileError, match="not a regular file"):
                read_narrowest(tmp_path / name, PEERS)
            results[name] = "refused"

    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    t.join(timeout=10)
    assert results == {"fifo": "refused", "dir": "refused", "zero": "refused"}
    assert read_narrowest(tmp_path / "missing", PEERS) is None


def test_a_bad_file_is_reported_once_and_the_last_reading_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "wan-links.json"
    links = _LinksFile(path, PEERS)
    assert links.gbps() is None  # not written yet: nothing, and nothing to report
    write_links(path, "east", {"west": {"bandwidth_gbps": 0.05}})
    assert links.gbps() == 0.05
    with caplog.at_level(logging.WARNING, logger="cpn.train"):
        for _ in range(20):  # rewritten every step with the same bad figure
            tmp = path.with_name("tmp")
            tmp.write_text(json.dumps({"links": {"west": {"bandwidth_gbps": 1e300}}}))
            tmp.replace(path)
            assert links.gbps() == 0.05
            assert links.gbps() == 0.05
    assert [r.getMessage() for r in caplog.records] == [
        f"wan: auto: ignoring {path}: links.west.bandwidth_gbps: 1e+300 is not in (0, 1e+06]"
    ]
    write_links(path, "east", {"west": {"bandwidth_gbps": 2.0}, "north": {"bandwidth_gbps": 0.001}})
    assert links.gbps() == 2.0  # only the job's other sites count
