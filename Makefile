# One command runs the pipeline, one passes the tests; each sets itself up.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.batchlab-installed
export PATH := $(abspath $(BIN)):$(PATH)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME ?= $(abspath .prefect)
export PREFECT_LOGGING_EXTRA_LOGGERS ?= batchlab

.PHONY: setup run test lint bench ui serve clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m pip check
	touch $@

run: setup  ## the whole pipeline: generate -> train -> evaluate -> export
	$(BIN)/dvc repro

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint --failure-threshold warning Dockerfile

test: lint  ## lint, type-check, then the whole test suite
	$(BIN)/python -m pytest

bench: setup  ## speed and overhead tables -> benchmarks/results.json and README figures
	$(BIN)/python benchmarks/run_all.py

ui: setup  ## MLflow UI on 127.0.0.1 only
	$(BIN)/mlflow ui --backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db} --host 127.0.0.1 --port 5000

serve: setup  ## serve the scheduled Prefect deployments (starts a local Prefect server if none is set)
	BIN=$(BIN) flows/serve.sh

clean:
	rm -rf .batchlab reports models data/prepared mlflow.db mlruns .pytest_cache .mypy_cache .ruff_cache
