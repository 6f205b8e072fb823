"""Every file a user names — a job, a topology, held GPUs, site tokens, a plan, the client's
config — is read by `cpn.contracts.loading.read_text`: missing, unreadable, a directory or
not UTF-8, it is one InputError naming the file (the CLI prints it as one line, exit 2),
never a traceback (outside review: a non-UTF-8 file gave `UnicodeDecodeError`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cpn.cli.worker import _load as load_worker_files
from cpn.client.config import load_config
from cpn.contracts import load_job, load_reservations, load_topology
from cpn.control.tokens import SiteTokens
from cpn.errors import InputError

READERS: dict[str, Callable[[Path], object]] = {
    "job": load_job,
    "topology": load_topology,
    "held GPUs": load_reservations,
    "site tokens": SiteTokens.load,
    "worker plan": lambda path: load_worker_files(path, path),
}


@pytest.mark.parametrize("reader", READERS.values(), ids=READERS.keys())
@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\xff\xfe", "not UTF-8 text (byte 0)"),
        (b"name: caf\xe9\n", "not UTF-8 text (byte 9)"),  # Latin-1, not UTF-8
        (None, "cannot read (Is a directory)"),
    ],
    ids=["utf-16 mark", "latin-1", "directory"],
)
def test_a_file_that_cannot_be_text_is_one_error_naming_it(
    tmp_path: Path, reader: Callable[[Path], object], content: bytes | None, words: str
) -> None:
    path = tmp_path / "input.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(InputError) as err:
        reader(path)
    assert str(err.value) == f"{path}: {words}"


def test_the_client_config_that_is_not_utf8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"server: \xff\n")
    monkeypatch.setenv("CPN_CONFIG", str(path))
    with pytest.raises(InputError, match=r"config\.yaml: not UTF-8 text \(byte 8\)$"):
        load_config()
