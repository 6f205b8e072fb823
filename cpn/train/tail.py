"""Reading files that another process appends to, a little at a time.

Workers append their per-step metrics and their output to files; launchers, agents and
`cpn train` follow them while the run goes on. `FileTail` returns only the bytes added
since its last read (never re-reading the file), split into complete lines; a line still
being written waits for the next read, unless the writer has ended (`final`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: At most this much of a file per read: a chatty writer cannot stall its reader.
READ_CHUNK = 1 << 20


@dataclass
class FileTail:
    path: Path
    offset: int = 0

    def lines(self, final: bool = False) -> list[bytes]:
        """New complete lines (without line ends); with `final`, also a last partial one."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read(READ_CHUNK)
        except OSError:
            return []  # not written yet
        end = data.rfind(b"\n") + 1
        if final and len(data) < READ_CHUNK:
            end = len(data)
        self.offset += end
        return data[:end].splitlines()

    def records(self, final: bool = False) -> list[dict[str, Any]]:
        """New lines that are JSON objects (anything else is skipped)."""
        out = []
        for line in self.lines(final):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out
