# elastic-train: the two commands a new machine needs are `make demo` and `make test`.
# Both create .venv (if missing) and install the package with its dev extras first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: demo test lint bench gpu-check clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

## The main job: 2 CPU processes under torchrun on the built-in dataset; stops early on target.
## Each demo starts fresh: it clears its own log and checkpoint folders first.
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 -m elastic_train --run-dir runs/demo

## The whole test suite, every layer folder (tests/unit, process, launch, slurm, netns; README "Development").
## Three test files at a time (-n 3 --dist loadfile): many tests wait on timers (hang timeouts,
## Slurm requeues, rendezvous), so a third lane fills the 2 cores where two left them idle a
## tenth of the time (Dec 7, fresh clones a commit apart: 39.4 min with two lanes, 34.6 with
## three, both cores 95% busy then). A file's tests stay together on one worker (module fixtures, the
## one local Slurm node, network namespaces). Files are handed out longest first (tests/conftest.py
## LAYER_ORDER; pytest-xdist's own order, by number of tests, put the minute-long few-test files
## last): no gain in wall time measured (34.9 min, both cores 96% busy), but the two Slurm files
## no longer run side by side on the one node, and the long tests fail early.
test: $(STAMP) lint
	$(PY) -m pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check elastic_train tests benchmarks jobs examples
	$(VENV)/bin/ruff format --check elastic_train tests benchmarks jobs examples
	$(VENV)/bin/mypy

## Every benchmark (~145 minutes on 2 cores; run it on a quiet machine), then docs/benchmarks.md
## is rewritten from the results in benchmarks/results/. BENCH_ARGS=--quick checks the pipeline.
bench: $(STAMP)
	$(PY) benchmarks/suite.py $(BENCH_ARGS)

## On a machine with NVIDIA GPUs (< 5 minutes): NCCL, bf16/fp16 AMP, async checkpoint of CUDA
## tensors, deterministic kill+resume, throughput vs the bare DDP loop; with 2+ GPUs also 2 processes
## (rank 1 saving from cuda:1, kill+resume under NCCL; FSDP2 with the bf16 policy: kill+resume
## bitwise and a reshard 2 -> 1). Prints a pass/fail/skipped table; no GPU:
## every check "skipped: no GPU", exit 0 (the last line says nothing was checked).
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf logs .pytest_cache .mypy_cache .ruff_cache .hypothesis
