"""Spike skip, divergence rollback, gradient accumulation, and the run registry."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_bindings
from jaxpt import config as C
from jaxpt import mesh as M
from jaxpt.run import monitor
from jaxpt.training import optim, state as S, step as step_lib
from jaxpt import train
from jaxpt.tools import runs
from jaxpt.model import ModelConfig
from jaxpt.training.stability import StabilityConfig

CFG = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                  max_seq_len=32)
OCFG = optim.OptimizerConfig(peak_learning_rate=3e-3, schedule="constant", warmup_steps=0, grad_clip_norm=1.0)


def make_step(stab, mesh_spec="data=2,fsdp=2,tensor=2", grad_accum=1):
    mesh = M.make_mesh(mesh_spec)
    spec = S.make_state_spec(CFG, lambda p: optim.make_optimizer(OCFG, 100, p), mesh, M.DEFAULT_RULES, stab)
    fn = step_lib.jit_train_step(spec, mesh, M.DEFAULT_RULES, z_loss_weight=1e-4,
                                 lr_schedule=optim.learning_rate_schedule(OCFG, 100), grad_clip_norm=1.0,
                                 grad_accum=grad_accum)
    shard = M.batch_sharding(mesh, M.DEFAULT_RULES)
    put = lambda b: {k: jax.device_put(v, shard) for k, v in b.items()}  # noqa: E731
    return spec, fn, put


def text_batches(n, seed=0):
    """Learnable batches: a repeating pattern of a few tokens plus noise, so loss falls steadily."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        base = np.tile(np.arange(10, 26), 2)[None].repeat(16, 0)
        noise = rng.integers(10, 26, base.shape)
        tokens = np.where(rng.random(base.shape) < 0.1, noise, base).astype(np.int32)
        out.append({"tokens": tokens, "segment_ids": np.ones_like(tokens),
                    "positions": np.broadcast_to(np.arange(32, dtype=np.int32), tokens.shape).copy()})
    return out


def padded_batch(seed: int, pad_seed: int, max_pad: int):
    """One of :func:`text_batches` whose rows end in 0 to ``max_pad - 1`` padding positions (segment id 0), drawn
    with ``pad_seed``: micro-batches with unequal target-token counts."""
    batch = text_batches(1, seed=seed)[0]
    rng = np.random.default_rng(pad_seed)
    seg = np.ones((16, 32), np.int32)
    for r in range(16):
        seg[r, 32 - rng.integers(0, max_pad):] = 0
    batch["segment_ids"] = seg
    return batch


def corrupted_batch():
    """Every target is a token the model never saw (id 127), in every row: a huge loss and gradient."""
    tokens = np.full((16, 32), 127, np.int32)
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens),
            "positions": np.broadcast_to(np.arange(32, dtype=np.int32), tokens.shape).copy()}


def leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
def test_spike_skip_equals_run_without_the_batch():
    stab = StabilityConfig(spike_window=8, spike_k=4.0, spike_min_history=6)
    spec, fn, put = make_step(stab)
    good = text_batches(14)
    k = 10  # the corrupted batch is fed as step k+1 of run A
    # Run A: good[0..k-1], corrupted, good[k..]. Run B: the same without the corrupted batch.
    a = S.init_state(spec, CFG, 0)
    b = S.init_state(spec, CFG, 0)
    losses_a, losses_b = [], []
    for i, batch in enumerate(good[:k]):
        a, _ = fn(a, put(batch))
        b, _ = fn(b, put(batch))
    a, m = fn(a, put(corrupted_batch()))
    assert float(m["skipped"]) == 1.0 and float(m["nonfinite"]) == 0.0
    assert (float(m["loss"]) > float(m["spike_loss_threshold"])
            or float(m["grad_norm"]) > float(m["spike_grad_norm_threshold"]))
    # Skipped: optimizer state, params, RNG and update count are those of run B, which never saw it.
    assert leaves_equal(a.params, b.params) and leaves_equal(a.opt_state, b.opt_state)
    assert int(a.num_updates) == int(b.num_updates) == k
    assert int(a.step) == k + 1 and int(b.step) == k
    assert np.array_equal(a.rng, b.rng)
    for batch in good[k:]:
        a, ma = fn(a, put(batch))
        b, mb = fn(b, put(batch))
        assert float(ma["skipped"]) == 0.0
        losses_a.append(float(ma["loss"]))
        losses_b.append(float(mb["loss"]))
    assert losses_a == losses_b
    # Without spike skipping the corrupted batch changes the trajectory (the test can fail).
    spec2, fn2, put2 = make_step(dataclasses.replace(stab, spike_skip=False))
    c = S.init_state(spec2, CFG, 0)
    for batch in good[:k]:
        c, _ = fn2(c, put2(batch))
    c, m = fn2(c, put2(corrupted_batch()))
    assert float(m["skipped"]) == 0.0 and not leaves_equal(c.params, b.params)


