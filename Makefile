# optcc_mpi: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP := $(VENV)/.installed
# Ranks for the MPI test runs (8 oversubscribes 2 cores, on purpose).
MPI_SIZES ?= 2 3 4 5 8
# Wall-clock limit for one whole mpiexec run: a hang fails instead of blocking CI.
MPI_RUN_TIMEOUT ?= 1500
# MPICH ranks beyond the cores spin in their progress engines and starve each other;
# throttling idle progress makes oversubscribed runs about ten times faster.
export MPIR_CVAR_CH4_PROGRESS_THROTTLE ?= 1
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: install test test-serial test-mpi package-check demo lint clean help

help:
	@echo "make install   create $(VENV) with the pinned dependencies (MPICH wheel included)"
	@echo "make demo      the main job: every algorithm on 8 ranks, checked, and the model table"
	@echo "make test      serial tests, then the MPI tests at $(MPI_SIZES) ranks"
	@echo "make lint      ruff"

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

test: $(STAMP)
	$(MAKE) --no-print-directory test-serial
	$(MAKE) --no-print-directory test-mpi
	$(MAKE) --no-print-directory package-check

# The wheel in a fresh virtual environment outside the tree, with no MPI library.
package-check: $(STAMP)
	PYTHON=$(PY) bash .ci/package-check

test-serial: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) tests

# `python -m mpi4py` aborts every rank when one raises, and pytest-timeout fails a hung
# test; `timeout` is the last line of defence. Exit code 5 (no tests collected) fails too.
test-mpi: $(STAMP)
	@set -e; for n in $(MPI_SIZES); do \
	  echo "== MPI tests on $$n ranks =="; \
	  timeout --signal=KILL $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m mpi4py -m pytest \
	    --with-mpi --only-mpi $(PYTEST_FLAGS) tests || { echo "MPI tests failed on $$n ranks"; exit 1; }; \
	done

demo: $(STAMP)
	$(VENV)/bin/optcc-mpi demo

lint: $(STAMP)
	$(VENV)/bin/ruff check optcc_mpi tests
	$(VENV)/bin/ruff format --check optcc_mpi tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# Recorded benchmarks (README "Measured"): the testbed needs root; results go to results/.
BENCH_SIZES ?= -b 16M -e 64M -f 2 -n 3 -w 1
.PHONY: bench-testbed bench-emulation
bench-testbed: $(STAMP)
	@mkdir -p results
	$(VENV)/bin/optcc-mpi testbed down >/dev/null
	$(VENV)/bin/optcc-mpi testbed up --ranks 8 --rate 400mbit
	$(VENV)/bin/optcc-mpi testbed run -- $(PY) -m optcc_mpi bench $(BENCH_SIZES) \
	  --algorithms ring,native,auto --out results/testbed-healthy.jsonl; \
	  status=$$?; $(VENV)/bin/optcc-mpi testbed down >/dev/null; exit $$status
	$(VENV)/bin/optcc-mpi testbed up --ranks 8 --rate 400mbit --degrade 0:0.5
	$(VENV)/bin/optcc-mpi testbed run -- $(PY) -m optcc_mpi bench $(BENCH_SIZES) \
	  --algorithms ring,optcc,r2ccl,native,auto --out results/testbed-degraded.jsonl; \
	  status=$$?; $(VENV)/bin/optcc-mpi testbed down >/dev/null; exit $$status

bench-emulation: $(STAMP)
	@mkdir -p results
	$(MPIEXEC) -n 8 $(PY) -m optcc_mpi bench -b 4M -e 16M -f 2 -n 3 -w 1 \
	  --links 0:0.5 --emulate bw=50MB/s --out results/emulation-degraded.jsonl

# One short check of the GPU paths (every algorithm on CuPy arrays at 1 and 4 ranks, the
# bf16 GemmEx Gram, recipe C training); says so and exits 0 where no GPU is usable.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py
