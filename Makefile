# The two commands of the README's quick start, and the checks CI runs.
.PHONY: setup demo test lint typecheck unit bench

setup:
	@./scripts/setup.sh

# The first thing to run: a control plane, three sites (network namespaces with
# rate-limited uplinks as root, else loopback) and a job across them; report in demo-report/.
demo: setup
	.venv/bin/cpn demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck: setup
	.venv/bin/mypy cpn api agents proto migrations bench tests

# Two pytest-xdist workers (most tests wait on processes, leases and restarts), files that
# share namespaces or Slurm process names kept on one worker (tests/conftest.py); then the
# measurements other tests would disturb, alone.
unit: setup
	.venv/bin/pytest -q -n 2 --dist loadgroup -m "not serial"
	.venv/bin/pytest -q -m serial

# Everything CI runs: lint, types, the whole test suite.
test: lint typecheck unit

bench: setup
	.venv/bin/python bench/scheduler.py
