"""End-to-end training on the bundled sample: the loop's records, and sharding that never changes the math."""

import json

import numpy as np
import pytest

from conftest import tiny_bindings
from jaxpt import config as C
from jaxpt import monitor, train


def run(prepared, workdir, steps, mesh="data=2,fsdp=2,tensor=2", **overrides):
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **overrides), steps=steps, mesh=mesh)
    final = train.run_training(cfg)
    return final, monitor.read_metrics(str(workdir))


def test_run_writes_records_and_learns(prepared_sample, tmp_path):
    final, records = run(prepared_sample, tmp_path, 30)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_sec", "step_time_s", "mfu", "tflops_per_device"):
        assert key in steps[-1], key
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"]
    assert np.isfinite(final["heldout_loss"]) and final["heldout_tokens"] > 0
    assert (tmp_path / "config.gin").read_text().count("ModelConfig.d_model = 64") == 1
    assert list((tmp_path / "tensorboard").iterdir())
    # lr reported is the schedule's value at the update's index (0-based): warmup 5 steps to 3e-3.
    assert steps[2]["learning_rate"] == pytest.approx(3e-3 * 2 / 5, rel=1e-5)


@pytest.mark.slow
def test_sharding_does_not_change_the_math(prepared_sample, tmp_path):
    """20 steps on four meshes give the same losses (relative difference < 1e-4, fp32)."""
    losses = {}
    for mesh in ("data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2"):
        _, records = run(prepared_sample, tmp_path / mesh.replace(",", "_"), 20, mesh=mesh)
        losses[mesh] = np.array([r["loss"] for r in records if "loss" in r])
    ref = losses["data=8"]
    assert len(ref) == 20 and ref[-1] < ref[0]
    for mesh, l in losses.items():
        np.testing.assert_allclose(l, ref, rtol=1e-4, err_msg=mesh)
