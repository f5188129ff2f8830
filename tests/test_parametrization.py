"""µP (ModelConfig.parametrization = 'mup'): the multiplier table, the wiring into a run, and the coordinate check.

The coordinate check follows Yang et al. 2022 ("Tensor Programs V", sec. 6 and Fig. 5; the ``mup`` package's
``get_coord_data``): train a few Adam steps at one learning rate at widths 64 and 512 and look at the size (RMS) of
each layer's activations. Under µP they stay flat with width; under SP the updates' effect grows with width.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpt import config as C
from jaxpt import mesh as M
from jaxpt.model import ModelConfig, parametrization
from jaxpt.run import build as build_lib
from jaxpt.training import optim, state as S, step as step_lib
from jaxpt.util.errors import ConfigError

# The check needs the two ends only (its assertions compare width 512 with 64); the table on the µP results page has
# 128 and 256 too, from the commit it names.
WIDTHS = (64, 512)
HEAD_DIM = 16
OCFG = optim.OptimizerConfig(peak_learning_rate=1e-2, schedule="constant", warmup_steps=0, grad_clip_norm=0.0,
                             weight_decay=0.0)


def _model(width: int, kind: str, base: int = 64, **extra) -> ModelConfig:
    """Width grows by heads and the MLP, head_dim fixed (the module docstring's rule)."""
    return ModelConfig(vocab_size=256, d_model=width, num_layers=2, num_heads=width // HEAD_DIM,
                       num_kv_heads=width // HEAD_DIM, head_dim=HEAD_DIM, mlp_dim=4 * width, max_seq_len=64,
                       parametrization=kind, mup_base_d_model=base if kind == "mup" else 0, **extra)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (8, 64)).astype(np.int32)
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens),
            "positions": np.broadcast_to(np.arange(64, dtype=np.int32), tokens.shape).copy()}


def _train(cfg: ModelConfig, steps: int, mesh_spec: str = "data=2,fsdp=2,tensor=2"):
    """``steps`` real train steps (jaxpt's jitted step and make_optimizer with µP's multipliers) on one batch."""
    mesh = M.make_mesh(mesh_spec)
    spec = S.make_state_spec(
        cfg, lambda p: optim.make_optimizer(OCFG, 100, p, parametrization.lr_multipliers(cfg, p)), mesh,
        M.DEFAULT_RULES)
    fn = step_lib.jit_train_step(spec, mesh, M.DEFAULT_RULES, z_loss_weight=0.0,
                                 lr_schedule=optim.learning_rate_schedule(OCFG, 100))
    shard = M.batch_sharding(mesh, M.DEFAULT_RULES)
    batch = {k: jax.device_put(v, shard) for k, v in _batch().items()}
    state = S.init_state(spec, cfg, seed=0)
    losses = []
    for _ in range(steps):
        state, metrics = fn(state, batch)
        losses.append(float(metrics["loss"]))
    return spec, state, losses


def _activation_rms(spec, params, cfg: ModelConfig) -> dict[str, float]:
    """RMS over every coordinate of: the embedding output, each block's output (the residual stream) and the
    logits, on a fresh batch (float32, no mesh)."""
    model = nnx.merge(spec.graphdef, jax.device_get(params))
    b = _batch(seed=1)
    tokens, seg, pos = (jnp.asarray(b[k]) for k in ("tokens", "segment_ids", "positions"))
    rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.square(a.astype(jnp.float32)))))  # noqa: E731
    x = jnp.take(model.embedding[...], tokens, axis=0)
    out = {"embedding": rms(x)}
    for i, block in enumerate(model.blocks):
        x, _ = block(x, seg, pos)
        out[f"block{i}"] = rms(x)
    logits = jnp.einsum("bld,dv->blv", model.final_norm(x), model.output_weights())
    out["logits"] = rms(logits)
    return out


