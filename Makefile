# Two entry points a new user needs: `make quickstart` and `make test`.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
ARTIFACTS ?= artifacts
WORKDIR ?= workdirs/quickstart
# Simulated devices for CPU hosts; on a real accelerator host unset it (XLA_FLAGS= make quickstart).
XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export XLA_FLAGS

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
