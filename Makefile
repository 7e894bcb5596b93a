PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 9095
# The embedded Redis's port (empty: serve's own default, 6390).
REDIS_PORT ?=

.PHONY: serve test lint system-deps compose-test bench demo dist clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[service]'
	touch $@

$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[demo]'
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

serve: $(VENV)/.serve
	$(BIN)/trainmedic serve --host $(HOST) --port $(PORT) $(if $(REDIS_PORT),--redis-port $(REDIS_PORT)) --data-dir .trainmedic

# The Debian tools the tests drive (Redis, Prometheus, Alertmanager, Chromium, Slurm...), installed when missing.
system-deps:
	@bash scripts/system-deps

lint: $(VENV)/.test
	$(BIN)/ruff check client service tests benchmarks scripts examples
	$(BIN)/python scripts/typecheck.py

test: system-deps lint
	$(BIN)/python -m pytest -q
	$(MAKE) compose-test

# docker-compose.yml for real, under Podman (as root): images built from Debian's packages and the Dockerfile
# (cached between runs), the stack up, one alert end to end, a restart, then down (tests/compose/run.py).
compose-test: $(VENV)/.test system-deps
	$(BIN)/python tests/compose/run.py

# profile_webhook.py samples the workers with py-spy (only the benchmarks need it).
bench: $(VENV)/.test
	$(BIN)/pip install -q py-spy
	$(BIN)/python benchmarks/run_all.py

# The closed loop on one machine: Prometheus + Alertmanager (Debian) -> trainmedic -> a toy training job. It
# installs what the demo runs only: the service, PyTorch, and Debian's Prometheus and Alertmanager.
demo: $(VENV)/.demo
	@bash scripts/system-deps demo
	$(BIN)/python scripts/demo.py $(DEMO_ARGS)

# An sdist and a wheel in dist/, checked by twine.
dist: $(VENV)/.test
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

clean:
	rm -rf $(VENV) .trainmedic .pytest_cache .mypy_cache build dist
