"""Placement of 3D-parallel jobs across sites (control layer): CP-SAT and baselines."""

from cpn.scheduler.cpsat import Objective, SolverSettings
from cpn.scheduler.planner import plan_job

__all__ = ["Objective", "SolverSettings", "plan_job"]
