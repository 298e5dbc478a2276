# Two commands set up and use a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV_VERSION := 0.13.8

.PHONY: demo test bench lint venv lock clean bq-emulator chromium tcmalloc

# --compile-bytecode: uv leaves .py files uncompiled, and where PYTHONDONTWRITEBYTECODE is set
# (common in container images, and on this project's CI machines) Python then compiles jax,
# flax, orbax and prefect from source in every process it starts: each workload attempt,
# sharding worker and test subprocess. Importing the workload took 5.2-5.5 s of CPU that
# way and 2.0 s compiled; compiling once costs ~25 s here.
$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip sync --quiet --compile-bytecode --python $(PY) requirements.lock
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	touch $@

venv: $(VENV)/.installed

# The BigQuery emulator for the `emulator` tests, in its own venv (it pins an older
# protobuf than the project). DuckDB would download its spatial extension at start-up,
# which fails offline: the copy from its wheel goes where DuckDB looks, under a HOME that
# the test fixture gives the emulator (the user's own ~/.duckdb is left alone).
BQ_VENV := .venv-bq
BQ_LOCK := tests/emulator/requirements-bq.lock
DUCKDB_EXT_DIR := $(BQ_VENV)/home/.duckdb/extensions/v1.5.5/linux_$(if $(filter aarch64 arm64,$(shell uname -m)),arm64,amd64)

$(BQ_VENV)/.installed: $(BQ_LOCK) | $(VENV)/.installed
	$(PYTHON) -m venv $(BQ_VENV)
	$(VENV)/bin/uv pip sync --quiet --python $(BQ_VENV)/bin/python $(BQ_LOCK)
	mkdir -p $(DUCKDB_EXT_DIR)
	cp $(BQ_VENV)/lib/python*/site-packages/duckdb_extension_spatial/extensions/v1.5.5/spatial.duckdb_extension $(DUCKDB_EXT_DIR)/
	touch $@

bq-emulator: $(BQ_VENV)/.installed

# Headless Chromium for the test that opens the Prefect UI (tests/test_deployments.py):
# Debian's package, installed only when missing (apt-get runs as root, as on CI).
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# TCMalloc, which local workload processes preload when it is installed (about 15% faster
# training steps on CPU: infra/slices/allocator.py). Optional: without it (or without root
# for apt-get) the workload runs on glibc's malloc with huge pages.
tcmalloc:
	@ldconfig -p | grep -q libtcmalloc || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; } || \
		echo "note: libtcmalloc-minimal4 not installed; local training uses glibc malloc"

demo: venv
	$(VENV)/bin/tpupipe run --config configs/demo.yaml

lint: venv
	$(VENV)/bin/ruff check .

# Test files run TEST_WORKERS at a time (pytest-xdist; a file stays on one worker, so a
# module's fixtures, such as the deployment tests' Prefect server, start once). Alone, the
# suite used 1.16 of 2 cores: most of its time is spent waiting on the processes it starts.
TEST_WORKERS ?= 2

test: lint bq-emulator chromium tcmalloc
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile

# Every benchmark under bench/ (12-20 minutes on 2 cores): bench/results/<date>.json
# and .md, one row per figure with the two measurements it divides.
bench: venv tcmalloc
	$(PY) bench/run_all.py

# Re-resolve the pinned dependencies after editing pyproject.toml.
lock: venv
	$(VENV)/bin/uv pip compile pyproject.toml --group dev --python-version 3.11 \
		--generate-hashes --quiet -o requirements.lock
	$(VENV)/bin/uv pip compile tests/emulator/requirements-bq.in --python-version 3.11 \
		--generate-hashes --quiet -o $(BQ_LOCK)

clean:
	rm -rf $(VENV) $(BQ_VENV) .tpupipe
