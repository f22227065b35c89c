# Quickstart: `make run` (the tiny CPU GRPO job) and `make test` (the CPU test suite). Both set up .venv first.
# Python 3.12 is found by scripts/find_python312.sh (override with PYTHON=...). Exact pins: constraints.txt.

SHELL := bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (--dist loadfile: a
# module's fixtures and its Ray are built once). On CI's 2 cores, 2 workers ran it in 65 min where one worker took
# the CI's 90 min limit (2026-11-28; one worker left a core idle about half the time). TEST_WORKERS=0 runs it in
# this process (a debugger; -x stops at the first failure in file order).
TEST_WORKERS ?= 2
# A worker that dies (a segfault, the OOM killer, a test past pyproject.toml's faulthandler_timeout) is not replaced:
# pytest-xdist 3.8 under --dist loadfile can wait forever once it replaces one (its issues #784, #1378: the dead
# worker's finished files come back as empty work), which turned a red run into CI's 90-minute timeout with no names
# (2026-11-29). Without a replacement the run goes on in the other worker, then ends red naming the test the worker
# died in ("worker 'gw0' crashed while running ..."); the rest of that worker's file is not run.
XDIST_ARGS := --dist loadfile --max-worker-restart=0

.PHONY: setup run test lint gpu-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt scripts/setup_megatron.sh
	@set -e; \
	if [ ! -x $(PY) ]; then \
	  py="$${PYTHON:-$$(scripts/find_python312.sh)}"; \
	  echo "creating $(VENV) with $$py"; "$$py" -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	scripts/setup_megatron.sh $(PY)
	@touch $@

run: setup
	$(VENV)/bin/miles-vl train configs/vision_tiny_cpu.yaml

test: setup
	@$(VENV)/bin/pytest -n $(TEST_WORKERS) $(XDIST_ARGS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests; that is a failure here" >&2; fi; \
	exit $$rc

lint: setup
	$(VENV)/bin/ruff format --check miles_vl tests benchmarks examples scripts
	$(VENV)/bin/ruff check miles_vl tests benchmarks examples scripts

gpu-test:
	scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