@pytest.mark.slow
def test_nonfinite_step_is_skipped_on_device():
    spec, fn, put = make_step(StabilityConfig())
    s0 = S.init_state(spec, CFG, 0)
    s1, _ = fn(s0, put(text_batches(1)[0]))
    opt_before = jax.device_get(s1.opt_state)  # the step donates its input state
    bad = s1.replace(params=jax.tree.map(lambda p: p * jnp.nan if p.ndim == 2 and p.shape[0] == 128 else p,
                                         s1.params))
    s2, m = fn(bad, put(text_batches(1)[0]))
    assert float(m["nonfinite"]) == 1.0 and float(m["skipped"]) == 1.0
    assert int(s2.num_updates) == 1 and leaves_equal(s2.opt_state, opt_before)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["data=2,fsdp=2,tensor=2", "data=8"])
def test_grad_accumulation_matches_full_batch(mesh_spec):
    """4 micro-batches == one global batch (rel 1e-5), with micro-batches holding different token counts."""
    mesh = M.make_mesh(mesh_spec)
    spec = S.make_state_spec(CFG, lambda p: optim.make_optimizer(OCFG, 100, p), mesh, M.DEFAULT_RULES)
    state = S.init_state(spec, CFG, 0)
    batch = text_batches(1)[0]
    # Uneven real tokens: padding (segment 0) over varying tails of rows, several documents per row.
    rng = np.random.default_rng(3)
    seg = np.ones((16, 32), np.int32)
    for r in range(16):
        seg[r, 10:] = 2
        seg[r, 32 - rng.integers(0, 30):] = 0
    batch["segment_ids"] = seg
    shard = M.batch_sharding(mesh, M.DEFAULT_RULES)
    dev = {k: jax.device_put(v, shard) for k, v in batch.items()}
    counts = [int(((seg[i::4][:, 1:] == seg[i::4][:, :-1]) & (seg[i::4][:, :-1] != 0)).sum()) for i in range(4)]
    assert len(set(counts)) > 1  # the micro-batches really differ

    def grads(accum):
        with M.activation_sharding(mesh, M.DEFAULT_RULES):
            return jax.jit(lambda p, b: step_lib.loss_and_grads(p, spec.graphdef, b, 1e-4, accum))(state.params, dev)

    aux1, g1 = grads(1)
    aux4, g4 = grads(4)
    np.testing.assert_allclose(float(aux4["loss"]), float(aux1["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(aux4["z_loss"]), float(aux1["z_loss"]), rtol=1e-5)
    assert float(aux4["num_target_tokens"]) == float(aux1["num_target_tokens"]) == sum(counts)
    for x, y in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


MOE_CFG = dataclasses.replace(CFG, mlp="moe", moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.25,
                              moe_router_sinkhorn_iters=5, moe_load_balance_weight=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("model_cfg", [CFG, MOE_CFG], ids=["dense", "moe"])
def test_one_update_is_the_same_for_every_accumulation(model_cfg):
    """One train step from the same state on the same global batch (uneven real tokens per micro-batch: padding
    over varying row tails) with accumulation 1, 2 and 4 gives the same update (new params within 1e-5), loss and
    metrics: for a dense model, and for the quickstart MoE (4 experts, top-2, capacity 1.25, Sinkhorn 5, balance
    weight 0.1 on expert=4,data=2), whose balancing loss is a product of whole-batch statistics (per-micro-batch
    balancing moved its load_balance_loss 1.0039 / 1.0253 / 1.0379 and the update by 6e-3)."""
    mesh_spec = "expert=4,data=2" if model_cfg.mlp == "moe" else "data=2,fsdp=2,tensor=2"
    mesh = M.make_mesh(mesh_spec)
    batch = padded_batch(seed=5, pad_seed=7, max_pad=24)
    out = {}
    for accum in (1, 2, 4):
        spec = S.make_state_spec(model_cfg, lambda p: optim.make_optimizer(OCFG, 100, p), mesh, M.DEFAULT_RULES)
        fn = step_lib.jit_train_step(spec, mesh, M.DEFAULT_RULES, z_loss_weight=1e-4,
                                     lr_schedule=optim.learning_rate_schedule(OCFG, 100), grad_clip_norm=1.0,
                                     grad_accum=accum)
        shard = M.batch_sharding(mesh, M.DEFAULT_RULES)
        state, metrics = fn(S.init_state(spec, model_cfg, 0), {k: jax.device_put(v, shard) for k, v in batch.items()})
        out[accum] = jax.device_get((state.params, metrics))
    params1, m1 = out[1]
    assert int(m1["skipped"]) == 0
    for accum in (2, 4):
        params, m = out[accum]
        for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params1)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5, err_msg=f"accum {accum}")
        for k in m1:
            np.testing.assert_allclose(float(m[k]), float(m1[k]), rtol=1e-5, atol=1e-7, err_msg=f"{k} accum {accum}")
    if model_cfg.mlp == "moe":
        assert 0.5 < float(m1["moe/load_balance_loss"]) < 2.0 and float(m1["moe/dropped_fraction"]) > 0


def run_with(prepared, workdir, steps, injector=None, **overrides):
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **overrides), steps=steps,
                  mesh="data=8")
    return train.run_training(cfg, fault_injector=injector)


