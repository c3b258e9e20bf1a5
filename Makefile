# Two commands set everything up from nothing:
#   make demo   installs, then runs a 4-rank example on the default backend
#   make test   installs every in-repo distribution, runs ruff, mypy and every test

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Every in-repo distribution, installed editable into one venv (the third-party example too:
# CI proves a plugin written from the README alone installs and works).
DISTS  := core backends/tcp_reference examples/third_party_plugin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit install clean bench

install: $(STAMP)

$(STAMP): constraints-dev.txt pyproject.toml $(addsuffix /pyproject.toml,$(DISTS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -c constraints-dev.txt setuptools
	$(PIP) install --quiet --disable-pip-version-check -c constraints-dev.txt \
		-e 'core[testing]' $(addprefix -e ,$(filter-out core,$(DISTS))) \
		numpy matplotlib pytest-timeout ruff mypy
	touch $@

demo: $(STAMP)
	$(PY) examples/allreduce_demo.py --world-size 4

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

test: lint typecheck unit

bench: $(STAMP)
	$(VENV)/bin/pg-core bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
