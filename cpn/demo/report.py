"""The demo's report: what was measured, the checks it passes, as HTML and as a table.

The HTML page stands alone (charts are inline SVG, no script, nothing fetched), so it
can be mailed or opened from disk; `report.json` beside it holds the same numbers.
"""

from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cpn.cli.render import fmt_bytes


@dataclass
class SiteRow:
    name: str
    gpus: int
    gpu_model: str
    uplink_mbit: float
    ranks: list[int]


@dataclass
class LinkRow:
    key: str
    bandwidth_mbit: float  # as the agents measured it
    rtt_ms: float


@dataclass
class DemoReport:
    network: str  # "emulated" or "loopback"
    network_note: str
    job_id: str
    job_name: str
    steps: int
    workers: int
    compression: str
    sites: list[SiteRow]
    links: list[LinkRow]
    predicted_wan_bytes: int  # the plan's bytes per iteration × the steps trained
    measured_wan_bytes: int  # what the workers counted on their sockets' way out
    predicted_intra_site_bytes: int
    measured_intra_site_bytes: int
    predicted_step_s: float  # the plan's, on the measured links
    predicted_wan_s: float
    modelled_step_s: float  # the same placement with each link at its uplinks' rate
    modelled_wan_s: float
    measured_step_s: float  # median of the slowest rank's step
    ddp_steps: int
    ddp_wan_bytes_per_step: float  # measured in a short run of the dense flat ring
    losses: list[float]
    step_seconds: list[float]
    wan_bytes_per_step: list[int]
    wall_s: float
    checks: list[tuple[str, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.checks:
            self.checks = [
                (
                    f"measured WAN bytes ≥ 100× below plain DDP's ({self.ddp_over_cpn:,.0f}×)",
                    self.ddp_over_cpn >= 100,
                ),
                (
                    "predicted WAN bytes == measured WAN bytes "
                    f"({self.predicted_wan_bytes:,} == {self.measured_wan_bytes:,})",
                    self.predicted_wan_bytes == self.measured_wan_bytes,
                ),
                (
                    f"loss goes down ({self.loss_start:.3f} → {self.loss_end:.3f})",
                    self.loss_end < self.loss_start,
                ),
            ]

    @property
    def ddp_wan_bytes(self) -> float:
        """The whole job's WAN bytes under DDP: its measured bytes per step × the steps."""
        return self.ddp_wan_bytes_per_step * self.steps

    @property
    def ddp_over_cpn(self) -> float:
        return self.ddp_wan_bytes / self.measured_wan_bytes if self.measured_wan_bytes else 0.0

    @property
    def loss_start(self) -> float:
        """Mean loss of the first fifth of the steps (one step's loss is noisy)."""
        return statistics.fmean(self.losses[: max(1, len(self.losses) // 5)])

    @property
    def loss_end(self) -> float:
        return statistics.fmean(self.losses[-max(1, len(self.losses) // 5) :])

    @property
    def ok(self) -> bool:
        return all(passed for _, passed in self.checks)

    def to_json(self) -> str:
        doc = asdict(self)
        doc.update(
            ddp_wan_bytes=self.ddp_wan_bytes,
            ddp_over_cpn=self.ddp_over_cpn,
            loss_start=self.loss_start,
            loss_end=self.loss_end,
            ok=self.ok,
        )
        # Strict JSON: a step without a loss (NaN here) is null, as the API writes it.
        return json.dumps(_finite(doc), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None, at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# ------------------------------------------------------------------------------ terminal


def _seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def print_report(report: DemoReport, console: Console) -> None:
    r = report
    console.print(f"[bold]Network[/]: {r.network_note}")
    plan = Table(title=f"Plan of job {r.job_id} ({r.workers} workers, {r.compression})")
    for col in ("site", "GPUs", "uplink", "ranks"):
        plan.add_column(col, justify="left" if col == "site" else "right")
    for s in r.sites:
        uplink = f"{s.uplink_mbit:g} Mbit/s" + ("" if r.network == "emulated" else " (modelled)")
        plan.add_row(s.name, f"{s.gpus} × {s.gpu_model}", uplink, ", ".join(map(str, s.ranks)))
    console.print(plan)
    links = Table(title="WAN links as the agents measured them")
    for col in ("link", "bandwidth", "RTT"):
        links.add_column(col, justify="left" if col == "link" else "right")
    for link in r.links:
        links.add_row(link.key, f"{link.bandwidth_mbit:,.1f} Mbit/s", f"{link.rtt_ms:.2f} ms")
    console.print(links)
    t = Table(title=f"Predicted vs measured, {r.steps} steps")
    for col in ("", "predicted", "measured"):
        t.add_column(col, justify="left" if not col else "right")
    t.add_row("WAN bytes", f"{r.predicted_wan_bytes:,}", f"{r.measured_wan_bytes:,}")
    t.add_row(
        "intra-site bytes", f"{r.predicted_intra_site_bytes:,}", f"{r.measured_intra_site_bytes:,}"
    )
    t.add_row("step time (plan, measured links)", _seconds(r.predicted_step_s), "")
    t.add_row(
        "step time at the uplink rates" + (" (WAN modelled)" if r.network == "loopback" else ""),
        _seconds(r.modelled_step_s),
        _seconds(r.measured_step_s) + " (median)",
    )
    t.add_row("  of which WAN sync", _seconds(r.modelled_wan_s), "")
    t.add_row(
        f"plain DDP WAN bytes (flat ring, measured over {r.ddp_steps} steps × {r.steps})",
        "",
        f"{r.ddp_wan_bytes:,.0f}",
    )
    t.add_row("DDP ÷ cpn", "", f"{r.ddp_over_cpn:,.0f}×")
    t.add_row("loss, first → last fifth", "", f"{r.loss_start:.3f} → {r.loss_end:.3f}")
    console.print(t)
    for text, passed in r.checks:
        console.print(f"  {'[green]✓[/]' if passed else '[red]✗[/]'} {text}")


# ----------------------------------------------------------------------------------- HTML


def _tick(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _svg_line(ys: Sequence[float], title: str, ylabel: str, width: int = 560) -> str:
    """A line chart of `ys` against their index, as inline SVG."""
    height, left, bottom, top, right = 260, 64, 40, 28, 12
    points = [(i, y) for i, y in enumerate(ys) if math.isfinite(y)]
    if len(points) < 2:
        return f"<p>{html.escape(title)}: not enough points</p>"
    lo, hi = min(y for _, y in points), max(y for _, y in points)
    if hi == lo:
        hi = lo + 1
    n = len(ys) - 1

    def xy(i: float, y: float) -> tuple[float, float]:
        x = left + (width - left - right) * i / n
        return x, top + (height - top - bottom) * (hi - y) / (hi - lo)

    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in points))
    ticks = []
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        _, y = xy(0, v)
        ticks.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick(v)}</text>'
        )
    for step in sorted({0, n // 2, n}):
        x, _ = xy(step, lo)
        ticks.append(
            f'<text x="{x:.1f}" y="{height - bottom + 16}" text-anchor="middle">{step}</text>'
        )
    return (
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(title)}"><title>{html.escape(title)}</title>'
        f'<text x="{left}" y="16" class="title">{html.escape(title)}</text>'
        + "".join(ticks)
        + f'<polyline points="{path}" class="line"/>'
        f'<text x="{(left + width) / 2}" y="{height - 6}" text-anchor="middle">step</text>'
        f'<text x="14" y="{(top + height) / 2}" transform="rotate(-90 14 {(top + height) / 2})" '
        f'text-anchor="middle">{html.escape(ylabel)}</text></svg>'
    )


def _svg_bars(bars: Sequence[tuple[str, float]], title: str, width: int = 560) -> str:
    """Horizontal bars on a log scale (the two differ by orders of magnitude)."""
    row, left, top = 44, 190, 30
    height = top + row * len(bars) + 10
    top_value = max(v for _, v in bars)
    decades = max(1.0, math.log10(top_value) - math.log10(max(1.0, min(v for _, v in bars))) + 1)
    scale = (width - left - 110) / decades
    floor = math.log10(top_value) - decades
    out = []
    for i, (label, value) in enumerate(bars):
        y = top + i * row
        w = max(2.0, (math.log10(max(value, 1.0)) - floor) * scale)
        out.append(
            f'<text x="{left - 8}" y="{y + 22}" text-anchor="end">{html.escape(label)}</text>'
            f'<rect x="{left}" y="{y + 6}" width="{w:.1f}" height="24" class="bar{i}"/>'
            f'<text x="{left + w + 6:.1f}" y="{y + 22}">{html.escape(fmt_bytes(value))}</text>'
        )
    return (
        f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(title)}"><title>{html.escape(title)}</title>'
        f'<text x="8" y="16" class="title">{html.escape(title)}</text>' + "".join(out) + "</svg>"
    )


_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 1180px; margin: 2em auto; color: #222 }
table { border-collapse: collapse; margin: 1em 0 }
td, th { border-bottom: 1px solid #ddd; padding: .3em .8em; text-align: right }
td:first-child, th:first-child { text-align: left }
.charts { display: flex; flex-wrap: wrap; gap: 2em }
svg text { font: 12px system-ui, sans-serif; fill: #333 } svg .title { font-weight: 600 }
svg .grid { stroke: #e5e5e5 } svg .line { fill: none; stroke: #1f6feb; stroke-width: 2 }
svg .bar0 { fill: #1f6feb } svg .bar1 { fill: #d1242f }
.ok { color: #1a7f37 } .bad { color: #d1242f } .note { color: #555 }
"""


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(report: DemoReport) -> str:
    r = report
    checks = "".join(
        f'<li class="{"ok" if ok else "bad"}">{"✓" if ok else "✗"} {html.escape(text)}</li>'
        for text, ok in r.checks
    )
    plan = _table(
        ("site", "GPUs", "uplink", "ranks"),
        [
            (
                s.name,
                f"{s.gpus} × {s.gpu_model}",
                f"{s.uplink_mbit:g} Mbit/s" + ("" if r.network == "emulated" else " (modelled)"),
                ", ".join(map(str, s.ranks)),
            )
            for s in r.sites
        ],
    )
    links = _table(
        ("link", "bandwidth (measured)", "RTT (measured)"),
        [(k.key, f"{k.bandwidth_mbit:,.1f} Mbit/s", f"{k.rtt_ms:.2f} ms") for k in r.links],
    )
    numbers = _table(
        ("", "predicted", "measured"),
        [
            ("WAN bytes", f"{r.predicted_wan_bytes:,}", f"{r.measured_wan_bytes:,}"),
            (
                "intra-site bytes",
                f"{r.predicted_intra_site_bytes:,}",
                f"{r.measured_intra_site_bytes:,}",
            ),
            ("step time (plan, on the measured links)", _seconds(r.predicted_step_s), ""),
            (
                "step time at the uplink rates"
                + (" (WAN modelled)" if r.network == "loopback" else ""),
                _seconds(r.modelled_step_s),
                _seconds(r.measured_step_s) + " (median)",
            ),
            ("  of which WAN sync", _seconds(r.modelled_wan_s), ""),
            (
                f"plain DDP WAN bytes (dense flat ring, measured over {r.ddp_steps} steps, × "
                f"{r.steps} steps)",
                "",
                f"{r.ddp_wan_bytes:,.0f}",
            ),
            ("DDP ÷ cpn", "", f"{r.ddp_over_cpn:,.0f}×"),
        ],
    )
    bars = _svg_bars(
        [
            (f"cpn ({r.compression})", r.measured_wan_bytes),
            ("plain DDP (measured)", r.ddp_wan_bytes),
        ],
        f"WAN bytes for the whole job ({r.steps} steps), log scale",
    )
    loss = _svg_line(r.losses, "Training loss", "loss")
    step = _svg_line(
        [s * 1000 for s in r.step_seconds], "Step time, slowest rank (step 0: start-up)", "ms"
    )
    return (
        "<!doctype html><html lang=en><meta charset=utf-8>"
        f"<title>cpn demo: job {html.escape(r.job_id)}</title><style>{_STYLE}</style><body>"
        f"<h1>cpn demo: {html.escape(r.job_name)} across three datacenters</h1>"
        f'<p class="note">{html.escape(r.network_note)}</p>'
        f"<ul>{checks}</ul>"
        f'<div class="charts">{bars}{loss}{step}</div>'
        f"<h2>Plan per site</h2>{plan}<h2>WAN links</h2>{links}"
        f"<h2>Predicted and measured</h2>{numbers}"
        f'<p class="note">Job {html.escape(r.job_id)}, {r.workers} workers, '
        f"{html.escape(r.compression)}; the demo took {r.wall_s:.0f} s. Measured bytes are "
        "what the workers counted as they sent (cpn.comm), per link class; the DDP figure is "
        "from a short run of the same plan with one flat ring over every replica "
        "(cpn train --dp-sync flat), what PyTorch DDP's all-reduce sends.</p></body></html>\n"
    )


def write_html(report: DemoReport, directory: Path) -> Path:
    """report.html and report.json in `directory`; returns the HTML's path."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(report.to_json() + "\n")
    path = directory / "report.html"
    path.write_text(render_html(report))
    return path