def test_lr_multipliers_follow_the_table():
    """Hidden matrices get 1/m, everything else 1; SP gets no tree at all (plain AdamW); an unknown matrix is
    refused by name."""
    cfg = _model(256, "mup")   # m = 4
    _, params = S.abstract_model(cfg)
    mult = parametrization.lr_multipliers(cfg, params)
    flat = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(mult)}
    hidden = {p for p in flat if p.split("/")[-2] in parametrization.HIDDEN_MATRICES}
    assert len(hidden) == 2 * 7   # 2 layers x (wq wk wv wo w_gate w_up w_down)
    assert all(flat[p] == 0.25 for p in hidden)
    assert all(flat[p] == 1.0 for p in set(flat) - hidden)
    assert {p.split("/")[0] for p in set(flat) - hidden} >= {"embedding", "output", "final_norm"}
    assert parametrization.lr_multipliers(_model(256, "sp"), params) is None
    with pytest.raises(ConfigError, match="parametrization = 'mup'.*blocks/0/mlp/w_extra"):
        parametrization.lr_multipliers(cfg, {"blocks": {0: {"mlp": {"w_extra": jnp.zeros((4, 4))}}}})


def test_config_refusals_name_the_keys():
    with pytest.raises(ConfigError, match="ModelConfig.mup_base_d_model = 0"):
        ModelConfig(parametrization="mup")
    with pytest.raises(ConfigError, match="ModelConfig.parametrization = 'mup'.*moe"):
        ModelConfig(parametrization="mup", mup_base_d_model=64, mlp="moe")
    with pytest.raises(ConfigError, match="ModelConfig.parametrization = 'mu'"):
        ModelConfig(parametrization="mu")
    assert ModelConfig(mlp="moe").parametrization == "sp"   # SP takes every MLP


@pytest.mark.integration
def test_init_scales_hidden_matrices_by_one_over_sqrt_m():
    """Same seed, width 256, base 64 (m = 4): every hidden matrix is the SP one / 2, the embedding and the output
    are equal; logits carry 1/m."""
    sp = nnx.state(_build(_model(256, "sp")), nnx.Param)
    mup = nnx.state(_build(_model(256, "mup")), nnx.Param)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(sp), jax.tree_util.tree_leaves_with_path(mup)):
        names = {str(getattr(k, "key", "")) for k in path}
        factor = 0.5 if names & parametrization.HIDDEN_MATRICES else 1.0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a) * factor, rtol=1e-6, atol=0)
    assert parametrization.output_multiplier(_model(256, "mup")) == 0.25


def _build(cfg):
    from jaxpt.model.decoder import Decoder
    return Decoder(cfg, rngs=nnx.Rngs(params=0))


@pytest.mark.integration
def test_mup_at_the_base_width_is_sp_bitwise():
    """m = 1: µP's table reduces to SP, so three train steps give bitwise the same losses and params."""
    _, sp_state, sp_losses = _train(_model(64, "sp"), 3)
    _, mup_state, mup_losses = _train(_model(64, "mup", base=64), 3)
    assert sp_losses == mup_losses
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(sp_state.params)),
                                                    jax.tree.leaves(jax.device_get(mup_state.params))))


@pytest.mark.integration
def test_a_run_gets_the_multipliers():
    """The trainer's build wires µP in: one update of a zero-initial state from unit gradients through the built
    optimizer is lr/m on hidden matrices and lr elsewhere (Adam's first step moves every coordinate by lr)."""
    cfg = C.parse(["configs/quickstart.gin"], [
        "ModelConfig.vocab_size = 256", "ModelConfig.d_model = 128", "ModelConfig.num_heads = 4",
        "ModelConfig.num_kv_heads = 4", "ModelConfig.head_dim = 32", "ModelConfig.parametrization = 'mup'",
        "ModelConfig.mup_base_d_model = 32", "OptimizerConfig.weight_decay = 0.0",
        "OptimizerConfig.warmup_steps = 0", "OptimizerConfig.schedule = 'constant'",
        "OptimizerConfig.peak_learning_rate = 0.01", "OptimizerConfig.grad_clip_norm = 0.0"], steps=10, mesh="data=8")
    built = build_lib.build_for(cfg)
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), built.spec.abstract.params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = built.spec.tx.update(grads, built.spec.tx.init(params), params)
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        names = {str(getattr(k, "key", "")) for k in path}
        expected = 0.01 / 4 if names & parametrization.HIDDEN_MATRICES else 0.01
        np.testing.assert_allclose(np.asarray(u), -expected, rtol=1e-5)