def nan_params_at(steps, once=True):
    """Poison every param with NaN before the given steps (each only the first time it is reached, like a
    transient fault, unless ``once`` is False)."""
    pending = set(steps)

    def inject(step, state):
        if step in pending:
            if once:
                pending.discard(step)
            return state.replace(params=jax.tree.map(lambda p: p * jnp.nan, state.params))
        return state
    return inject


@pytest.mark.slow
def test_nan_rolls_back_damps_lr_and_continues(prepared_sample, tmp_path):
    final = run_with(prepared_sample, tmp_path, 24, nan_params_at({14}),
                     **{"CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "5",
                        "CheckpointConfig.async_save": "False", "StabilityConfig.lr_damping": "0.5"})
    assert np.isfinite(final["heldout_loss"])
    events = json.loads((tmp_path / "run.json").read_text())["events"]
    kinds = [e["event"] for e in events]
    assert kinds == ["nonfinite_skip", "rollback"], kinds
    rb = events[1]
    assert rb["step"] == 14 and rb["restored_step"] == 10 and rb["lr_scale"] == 0.5
    recs = [r for r in monitor.read_metrics(str(tmp_path)) if "loss" in r and "event" not in r]
    after = [r for r in recs if r["step"] > 10][-5:]
    # Constant-after-warmup LR 3e-3 (decay horizon 100) damped by 0.5 after the rollback.
    assert all(r["learning_rate"] < 3e-3 * 0.5 * 1.0001 for r in after)
    assert recs[-1]["step"] == 24 and np.isfinite(recs[-1]["loss"])
    # The rollback superseded the records of the discarded steps 11-14 (kept apart): one record per step.
    assert [r["step"] for r in recs] == list(range(1, 25))
    every = [r["step"] for r in monitor.read_metrics(str(tmp_path), superseded=True) if "event" not in r
             and ("loss" in r or "skipped_loss" in r)]
    assert every == [*range(1, 15), *range(11, 25)]


@pytest.mark.slow
def test_repeated_nan_stops_with_a_clear_message(prepared_sample, tmp_path, capsys):
    from jaxpt.training.stability import DivergenceError
    with pytest.raises(DivergenceError, match="rollbacks within"):
        run_with(prepared_sample, tmp_path, 30, nan_params_at(set(range(3, 31)), once=False),
                 **{"StabilityConfig.max_rollbacks": "2"})
    rec = json.loads((tmp_path / "run.json").read_text())
    assert rec["status"] == "failed" and "rollbacks within" in rec["final"]["error"]
    assert [e["event"] for e in rec["events"]].count("rollback") == 2


@pytest.mark.slow
def test_runs_cli_list_show_compare_plot(prepared_sample, tmp_path, capsys):
    for name in ("a", "b"):
        run_with(prepared_sample, tmp_path / name, 6)
    assert runs.main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("completed") == 2 and "heldout_loss" in out
    rec = runs.load_run(str(tmp_path / "a"))
    assert rec["final"]["step"] == 6 and rec["git"]["commit"] and len(rec["config_hash"]) == 64
    assert runs.main(["show", rec["run_id"], "--root", str(tmp_path)]) == 0
    assert runs.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "config_hash" in out and "final.heldout_loss" in out
    png = tmp_path / "loss.png"
    assert runs.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--output", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert runs.main(["show", "nope", "--root", str(tmp_path)]) == 1


def test_spike_skips_in_a_row_are_capped():
    """A lasting jump is skipped at most spike_max_consecutive times, then accepted (no frozen training)."""
    from jaxpt.training.stability import decide_skip, init_history
    cfg = StabilityConfig(spike_window=8, spike_k=3.0, spike_min_history=4, spike_max_consecutive=3)
    h = init_history(cfg)
    for v in (1.0, 1.1, 0.9, 1.0, 1.05):
        skip, h, _ = decide_skip(cfg, h, jnp.float32(v), jnp.float32(v), jnp.asarray(False))
        assert not bool(skip)
    decisions = []
    for _ in range(6):  # the level jumps to 5 and stays
        skip, h, _ = decide_skip(cfg, h, jnp.float32(5.0), jnp.float32(5.0), jnp.asarray(False))
        decisions.append(bool(skip))
    assert decisions[:4] == [True, True, True, False]
    assert int(h["num_skipped"]) == 3
    # Non-finite steps are always skipped, cap or not.
    for _ in range(5):
        skip, h, m = decide_skip(cfg, h, jnp.float32(jnp.nan), jnp.float32(1.0), jnp.asarray(False))
        assert bool(skip) and float(m["nonfinite"]) == 1.0
