# gpu-training-stack. Every target installs what it needs into .venv first.
# `make plan` is the main command (offline); `make test` runs everything CI runs.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STACK  ?= dev
FORMAT ?= table
STAMP  := $(VENV)/.installed

.PHONY: plan test typecheck unit venv clean

$(STAMP): requirements.txt requirements-dev.txt constraints.txt
	@echo "installing pinned dependencies into $(VENV) ..." >&2
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) >&2
	@$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt -c constraints.txt >&2
	@touch $@

venv: $(STAMP)

## plan: the stack offline — resources, cost, policy verdicts (STACK=dev|prod|<name>, FORMAT=table|json)
plan: $(STAMP)
	@$(PY) -m infra.plan --stack $(STACK) --format $(FORMAT)

## test: type checks and the whole test suite
test: typecheck unit

typecheck: $(STAMP)
	$(PY) -m mypy infra __main__.py tests policies

unit: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache
