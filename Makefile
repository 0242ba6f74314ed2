# cascade — the two quickstart commands: `make demo` and `make test`.
# Both create .venv with the machine's python3 and install from setup.py.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny.py
WORKDIR ?= runs/tiny

.PHONY: demo world test test-heavy test-all mutation sysdeps clean

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
	$(PY) -m cascade.main --config=$(CONFIG) --workdir=$(WORKDIR)

# The tiny configs' data (their `prepare` step): the tiny world of SEED under
# runs/tiny_world, built on first use and reused while its stamp matches.
SEED ?= 0
world: $(VENV)/.stamp-base
	$(PY) -m tiny_world.build --seed=$(SEED) --root=runs/tiny_world

# The default suite on TEST_WORKERS pytest-xdist workers (a test file stays on one worker, so
# its module fixtures and compiled programs are shared); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.stamp-test sysdeps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The heavy tier: compile-bound parity checks (sharded = unsharded, scan = loop, engine = one
# call, packed = padded), learning tests, the pinned golden cascade, notebooks and benchmark
# smoke runs. CI runs it after `make test`.
test-heavy: $(VENV)/.stamp-test sysdeps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m heavy

# Everything, the heavy and slow tests too.
test-all: $(VENV)/.stamp-test sysdeps
	$(PY) -m pytest -q -m ""

# Mutation testing (cosmic-ray, the `mutation` extra); not part of `make test`. Each module in
# MUTATE is mutated one edit at a time in a copy of the tree under MUTATION_DIR (cosmic-ray edits
# the files it mutates, so never in place) and MUTATION_TESTS, fast tests only, must then fail;
# cr-report lists the survivors. The whole default set takes hours on 2 cores: narrow it, e.g.
#   make mutation MUTATE=cascade/rollout.py MUTATION_TESTS=tests/cascade/test_rollout.py
MUTATE ?= cascade/rollout.py cascade/kinds/rl.py cascade/kinds/loop.py cascade/kinds/grpo.py \
          cascade/kinds/mopd.py cascade/kinds/sft.py cascade/kinds/base.py cascade/checkpoint.py \
          rl/grpo.py rl/filtering.py rl/batch.py rl/distill.py rl/sft.py rl/train_step.py \
          rl/page_pool.py rl/scheduler.py verifiers/math.py
MUTATION_TESTS ?= --timeout=120 tests/cascade/test_rollout.py tests/cascade/test_kinds_rl.py \
          tests/cascade/test_kinds_rl_config.py tests/cascade/test_kinds_rl_draws.py \
          tests/cascade/test_kinds_loop.py tests/cascade/test_kinds_sft.py \
          tests/cascade/test_policies.py tests/cascade/test_kinds.py tests/cascade/test_checkpoint.py \
          tests/rl tests/verifiers/test_math.py
# MUTATION_SAMPLE=N runs a seeded random sample of N mutants per module (0: all of them);
# MUTATION_RERUN=DIR runs only the mutants that survived the sessions saved in DIR (a
# copy of an earlier MUTATION_DIR, which each run empties), e.g. against more tests.
MUTATION_SAMPLE ?= 0
MUTATION_SEED ?= 0
MUTATION_RERUN ?=
MUTATION_DIR ?= /tmp/cascade-mutation-$(shell id -un)
CR := $(abspath $(VENV))/bin
$(VENV)/.stamp-mutation: setup.py $(VENV)/.stamp-test
	$(PY) -m pip install -q -e '.[test,mutation]'
	touch $@

mutation: $(VENV)/.stamp-mutation
	rm -rf $(MUTATION_DIR) && mkdir -p $(MUTATION_DIR)
	git ls-files -co --exclude-standard | grep -v '^runs/' | tar -cf - -T - | tar -xf - -C $(MUTATION_DIR)
	cd $(MUTATION_DIR) && for m in $(MUTATE); do \
	  n=$$(echo $$m | tr '/.' '__'); \
	  printf '[cosmic-ray]\nmodule-path = "%s"\ntimeout = 900.0\nexcluded-modules = []\ntest-command = "env PYTHONPATH=%s %s -m pytest -x -q %s"\n[cosmic-ray.distributor]\nname = "local"\n' \
	    "$$m" "$(MUTATION_DIR)" "$(CR)/python" "$(MUTATION_TESTS)" > $$n.toml && \
	  $(CR)/cosmic-ray init $$n.toml $$n.sqlite && \
	  { [ -z "$(MUTATION_RERUN)" ] || $(CR)/python tools/mutation_sample.py $$n.sqlite \
	      --survivors_of=$(abspath $(MUTATION_RERUN))/$$n.sqlite; } && \
	  { [ "$(MUTATION_SAMPLE)" = 0 ] || [ -n "$(MUTATION_RERUN)" ] || \
	    $(CR)/python tools/mutation_sample.py $$n.sqlite \
	      --size=$(MUTATION_SAMPLE) --seed=$(MUTATION_SEED); } && \
	  $(CR)/cosmic-ray exec $$n.toml $$n.sqlite && \
	  $(CR)/cr-report $$n.sqlite || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info
