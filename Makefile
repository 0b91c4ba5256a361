# The two commands of the README: `make demo` and `make test`. Both install what they need first.
SHELL := /bin/bash
PY := .venv/bin/python
CLUSTER_DIR := .omnikube/cluster
LINT_PATHS := operator runtime_image tests e2e bench hack

.PHONY: install test test-fast lint crds demo demo-down cluster-up cluster-down

install:
	@bash hack/bootstrap.sh

## Lint and type checks first (a lint failure is cheap), then every test: unit, served, cluster (real control
## plane) and end to end, as lanes side by side where they do not compete (hack/run_tests.py says which and why),
## ending with a table of tests and seconds per tier and the 20 slowest tests (junit files in .omnikube/junit/).
## The control plane's binaries, Prometheus and KEDA of the e2e tier (Go; cold: minutes, cached after) start
## building in the background first thing (hack/bootstrap.sh), so the venv install and the lint overlap them; the
## tests start once the control plane is built, and the e2e lane waits for Prometheus and KEDA.
## `make test LANES=unit,cluster` runs some lanes only.
LANES ?= all
test: export OMNIKUBE_CLUSTER_BUILD := background
test: lint
	$(PY) hack/run_tests.py --lanes $(LANES)

## Unit tests only (no cluster, no model loads).
test-fast: install
	$(PY) -m pytest -q tests -m "not models"

## ruff (lint and format), the import contracts and mypy (its settings: [tool.mypy] in pyproject.toml).
lint: install
	.venv/bin/ruff check $(LINT_PATHS)
	.venv/bin/ruff format --check $(LINT_PATHS)
	.venv/bin/lint-imports
	.venv/bin/mypy

## Regenerate crds/ from the models in omni_operator.
crds: install
	$(PY) -m omni_operator.crdgen --out crds/
	$(PY) hack/sync-chart-crds.py

cluster-up: install
	@$(PY) e2e/cluster/localcluster.py up --dir $(CLUSTER_DIR)

cluster-down:
	@$(PY) e2e/cluster/localcluster.py down --dir $(CLUSTER_DIR)

demo: install
	@bash hack/demo.sh

## Stop the demo: its pods, the pod runner and the control plane.
demo-down:
	@if [ -f .omnikube/podrunner.pid ]; then kill $$(cat .omnikube/podrunner.pid) 2>/dev/null || true; \
	  for i in $$(seq 30); do kill -0 $$(cat .omnikube/podrunner.pid) 2>/dev/null || break; sleep 1; done; \
	  rm -f .omnikube/podrunner.pid; fi
	@$(PY) e2e/cluster/localcluster.py down --dir $(CLUSTER_DIR)
