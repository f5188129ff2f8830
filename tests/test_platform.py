"""Quiet CPU hosts: with libtpu installed and no TPU, jaxpt's programs print no libtpu error lines, because importing
jaxpt selects JAX's CPU backend on a host without accelerators (:mod:`jaxpt.util.platform`)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from jaxpt.util import platform

LIBTPU_NOISE = ("Failed to find host bounds", "E0000", "INVALID_ARGUMENT", "libtpu")


def _fake_pci(tmp_path, *vendors):
    for i, v in enumerate(vendors):
        d = tmp_path / f"0000:00:{i:02x}.0"
        d.mkdir()
        (d / "vendor").write_text(v + "\n")
    return str(tmp_path)


@pytest.mark.parametrize("vendors, expected", [
    (("0x8086", "0x1af4"), "cpu"),       # Intel host bridge, virtio: nothing JAX can use but the CPU
    (("0x8086", "0x1ae0"), None),        # a Google TPU
    (("0x8086", "0x10de"), None),        # an NVIDIA GPU
    (("0x1002",), None),                 # an AMD GPU
])
def test_cpu_is_selected_only_without_accelerators(tmp_path, vendors, expected):
    env = {}
    assert platform.select_cpu_without_accelerators(env, _fake_pci(tmp_path, *vendors)) == (expected is not None)
    assert env.get("JAX_PLATFORMS") == expected


def test_an_explicit_choice_is_kept(tmp_path):
    root = _fake_pci(tmp_path, "0x8086")
    env = {"JAX_PLATFORMS": "tpu"}
    assert not platform.select_cpu_without_accelerators(env, root) and env == {"JAX_PLATFORMS": "tpu"}
    env = {"JAXPT_AUTO_PLATFORMS": "0"}
    assert not platform.select_cpu_without_accelerators(env, root) and "JAX_PLATFORMS" not in env
    assert not platform.select_cpu_without_accelerators({}, str(tmp_path / "no_sys"))  # not Linux: unknown


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu installed (the tpu extra)")
@pytest.mark.skipif(bool((platform.pci_vendors() or set()) & platform.ACCELERATOR_VENDORS),
                    reason="this host has an accelerator")
@pytest.mark.parametrize("args", [["--help"], ["--config", "configs/quickstart.gin", "--dry-run"]])
def test_the_trainer_prints_no_libtpu_error_on_a_cpu_host(args):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAXPT_AUTO_PLATFORMS")}
    r = subprocess.run([sys.executable, "-m", "jaxpt.train", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode in (0, 2), r.stderr[-2000:]  # --dry-run may refuse (a missing sample): still no noise
    noise = [ln for ln in r.stderr.splitlines() if any(n in ln for n in LIBTPU_NOISE)]
    assert noise == [], noise
    if "--dry-run" in args:  # the control: without the CPU choice the same command prints libtpu's errors here
        r = subprocess.run([sys.executable, "-m", "jaxpt.train", *args], cwd=REPO_ROOT,
                           env={**env, "JAXPT_AUTO_PLATFORMS": "0"}, capture_output=True, text=True, timeout=300)
        assert any(n in r.stderr for n in LIBTPU_NOISE), r.stderr[-2000:]
