"""The gradient noise scale (McCandlish et al. 2018): the estimator on a problem with a known answer, and the
in-step micro-batch statistics against an independent per-micro-batch jax.grad."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpt import mesh as M
from jaxpt.training import noise_scale, optim, state as S, step as step_lib
from jaxpt.training.stability import StabilityConfig

from test_stability import CFG, OCFG, make_step, padded_batch


def _synthetic_run(sizes, steps, seed=0, dim=64):
    """Per-example gradients ~ N(mu, diag(var)): each step, micro-batches of ``sizes`` examples (the small
    batches) and their union (the big batch), as accumulation forms them. Returns (smoother, true B_simple)."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=dim)
    var = rng.uniform(0.5, 2.0, size=dim) * 10.0
    true = var.sum() / (mu @ mu)  # tr(Sigma) / |G|^2
    smoother = noise_scale.NoiseScaleSmoother(decay=0.999)
    for _ in range(steps):
        per_example = mu + rng.normal(size=(sum(sizes), dim)) * np.sqrt(var)
        parts = np.split(per_example, np.cumsum(sizes)[:-1])
        micro_sq = np.mean([np.sum(p.mean(0) ** 2) for p in parts])
        inv_small = np.mean([1.0 / len(p) for p in parts])
        big_sq = np.sum(per_example.mean(0) ** 2)
        g, t = noise_scale.estimates(micro_sq, inv_small, big_sq, float(sum(sizes)))
        smoother.observe({"gns/grad_sq": g, "gns/trace": t})
    return smoother, true


@pytest.mark.parametrize("sizes", [(8, 8, 8, 8), (2, 5, 9, 16)], ids=["equal", "unequal"])
def test_estimator_recovers_known_noise_scale(sizes):
    """B_simple = tr(Sigma)/|mu|^2 (about 16 tokens here, the order of the micro-batch size) is recovered within
    5% after 4000 steps, with equal micro-batches and with unequal ones (through mean_i 1/n_i)."""
    smoother, true = _synthetic_run(sizes, 4000)
    assert 3 < true < 30
    assert abs(smoother.value() / true - 1) < 0.05, (smoother.value(), true)


def test_estimates_are_unbiased_in_expectation():
    """Feeding the exact expectations E|G_B|^2 = |G|^2 + tr/B returns |G|^2 and tr exactly."""
    g2, tr = 3.0, 40.0
    sizes = np.array([4.0, 6.0, 10.0])
    micro = np.mean(g2 + tr / sizes)
    got = noise_scale.estimates(micro, np.mean(1 / sizes), g2 + tr / sizes.sum(), sizes.sum())
    np.testing.assert_allclose(got, (g2, tr), rtol=1e-12)


def test_smoother_ignores_missing_skipped_and_nonfinite_steps():
    s = noise_scale.NoiseScaleSmoother(decay=0.5)
    s.observe({"loss": 1.0})  # no accumulation: no estimates
    assert s.value() is None and s.record() == {}
    s.observe({"gns/grad_sq": 2.0, "gns/trace": 10.0})
    s.observe({"gns/grad_sq": 1.0, "gns/trace": 1e9, "skipped": 1.0})
    s.observe({"gns/grad_sq": float("nan"), "gns/trace": 1.0})
    assert s.record() == {"grad_noise_scale": 5.0}
    s.observe({"gns/grad_sq": -4.0, "gns/trace": 10.0})  # EMA(|G|^2) = 0.5*2*0.5 - 4*0.5 < 0: no ratio
    assert s.value() is None
    s.reset()
    assert s.value() is None
    with pytest.raises(ValueError, match="decay"):
        noise_scale.NoiseScaleSmoother(decay=1.0)


def _uneven_batch():
    return padded_batch(seed=2, pad_seed=11, max_pad=28)


def _reference_micro_stats(params, graphdef, batch, accum, z_loss_weight):
    """mean_i |G_i|^2 and mean_i 1/n_i with each micro-batch's gradient taken by itself (its own mean loss,
    jax.grad, unsharded), independent of the accumulation code."""
    sq, inv = [], []
    grad = jax.jit(jax.grad(lambda p, b: step_lib.loss_fn(p, graphdef, b, z_loss_weight)[0]))
    for i in range(accum):
        mb = {k: jnp.asarray(v[i::accum]) for k, v in batch.items()}
        g = grad(params, mb)
        sq.append(sum(float(jnp.sum(jnp.square(x))) for x in jax.tree.leaves(g)))
        _, w = step_lib.targets_and_weights(mb["tokens"], mb["segment_ids"])
        inv.append(1.0 / float(jnp.sum(w)))
    return float(np.mean(sq)), float(np.mean(inv))


@pytest.mark.slow
def test_in_step_micro_grad_sq_matches_independent_grads():
    """On the tiny model (data=2,fsdp=2,tensor=2, 4 micro-batches of uneven token counts), the train step's
    gns/micro_grad_sq equals mean_i |grad of micro-batch i's own mean loss|^2 from a separate jax.grad per
    micro-batch (rel 1e-4), gns/grad_sq and gns/trace follow the estimator from it and grad_norm, and without
    accumulation the gns/* metrics are absent."""
    batch = _uneven_batch()
    spec, fn, put = make_step(StabilityConfig(), grad_accum=4)
    state = S.init_state(spec, CFG, 0)
    params = jax.device_get(state.params)
    ref_sq, ref_inv = _reference_micro_stats(params, spec.graphdef, batch, 4, 1e-4)
    _, m = fn(state, put(batch))
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    np.testing.assert_allclose(m["gns/micro_grad_sq"], ref_sq, rtol=1e-4)
    g, t = noise_scale.estimates(ref_sq, ref_inv, m["grad_norm"] ** 2, m["num_target_tokens"])
    np.testing.assert_allclose([m["gns/grad_sq"], m["gns/trace"]], [g, t], rtol=1e-3)
    assert all(math.isfinite(m[k]) for k in noise_scale.STEP_KEYS)
    spec1, fn1, put1 = make_step(StabilityConfig(), grad_accum=1)
    _, m1 = jax.eval_shape(fn1, spec1.abstract, put1(batch))  # the metrics' names are the traced step's: no compile
    assert not set(noise_scale.STEP_KEYS) & set(m1)


@pytest.mark.slow
def test_run_logs_grad_noise_scale_only_with_accumulation(prepared_sample, tmp_path):
    """A 6-step run with grad_accum_steps 2 logs gns/* every step and grad_noise_scale (tokens, positive, finite:
    early in training |G|^2 is far above the noise) once the averages exist; with 1 the records hold neither."""
    from test_stability import run_with
    from jaxpt.run import monitor
    run_with(prepared_sample, tmp_path / "a2", 6, **{"TrainConfig.grad_accum_steps": "2"})
    records = [r for r in monitor.read_metrics(str(tmp_path / "a2")) if "loss" in r and "event" not in r]
    assert len(records) == 6 and all(set(noise_scale.STEP_KEYS) <= set(r) for r in records)
    assert all(0 < r["grad_noise_scale"] < 1e9 for r in records), [r.get("grad_noise_scale") for r in records]
    run_with(prepared_sample, tmp_path / "a1", 2)
    plain = [r for r in monitor.read_metrics(str(tmp_path / "a1")) if "loss" in r and "event" not in r]
    assert plain and not any({"grad_noise_scale", *noise_scale.STEP_KEYS} & set(r) for r in plain)
