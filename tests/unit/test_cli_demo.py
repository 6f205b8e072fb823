"""`cpn demo`'s bad input: one line, exit 2, before anything is started."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpn.demo.run import _prepare_workdir
from cpn.errors import InputError
from tests.processes import CPN


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--report", "{file}"], "--report: {file}: exists and is not a directory"),
        (["--report", "{file}/sub"], "--report: {file}/sub: {file} is not a directory"),
        (["--steps", "1"], "Invalid value for '--steps'"),
        (["--ddp-steps", "0"], "Invalid value for '--ddp-steps'"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    argv = [a.replace("{file}", str(file)) for a in args]
    done = subprocess.run(
        [*CPN, "demo", *argv, "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message.replace("{file}", str(file)) in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "work").exists()  # nothing was started


@pytest.mark.parametrize("kind", ["earlier run", "a file", "under a file"])
def test_a_workdir_in_use_is_refused_before_anything_starts(tmp_path: Path, kind: str) -> None:
    """A second demo in the same --workdir would reuse the first one's database (its jobs
    and sites) and crashed on its baseline's directory: refused in one line instead."""
    work = tmp_path / "work"
    if kind == "earlier run":
        (work / "ddp").mkdir(parents=True)
        (work / "cpn.db").write_bytes(b"")
        target, message = work, "not empty (an earlier demo's files?)"
    elif kind == "a file":
        work.write_text("")
        target, message = work, "not a directory"
    else:
        work.write_text("")
        target, message = work / "sub", "cannot create it"
    done = subprocess.run(
        [*CPN, "demo", "--no-emulate", "--steps", "2", "--workdir", str(target)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"--workdir {target}: {message}" in done.stderr
    assert "Traceback" not in done.stderr
    if kind == "earlier run":
        assert sorted(p.name for p in work.iterdir()) == ["cpn.db", "ddp"]  # left as it was


def test_a_workdir_that_cannot_be_listed_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unlistable --workdir gave a PermissionError traceback (final re-read of stop
    26). Root (this suite's CI) lists every directory, so the refusal is simulated at
    `Path.iterdir`, the one call that meets it; chmod 000 is the same for another user."""
    work = tmp_path / "locked"
    work.mkdir()

    def refuse(self: Path) -> Iterator[Path]:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refuse)
    with pytest.raises(InputError) as err:
        _prepare_workdir(work)
    assert str(err.value) == f"--workdir {work}: cannot list it (Permission denied)"
    # Under a directory the user may not enter, exists() itself raises (outside review).
    monkeypatch.setattr(Path, "exists", refuse)
    with pytest.raises(InputError) as err:
        _prepare_workdir(work / "x")
    assert str(err.value) == f"--workdir {work}/x: cannot list it (Permission denied)"