@pytest.mark.slow
def test_coordinate_check_flat_under_mup_and_growing_under_sp():
    """After 4 Adam steps at lr 1e-2, widths 64 -> 512 (8x): under µP every layer's activation RMS at width 512 is
    within a factor 2 of width 64's (the tolerance: the logits' initial part shrinks as 1/sqrt(m) by design, so
    after few steps they sit a little lower at larger widths; measured 0.67x, the blocks 0.75-0.8x); under SP
    the blocks' and the logits' RMS grow more than 4x (measured 8x for the logits and over 100x for the blocks:
    Adam moves each weight by about lr whatever the width, and a width-D dot product sums D such moves)."""
    rms = {kind: {w: _activation_rms(*_trained(w, kind)) for w in WIDTHS} for kind in ("sp", "mup")}
    for kind in rms:   # the table of docs/results/mup.md (pytest -s shows it)
        for w in WIDTHS:
            print(kind, w, " ".join(f"{layer} {v:.3f}" for layer, v in rms[kind][w].items()))
    for layer in rms["mup"][64]:
        ratio = rms["mup"][512][layer] / rms["mup"][64][layer]
        assert 0.5 < ratio < 2, (layer, [rms["mup"][w][layer] for w in WIDTHS])
    for layer in ("block0", "block1", "logits"):
        growth = rms["sp"][512][layer] / rms["sp"][64][layer]
        assert growth > 4, (layer, [rms["sp"][w][layer] for w in WIDTHS])


def _trained(width, kind):
    cfg = _model(width, kind)
    spec, state, _ = _train(cfg, 4, mesh_spec="data=8")
    return spec, state.params, cfg


def _run_cfg(prepared, workdir, steps, **model):
    from conftest import tiny_bindings
    over = {"CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "2",
            "CheckpointConfig.async_save": "False", **{f"ModelConfig.{k}": repr(v) for k, v in model.items()}}
    return C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **over), steps=steps, mesh="data=8")


@pytest.mark.slow
def test_a_checkpoint_continues_only_under_its_parametrization(prepared_sample, tmp_path):
    """A run saved under µP (d_model 64, base 32: m = 2) refuses to resume under SP, in the dry run as in the run,
    naming both keys and both sides, before any array is read; resuming under the same µP works. A run saved under
    SP resumes under µP at its base width (m = 1: the same function, and the same optimizer state structure)."""
    from jaxpt import train
    from jaxpt.run import session
    from jaxpt.util.errors import CheckpointError
    work = tmp_path / "mup"
    session.run_training(_run_cfg(prepared_sample, work, 2, parametrization="mup", mup_base_d_model=32))
    with pytest.raises(CheckpointError, match=r"trained under µP \(base width 32, m = 2\), this run sets SP .*"
                                              r"keep ModelConfig.parametrization = 'mup' and "
                                              r"ModelConfig.mup_base_d_model = 32"):
        session.run_training(_run_cfg(prepared_sample, work, 4))
    assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    with pytest.raises(CheckpointError, match="parametrization"):
        train.dry_run(_run_cfg(prepared_sample, work, 4))
    plan = train.dry_run(_run_cfg(prepared_sample, work, 4, parametrization="mup", mup_base_d_model=32))
    assert "µP (base width 32, m = 2)" in plan
    session.run_training(_run_cfg(prepared_sample, work, 4, parametrization="mup", mup_base_d_model=32))
    assert (work / "checkpoints" / "4").is_dir()
    sp_work = tmp_path / "sp"
    session.run_training(_run_cfg(prepared_sample, sp_work, 2))
    session.run_training(_run_cfg(prepared_sample, sp_work, 4, parametrization="mup", mup_base_d_model=64))
    assert (sp_work / "checkpoints" / "4").is_dir()


def test_a_base_width_under_sp_is_refused_and_tied_mup_is_noted():
    with pytest.raises(ConfigError, match="ModelConfig.mup_base_d_model = 128: is set but "
                                          "ModelConfig.parametrization = 'sp' ignores it"):
        ModelConfig(mup_base_d_model=128)
    with pytest.raises(ConfigError, match="ModelConfig.mup_base_d_model = -1: must be set"):
        ModelConfig(parametrization="mup", mup_base_d_model=-1)
    tied = ModelConfig(d_model=128, parametrization="mup", mup_base_d_model=64, tie_embeddings=True)
    assert "cannot be exported to Hugging Face" in parametrization.notes(tied)[0]
    assert parametrization.notes(dataclasses.replace(tied, tie_embeddings=False)) == []
    assert parametrization.notes(dataclasses.replace(tied, mup_base_d_model=128)) == []   # m = 1
