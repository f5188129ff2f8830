"""The persistent compilation cache (:mod:`jaxpt.run.compile_cache`): where ``TrainConfig.compilation_cache_dir`` puts
it, that a second process loads what the first compiled, and that a block leaves the process's setting as it was."""

import os
import subprocess
import sys

import jax
import pytest

from conftest import REPO_ROOT
from jaxpt.run import compile_cache
from jaxpt import config as config_lib

# Compiles one program inside persistent_cache(argv[1]) (argv[1] 'off': None) and prints requests and hits.
SCRIPT = """
import sys
import jax, jax.numpy as jnp
from jaxpt.run import compile_cache
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the tiny program is written too
with compile_cache.persistent_cache(None if sys.argv[1] == "off" else sys.argv[1]) as stats:
    jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
print("STATS", -1 if stats is None else stats.requests, -1 if stats is None else stats.hits)
"""


@pytest.fixture
def no_jax_cache_dir():
    """The process's ``jax_compilation_cache_dir`` unset for the test, and put back after it."""
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", previous)


def test_auto_is_jax_own_setting_else_the_workdir(no_jax_cache_dir, tmp_path):
    """'auto' -> <workdir>/jax_cache, or JAX's directory when one is set; '' / 'off' -> no cache; '~' is expanded;
    a URL is kept as written. The config's default is 'auto'."""
    assert config_lib.TrainConfig().compilation_cache_dir == "auto"
    assert compile_cache.resolve_cache_dir("auto", "runs/a") == os.path.join("runs/a", "jax_cache")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    assert compile_cache.resolve_cache_dir("auto", "runs/a") == str(tmp_path)
    assert compile_cache.resolve_cache_dir("", "runs/a") is None
    assert compile_cache.resolve_cache_dir("off", "runs/a") is None
    assert compile_cache.resolve_cache_dir("~/c", "runs/a") == os.path.join(os.path.expanduser("~"), "c")
    assert compile_cache.resolve_cache_dir("gs://b/c", "runs/a") == "gs://b/c"


def test_a_block_restores_the_previous_setting(no_jax_cache_dir, tmp_path):
    """Inside the block JAX's cache directory is the block's (None for 'off'); after it, what it was before."""
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "outer"))
    with compile_cache.persistent_cache(str(tmp_path / "inner")) as stats:
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "inner")
        assert (stats.requests, stats.hits, stats.directory) == (0, 0, str(tmp_path / "inner"))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "outer")
    with compile_cache.persistent_cache(None) as stats:
        assert stats is None and jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "outer")


def _run(arg: str, env_cache: str | None = None) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")
    if env_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = env_cache
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arg], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STATS"))
    return tuple(int(v) for v in line.split()[1:])


@pytest.mark.integration
def test_a_second_process_loads_the_program_from_the_cache(tmp_path):
    """Process 1 compiles the program and writes it to the cache directory (0 hits); process 2, started afresh with
    the same directory, loads every program it looks up (hits = requests) and writes nothing new; with the cache
    'off', even JAX_COMPILATION_CACHE_DIR pointing at a full cache is not read (and nothing is written there)."""
    cache = tmp_path / "cache"
    requests, hits = _run(str(cache))
    entries = sorted(os.listdir(cache))
    assert requests >= 1 and hits == 0 and entries
    requests2, hits2 = _run(str(cache))
    assert requests2 == hits2 == requests
    assert sorted(os.listdir(cache)) == entries
    other = tmp_path / "other"
    other.mkdir()
    assert _run("off", env_cache=str(other)) == (-1, -1)
    assert not os.listdir(other)
