"""Learning-rate schedules against hand-computed values; weight decay spares norms (and embeddings)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpt.training import optim
from jaxpt.util.errors import ConfigError
from jaxpt.model import Decoder, ModelConfig
from jaxpt.run.validate import validate


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


# Hand-computed values at step 0, the end of warmup, the start of decay and the final step of each schedule.
# cosine: p=1e-3, w=10, T=110, m=0.1: lr(T-1) = p * (m + (1 - m) * 0.5 * (1 + cos(pi * 99 / 100))).
# wsd: p=2e-3, w=10, T=100, d=round(0.2 * 100)=20, m=0.1: flat to step 80, then -1.8e-3/20 = -9e-5 per step.
# constant: p=1e-3, w=4: half the peak at step 2.
SCHEDULE_POINTS = [
    (dict(schedule="cosine", peak_learning_rate=1e-3, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1),
     [(0, 0.0), (5, 0.5e-3), (10, 1e-3), (109, 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.99)))),
      (110, 1e-4), (200, 1e-4)]),
    (dict(schedule="wsd", peak_learning_rate=2e-3, warmup_steps=10, decay_steps=100, min_lr_ratio=0.1,
          wsd_decay_fraction=0.2),
     [(0, 0.0), (10, 2e-3), (80, 2e-3), (81, 1.91e-3), (90, 1.1e-3), (100, 2e-4), (150, 2e-4)]),
    # warmup and decay exactly adjacent: the end of warmup is the start of decay.
    (dict(schedule="wsd", peak_learning_rate=1.0, warmup_steps=80, decay_steps=100, min_lr_ratio=0.0,
          wsd_decay_fraction=0.2),
     [(0, 0.0), (40, 0.5), (80, 1.0), (90, 0.5), (100, 0.0)]),
    (dict(schedule="constant", peak_learning_rate=1e-3, warmup_steps=4, decay_steps=50),
     [(0, 0.0), (2, 0.5e-3), (4, 1e-3), (50, 1e-3)]),
]


@pytest.mark.parametrize("kwargs,points", SCHEDULE_POINTS, ids=["cosine", "wsd", "wsd_adjacent", "constant"])
def test_every_schedule_at_its_phase_boundaries(kwargs, points):
    cfg = optim.OptimizerConfig(**kwargs)
    for step, want in points:
        assert lr(cfg, 1000, step) == pytest.approx(want, rel=1e-5, abs=1e-12), step


@pytest.mark.parametrize("kwargs,keys", [
    # the case: the floor would be reached at step 110, LR(100) = 0.55 x peak
    (dict(schedule="wsd", warmup_steps=90, decay_steps=100, wsd_decay_fraction=0.2),
     ("OptimizerConfig.warmup_steps = 90", "OptimizerConfig.wsd_decay_fraction = 0.2",
      "OptimizerConfig.decay_steps = 100")),
    # cosine with no room to decay: LR(T) would be the peak, not the floor
    (dict(schedule="cosine", warmup_steps=100, decay_steps=100),
     ("OptimizerConfig.warmup_steps = 100", "OptimizerConfig.decay_steps = 100")),
    (dict(schedule="constant", warmup_steps=101, decay_steps=100), ("OptimizerConfig.warmup_steps = 101",)),
])
def test_impossible_schedule_shapes_are_config_errors_naming_the_keys(kwargs, keys):
    with pytest.raises(ConfigError) as e:
        optim.OptimizerConfig(**kwargs)
    for key in keys:
        assert key in str(e.value)


def test_schedule_horizon_from_train_steps_is_checked_by_validate():
    """With ``decay_steps = 0`` the horizon is ``TrainConfig.steps``: the same shapes are refused by
    ``config.validate`` (through ``parse``'s caller) naming ``TrainConfig.steps``."""
    from jaxpt import config as C
    cfg = C.parse([], ["OptimizerConfig.schedule = 'wsd'", "OptimizerConfig.warmup_steps = 90",
                       "OptimizerConfig.decay_steps = 0"], steps=100, mesh="data=8")
    with pytest.raises(ConfigError, match=r"TrainConfig\.steps = 100"):
        validate(cfg, 8)
    ok = C.parse([], ["OptimizerConfig.schedule = 'wsd'", "OptimizerConfig.warmup_steps = 80",
                      "OptimizerConfig.decay_steps = 0"], steps=100, mesh="data=8")
    validate(ok, 8)
    assert lr(ok.optimizer, 100, 100) == pytest.approx(ok.optimizer.peak_learning_rate * ok.optimizer.min_lr_ratio)


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
