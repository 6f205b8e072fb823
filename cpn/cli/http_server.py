"""uvicorn for `cpn serve`, minus its own signal handling.

uvicorn re-raises SIGTERM/SIGINT once it has shut down, which would kill the process before
the control server stops and flushes its last lease renewals. `cpn serve` installs its own
handlers that call `request_exit()`, shuts both servers down in order, and exits 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn


class HttpServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def request_exit(self) -> None:
        self.should_exit = True
