"""Per-site pattern formulation of the WAN-bytes objective (see docs/scheduler.md)."""
