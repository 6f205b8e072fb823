"""Per-site pattern formulation of the WAN-bytes objective (docs/scheduler.md §2–6).

- `problem`: the objective in terms of one pattern per site; `classes`: interchangeable
  sites; `pricing`: the exact programme for a class's best pattern;
- `colgen`: the master LP and column generation; `bound`: the Lagrangian bound, valid for
  any prices, computed exactly; `branching`: branch and bound on the sites per stage;
- `master`: integer masters (CP-SAT) for plans; `cuts`: per-site cuts for the CP-SAT model;
- `search`: all of it in one budget (`pattern_search`); `effort`: how that budget is counted.
"""
