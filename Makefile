# Two entry points a new user needs: `make quickstart` and `make test`.
PY ?= python3
# The interpreter PY names; `pythonX.Y` not runnable as such (a pyenv shim of a version that is not selected)
# falls back to the newest ~/.pyenv/versions/X.Y.*/bin/python.
PYEXE := $(shell $(PY) -c 'import sys; print(sys.executable)' 2>/dev/null || \
	ls -d $(HOME)/.pyenv/versions/$(patsubst python%,%,$(notdir $(PY))).*/bin/python 2>/dev/null | sort -V | tail -1)
PYVER := $(if $(PYEXE),$(shell $(PYEXE) -c 'import sys; print("%d%d" % sys.version_info[:2])' 2>/dev/null))
ifeq ($(PYVER),)
$(error PY=$(PY): no such Python interpreter)
endif
# One venv per interpreter: `.venv` for the default python3, `.venv312` for `make test PY=python3.12`, ...
ifeq ($(origin PY),file)
VENV ?= .venv
else
VENV ?= .venv$(PYVER)
endif
VPY := $(VENV)/bin/python
ARTIFACTS ?= artifacts
WORKDIR ?= workdirs/quickstart
# Simulated devices for CPU hosts; on a real accelerator host unset it (XLA_FLAGS= make quickstart).
# The simulated devices share the cores, so on a busy host one can reach a collective long after the others:
# XLA's default 40 s wait would abort the run, hence the 10-minute collective timeouts.
XLA_FLAGS ?= --xla_force_host_platform_device_count=8 --xla_cpu_collective_call_warn_stuck_timeout_seconds=60 \
	--xla_cpu_collective_call_terminate_timeout_seconds=600 --xla_cpu_collective_timeout_seconds=600
export XLA_FLAGS
# XLA:CPU's thread pools, 4 threads per simulated device: XLA's default, max(cores, devices), is 8 threads on a small
# host, and a pipelined step's waiting collectives can hold all 8 and abort the run (tests/conftest.py PJRT_NPROC,
# benchmarks/repro/cpu_collective_starvation.py).
PJRT_NPROC ?= 32
export PJRT_NPROC
# CPU even where libtpu is installed (the `tpu` extra, part of `dev`): on a TPU VM run python -m jaxpt.train directly.
JAX_PLATFORMS ?= cpu
export JAX_PLATFORMS

.PHONY: quickstart test test-unit test-integration test-corpus test-fast test-newest prepare venv venv-core docs clean

# The quickstart installs the core (about 1.1 GB); the tests install the dev extra on top (TensorFlow, torch, libtpu,
# Beam, lm-eval: about 5.7 GB). pip prints little: each step says what it installs first.
$(VENV)/.core: pyproject.toml
	test -x $(VPY) || $(PYEXE) -m venv $(VENV)
	@echo "installing jaxpt's core and the prepare extra into $(VENV): about 1.1 GB, 2-5 minutes on a fresh host"
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[prepare]'
	touch $@

$(VENV)/.installed: $(VENV)/.core
	@echo "installing the test set (jaxpt[dev]) into $(VENV): about 4.5 GB more, 5-10 minutes on a fresh host"
	$(VPY) -m pip install -q -e '.[dev]'
	touch $@

venv-core: $(VENV)/.core

venv: $(VENV)/.installed

prepare: venv-core
	$(VPY) -m jaxpt.data.prepare --output $(ARTIFACTS)/sample

quickstart: prepare
	$(VPY) -m jaxpt.train --config configs/quickstart.gin --workdir $(WORKDIR)

# The tiers (tests/tiers.py, docs/design/testing.md): unit (no training, no child process, a few seconds a test: run
# it before a commit), integration (training, processes, conversions, TPU compiles), corpus (all of raw-v1).
# `make test` runs the unit tier alone first (timed on its own, and a broken unit shows in minutes), then the other
# two in one run; it fails if either failed. Each run ends with its tiers' counts and seconds and its slowest tests.
PYTEST := $(VPY) -m pytest -q -n 2 --timeout=1200

test: venv
	$(PYTEST) -m unit tests; unit=$$?; $(PYTEST) -m 'not unit' tests; rest=$$?; \
	echo "make test: unit tier exit $$unit, integration and corpus exit $$rest"; [ $$unit = 0 ] && [ $$rest = 0 ]

test-unit: venv
	$(PYTEST) -m unit tests

test-integration: venv
	$(PYTEST) -m integration tests

test-corpus: venv
	$(PYTEST) -m corpus tests

# The unit tier under its old name.
test-fast: test-unit

# CI's second interpreter (Python 3.12, the newest jax/flax/optax/orbax/grain): the fast tests of the files that call
# those libraries most directly (the programs' goldens, model, sharding, train step, optimizers, checkpoints, the
# data loader and packing), so a library change shows there without a second run of the whole suite. Its venv holds
# the core and the test tools only (`$(VENV)/.newest`, about 1.2 GB): none of these files needs Beam, TensorFlow,
# torch or libtpu, and the full dev install cost CI about ten minutes more.
NEWEST_TESTS := test_behaviour_goldens test_model test_sharding test_train test_optim test_muon test_checkpoint \
	test_data_loader test_data_packing
$(VENV)/.newest: pyproject.toml
	test -x $(VPY) || $(PYEXE) -m venv $(VENV)
	@echo "installing jaxpt's core and the test tools into $(VENV): about 1.2 GB, 2-5 minutes on a fresh host"
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[prepare,test]'
	touch $@

# The unit tier's time limits are off here (JAXPT_UNIT_LIMIT_S=0): they are set for the 3.11 stack, and this run
# checks another stack's results, not the tier's cost.
test-newest: $(VENV)/.newest
	JAXPT_UNIT_LIMIT_S=0 $(VPY) -m pytest -q -n 2 --timeout=1200 --durations=10 -m 'not slow' $(NEWEST_TESTS:%=tests/%.py)

# The documentation site, built strictly (a broken link, anchor or nav entry fails) into site/. The reference pages
# are generated from the code during the build (docs/gen_reference.py), so it needs the dev venv too. The theme's
# end-of-life notice is silenced here; docs/design/docs-site.md says what it means for the project.
$(VENV)/.docs-installed: pyproject.toml $(VENV)/.installed
	$(VPY) -m pip install -q -e '.[docs]'
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(ARTIFACTS) workdirs site
