"""Bounds shared by every boundary: the contract files, the agent protocol and the REST API.

One place, so that what a file may say, what an agent may send and what the API accepts
agree, and so that every value that passes fits where it goes: the registry's columns
(32-bit INTEGER, 64-bit BIGINT, VARCHAR(n); PostgreSQL refuses NUL in text), Python's
`datetime`, and the arithmetic of the cost model (no inf, no NaN).

Two kinds of string:

- a *name* (site, node) or *id* (agent id) is ASCII from a small alphabet: it ends up in
  link keys, file names, URLs and log lines;
- a *label* (GPU model, UUID, agent version, RDMA device) is printable Unicode on one line:
  no control characters (NUL, escape sequences, line breaks) and no invisible format
  characters (bidirectional overrides), which is what `str.isprintable()` says;
- free *text* (a worker's failure message) may also hold tabs and line breaks.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

#: Largest value of a 32-bit INTEGER column (GPU index, rank, port, registrations).
INT32_MAX = 2**31 - 1
#: Largest value of a 64-bit BIGINT column (steps, byte counters).
INT64_MAX = 2**63 - 1

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
NAME_MAX = 64
AGENT_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.@:\-]*"
AGENT_ID_MAX = 128
LABEL_MAX = 64
JOB_ID_MAX = 64
LEASE_ID_MAX = 64
CHECKPOINT_ID_MAX = 256
ADDRESS_MAX = 256
MESSAGE_MAX = 4096

MAX_NODES_PER_AGENT = 10_000
#: Launches one agent follows at once (its registration lists them).
MAX_LAUNCHES_PER_AGENT = 10_000
MAX_GPUS_PER_NODE = 1024
MAX_NICS_PER_NODE = 64
#: RDMA port numbers count from 1; a switch has at most 254 ports (port 255 is reserved).
MAX_RDMA_PORT = 254

#: Physical ceilings, far above any real hardware, that keep sums and products finite.
MAX_GBPS = 1e6  # a petabit per second
MAX_GPU_MEMORY_GB = 1e5
MAX_TFLOPS = 1e6
MAX_MILLISECONDS = 1e6  # about 17 minutes of latency or RTT
MAX_PRICE = 1e6
#: Physical floors: anything slower is an outage or a typo, and the tiny positive values
#: below them (1e-12 Gb/s, 1e-300 TFLOP/s) make times that no scheduler can represent.
MIN_GBPS = 1e-3  # a megabit per second
MIN_TFLOPS = 1e-3  # a GFLOP/s
MIN_GPU_MEMORY_GB = 1e-3  # a megabyte

_NAME = re.compile(NAME_PATTERN)
_AGENT_ID = re.compile(AGENT_ID_PATTERN)
_TEXT_WHITESPACE = str.maketrans("", "", "\t\n\r")


def is_name(value: str) -> bool:
    # fullmatch, not match with `$`: Python's `$` also matches before a final newline.
    return len(value) <= NAME_MAX and _NAME.fullmatch(value) is not None


def is_agent_id(value: str) -> bool:
    return len(value) <= AGENT_ID_MAX and _AGENT_ID.fullmatch(value) is not None


def is_label(value: str) -> bool:
    """Printable on one line: no control or invisible format characters."""
    return value.isprintable()


def is_text(value: str) -> bool:
    """Printable, with tabs and line breaks allowed (a multi-line message)."""
    return value.isprintable() or value.translate(_TEXT_WHITESPACE).isprintable()


def _label(value: str) -> str:
    if not is_label(value):
        raise ValueError("must be printable text on one line (no control characters)")
    return value


# ---------------------------------------------------------------------------- pydantic types

#: Names of sites and nodes end up in link keys ("a|b"), file names and URLs.
Name = Annotated[
    str, StringConstraints(pattern=rf"^{NAME_PATTERN}$", min_length=1, max_length=NAME_MAX)
]
AgentId = Annotated[
    str,
    StringConstraints(pattern=rf"^{AGENT_ID_PATTERN}$", min_length=1, max_length=AGENT_ID_MAX),
]
Label = Annotated[
    str, StringConstraints(min_length=1, max_length=LABEL_MAX), AfterValidator(_label)
]
Gbps = Annotated[float, Field(ge=MIN_GBPS, le=MAX_GBPS, allow_inf_nan=False)]
Milliseconds = Annotated[float, Field(ge=0, le=MAX_MILLISECONDS, allow_inf_nan=False)]
Price = Annotated[float, Field(ge=0, le=MAX_PRICE, allow_inf_nan=False)]
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
