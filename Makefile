# The two commands of the README: `make demo` and `make test`. Both install what they need first.
SHELL := /bin/bash
PY := .venv/bin/python
CLUSTER_DIR := .omnikube/cluster
LINT_PATHS := operator runtime_image tests e2e bench hack

.PHONY: install test test-fast lint crds demo demo-down cluster-up cluster-down

install:
	@bash hack/bootstrap.sh

## Lint and type checks first (a lint failure is cheap), then every test: unit, cluster (real control
## plane) and end to end.
## The control plane's binaries, Prometheus and KEDA of the e2e tier (Go; cold: minutes, cached after) start
## building in the background first thing (hack/bootstrap.sh), so the venv install, the lint and the unit tests
## overlap them; the e2e tier waits for them (each build.sh holds a lock).
test: export OMNIKUBE_CLUSTER_BUILD := background
test: lint
	$(PY) -m pytest -q --durations=40

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
