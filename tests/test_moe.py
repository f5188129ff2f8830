"""Mixture of experts: routing and its losses against hand computation, capacity drops, dropless mode, expert
shares in the metrics, expert parallelism (all-to-all, equal losses across meshes), checkpoints across
expert-parallel sizes, parameter accounting and config checks; causal routing (each token by itself: later
tokens never move earlier logits) and its use by evaluation."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxpt.run import build as builder
from jaxpt import config as C
from jaxpt.training import flops
from jaxpt.util.errors import ConfigError
from jaxpt.model import Decoder, ModelConfig, count_params
from jaxpt.model.moe import MoE, dispatch_and_combine, expert_capacity, route, sinkhorn_offsets
from jaxpt.run.validate import validate

TINY = ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64,
                   max_seq_len=32, mlp="moe", moe_num_experts=4, moe_top_k=2, moe_capacity_factor=2.0)


def _batch(B, L, vocab, seed=0):
    tok = jax.random.randint(jax.random.key(seed), (B, L), 0, vocab, dtype=jnp.int32)
    return {"tokens": tok, "segment_ids": jnp.ones_like(tok), "positions": jnp.broadcast_to(jnp.arange(L), (B, L))}


def _tiny_train_cfg(mesh: str, steps: int = 4, **model):
    binds = {"ModelConfig.vocab_size": 256, "ModelConfig.d_model": 32, "ModelConfig.num_layers": 2,
             "ModelConfig.num_heads": 2, "ModelConfig.num_kv_heads": 2, "ModelConfig.head_dim": 16,
             "ModelConfig.mlp_dim": 64, "ModelConfig.max_seq_len": 32, "TrainConfig.seq_len": 32,
             "TrainConfig.global_batch_size": 8, "OptimizerConfig.warmup_steps": 1,
             "OptimizerConfig.decay_steps": 20, **{f"ModelConfig.{k}": v for k, v in model.items()}}
    return C.parse(["configs/quickstart_moe.gin"], [f"{k} = {v!r}" for k, v in binds.items()],
                   steps=steps, mesh=mesh)


# ------------------------------------------------------------------------------------ routing, by hand
@pytest.mark.integration
def test_load_balance_and_router_z_loss_equal_hand_computed_values():
    """Switch eq. 4 (E * sum_i f_i P_i, f over all top-k choices) and ST-MoE eq. 5 (mean logsumexp^2) on a
    3-token, 3-expert routing written out by hand."""
    logits = np.array([[[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.5, 2.5]]], np.float32)   # [G=1, S=3, E=3]
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    # top-2 by hand: token0 -> {0, 1}, token1 -> {1, 2}, token2 -> {2, 0}: each expert chosen twice of 6.
    f = np.array([2, 2, 2]) / 6
    P = p[0].mean(0)
    lse = np.log(np.exp(logits[0]).sum(-1))
    r = route(jnp.asarray(logits), 2)
    np.testing.assert_array_equal(np.asarray(r.experts[0]), [[0, 1], [1, 2], [2, 0]])
    np.testing.assert_allclose(float(r.load_balance_loss), 3 * np.sum(f * P), rtol=1e-6)
    np.testing.assert_allclose(float(r.router_z_loss), np.mean(lse ** 2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r.share), f, rtol=1e-6)
    # gates: top-2 probabilities renormalized
    np.testing.assert_allclose(np.asarray(r.gates[0, 0]), p[0, 0, [0, 1]] / p[0, 0, [0, 1]].sum(), rtol=1e-6)
    # top-1 (Switch): f is the top-1 fraction and the gate is the probability itself
    r1 = route(jnp.asarray(logits), 1)
    f1 = np.array([1, 1, 1]) / 3
    np.testing.assert_allclose(float(r1.load_balance_loss), 3 * np.sum(f1 * P), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r1.gates[0, :, 0]), p[0].max(-1), rtol=1e-6)


@pytest.mark.integration
def test_capacity_one_drops_exactly_the_overflow_and_dropped_tokens_pass_through():
    """capacity_factor 1.0, 8 tokens, 4 experts, top-1: C = 2. Five tokens want expert 0, one each experts
    1-3: expert 0 keeps its first two tokens (in order), the other three are dropped (the MoE adds 0 to them,
    so the block's residual passes them through); every other token is processed."""
    cfg = dataclasses.replace(TINY, moe_top_k=1, moe_capacity_factor=1.0)
    assert expert_capacity(cfg, 8) == 2
    target = np.array([0, 1, 0, 0, 2, 0, 3, 0])
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    D = cfg.d_model
    x = np.zeros((1, 8, D), np.float32)
    x[0, np.arange(8), 4 + np.arange(8)] = 1.0           # distinct inputs, orthogonal to the routing dims
    x[0, np.arange(8), target] = 1.0
    w = np.zeros((D, 4), np.float32)
    w[np.arange(4), np.arange(4)] = 20.0                 # token t's router logit is 20 for expert target[t]
    moe.w_router[...] = jnp.asarray(w)
    y, aux = moe(jnp.asarray(x))
    dropped = [3, 5, 7]
    assert float(aux["moe/dropped_fraction"]) * 8 == 3
    y = np.asarray(y)
    assert np.all(y[0, dropped] == 0)
    assert np.all(np.abs(y[0, [0, 1, 2, 4, 6]]).max(-1) > 0)
    # and directly, with top-2: expert 0 first choice of 5 tokens and nothing else overflows
    experts = jnp.asarray(np.stack([target, (target + 1) % 4], -1)[None])          # [1, 8, 2]
    _, _, n = dispatch_and_combine(experts, jnp.ones((1, 8, 2)) / 2, 4, capacity=3)
    # expert 0: 5 first choices + 1 second choice (token with target 3) = 6 for 3 slots -> 3 dropped;
    # expert 1: 1 first + 5 second = 6 -> 3 dropped; experts 2, 3: 2 each, none dropped.
    assert int(n) == 6


@pytest.mark.integration
@pytest.mark.parametrize("group_size", [0, 8])
def test_dropless_equals_capacity_mode_without_drops(group_size):
    """ragged_dot over expert-sorted tokens gives the loss and gradients of the dispatch/combine einsums when
    the capacity drops nothing (rel 1e-5), routing groups whole rows or 8-token pieces of them."""
    batch = _batch(2, 32, 256)
    from jaxpt.training.step import loss_fn

    def loss_and_grads(cfg):
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(1,))
        (loss, aux), g = grad_fn(params, graphdef, batch, 1e-4)
        return loss, aux, g

    l_cap, aux_cap, g_cap = loss_and_grads(dataclasses.replace(TINY, moe_group_size=group_size))
    l_drop, aux_drop, g_drop = loss_and_grads(dataclasses.replace(TINY, moe_dropless=True))
    assert float(aux_cap["moe/dropped_fraction"]) == 0.0
    np.testing.assert_allclose(float(l_drop), float(l_cap), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_cap), jax.tree.leaves(g_drop)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


