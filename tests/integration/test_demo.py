"""`cpn demo` run short, as a user runs it: on loopback, in network namespaces with
rate-limited uplinks (as root), interrupted with SIGINT mid-run, and failing mid-run.
Each run checks the report's claims (WAN bytes ≥ 100× below DDP's, predicted == measured,
the loss going down) and that nothing it started is left: no process, namespace, veth,
bridge or qdisc (the qdiscs and the bridge live in the namespaces and go with them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cpn.demo.run import PREFIX, SITES, emulation_available, leftovers
from cpn.emulated_wan import remove_stale
from tests.processes import CPN

pytestmark = pytest.mark.slow

EMULATION, WHY_NOT = emulation_available()
needs_netns = pytest.mark.skipif(not EMULATION, reason=f"no emulated sites here: {WHY_NOT}")


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes with `text` in them (the demo's working directory
    is in every command it starts: the database, the agents' and workers' directories)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and text in cmd:
            found.append(f"{entry.name}: {cmd}")
    return found


def _demo(tmp: Path, *flags: str, steps: int = 8) -> tuple[subprocess.CompletedProcess[str], Any]:
    report = tmp / "report"
    work = tmp / "work"
    done = subprocess.run(
        [*CPN, "demo", "--steps", str(steps), "--ddp-steps", "1", "--report", str(report),
         "--workdir", str(work), *flags],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _processes_mentioning(str(work)) == []
    assert leftovers() == []
    return done, json.loads((report / "report.json").read_text())


def _check_report(report: dict[str, Any], tmp: Path, steps: int) -> None:
    assert report["ok"] is True
    assert report["steps"] == steps
    assert report["ddp_over_cpn"] >= 100
    assert report["predicted_wan_bytes"] == report["measured_wan_bytes"] > 0
    assert report["predicted_intra_site_bytes"] == report["measured_intra_site_bytes"]
    assert report["loss_end"] < report["loss_start"]
    assert len(report["losses"]) == steps
    # Every site takes part (the job needs all their GPUs), each with its GPUs' worth.
    assert {s["name"]: len(s["ranks"]) for s in report["sites"]} == {s.name: s.gpus for s in SITES}
    page = (tmp / "report" / "report.html").read_text()
    assert page.count("<svg") == 3 and "Training loss" in page and "plain DDP" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing fetched: it stands alone


def test_demo_on_loopback(tmp_path: Path) -> None:
    done, report = _demo(tmp_path, "--no-emulate")
    _check_report(report, tmp_path, 8)
    assert report["network"] == "loopback"
    assert "WAN time is modelled, not enforced" in done.stdout
    assert "predicted WAN bytes == measured WAN bytes" in done.stdout  # the terminal table
    # Unshaped loopback: the agents measured links far faster than the modelled uplinks.
    assert all(link["bandwidth_mbit"] > 200 for link in report["links"])


@needs_netns
def test_demo_in_network_namespaces(tmp_path: Path) -> None:
    done, report = _demo(tmp_path, "--emulate")
    _check_report(report, tmp_path, 8)
    assert report["network"] == "emulated"
    assert "rate-limited with tc tbf" in done.stdout and "latency is not emulated" in done.stdout
    # The agents' probes crossed the shaped uplinks: no link is faster than the faster of
    # its two ends' limits (plus the token bucket's burst on a 1 MiB probe).
    uplink = {s.name: s.uplink_mbit for s in SITES}
    for link in report["links"]:
        a, b = link["key"].split("|")
        assert link["bandwidth_mbit"] < 1.3 * max(uplink[a], uplink[b]), link


def _start_long_demo(tmp_path: Path) -> tuple[subprocess.Popen[str], list[str], threading.Thread]:
    """A demo whose job would train for ever, once its workers run (in its namespaces
    when they can be made); its output lines, as they come."""
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [*CPN, "demo", "--steps", "100000", "--report", str(tmp_path / "report"),
         "--workdir", str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A shell's background job ignores SIGINT, and so would the demo started from it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 120
        # The job is planned (the DDP baseline starts from its plan) and its workers run.
        while not any("baseline started" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        while not _processes_mentioning(f"{work}/work-"):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        if EMULATION:
            assert leftovers(), "the demo should be running in its namespaces"
    except BaseException:
        _end(proc, work)
        raise
    return proc, lines, reader


def _end(proc: subprocess.Popen[str], work: Path) -> None:
    """After a failed test: leave nothing for the next one."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for line in _processes_mentioning(str(work)):
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    remove_stale(PREFIX, PREFIX)


def _finished(
    proc: subprocess.Popen[str], lines: list[str], reader: threading.Thread, tmp_path: Path
) -> tuple[int, str]:
    work = tmp_path / "work"
    try:
        code = proc.wait(60)
    finally:
        _end(proc, work)
        reader.join(10)
    out = "".join(lines)
    assert "Traceback" not in out, out
    assert _processes_mentioning(str(work)) == []
    assert leftovers() == []
    assert not (tmp_path / "report").exists()  # nothing half-written
    return code, out


def test_sigint_mid_run_leaves_nothing(tmp_path: Path) -> None:
    proc, lines, reader = _start_long_demo(tmp_path)
    proc.send_signal(signal.SIGINT)
    code, out = _finished(proc, lines, reader, tmp_path)
    assert code == 130 and "interrupted" in out, out


def test_failure_mid_run_leaves_nothing(tmp_path: Path) -> None:
    """The control plane dies under the running job: the demo fails in one message that
    names it, and removes everything else it started."""
    proc, lines, reader = _start_long_demo(tmp_path)
    serve = [p for p in _processes_mentioning(str(tmp_path / "work")) if " serve " in p]
    assert len(serve) == 1, serve
    os.kill(int(serve[0].split(":")[0]), signal.SIGKILL)
    code, out = _finished(proc, lines, reader, tmp_path)
    assert code == 1 and "error: serve exited with -9" in out, out
    # The message points at the logs, so they stay (a temporary directory was deleted).
    assert f"kept {tmp_path / 'work'}:" in " ".join(out.split()), out
    assert (tmp_path / "work" / "serve.log").exists()
