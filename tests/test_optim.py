"""Learning-rate schedules against hand-computed values; weight decay spares norms (and embeddings)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpt import optim
from jaxpt.errors import ConfigError
from jaxpt.model import Decoder, ModelConfig


def lr(cfg, total, step):
    return float(optim.learning_rate_schedule(cfg, total)(step))


def test_cosine_schedule_values():
    cfg = optim.OptimizerConfig(peak_learning_rate=1e-3, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr(cfg, 110, 0) == 0.0
    assert lr(cfg, 110, 5) == pytest.approx(0.5e-3)
    assert lr(cfg, 110, 10) == pytest.approx(1e-3)
    # halfway through the decay: 1e-3 * (0.1 + 0.9 * 0.5 * (1 + cos(pi/2))) = 0.55e-3
    assert lr(cfg, 110, 60) == pytest.approx(0.55e-3, rel=1e-5)
    # a quarter: 1e-3 * (0.1 + 0.9 * 0.5 * (1 + cos(pi/4)))
    assert lr(cfg, 110, 35) == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))), rel=1e-5)
    assert lr(cfg, 110, 110) == pytest.approx(1e-4, rel=1e-5)
    assert lr(cfg, 110, 500) == pytest.approx(1e-4, rel=1e-5)


def test_wsd_schedule_values():
    cfg = optim.OptimizerConfig(peak_learning_rate=2e-3, schedule="wsd", warmup_steps=10, min_lr_ratio=0.0,
                                wsd_decay_fraction=0.2)
    total = 100  # decay phase: the last 20 steps, 80 -> 100
    assert lr(cfg, total, 4) == pytest.approx(0.8e-3)
    assert lr(cfg, total, 10) == pytest.approx(2e-3)
    assert lr(cfg, total, 79) == pytest.approx(2e-3)
    assert lr(cfg, total, 80) == pytest.approx(2e-3)
    assert lr(cfg, total, 90) == pytest.approx(1e-3)
    assert lr(cfg, total, 95) == pytest.approx(0.5e-3)
    assert lr(cfg, total, 100) == pytest.approx(0.0, abs=1e-12)


def test_decay_steps_overrides_run_length():
    cfg = optim.OptimizerConfig(peak_learning_rate=1.0, schedule="cosine", warmup_steps=0, min_lr_ratio=0.0,
                                decay_steps=10)
    assert lr(cfg, 1000, 5) == pytest.approx(0.5)


def test_bad_schedule_raises():
    # An unknown schedule is refused when the config is built, before any schedule exists.
    with pytest.raises(ConfigError, match=r"OptimizerConfig\.schedule = 'step': choose one of \('cosine'"):
        optim.OptimizerConfig(schedule="step")
    with pytest.raises(ValueError, match="OptimizerConfig.warmup_steps"):
        optim.learning_rate_schedule(optim.OptimizerConfig(warmup_steps=50), 10)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_weight_decay_leaves_norms_and_embeddings_untouched(scan):
    cfg = ModelConfig(vocab_size=50, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                      mlp_dim=32, scan_layers=scan)
    _, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    ocfg = optim.OptimizerConfig(peak_learning_rate=0.1, schedule="constant", warmup_steps=0, weight_decay=0.5,
                                 grad_clip_norm=1.0)
    tx = optim.make_optimizer(ocfg, 10, params)
    opt_state = tx.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    # With zero gradients Adam's step is exactly 0, so only decoupled decay moves params: p * (1 - lr*wd).
    updates, _ = tx.update(zeros, opt_state, params)
    new = optax.apply_updates(params, updates)
    for (path, old), nw in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(new)):
        key = jax.tree_util.keystr(path)
        if "scale" in key or "embedding" in key:
            np.testing.assert_array_equal(nw, old, err_msg=key)
        else:
            np.testing.assert_allclose(nw, old * (1 - 0.1 * 0.5), rtol=1e-6, err_msg=key)
    # With decay_embeddings=True the embedding decays too.
    tx = optim.make_optimizer(optim.OptimizerConfig(**{**ocfg.__dict__, "decay_embeddings": True}), 10, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    emb_new = optax.apply_updates(params, updates)["embedding"][...]
    np.testing.assert_allclose(emb_new, params["embedding"][...] * 0.95, rtol=1e-6)
