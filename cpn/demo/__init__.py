"""`cpn demo`: the whole idea on one machine, measured.

A control plane (`cpn serve` on SQLite in a temporary directory), three site agents with
virtual GPUs (sites of different sizes) — each in its own network namespace with its
uplink rate-limited when run as root on Linux (`cpn.emulated_wan`), else on loopback —
a small GPT job submitted over REST and trained across the three sites with top-k
compression on the WAN, then a report: the plan per site, predicted against measured WAN
bytes and step time, the WAN bytes of the same job under plain DDP (a short measured run
of the dense flat ring), and the loss curve (`cpn.demo.report`).
"""

from cpn.demo.report import DemoReport, write_html
from cpn.demo.run import DemoFailed, DemoSettings, run_demo

__all__ = ["DemoFailed", "DemoReport", "DemoSettings", "run_demo", "write_html"]
