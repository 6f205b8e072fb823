"""The bounds on what a task report carries besides its state: per-step metrics and
worker log lines (ReportTaskStatusRequest.steps, .log_lines).

A report over a bound is refused whole (INVALID_ARGUMENT naming the field): the agent
sends at most these many per request and cuts longer lines, so only a broken or hostile
client meets them, and it must not be able to fill the database or the server's memory.
"""

from __future__ import annotations

import math

from cpn.contracts.limits import is_label
from cpn.control.errors import InvalidField
from cpn.registry.job_output import StepRecord
from proto.cpn.v1 import agent_pb2 as pb

MAX_STEPS = 1000
MAX_LINES = 1000
MAX_LINE_BYTES = 4096
#: Beyond any real run, and inside every database's BIGINT.
MAX_STEP = 2**53
MAX_BYTES = 2**62
#: A WAN sync's summary ("outer H=128 topk 0.01") is far shorter.
MAX_WAN_SYNC = 200


def steps(request: pb.ReportTaskStatusRequest) -> tuple[StepRecord, ...]:
    if len(request.steps) > MAX_STEPS:
        raise InvalidField("steps", f"at most {MAX_STEPS} per report, got {len(request.steps)}")
    out = []
    for i, s in enumerate(request.steps):
        where = f"steps[{i}]"
        if s.step > MAX_STEP:
            raise InvalidField(f"{where}.step", f"at most {MAX_STEP}")
        if not math.isfinite(s.seconds) or s.seconds < 0:
            raise InvalidField(f"{where}.seconds", "must be a finite number ≥ 0")
        sent = (s.bytes.intra_node, s.bytes.intra_site, s.bytes.wan)
        for name, value in zip(("intra_node", "intra_site", "wan"), sent, strict=True):
            if value > MAX_BYTES:
                raise InvalidField(f"{where}.bytes.{name}", f"at most {MAX_BYTES}")
        # A non-finite loss is news (the run diverged) but cannot be summed: kept as absent.
        loss = s.loss if s.HasField("loss") and math.isfinite(s.loss) else None
        # A label (cpn.contracts.limits): shown per step by the REST API; empty is absent.
        wan_sync = s.wan_sync if s.HasField("wan_sync") and s.wan_sync else None
        if wan_sync is not None and len(wan_sync) > MAX_WAN_SYNC:
            raise InvalidField(f"{where}.wan_sync", f"at most {MAX_WAN_SYNC} characters")
        if wan_sync is not None and not is_label(wan_sync):
            # Escape sequences, line breaks, NUL (PostgreSQL text holds none), bidi overrides.
            raise InvalidField(f"{where}.wan_sync", "must be printable text on one line")
        out.append(StepRecord(s.step, loss, s.seconds, *sent, wan_sync=wan_sync))
    return tuple(out)


_ONE_LINE = str.maketrans({"\x00": None, "\n": "\\n", "\r": "\\r"})


def log_lines(request: pb.ReportTaskStatusRequest) -> tuple[str, ...]:
    lines = request.log_lines
    if len(lines) > MAX_LINES:
        raise InvalidField("log_lines", f"at most {MAX_LINES} per report, got {len(lines)}")
    for i, line in enumerate(lines):
        if len(line.encode()) > MAX_LINE_BYTES:
            raise InvalidField(f"log_lines[{i}]", f"at most {MAX_LINE_BYTES} bytes")
    # NUL cannot be stored in PostgreSQL text; it is never meaningful in a log line. A line
    # stays one line (readers print it after its rank: an embedded line break would let a
    # worker forge lines of another rank), so breaks are kept visible as escapes.
    kept = tuple(line.translate(_ONE_LINE) for line in lines)
    if request.log_lines_dropped:
        kept = (f"[cpn agent: {request.log_lines_dropped} lines dropped]", *kept)
    return kept