@pytest.mark.integration
def test_every_nth_layer_placement_and_param_accounting():
    """moe_every=2 over 4 layers: layers 1 and 3 are MoE, 0 and 2 dense; count_params' total equals the
    built model's, its matmul (active) count has 2 of 4 experts per MoE layer, and MFU's FLOPs use it."""
    cfg = dataclasses.replace(TINY, num_layers=4, moe_every=2)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    kinds = [type(b.mlp).__name__ for b in model.blocks]
    assert kinds == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    n_built = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    c = count_params(cfg)
    assert c["total"] == n_built
    D, F, E, V = 32, 64, 4, 256
    attn = 4 * (2 * D * 2 * 16 + 2 * D * 2 * 16)
    assert c["matmul"] == attn + 2 * 3 * D * F + 2 * (D * E + 3 * D * F * 2) + D * V
    assert flops.flops_per_token(cfg, 32) == 6 * c["matmul"] + 6 * 4 * 2 * 16 * 32
    _, aux = model(*_batch(1, 32, 256).values(), return_aux=True)
    assert aux["moe/expert_share"].shape == (2, 4)
    # a shared expert of width 16: 3 D 16 more params per MoE layer, all of them active
    shared = dataclasses.replace(cfg, moe_shared_expert_dim=16)
    cs = count_params(shared)
    assert cs["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(Decoder(shared, rngs=nnx.Rngs(0)), nnx.Param)))
    assert cs["total"] - c["total"] == cs["matmul"] - c["matmul"] == 2 * 3 * D * 16


def test_load_balance_gradient_reaches_the_router_as_the_hand_formula():
    """The balancing loss's gradient reaches the router: d/dl_te of E sum_i f_i P_i (f held constant, as
    Switch does) is (E / T) p_te (f_e - sum_i f_i p_ti), and the router weights get x^T of it; checked with
    jax.grad on random logits, top-2 and top-1, with no gradient through f."""
    rng = np.random.default_rng(0)
    T, D, E = 12, 5, 4
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = rng.standard_normal((D, E)).astype(np.float32)
    for k in (1, 2):
        def lb(w_):
            return route(jnp.einsum("td,de->te", x, w_)[None], k).load_balance_loss
        g = np.asarray(jax.jit(jax.grad(lb))(jnp.asarray(w)))
        logits = x @ w
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[:, :k]
        f = np.bincount(top.reshape(-1), minlength=E) / (T * k)
        g_logits = E / T * p * (f[None] - (p * f[None]).sum(-1, keepdims=True))
        np.testing.assert_allclose(g, x.T @ g_logits, rtol=1e-4, atol=1e-7)
        assert np.linalg.norm(g) > 1e-3


@pytest.mark.integration
def test_sinkhorn_selection_balances_tokens_that_share_most_of_their_logits():
    """Logits = a large per-expert part shared by every token (3, 1, -1, -3) + 0.02 noise (what the quickstart
    MoE's layers show after ~10 steps): plain top-2 sends every token to experts 0 and 1; Sinkhorn selection
    (S-BASE) spreads them (each share within 0.25 +- 0.05), its offsets undo the shared part (b_e - b_0 =
    -(c_e - c_0) within 0.02), the row-normalized balanced assignment has equal expert masses, gates are
    still the renormalized top-2 probabilities, padding takes no part, and one-token groups (decoding) route
    as plain top-k."""
    rng = np.random.default_rng(0)
    c = np.array([3.0, 1.0, -1.0, -3.0], np.float32)
    logits = jnp.asarray(c + 0.02 * rng.standard_normal((2, 128, 4)), jnp.float32)
    valid = np.zeros((2, 128), bool)
    valid[0, :64] = True   # padding: the second group all padding, the first half padding

    @jax.jit
    def cases(logits, valid):
        shift = jnp.asarray([0.0, 0.0, 50.0, 0.0])   # a router bias forced high on expert 2
        one = logits.reshape(256, 1, 4)                # one-token groups (decoding)
        return {"plain": route(logits, 2), "sk": route(logits, 2, sinkhorn_iters=5),
                "b": sinkhorn_offsets(logits, jnp.ones((2, 128)), 5),
                "shifted": route(logits + shift, 2, sinkhorn_iters=5),
                "padded": route(logits, 2, valid, sinkhorn_iters=5),
                "b_padded": sinkhorn_offsets(logits, valid.astype(jnp.float32), 5),
                "alone": route(logits[:1, :64], 2, sinkhorn_iters=5),
                "one_sk": route(one, 2, sinkhorn_iters=5).experts, "one_plain": route(one, 2).experts,
                "dgate": jax.grad(lambda l: route(l, 2, sinkhorn_iters=5).gates[0, 0, 0])(logits)}

    out = jax.device_get(cases(logits, jnp.asarray(valid)))
    np.testing.assert_allclose(out["plain"].share, [0.5, 0.5, 0.0, 0.0])
    r = out["sk"]
    assert np.all(np.abs(r.share - 0.25) < 0.05), r.share
    b = out["b"]
    np.testing.assert_allclose(b - b[:, :1], -(c - c[0])[None].repeat(2, 0), atol=0.02)
    q = np.exp(np.asarray(logits) + b[:, None, :])
    q /= q.sum(-1, keepdims=True)                                       # rows sum to 1
    np.testing.assert_allclose(q.sum(1), 128 / 4, rtol=1e-3)           # each expert a quarter of the tokens
    chosen = np.take_along_axis(r.probs, r.experts, -1)
    np.testing.assert_allclose(r.gates, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    assert np.abs(out["dgate"]).sum() > 0          # the gates keep the router's gradient
    np.testing.assert_array_equal(out["shifted"].experts, r.experts)   # the forced bias changes no choice
    assert np.all(np.isfinite(out["b_padded"]))
    np.testing.assert_array_equal(out["padded"].experts[0, :64], out["alone"].experts[0])
    np.testing.assert_allclose(out["padded"].share, out["alone"].share, rtol=1e-6)
    np.testing.assert_array_equal(out["one_sk"], out["one_plain"])


def test_moe_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_top_k = 5"):
        dataclasses.replace(TINY, moe_top_k=5)
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_every = 3"):
        dataclasses.replace(TINY, moe_every=3)
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_every = 2.*scan_layers"):
        dataclasses.replace(TINY, moe_every=2, scan_layers=True)
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_capacity_factor = 0"):
        dataclasses.replace(TINY, moe_capacity_factor=0.0)
    with pytest.raises(ConfigError, match=r"'expert' \(size 4\).*'swiglu' has none"):
        validate(_tiny_train_cfg("expert=4,data=2", mlp="swiglu"), 8)
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_num_experts = 4 is not divisible by mesh expert = 8"):
        validate(_tiny_train_cfg("expert=8"), 8)
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_router_init_std = -0.1"):
        dataclasses.replace(TINY, moe_router_init_std=-0.1)
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_router_sinkhorn_iters = -1"):
        dataclasses.replace(TINY, moe_router_sinkhorn_iters=-1)
    # moe_router_init_std sets the router weights' init (128 draws: std within ~25%); 0 falls back to init_std
    for std, expect in ((0.002, 0.002), (0.0, TINY.init_std)):
        w = MoE(dataclasses.replace(TINY, moe_router_init_std=std), rngs=nnx.Rngs(0)).w_router[...]
        assert 0.75 * expect < float(jnp.std(w)) < 1.25 * expect
    # dropless is not expert-parallel: refused on expert > 1, accepted on expert = 1 (data/fsdp/tensor)
    with pytest.raises(ConfigError, match=r"ModelConfig.moe_dropless = True is not expert-parallel.*expert = 2"):
        validate(_tiny_train_cfg("expert=2,data=4", moe_dropless=True), 8)
    assert validate(_tiny_train_cfg("fsdp=2,data=4", moe_dropless=True), 8)["expert"] == 1


# ------------------------------------------------------------------------------- sharded, through build()
@pytest.mark.integration
def test_expert_parallel_step_exchanges_tokens_all_to_all_and_reports_shares():
    """On expert=4,data=2 the compiled train step holds all-to-alls (XLA's lowering of the dispatch and
    combine einsums' resharding); per-layer expert shares reach the metrics and sum to 1. Forcing one expert's
    router bias high shows in the metrics: the router's own top-2 sends every token to it (``router_share``
    exactly 1/2 under top-2), with plain top-k also the realized ``expert_share``; Sinkhorn selection (the
    preset's) cancels the bias, so there the realized shares stay spread and only ``router_share`` shows it."""
    def force_bias(state):
        for layer in range(2):
            b = state.params["blocks"][layer]["mlp"]["router_bias"]
            state.params["blocks"][layer]["mlp"]["router_bias"] = b.replace(jnp.asarray([0.0, 0.0, 50.0, 0.0]))
        return state

    def shares(m, name, layer):
        return [float(m[f"moe/{name}/layer{layer}/expert{e}"]) for e in range(4)]

    for iters in (0, 5):
        built = builder.build_for(_tiny_train_cfg("expert=4,data=2", moe_router_sinkhorn_iters=iters))
        state = built.init_state()
        batch = jax.device_put(_batch(8, 32, 256), built.batch_shardings())
        compiled = built.train_step.lower(state, batch).compile()
        assert "all-to-all" in compiled.as_text()
        w = state.params["blocks"][0]["mlp"]["w_gate"]
        assert w.sharding.spec[0] == "expert"
        state, m = compiled(state, batch)
        for layer in range(2):
            for name in ("expert_share", "router_share"):
                s = shares(m, name, layer)
                assert math.isclose(sum(s), 1.0, rel_tol=1e-6) and max(s) < 0.9, (iters, name, s)
            if not iters:
                assert shares(m, "router_share", layer) == shares(m, "expert_share", layer)
        state, m = compiled(force_bias(state), batch)
        for layer in range(2):
            assert shares(m, "router_share", layer)[2] == 0.5
            realized = shares(m, "expert_share", layer)
            assert math.isclose(sum(realized), 1.0, rel_tol=1e-6)
            if iters:
                assert max(realized) < 0.4, realized     # balanced selection hides the bias
            else:
                assert realized[2] == 0.5


def _losses(cfg, steps):
    built = builder.build_for(cfg)
    state = built.init_state()
    out = []
    for i in range(steps):
        batch = jax.device_put(_batch(cfg.global_batch_size, cfg.seq_len, cfg.model.vocab_size, seed=i),
                               built.batch_shardings())
        state, m = built.train_step(state, batch)
        out.append((float(m["loss"]), float(m["moe/dropped_fraction"]), float(m["moe/load_balance_loss"])))
    return np.array(out)


@pytest.mark.slow
def test_quickstart_moe_losses_equal_across_meshes():
    """configs/quickstart_moe.gin (capacity factor 2.0 = experts / top_k: nothing dropped), 8 steps on a
    fixed synthetic batch stream: the losses on expert=4,data=2 and on expert=2,fsdp=2,tensor=2 equal those of
    plain data parallelism (data=8) within rel 1e-4."""
    binds = ["ModelConfig.vocab_size = 512", "ModelConfig.moe_capacity_factor = 2.0",
             "TrainConfig.global_batch_size = 8", "TrainConfig.seq_len = 32"]
    ref = _losses(C.parse(["configs/quickstart_moe.gin"], binds, steps=8, mesh="data=8"), 8)
    assert np.all(ref[:, 1] == 0) and np.ptp(ref[:, 0]) > 1e-3   # nothing dropped; the steps change the loss
    for mesh in ("expert=4,data=2", "expert=2,fsdp=2,tensor=2"):
        got = _losses(C.parse(["configs/quickstart_moe.gin"], binds, steps=8, mesh=mesh), 8)
        np.testing.assert_allclose(got[:, 0], ref[:, 0], rtol=1e-4, err_msg=mesh)
        np.testing.assert_allclose(got[:, 2], ref[:, 2], rtol=1e-4, err_msg=mesh)


@pytest.mark.integration
def test_checkpoint_restores_across_expert_parallel_sizes(tmp_path):
    """A state saved on expert=4,data=2 restores on expert=2,data=4: the same params, placed on the new
    shardings, and the same next loss as continuing on the original mesh."""
    from jaxpt.checkpoint import CheckpointConfig, Checkpointer
    built4 = builder.build_for(_tiny_train_cfg("expert=4,data=2"))
    state = built4.init_state()
    batch = _batch(8, 32, 256, seed=3)
    state, _ = built4.train_step(state, jax.device_put(batch, built4.batch_shardings()))
    ckpt = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    # the train state and metadata only (no data iterator in this test)
    ckpt.manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({})),
                      force=True)
    ckpt.wait()
    saved = jax.tree.map(np.asarray, state.params)
    _, m4 = built4.train_step(state, jax.device_put(_batch(8, 32, 256, seed=4), built4.batch_shardings()))

    built2 = builder.build_for(_tiny_train_cfg("expert=2,data=4"))
    restored = Checkpointer(str(tmp_path), CheckpointConfig(), read_only=True).restore(1, built2.spec.abstract, None)
    w = restored.params["blocks"][0]["mlp"]["w_up"]
    assert w.sharding.spec[0] == "expert" and w.sharding.mesh.shape["expert"] == 2
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.params), saved)
    _, m2 = built2.train_step(restored, jax.device_put(_batch(8, 32, 256, seed=4), built2.batch_shardings()))
    np.testing.assert_allclose(float(m2["loss"]), float(m4["loss"]), rtol=1e-5)


