"""What a worker sent, by link class, and the step it is at.

Every collective in `cpn.comm` adds the bytes it puts on the wire to one `Traffic` per
worker (tensor-parallel all-reduces, pipeline sends, data-parallel sync alike), under the
link-class names the cost model uses (`cpn.costmodel`, plan JSON `bytes_per_iteration`):

  - `intra_node`: tensor-parallel traffic, inside one node (NVLink/PCIe);
  - `intra_site`: everything else that stays inside a site (pipeline hops between nodes
    of one site, the in-site phases of data-parallel sync);
  - `wan`: bytes that leave the site.

`step` is the training step the worker is at; collectives that fail name it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

LinkClass = Literal["intra_node", "intra_site", "wan"]
LINK_CLASSES: tuple[LinkClass, ...] = get_args(LinkClass)


def _zeros() -> dict[LinkClass, int]:
    return dict.fromkeys(LINK_CLASSES, 0)


@dataclass
class Traffic:
    """Bytes sent so far, by link class, and the current step (for error messages)."""

    sent: dict[LinkClass, int] = field(default_factory=_zeros)
    step: int = 0

    def add(self, link: LinkClass, nbytes: int) -> None:
        self.sent[link] += nbytes

    def snapshot(self) -> dict[str, int]:
        """A copy of the totals, keyed by link-class name (JSON-ready)."""
        return {link: int(n) for link, n in self.sent.items()}

    def load(self, totals: dict[str, int]) -> None:
        """Restore totals from `snapshot()` (a resumed run keeps counting from there)."""
        for link in LINK_CLASSES:
            self.sent[link] = int(totals.get(link, 0))
