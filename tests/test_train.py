"""End-to-end training on the bundled sample: the loop's records, and sharding that never changes the math."""

import json

import numpy as np
import pytest

from conftest import tiny_bindings
from jaxpt import config as C
from jaxpt.run import monitor


from jaxpt import train
def run(prepared, workdir, steps, mesh="data=2,fsdp=2,tensor=2", **overrides):
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **overrides), steps=steps, mesh=mesh)
    final = train.run_training(cfg)
    return final, monitor.read_metrics(str(workdir))


@pytest.mark.slow
def test_run_writes_records_and_learns(prepared_sample, tmp_path, without_session_compilation_cache):
    final, records = run(prepared_sample, tmp_path, 30)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("loss", "grad_norm", "learning_rate", "tokens_per_sec", "step_time_s", "mfu", "tflops_per_device"):
        assert key in steps[-1], key
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"]
    assert np.isfinite(final["heldout_loss"]) and final["heldout_tokens"] > 0
    assert (tmp_path / "config.gin").read_text().count("ModelConfig.d_model = 64") == 1
    assert list((tmp_path / "tensorboard").iterdir())
    assert list((tmp_path / "jax_cache").iterdir())  # the compilation cache is on by default, in the workdir
    # lr reported is the schedule's value at the update's index (0-based): warmup 5 steps to 3e-3.
    assert steps[2]["learning_rate"] == pytest.approx(3e-3 * 2 / 5, rel=1e-5)


@pytest.mark.slow
def test_sharding_does_not_change_the_math(prepared_sample, tmp_path):
    """8 steps on four meshes give the same losses (relative difference < 1e-4, fp32)."""
    losses = {}
    for mesh in ("data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2"):
        _, records = run(prepared_sample, tmp_path / mesh.replace(",", "_"), 8, mesh=mesh)
        losses[mesh] = np.array([r["loss"] for r in records if "loss" in r])
    ref = losses["data=8"]
    assert len(ref) == 8 and ref[-1] < ref[0]
    for mesh, l in losses.items():
        np.testing.assert_allclose(l, ref, rtol=1e-4, err_msg=mesh)


def _fingerprint_pair(prepared, workdir, **overrides):
    """HLO fingerprints of the train step as ``jaxpt.train`` builds it and as ``jaxpt.tools.sweep`` compiles it."""
    import jax
    from jaxpt.tools import sweep
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **overrides), steps=10,
                  mesh="data=2,fsdp=2,tensor=2")
    trained = train.setup(cfg).built.hlo_fingerprint()
    swept = sweep.lower(cfg, jax.devices()).hlo_fingerprint()
    return trained, swept


@pytest.mark.slow
def test_train_and_sweep_compile_the_same_step(prepared_sample, tmp_path):
    """``jaxpt.train`` and ``jaxpt.tools.sweep`` lower the same program for the same config, including gradient
    accumulation and the stability policy; and the fingerprint does see those settings (it is not constant)."""
    accum = {"TrainConfig.grad_accum_steps": "4", "StabilityConfig.spike_skip": "True"}
    trained, swept = _fingerprint_pair(prepared_sample, tmp_path, **accum)
    assert trained == swept
    plain, _ = _fingerprint_pair(prepared_sample, tmp_path, **{"TrainConfig.grad_accum_steps": "1",
                                                               "StabilityConfig.spike_skip": "True"})
    no_skip, _ = _fingerprint_pair(prepared_sample, tmp_path, **{"TrainConfig.grad_accum_steps": "4",
                                                                 "StabilityConfig.spike_skip": "False"})
    assert len({trained, plain, no_skip}) == 3


def test_malformed_heldout_fails_at_setup(prepared_sample, tmp_path, capsys):
    """A held-out file with a bad line stops the trainer at setup with exit 2, naming the file and line, before
    step 1 (no metrics, no checkpoint)."""
    import gzip
    bad = tmp_path / "heldout.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"id": "a", "text": "fine"}\n{"id": "b", "text": \n')
    workdir = tmp_path / "run"
    argv = ["--config", "configs/quickstart.gin", "--steps", "3", "--mesh", "data=8"]
    for b in tiny_bindings(prepared_sample, workdir, **{"DataConfig.heldout_path": repr(str(bad))}):
        argv += ["--gin", b]
    assert train.main(argv) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    assert not (workdir / "metrics.jsonl").exists() and not (workdir / "checkpoints").exists()


@pytest.mark.slow
def test_profile_window_hook_writes_a_trace(prepared_sample, tmp_path):
    """``--profile-steps 2:3`` (a loop hook) writes a jax.profiler trace under <workdir>/profile and marks
    the record of its last step."""
    workdir = tmp_path / "run"
    argv = ["--config", "configs/quickstart.gin", "--steps", "4", "--mesh", "data=8", "--profile-steps", "2:3"]
    for b in tiny_bindings(prepared_sample, workdir, **{"TrainConfig.eval_batches": "1"}):
        argv += ["--gin", b]
    assert train.main(argv) == 0
    traces = list((workdir / "profile").rglob("*.xplane.pb"))
    assert traces, sorted(p.name for p in (workdir / "profile").rglob("*"))
    records = monitor.read_metrics(str(workdir))
    assert [r["step"] for r in records if "profile_dir" in r] == [3]
