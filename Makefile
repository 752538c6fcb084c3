# One command runs the pipeline, one passes the tests; each sets itself up. `make` lists the targets.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.batchlab-installed
UI_PORT ?= 5000
export PREFECT_PORT ?= 4200
export PATH := $(abspath $(BIN)):$(PATH)
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME ?= $(abspath .prefect)
export PREFECT_LOGGING_EXTRA_LOGGERS ?= batchlab

.DEFAULT_GOAL := help
.PHONY: help setup run compare test test-fast test-durations lint format bench ui serve clean docker-check

help:  ## this list
	@sed -n 's/^\([a-z-]*\):.*## \(.*\)/  make \1\t\2/p' $(firstword $(MAKEFILE_LIST)) | expand -t 19

setup: $(STAMP)  ## create .venv with the pinned set (the targets that need it do this first)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m pip check
	touch $@

run: setup  ## the whole pipeline: generate -> train -> evaluate -> export, and the sweep
	$(BIN)/dvc repro

# headline metrics always; params only where experiments differ; no per-file hash columns and no
# Created column (a commit older than today shows a 12-character date there, past 100 columns)
compare:  ## experiments side by side: the params that differ, accuracy, F1 (macro), ROC-AUC, B_crit, the batch
	@$(BIN)/dvc exp show --only-changed --precision 4 \
	  --keep 'Experiment$$|accuracy$$|f1_macro$$|roc_auc$$|b_crit$$|recommended_batch_size$$' \
	  --drop '^Created$$|.*/|precision_|recall_|f1_|^(atol|file_bytes|max_abs_diff|opset|seeds|test_rows)$$|^latency\.|^b_|^(e_min|s_min|fit_r2|target_val_loss|best_f1_batch_size|recommended_speedup|recommended_f1_minus_best)$$|.*_seconds$$'

lint: setup  ## ruff, ruff format --check, mypy, hadolint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint --failure-threshold warning Dockerfile

format: setup  ## ruff format, then ruff check --fix
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# pytest-xdist workers: one per core this process may use (nproc), at most 8 (each loads torch);
# WORKERS=0 runs one process. Tests are handed out longest first by tests/durations.json, and the
# tests that share a module-scoped fixture go to one worker (tests/support/tiers.py).
# The tiers: unit (unmarked, in-process), integration and e2e (both also `slow`): tests/support/tiers.py.
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$((n < 8 ? n : 8)))
# the slow tier waits on servers, sleeps through its faults and polls processes: on one worker a
# core, a quarter of the CPU idled (vmstat over the Dask fault and leak tests); one worker more fills it
SLOW_WORKERS ?= $(shell w=$(WORKERS); echo $$((w > 0 ? w + 1 : 0)))
PYTEST := $(BIN)/python -m pytest -n $(WORKERS)
test: lint  ## lint, type-check, the unit tier, then the integration and e2e tiers, on every core
	$(PYTEST) -m "not slow"
	$(BIN)/python -m pytest -n $(SLOW_WORKERS) -m slow

test-fast: lint  ## lint, type-check, then the unit tier (in-process, no process starts), on every core
	$(PYTEST) -m "not slow"

test-durations: setup  ## the whole suite, its per-test seconds merged into tests/durations.json (the order of `make test`)
	BATCHLAB_DURATIONS_OUT=tests/durations.json $(PYTEST)

bench: setup  ## speed and overhead tables -> benchmarks/results.json and docs/benchmarks.md
	$(BIN)/python -m pip install -q -r benchmarks/requirements.txt -c requirements.lock
	$(BIN)/python benchmarks/run_all.py

# One server process and no GenAI job runners (their consumers were 8 more processes), without
# starlette's deprecation warning (a UserWarning); exec: stopping make stops the server (mlflow
# passes SIGTERM on to it). The URL opens the runs table, not MLflow 3's GenAI overview.
ui: setup  ## MLflow UI on http://127.0.0.1:5000 (UI_PORT=...), opened on the runs table
	@store=$${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db}; \
	url=$$($(BIN)/batchlab ui-url --store "$$store" --port $(UI_PORT)) || url=http://127.0.0.1:$(UI_PORT); \
	echo "MLflow UI: $$url  (Ctrl-C stops it)"; \
	export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false PYTHONWARNINGS='ignore:starlette.middleware.wsgi is deprecated'; \
	exec $(BIN)/mlflow ui --backend-store-uri "$$store" --host 127.0.0.1 --port $(UI_PORT) --workers 1

serve: setup  ## serve the Prefect schedules (a local server on PREFECT_PORT unless PREFECT_API_URL is set)
	exec env BIN=$(BIN) flows/serve.sh

# Builds the image with podman (or docker) and runs `make run` and `batchlab predict` in it as its
# user, to a clean `dvc status`; a local Debian base when no registry base is at hand (docs/install.md).
docker-check:  ## build the image and run the pipeline in it (podman or docker; ~15 min, not in `make test`)
	bash scripts/docker-check.sh

clean:  ## remove every output, the MLflow store and the caches
	rm -rf .batchlab reports models data/prepared mlflow.db mlruns .pytest_cache .mypy_cache .ruff_cache
