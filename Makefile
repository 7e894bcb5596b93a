PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 9095

.PHONY: serve test bench demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[service]'
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

serve: $(VENV)/.serve
	$(BIN)/trainmedic serve --host $(HOST) --port $(PORT) --data-dir .trainmedic

test: $(VENV)/.test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.test
	$(BIN)/python benchmarks/run_all.py

# The closed loop on one machine: Prometheus + Alertmanager (Debian) -> trainmedic -> a toy training job.
demo: $(VENV)/.test
	$(BIN)/python scripts/demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .trainmedic .pytest_cache
