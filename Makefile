# Two commands set up and use a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV_VERSION := 0.13.8

.PHONY: demo test lint venv lock clean

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip sync --quiet --python $(PY) requirements.lock
	$(VENV)/bin/uv pip install --quiet --python $(PY) --no-deps -e .
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/tpupipe run --config configs/demo.yaml

lint: venv
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/pytest

# Re-resolve the pinned dependencies after editing pyproject.toml.
lock: venv
	$(VENV)/bin/uv pip compile pyproject.toml --group dev --python-version 3.11 \
		--generate-hashes --quiet -o requirements.lock

clean:
	rm -rf $(VENV) .tpupipe
