"""cpn.demo.report: the checks the demo's report makes, and its page, from known numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cpn.demo.report import DemoReport, LinkRow, SiteRow, render_html, write_html


def _report(**change: Any) -> DemoReport:
    fields: dict[str, Any] = {
        "network": "loopback",
        "network_note": "loopback <test>",
        "job_id": "job-1",
        "job_name": "demo-<gpt>",
        "steps": 10,
        "workers": 4,
        "compression": "top-k 0.1% on the WAN",
        "sites": [SiteRow("a", 2, "A100-80G", 100.0, [0, 1]), SiteRow("b", 1, "T4", 20.0, [2])],
        "links": [LinkRow("a|b", 99.5, 0.1)],
        "predicted_wan_bytes": 4050 * 10,
        "measured_wan_bytes": 4050 * 10,
        "predicted_intra_site_bytes": 1000,
        "measured_intra_site_bytes": 1000,
        "predicted_step_s": 0.04,
        "predicted_wan_s": 0.001,
        "modelled_step_s": 0.05,
        "modelled_wan_s": 0.002,
        "measured_step_s": 0.08,
        "ddp_steps": 3,
        "ddp_wan_bytes_per_step": 2_428_416.0,
        "losses": [5.5, 5.4, 5.3, 5.2, 5.1, 5.0, 4.9, 4.8, 4.7, 4.6],
        "step_seconds": [3.0] + [0.08] * 9,
        "wan_bytes_per_step": [4050] * 10,
        "wall_s": 60.0,
    }
    fields.update(change)
    return DemoReport(**fields)


def test_checks_from_known_numbers() -> None:
    r = _report()
    assert r.ddp_wan_bytes == 24_284_160
    assert r.ddp_over_cpn == 24_284_160 / 40_500  # 599.6…×
    assert (r.loss_start, r.loss_end) == (5.45, 4.65)  # first and last fifth (2 steps each)
    assert [passed for _, passed in r.checks] == [True, True, True] and r.ok


def test_each_check_can_fail() -> None:
    assert not _report(ddp_wan_bytes_per_step=4050.0 * 99).checks[0][1]  # 99×: below 100×
    assert not _report(measured_wan_bytes=40_501).checks[1][1]
    flat = _report(losses=[5.0] * 10)
    assert not flat.checks[2][1] and not flat.ok
    assert _report(measured_wan_bytes=0).ddp_over_cpn == 0.0


def test_page_stands_alone_and_escapes(tmp_path: Path) -> None:
    page = render_html(_report(losses=[float("nan"), *[5.0 - i / 10 for i in range(9)]]))
    assert page.count("<svg") == 3
    assert "demo-&lt;gpt&gt;" in page and "<gpt>" not in page
    assert "loopback &lt;test&gt;" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    path = write_html(_report(), tmp_path / "out")
    assert path == tmp_path / "out" / "report.html" and path.read_text().startswith("<!doctype")
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["ok"] is True and doc["ddp_wan_bytes"] == 24_284_160


def test_report_json_is_strict_json_when_a_step_has_no_loss() -> None:
    """A step without a loss is NaN in the report; report.json must still parse in a strict
    reader (it held a bare NaN, which JSON does not have)."""
    losses = [5.5, float("nan"), 5.3, 5.2, 5.1, 5.0, 4.9, 4.8, 4.7, 4.6]
    text = _report(losses=losses).to_json()

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    doc = json.loads(text, parse_constant=refuse)
    assert doc["losses"][1] is None and doc["losses"][0] == 5.5
    assert doc["loss_start"] is None  # the mean over a window holding the missing loss
    assert doc["loss_end"] == (4.7 + 4.6) / 2
