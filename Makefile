# cascade — the two quickstart commands: `make demo` and `make test`.
# Both create .venv with the machine's python3 and install from setup.py.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.py
WORKDIR ?= runs/tiny

.PHONY: demo world test test-all sysdeps clean

$(VENV)/.stamp-base: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.stamp-test: setup.py $(VENV)/.stamp-base
	$(PY) -m pip install -q -e '.[test,interop]'
	touch $@

# bubblewrap isolates the code/SWE verifiers' sandbox, which refuses to start
# without it (or with a verifier option isolation='none'); installed where we are root.
sysdeps:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing bubblewrap (code sandbox)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
	  || echo "WARNING: could not install bubblewrap; code/SWE verifiers will refuse to start (install it, or set their option isolation='none' for trusted code only)"; \
	else \
	  echo "WARNING: bubblewrap (bwrap) is missing: install it with 'sudo apt-get install bubblewrap';"; \
	  echo "         until then code/SWE verifiers refuse to start (option isolation='none' opts out, trusted code only)"; \
	fi

demo: $(VENV)/.stamp-base sysdeps
	$(PY) -m cascade.main --config=$(CONFIG) --workdir=$(WORKDIR) --verbosity=-1

# The tiny configs' data (their `prepare` step): the tiny world of SEED under
# runs/tiny_world, built on first use and reused while its stamp matches.
SEED ?= 0
world: $(VENV)/.stamp-base
	$(PY) -m cascade.tiny_world.build --seed=$(SEED) --root=runs/tiny_world

test: $(VENV)/.stamp-test sysdeps
	$(PY) -m pytest -q

# Everything, the slow tests too.
test-all: $(VENV)/.stamp-test sysdeps
	$(PY) -m pytest -q -m ""

clean:
	rm -rf $(VENV) build *.egg-info
