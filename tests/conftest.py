"""Test-wide setup. Runs before any test module imports jax."""

import os
import pathlib

import pytest

# Eight simulated CPU devices so sharding is tested on a real mesh, not one device. This must happen before
# jax is imported anywhere in the test process.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW_V1 = REPO_ROOT.parent / "shared" / "corpus" / "raw-v1"


@pytest.fixture(scope="session")
def raw_v1_dir() -> pathlib.Path:
    """The full raw-v1 corpus; tests using it skip (with the reason) when it is not next to the repo."""
    if not (RAW_V1 / "MANIFEST.json").is_file():
        pytest.skip(f"raw-v1 corpus not found at {RAW_V1}")
    return RAW_V1
