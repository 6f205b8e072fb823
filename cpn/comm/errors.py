"""The one error every failed collective raises, whatever moved the tensor."""

from __future__ import annotations

from collections.abc import Sequence


class CommError(RuntimeError):
    """A collective failed: a peer died, stalled past the timeout, or was misconfigured.

    Raised by every collective in `cpn.comm` — tensor-parallel all-reduces, pipeline
    sends and receives, data-parallel sync — with the step, the operation and the ranks
    in the message, so that a worker's last log line says what broke.
    """

    def __init__(self, operation: str, ranks: Sequence[int], step: int, cause: str) -> None:
        self.operation = operation
        self.ranks = tuple(ranks)
        self.step = step
        super().__init__(
            f"{operation} failed at step {step} among ranks {list(self.ranks)}: {cause} "
            "(a peer may have died or stalled past the timeout)"
        )
