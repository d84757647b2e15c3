# Megatrace: `make test` and `make demo` install what they need on a fresh Debian machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# iproute2: `ip` builds the network namespaces of the cluster tests (tests/cluster/).
DEB_PACKAGES := prometheus prometheus-alertmanager prometheus-node-exporter postgresql iproute2
DEB_COMMANDS := prometheus promtool prometheus-alertmanager prometheus-node-exporter pg_ctlcluster ip
# The native tracer capture is compiled with g++ through ninja; callgrind measures it (bench).
BUILD_PACKAGES := g++ ninja-build valgrind python3-dev
BUILD_COMMANDS := g++ ninja valgrind
HAVE_PYTHON_H := $(PYTHON) -c "import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))"
# loadgroup: the tests of one cluster (tests/cluster/, marked xdist_group) share one worker and its cluster.
PYTEST_ARGS ?= -n auto --dist loadgroup

.PHONY: test test-loaded demo lint deps debs venv clean native

test: deps lint native
	$(BIN)/pytest $(PYTEST_ARGS)

# The suite beside CPU hogs that keep the load average at or above 4, as on a shared machine; the
# load sampled during the run is printed at the end, and the hogs stop however the run ends.
test-loaded: deps lint native
	$(BIN)/python -m tests.support.loaded --floor 4 -- $(BIN)/pytest $(PYTEST_ARGS)

# The tracer's native capture (C++ against the installed torch); the tracer falls back to Python without it.
native: deps
	$(BIN)/python -m megatrace.tracer.native

# The whole pipeline on this machine: a real job hangs, then runs slow; see README.
demo: deps
	$(BIN)/megatrace stack demo

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tests/support/typecheck.py alertbot

deps: debs $(VENV)/.installed

# Install the Debian packages only when one of their commands is missing.
debs:
	@missing=0; for c in $(DEB_COMMANDS); do command -v $$c >/dev/null || missing=1; done; \
	if [ $$missing = 1 ]; then \
	  echo "installing Debian packages: $(DEB_PACKAGES)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(DEB_PACKAGES); \
	fi
	@missing=0; for c in $(BUILD_COMMANDS); do command -v $$c >/dev/null || missing=1; done; \
	$(HAVE_PYTHON_H) || missing=1; \
	if [ $$missing = 1 ]; then \
	  echo "installing Debian packages: $(BUILD_PACKAGES)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(BUILD_PACKAGES); \
	fi

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall only when the project's dependency list changes.
$(VENV)/.installed: pyproject.toml $(VENV)/bin/python
	$(BIN)/pip install -q -e '.[dev,torch]'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
