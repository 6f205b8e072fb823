"""Every command in README.md, exercised.

- The tour's `sh` blocks run as they would when pasted, in order, in one shell (in a
  scratch directory that links to this checkout's .venv, examples/ and scripts/), with
  the fixed ports 8080 and 50051 swapped for free ones; the last block stops what the
  others started, and nothing may be left running.
- The quick start's and the development section's `make` commands are Makefile targets
  whose recipes are what the README says (`make demo` runs `cpn demo`, which
  tests/integration/test_demo.py runs; `make test` is what CI's .ci/run runs).
- `text` blocks are templates (placeholders in capitals): every flag they use exists.
- No other fenced block holds a command, and every relative link points at a file.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cpn.listen_ports import free_port
from tests.processes import CPN

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@dataclass
class Block:
    lang: str
    text: str
    section: str  # the `## ` heading it is under


def _blocks() -> list[Block]:
    out = []
    section = ""
    lines = README.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            end = lines.index("```", i + 1)
            out.append(Block(fence.group(1), "\n".join(lines[i + 1 : end]), section))
            i = end
        i += 1
    return out


BLOCKS = _blocks()
MAKE_COMMANDS = {
    "make demo": "demo",
    "make test": "test",
    "make lint": "lint",
    "make typecheck": "typecheck",
    "make unit": "unit",
}


def _commands(text: str) -> list[str]:
    """A block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [c.split("  #")[0].strip() for c in joined.splitlines() if c.strip()]


def test_every_block_is_accounted_for() -> None:
    tour = [b for b in BLOCKS if b.section == "A tour"]
    assert len(tour) >= 4 and all(b.lang == "sh" for b in tour)
    for block in BLOCKS:
        if block.section == "A tour":
            continue
        if block.lang == "sh":  # outside the tour: only make targets
            for command in _commands(block.text):
                assert command in MAKE_COMMANDS, f"{command!r} is run by no test"
        elif block.lang == "text":
            assert all(c.startswith("cpn ") for c in _commands(block.text)), block.text
        else:  # the picture of the layers, the error examples
            assert block.lang == "", block
            assert not re.search(r"^\s*(\.venv/bin/|cpn |make |curl )", block.text, re.M), block


def _recipe(target: str) -> tuple[list[str], list[str]]:
    """A Makefile target's prerequisites and recipe lines."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{target}:(.*)\n((?:\t.*\n?)*)", text, re.M)
    assert match, f"no target {target} in the Makefile"
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def test_make_commands_do_what_the_readme_says() -> None:
    for target in MAKE_COMMANDS.values():
        _recipe(target)
    prereqs, recipe = _recipe("demo")
    assert prereqs == ["setup"] and recipe == [".venv/bin/cpn demo"]
    assert _recipe("test")[0] == ["lint", "typecheck", "unit"]
    assert _recipe("setup")[1] == ["@./scripts/setup.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.strip().endswith("make test")
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "chromium chromium-driver" in setup and "iproute2" in setup


def test_templates_use_flags_that_exist() -> None:
    templates = [c for b in BLOCKS if b.lang == "text" for c in _commands(b.text)]
    assert templates
    for command in templates:
        words = command.split()
        sub = words[1]
        helptext = subprocess.run(
            [*CPN, sub, "--help"], capture_output=True, text=True, timeout=60, check=True,
            env={**os.environ, "COLUMNS": "200"},
        ).stdout  # fmt: skip
        for flag in (w for w in words if w.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", helptext), f"cpn {sub}: no {flag}"


def test_relative_links_point_at_files() -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def _live(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def test_the_tour_runs_when_pasted(tmp_path: Path) -> None:
    for name in (".venv", "examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    http, grpc = free_port(), free_port()
    script = "\n".join(b.text for b in BLOCKS if b.section == "A tour")
    script = script.replace("8080", str(http)).replace("50051", str(grpc))
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", "set -eo pipefail\n" + script],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "COLUMNS": "120"},
    )  # fmt: skip
    pids_file = tmp_path / "tour" / "pids"
    if pids_file.exists():  # the last block did not run: stop what the tour started
        pids = [int(p) for p in pids_file.read_text().split()]
        subprocess.run(["kill", *map(str, pids)], check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert not (tmp_path / "tour").exists()  # the last block removed it
    assert "succeeded" in out and "gpt-small" in out
    assert re.search(r"^a: 2 of 2 GPUs free; links: ", out, re.M), out[-3000:]
    assert "<title>cpn" in out  # the dashboard answered
    assert time.monotonic() - started < 300
    # Nothing the tour started still runs (the ids it wrote are gone with tour/).
    leftovers = subprocess.run(
        ["pgrep", "-f", f"--grpc-port {grpc}|127.0.0.1:{grpc}"], capture_output=True,
        text=True, check=False,
    ).stdout.split()  # fmt: skip
    deadline = time.monotonic() + 20
    while _live([int(p) for p in leftovers]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live([int(p) for p in leftovers]) == []