def test_planner_counts_all_expert_params_in_memory_and_estimates_the_all_to_all():
    """tools.plan on expert=4,data=2: stored params per device are the other params (routers included) whole
    plus a quarter of the expert weights (fp32); the all-to-all bytes per device are, per MoE layer, 4 exchanges (2 forward,
    2 backward) of E x (its 1 row) x C x D (fp32) of which 3/4 leave the device; v5p time = bytes / (4800 Gbit/s / 2)."""
    from jaxpt.lab import plan
    from jaxpt.training import memory
    cfg = _tiny_train_cfg("expert=4,data=2")
    sizes = validate(cfg, 8)
    c = count_params(cfg.model)
    mem = memory.estimate_memory(cfg, sizes)
    expert_weights = 2 * 3 * 32 * 64 * 4             # 2 MoE layers x (w_gate, w_up, w_down) [E, D, F]
    assert mem.params == 4 * (c["total"] - expert_weights + expert_weights // 4)   # routers stay whole
    hw = plan.parse_hardware("v5p-16")
    est = plan.all_to_all_estimate(cfg, sizes, hw)
    rows, C_, D, E = 8 / 8, expert_capacity(cfg.model, 32), 32, 4   # a device's own rows (batch over data x expert)
    per = E * rows * C_ * D * 4 * 3 / 4
    assert est["all_to_alls"] == 2 * 4 and est["bytes_per_device"] == pytest.approx(2 * 4 * per)
    assert est["seconds"] == pytest.approx(est["bytes_per_device"] / (4800e9 / 8 / 2))
    assert plan.all_to_all_estimate(_tiny_train_cfg("data=8", mlp="swiglu"), {"data": 8}, hw) is None


def test_presets_have_the_published_shapes():
    """Mixtral-8x7B: 46,702,792,704 params (Jiang et al. 2024) + 32 layers x 8 router biases; 12.9B active with
    the embedding. moe_1b: about 1B in all, 8 experts top-2. quickstart_moe: 4 experts top-2 in every layer,
    validated on its own mesh (expert=4,data=2) on 8 devices; the Mixtral preset on v5p-128 (64 chips)."""
    mixtral = C.parse(["configs/quickstart.gin", "configs/models/mixtral_8x7b.gin", "configs/slices/v5p-128.gin"],
                      ["TrainConfig.mesh = 'expert=4,fsdp=-1'"])
    c = count_params(mixtral.model)
    assert c["total"] == 46_702_792_704 + 32 * 8
    assert round((c["matmul"] + c["embedding"]) / 1e8) == 129
    assert validate(mixtral, 64)["expert"] == 4
    small = C.parse(["configs/quickstart.gin", "configs/models/moe_1b.gin"], []).model
    assert 0.95e9 < count_params(small)["total"] < 1.1e9 and (small.moe_num_experts, small.moe_top_k) == (8, 2)
    q = C.parse(["configs/quickstart_moe.gin"], ["ModelConfig.vocab_size = 512"])
    assert (q.model.mlp, q.model.moe_num_experts, q.model.moe_top_k, q.model.num_moe_layers) == ("moe", 4, 2, 4)
    assert validate(q, 8) == {"stage": 1, "data": 2, "fsdp": 1, "sequence": 1, "expert": 4, "tensor": 1}


# ------------------------------------------------------------------------------------------------ padding
@pytest.mark.integration
def test_padding_takes_no_capacity_and_counts_in_no_statistic():
    """capacity_factor 1.0, top-1, 8 tokens, 4 experts: C = 2. Tokens 0-2 are padding (segment id 0) routed
    to expert 0; real tokens 3-7 want experts [0, 0, 1, 2, 3]. Counted as tokens, the padding would fill
    expert 0's two slots and drop both real expert-0 tokens; excluded, nothing is dropped, the real tokens get
    exactly what they get with no padding in the group, padding gets 0, and the shares, the balancing loss and
    the z-loss are Switch eq. 4 / ST-MoE eq. 5 over the 5 real tokens, computed here by hand. Dropless mode
    gives the real tokens the same outputs and the same statistics."""
    cfg = dataclasses.replace(TINY, moe_top_k=1, moe_capacity_factor=1.0)
    target = np.array([0, 0, 0, 0, 0, 1, 2, 3])
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1]], np.int32)
    D = cfg.d_model
    x = np.zeros((1, 8, D), np.float32)
    x[0, np.arange(8), 4 + np.arange(8)] = 1.0
    x[0, np.arange(8), target] = 1.0
    w = np.zeros((D, 4), np.float32)
    w[np.arange(4), np.arange(4)] = 3.0              # logits 3 for the target expert, 0 for the others
    logits = x[0] @ w
    real = seg[0] > 0
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    f = np.bincount(target[real], minlength=4) / real.sum()
    P = p[real].mean(0)
    z = np.mean(np.log(np.exp(logits[real]).sum(-1)) ** 2)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.w_router[...] = jnp.asarray(w)
    for dropless in (False, True):
        moe.cfg = dataclasses.replace(cfg, moe_dropless=dropless)
        y, aux = moe(jnp.asarray(x), jnp.asarray(seg))
        y = np.asarray(y)
        assert float(aux["moe/dropped_fraction"]) == 0.0
        assert np.all(y[0, :3] == 0)
        np.testing.assert_allclose(np.asarray(aux["moe/expert_share"]), f, rtol=1e-6)
        np.testing.assert_allclose(float(aux["moe/load_balance_loss"]), 4 * np.sum(f * P), rtol=1e-6)
        np.testing.assert_allclose(float(aux["moe/router_z_loss"]), z, rtol=1e-6)
        # each real token alone in a one-token group (a row) of its own: its expert's output times its gate
        alone, _ = moe(jnp.asarray(x[0, 3:, None]), jnp.ones((5, 1), jnp.int32))
        np.testing.assert_allclose(y[0, 3:], np.asarray(alone)[:, 0], rtol=1e-5, atol=1e-7)
    # without the mask (all tokens real) the padding takes expert 0's slots: the two real expert-0 tokens drop
    moe.cfg = cfg
    y, aux = moe(jnp.asarray(x), jnp.ones_like(jnp.asarray(seg)))
    assert float(aux["moe/dropped_fraction"]) * 8 == 3 and np.all(np.asarray(y)[0, 3:5] == 0)


