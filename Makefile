# Two commands set everything up from nothing:
#   make demo   installs, then runs a 4-rank example on the default backend and a short side-by-side
#               benchmark of the installed backends
#   make test   installs every in-repo distribution, runs ruff, mypy, `make docs`, `make package` and every test
#   make docs   builds the documentation site (mkdocs.yml, docs/) strictly into build/site
#   make package builds every distribution's sdist and wheel into build/dist and tests them
#                installed (not editable) in a fresh venv, build/pkg-venv

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Every in-repo distribution, installed editable into one venv (the third-party example too:
# CI proves a plugin written from the README alone installs and works).
DISTS  := core backends/tcp_reference backends/gloo backends/nccl backends/mpi backends/shm examples/third_party_plugin
STAMP  := $(VENV)/.installed

# The release check (tests/integration/test_packaging.py): `make package` runs it, `make unit` leaves it out.
PACKAGING := tests/integration/test_packaging.py

.PHONY: demo test lint typecheck docs unit package install clean bench bytecode torch-tests

install: $(STAMP)

$(STAMP): constraints-dev.txt pyproject.toml $(addsuffix /pyproject.toml,$(DISTS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -c constraints-dev.txt setuptools
	$(PIP) install --quiet --disable-pip-version-check -c constraints-dev.txt \
		-e 'core[testing]' $(addprefix -e ,$(filter-out core,$(DISTS))) \
		numpy matplotlib pytest-timeout pytest-xdist ruff mypy build expecttest \
		mkdocs mkdocs-material 'mkdocstrings[python]'
	touch $@

# The demo ends with the installed backends side by side: a short `pg-core bench` (a few sizes of
# all_reduce, 2 ranks, a quarter second per row; every backend installed and available, mpi's
# ranks through mpiexec, beside torch's Gloo and raw mpi4py).
DEMO_BENCH := --world-size 2 --ops all_reduce --sizes 4,64K,1M --iters 50 --warmup 2 --time-budget 0.25 --quiet

demo: $(STAMP)
	$(PY) examples/allreduce_demo.py --world-size 4
	@echo
	@echo "Side by side: all_reduce on every installed backend at 2 ranks, beside the raw libraries (pg-core bench $(DEMO_BENCH)):"
	@$(VENV)/bin/pg-core bench $(DEMO_BENCH)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml) into build/site. --strict: a broken link, a missing page or
# an API reference that does not resolve fails the build. Offline: no theme fonts are fetched.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The tests run in parallel worker processes (pytest-xdist), one per core up to 4: most of
# them wait on rank processes, sockets and timeouts, so two workers on 2 cores took the suite
# from 1377 to 1003 s (2026-11-26) with every multi-rank test's timeouts unchanged. No more
# than one per core: three workers kept both cores 98.6% busy over the run (/proc/stat,
# 2026-11-27) and took 1155 s, against 1092 s for two the same morning.
# UNIT_WORKERS=0 runs them in this process, one after another.
UNIT_WORKERS ?= auto

unit: bytecode
	$(PY) -m pytest -n $(UNIT_WORKERS) --maxprocesses=4 --ignore=$(PACKAGING)

# Bytecode of the repository's own modules, written before the tests run. The tests start many
# Python processes (ranks, launchers, CLIs), each importing pg-core, a backend and the test
# module that holds its rank function; where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines) none of them writes what it compiled, so each compiled them again: 0.27 s
# of CPU per process for pg-core and pg-tcp alone, against 0.05 s with their bytecode there.
# Python checks each .pyc against its source's size and time, so an edited file is compiled again.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 $(addsuffix /src,$(DISTS)) $(addsuffix /tests,$(DISTS)) tests examples conftest.py

# Torch's own distributed tests (torch.testing._internal.distributed.distributed_test, which needs
# expecttest) over pg-core through torch's plugin route, beside torch's Gloo: the CI subset
# (tests/torch_suite/subset.txt) as a table, then the targets checked (every test Gloo passes passes
# over pg-gloo, and over pg-tcp but for tests/torch_suite/known_failures.txt). `make unit` runs the
# same check as one test (tests/torch_suite/test_torch_suite.py). TORCH_TESTS_ARGS=--all for every test.
torch-tests: bytecode
	$(PY) tests/torch_suite/run_torch_tests.py --check $(TORCH_TESTS_ARGS)

# sdist, then a wheel built from the sdist, per distribution (build/dist); a fresh build/pkg-venv
# with the wheels and torch from constraints-dev.txt; then, from outside the repository:
# `pg-core backends`, a 2-rank all_reduce, a few conformance examples, versions and changelogs.
package: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider $(PACKAGING)

# lint, typecheck and the docs first (a minute: a style error or a broken link fails fast), then the packaging check and the
# tests side by side (the tests keep both cores busy only most of the time), each one's output
# printed whole when it ends.
test: lint typecheck docs
	$(MAKE) --no-print-directory -j2 --output-sync=target package unit

bench: $(STAMP)
	$(VENV)/bin/pg-core bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build/dist build/pkg-venv
