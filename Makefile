# Two entry points a new user needs: `make quickstart` and `make test`.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
ARTIFACTS ?= artifacts
WORKDIR ?= workdirs/quickstart
# Simulated devices for CPU hosts; on a real accelerator host unset it (XLA_FLAGS= make quickstart).
# The simulated devices share the cores, so on a busy host one can reach a collective long after the others:
# XLA's default 40 s wait would abort the run, hence the 10-minute collective timeouts.
XLA_FLAGS ?= --xla_force_host_platform_device_count=8 --xla_cpu_collective_call_warn_stuck_timeout_seconds=60 \
	--xla_cpu_collective_call_terminate_timeout_seconds=600 --xla_cpu_collective_timeout_seconds=600
export XLA_FLAGS
# CPU even where libtpu is installed (the `tpu` extra, part of `dev`): on a TPU VM run python -m jaxpt.train directly.
JAX_PLATFORMS ?= cpu
export JAX_PLATFORMS

.PHONY: quickstart test test-fast prepare venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

prepare: venv
	$(VPY) -m jaxpt.data.prepare --output $(ARTIFACTS)/sample

quickstart: prepare
	$(VPY) -m jaxpt.train --config configs/quickstart.gin --workdir $(WORKDIR)

test: venv
	$(VPY) -m pytest -q -n 2 --durations=15 tests

test-fast: venv
	$(VPY) -m pytest -q -n 2 -m 'not slow' tests

clean:
	rm -rf $(ARTIFACTS) workdirs