@pytest.mark.integration
def test_padding_content_changes_no_real_token_and_no_moe_metric():
    """Through the decoder (the block hands segment ids to the MoE), with capacity factor 1.0 so capacity is
    contested: rewriting the padding tokens (segment id 0) of a batch changes neither the real tokens' logits
    nor any MoE statistic, whereas the same rewrite of real tokens does change the statistics."""
    cfg = dataclasses.replace(TINY, moe_capacity_factor=1.0)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    b = _batch(2, 32, 256, seed=1)
    seg = np.ones((2, 32), np.int32)
    seg[0, 20:] = 0
    seg[1, 12:] = 0
    pad = seg == 0
    fwd = jax.jit(lambda t, s, p: model(t, s, p, return_aux=True))
    logits, aux = fwd(b["tokens"], jnp.asarray(seg), b["positions"])
    other = np.where(pad, (np.asarray(b["tokens"]) * 7 + 3) % 256, np.asarray(b["tokens"]))
    logits2, aux2 = fwd(jnp.asarray(other), jnp.asarray(seg), b["positions"])
    np.testing.assert_allclose(np.asarray(logits2)[~pad], np.asarray(logits)[~pad], rtol=1e-5, atol=1e-6)
    for k in ("moe/expert_share", "moe/load_balance_loss", "moe/router_z_loss", "moe/dropped_fraction"):
        np.testing.assert_allclose(np.asarray(aux2[k]), np.asarray(aux[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    # the check can fail: rewriting real tokens instead moves the shares
    real_rewrite = np.where(~pad, (np.asarray(b["tokens"]) * 7 + 3) % 256, np.asarray(b["tokens"]))
    _, aux3 = fwd(jnp.asarray(real_rewrite), jnp.asarray(seg), b["positions"])
    assert np.abs(np.asarray(aux3["moe/expert_share"]) - np.asarray(aux["moe/expert_share"])).max() > 1e-3


def test_runs_plot_reads_realized_and_router_shares(tmp_path, monkeypatch):
    """``jaxpt.tools.runs`` reads both share series per layer and expert, in step order, and the expert-share
    plot goes to its own default file, not over ``loss.png``."""
    from jaxpt.tools import runs

    recs = []
    for step, (real, own) in enumerate([((0.3, 0.7), (0.3, 0.7)), ((0.5, 0.5), (1.0, 0.0))], start=1):
        rec = {"step": step, "loss": 1.0}
        for e in range(2):
            rec[f"moe/expert_share/layer0/expert{e}"] = real[e]
            rec[f"moe/router_share/layer0/expert{e}"] = own[e]
        recs.append(json.dumps(rec))
    (tmp_path / "metrics.jsonl").write_text("\n".join(recs) + "\n")
    assert runs.read_expert_shares(str(tmp_path)) == {0: {0: [(1, 0.3), (2, 0.5)], 1: [(1, 0.7), (2, 0.5)]}}
    assert runs.read_expert_shares(str(tmp_path), "router_share") == {0: {0: [(1, 0.3), (2, 1.0)],
                                                                          1: [(1, 0.7), (2, 0.0)]}}
    out = runs.cmd_plot_expert_shares([{"workdir": str(tmp_path)}], str(tmp_path / "shares.png"))
    assert (tmp_path / "shares.png").stat().st_size > 0 and out.endswith("shares.png")
    # The CLI's default file is named after what it draws (it was loss.png for both plots).
    monkeypatch.setattr(runs, "load_run", lambda run, root: {"workdir": run})
    monkeypatch.chdir(tmp_path)
    assert runs.main(["plot", str(tmp_path), "--expert-shares"]) == 0
    assert (tmp_path / "expert_shares.png").exists() and not (tmp_path / "loss.png").exists()


# ------------------------------------------------------------------------------------------ causal routing
#: The quickstart MoE's router (configs/quickstart_moe.gin): 4 experts, top-2, capacity 1.25, 5 Sinkhorn iterations.
QUICKSTART_ROUTER = dict(moe_num_experts=4, moe_top_k=2, moe_capacity_factor=1.25, moe_router_sinkhorn_iters=5)


def _random_params(cfg, seed=0, std=0.2):
    """A model of ``cfg`` with every param drawn N(0, std) on the host: routers that route tokens apart."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed))))
    rng = np.random.default_rng(seed)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.asarray(std * rng.standard_normal(a.shape), a.dtype), state))


@pytest.mark.integration
@pytest.mark.parametrize("variant", [{}, {"moe_group_size": 8}, {"moe_dropless": True}, {"scan_layers": True}])
def test_causal_routing_keeps_prefix_logits_independent_of_later_tokens(variant):
    """Replacing the tokens at positions >= 16 of 32-token rows leaves the logits at positions 0-15 bit for bit
    unchanged under ``routing='causal'`` (per-token top-k, every assignment kept), with the quickstart router,
    in capacity mode (whole rows or 8-token groups), dropless mode and a scanned stack; under the training
    routing (capacity slots and Sinkhorn offsets from the whole group) the same replacement moves them (the
    check can fail)."""
    cfg = dataclasses.replace(TINY, **QUICKSTART_ROUTER, **variant)
    model = _random_params(cfg)
    b = _batch(4, 32, 256, seed=2)
    later = np.asarray(b["tokens"]).copy()
    later[:, 16:] = (later[:, 16:] * 7 + 3) % 256
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t, routing: nnx.merge(graphdef, st)(t, b["segment_ids"], b["positions"], routing=routing),
                  static_argnums=2)
    for routing in ("causal", "train"):
        a, c = np.asarray(fwd(state, b["tokens"], routing)), np.asarray(fwd(state, jnp.asarray(later), routing))
        moved = np.abs(a[:, :16] - c[:, :16]).max()
        if routing == "causal":
            assert moved == 0.0, moved
        elif not cfg.moe_group_size and not cfg.moe_dropless:   # groups of 8 never mix the halves; dropless
            assert moved > 1e-3, moved                            # mixes them through Sinkhorn only


@pytest.mark.integration
def test_causal_routing_is_per_token_top_k_with_every_assignment_kept():
    """One MoE layer under causal routing against a hand computation per token: the top-2 of its router
    probabilities (no Sinkhorn offsets), gates renormalized, each chosen expert's SwiGLU output times its gate,
    nothing dropped at capacity factor 0.5 (which drops under the training routing), padding 0 and out of every
    statistic; the dropless layer gives the same outputs."""
    cfg = dataclasses.replace(TINY, **dict(QUICKSTART_ROUTER, moe_capacity_factor=0.5))
    moe = MoE(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    for name in ("w_router", "w_gate", "w_up", "w_down"):
        p = getattr(moe, name)
        p[...] = jnp.asarray(0.3 * rng.standard_normal(p.shape), jnp.float32)
    x = rng.standard_normal((2, 16, cfg.d_model)).astype(np.float32)
    seg = np.ones((2, 16), np.int32)
    seg[1, 11:] = 0
    y, aux = moe(jnp.asarray(x), jnp.asarray(seg), routing="causal")
    _, aux_train = moe(jnp.asarray(x), jnp.asarray(seg))
    assert float(aux_train["moe/dropped_fraction"]) > 0 and float(aux["moe/dropped_fraction"]) == 0.0
    wr, wg, wu, wd = (np.asarray(getattr(moe, n)[...], np.float64) for n in ("w_router", "w_gate", "w_up", "w_down"))
    logits = x.astype(np.float64) @ wr
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.zeros_like(x, np.float64)
    counts = np.zeros(4)
    for b in range(2):
        for t in range(16):
            if not seg[b, t]:
                continue
            top = np.argsort(-p[b, t])[:2]
            counts[top] += 1
            for e in top:
                h = x[b, t] @ wg[e]
                want[b, t] += p[b, t, e] / p[b, t, top].sum() * ((h / (1 + np.exp(-h))) * (x[b, t] @ wu[e])) @ wd[e]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(aux["moe/expert_share"]), counts / counts.sum(), rtol=1e-6)
    moe.cfg = dataclasses.replace(cfg, moe_dropless=True)
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x), jnp.asarray(seg), routing="causal")[0]), want,
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="routing 'grouped'"):
        moe(jnp.asarray(x), routing="grouped")


@pytest.mark.integration
def test_evaluation_scores_moe_causally_and_says_so():
    """The held-out scorer and the eval step route a mixture of experts token by token: the scores of a window's
    first 16 tokens do not change when its later tokens do, the perplexity report names the routing, and a
    dense model's report carries no routing (nothing to say); ``routing='train'`` is there to measure the
    difference, and moves them."""
    from jaxpt import mesh as mesh_lib
    from jaxpt.eval import heldout
    from jaxpt.eval.scorer import Scorer, Window
    from jaxpt.model.decoder import eval_routing
    from jaxpt.training.step import eval_step

    cfg = dataclasses.replace(TINY, **QUICKSTART_ROUTER)
    model = _random_params(cfg)
    mesh = mesh_lib.mesh_from_config("data=8")
    rng = np.random.default_rng(4)
    first = rng.integers(3, 256, 32).astype(np.int32)
    second = first.copy()
    second[16:] = rng.integers(3, 256, 16)
    assert eval_routing(cfg) == "causal" and eval_routing(dataclasses.replace(cfg, mlp="swiglu")) == "causal"
    for routing in (None, "train"):
        scorer = Scorer.from_model(model, mesh, mesh_lib.DEFAULT_RULES, seq_len=32, batch_size=8, routing=routing)
        res = scorer.score([Window(first, 1), Window(second, 1)], pack=False, keep_tokens=True)
        moved = np.abs(res.token_logp[0][:15] - res.token_logp[1][:15]).max()
        assert (moved == 0.0) if routing is None else (moved > 1e-4), (routing, moved)
        assert scorer.routing == (routing or "causal")
    hset = heldout.HeldoutSet.build([heldout.Document("d", "abc")], _ByteTokenizer(), seq_len=32)
    assert heldout.perplexity_report(scorer, hset, group_by=())["routing"] == "train"
    dense = Scorer.from_model(_random_params(dataclasses.replace(cfg, mlp="swiglu")), mesh, mesh_lib.DEFAULT_RULES,
                              seq_len=32, batch_size=8)
    assert "routing" not in heldout.perplexity_report(dense, hset, group_by=())
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.asarray(np.stack([first, second]))
    batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens), "positions": jnp.broadcast_to(jnp.arange(32), (2, 32))}
    out = jax.jit(lambda p, b: eval_step(p, b, graphdef=graphdef))(params, batch)
    logits = model(batch["tokens"], batch["segment_ids"], batch["positions"], routing="causal")
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    want = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).sum()
    np.testing.assert_allclose(float(out["loss_sum"]), float(want), rtol=1e-5)


class _ByteTokenizer:
    """Bytes as token ids (3..258 clipped into TINY's 256), EOS 2: enough to build a held-out set."""

    eos_id, pad_id = 2, 0

    def encode_batch(self, texts):
        return [np.asarray([3 + (b % 250) for b in t.encode()], np.int32) for t in texts]
