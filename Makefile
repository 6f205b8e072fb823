# The two commands of the README's quick start, and the checks CI runs.
.PHONY: setup demo test lint typecheck unit bench

setup:
	@./scripts/setup.sh

# The main job: plan the bundled example job onto the bundled three-site topology.
demo: setup
	.venv/bin/cpn plan --topology examples/topologies/three-sites.yaml --job examples/jobs/gpt-7b-auto.yaml

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck: setup
	.venv/bin/mypy cpn api agents proto migrations bench tests

unit: setup
	.venv/bin/pytest -q

# Everything CI runs: lint, types, the whole test suite.
test: lint typecheck unit

bench: setup
	.venv/bin/python bench/scheduler.py
