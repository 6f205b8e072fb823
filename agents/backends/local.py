"""The `local` backend: the launcher as a child process of the agent, on the agent's node.

One `cpn launch` (torch's elastic agent, cpn/train/launcher.py) per launch, in its own
session so that a cancel reaches every worker: SIGTERM, then SIGKILL to the whole group
after the grace. Its output goes to `launcher.log` in the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agents.backends.base import (
    BackendError,
    Capacity,
    Handle,
    LaunchSpec,
    NodeCapacity,
    State,
    Status,
)

#: The launcher process's native states → cpn's (the process is the engine here).
LOCAL_STATES: dict[str, State] = {
    "running": State.RUNNING,  # the launcher process exists (workers start in it)
    "exited": State.SUCCEEDED,  # exit status 0: every worker exited 0
    "failed": State.FAILED,  # exit status ≠ 0 (result.json names the failed ranks)
    "signalled": State.FAILED,  # killed by a signal nobody of cpn sent (OOM killer, a user)
    "cancelled": State.CANCELLED,  # ended by cancel(): the agent's stop order
}


@dataclass
class _Process:
    handle: Handle
    process: asyncio.subprocess.Process
    cancelled: bool = False


@dataclass
class LocalBackend:
    """Launches as child processes on this node (`cpn agent --backend local`)."""

    #: This node's name and GPUs, for capacity().
    node: str
    gpus: Callable[[], int] = lambda: 0
    name: str = "local"
    site_wide: bool = False
    poll_interval_s: float = 0.25
    _runs: dict[tuple[str, int], _Process] = field(default_factory=dict)

    async def check(self) -> None:
        """Nothing to reach: the engine is this process."""

    async def submit(self, spec: LaunchSpec) -> Handle:
        if len(spec.nodes) != 1 or len(spec.commands) != 1:
            raise BackendError(f"the local backend runs one node, got {len(spec.nodes)}")
        key = (spec.job_id, spec.epoch)
        known = self._runs.get(key)
        if known is not None and known.process.returncode is None:
            return known.handle  # a retried submit: the same launch, not a second one
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        argv = spec.commands[0]
        env = {**os.environ, **spec.env}
        try:
            with (spec.run_dir / "launcher.log").open("ab") as out:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    env=env,
                    cwd=spec.run_dir,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,  # its own process group: a cancel reaches all
                )
        except OSError as exc:
            raise BackendError(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
        handle = Handle(spec.job_id, spec.epoch, str(process.pid), spec.run_dir, spec.nodes)
        self._runs[key] = _Process(handle, process)
        return handle

    def _run(self, handle: Handle) -> _Process:
        run = self._runs.get((handle.job_id, handle.epoch))
        if run is None:
            raise BackendError(f"job {handle.job_id} epoch {handle.epoch}: not launched here")
        return run

    async def poll(self, handle: Handle) -> Status:
        run = self._run(handle)
        code = run.process.returncode
        if code is None:
            return Status(LOCAL_STATES["running"], "running")
        if run.cancelled:
            return Status(LOCAL_STATES["cancelled"], "cancelled", "stop order", exit_code=code)
        if code == 0:
            return Status(LOCAL_STATES["exited"], "exited", exit_code=0)
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            return Status(
                LOCAL_STATES["signalled"],
                "signalled",
                f"the launcher was killed by {name}",
                0,
                code,
            )
        return Status(LOCAL_STATES["failed"], "failed", f"the launcher exited with {code}", 0, code)

    async def wait(self, handle: Handle, timeout_s: float) -> None:
        """Return when the launcher exits or after `timeout_s`, whichever is first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):  # not wait_for: see agents/events.py
                await self._run(handle).process.wait()

    async def cancel(self, handle: Handle, grace_s: float) -> None:
        """SIGTERM the launcher (it ends its workers), SIGKILL its group after the grace."""
        run = self._run(handle)
        if run.process.returncode is not None:
            return
        run.cancelled = True
        _signal_group(run.process, signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await run.process.wait()
        except TimeoutError:
            _signal_group(run.process, signal.SIGKILL)
            await run.process.wait()

    def logs(self, handle: Handle, node_rank: int) -> Path:
        return handle.run_dir / "launcher.log"

    async def capacity(self) -> Capacity:
        return Capacity((NodeCapacity(self.node, self.gpus(), True, "local"),))

    async def adopt(self) -> Sequence[Handle]:
        """None: a local launcher is the agent's child and is ended with it."""
        return ()

    def forget(self, handle: Handle) -> None:
        self._runs.pop((handle.job_id, handle.epoch), None)


def _signal_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
