"""The WAN links file of a `wan: auto` launch: the site agent writes its newest
measurement per peer site into the run directory (`RunFiles.wan_links`), every rank reads
the narrowest bandwidth to the job's other sites from it (`cpn.train.wan_auto`).

Writer and reader of the format together, without torch: the agent imports the writer.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from cpn.contracts.limits import MAX_GBPS

#: The agent's file is a few hundred bytes; anything far larger is not its file.
MAX_LINKS_BYTES = 1 << 20


class LinksFileError(ValueError):
    """The links file exists but cannot be used (one line: what is wrong with it)."""


def read_narrowest(path: Path, sites: set[str]) -> float | None:
    """The narrowest measured bandwidth (Gbit/s) to any of `sites` in the agent's file,
    or None (no file, or no such site measured). The file:

        {"site": "a", "links": {"b": {"bandwidth_gbps": 0.05, "rtt_ms": 40.0,
                                      "measured_at": 1795000000.0}}}

    Raises `LinksFileError` for a file that is there but unusable: not a regular file
    (a FIFO or a device would block the step or never end), larger than
    MAX_LINKS_BYTES, not JSON (also nested beyond the parser's recursion), not of this
    shape, or a bandwidth that is not a number in (0, MAX_GBPS] — a figure beyond every
    link would not fit the 64-bit agreement.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LinksFileError(f"cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LinksFileError("not a regular file")
        if info.st_size > MAX_LINKS_BYTES:
            raise LinksFileError(f"{info.st_size} bytes, more than {MAX_LINKS_BYTES}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_LINKS_BYTES + 1)
    except OSError as exc:
        raise LinksFileError(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_LINKS_BYTES:
        raise LinksFileError(f"more than {MAX_LINKS_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise LinksFileError(f"not JSON ({str(exc)[:100]})") from None
    links = doc.get("links") if isinstance(doc, dict) else None
    if not isinstance(links, dict):
        raise LinksFileError('no "links" object')
    found = []
    for peer, v in links.items():
        if peer not in sites:
            continue
        g = v.get("bandwidth_gbps") if isinstance(v, dict) else None
        if isinstance(g, bool) or not isinstance(g, int | float):
            raise LinksFileError(f"links.{str(peer)[:64]}.bandwidth_gbps: not a number")
        if not (math.isfinite(g) and 0 < g <= MAX_GBPS):
            raise LinksFileError(
                f"links.{str(peer)[:64]}.bandwidth_gbps: {g!r} is not in (0, {MAX_GBPS:g}]"
            )
        found.append(float(g))
    return min(found) if found else None


def write_links(path: Path, site: str, links: dict[str, dict[str, float]]) -> None:
    """Write the agent's file atomically (a worker never reads half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"site": site, "links": links}, sort_keys=True))
    tmp.replace(path)
