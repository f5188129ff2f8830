"""Model seams: attention implementations and MLPs chosen by config, auxiliary outputs with declared
reductions (over layers and over gradient-accumulation micro-batches), auxiliary losses, and checkpoint
compatibility decided from param shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpt.training import step as step_lib
from jaxpt.checkpoint import CheckpointError
from jaxpt.run.lineage import check_compatible
from jaxpt.util.errors import ConfigError
from jaxpt.model import Decoder, ModelConfig, add_attention, add_mlp
from jaxpt.model.auxiliary import AuxSpec, fold, merge_specs, reduce_aux
from jaxpt.model.rope import rope
from jaxpt.model.mlp import SwiGLU

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                  max_seq_len=32)


# ---------------------------------------------------------------- implementations the tests add (explicit calls)
def bias_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
    """Another route to the same math: k/v repeated to H heads, the mask as an additive bias. Declares no
    aux outputs, so ``max_attention_logit`` must be absent under it."""
    G = q_BxLxHxHd.shape[2] // k_BxMxKxHd.shape[2]
    k_BxMxHxHd = jnp.repeat(k_BxMxKxHd, G, axis=2)
    v_BxMxHxHd = jnp.repeat(v_BxMxKxHd, G, axis=2)
    L, M = q_segment_ids_BxL.shape[1], kv_segment_ids_BxM.shape[1]
    allowed_BxLxM = ((q_segment_ids_BxL[:, :, None] == kv_segment_ids_BxM[:, None, :])
                     & (np.arange(M)[None, :] <= np.arange(L)[:, None]))
    bias_Bx1xLxM = jnp.where(allowed_BxLxM, 0.0, -1e30)[:, None]
    logits = jnp.einsum("blhd,bmhd->bhlm", q_BxLxHxHd * scale, k_BxMxHxHd,
                        preferred_element_type=jnp.float32) + bias_Bx1xLxM
    probs = jax.nn.softmax(logits, axis=-1).astype(q_BxLxHxHd.dtype)
    return jnp.einsum("bhlm,bmhd->blhd", probs, v_BxMxHxHd), {}


class SigmoidSwiGLU(SwiGLU):
    """SwiGLU with silu written out as ``g * sigmoid(g)``: same params and init, same function."""

    def __call__(self, x_BxLxD):
        cd = self.cfg.jnp_compute_dtype
        gate = x_BxLxD @ self.w_gate[...].astype(cd)
        h = gate * jax.nn.sigmoid(gate) * (x_BxLxD @ self.w_up[...].astype(cd))
        return h @ self.w_down[...].astype(cd), {}


L2_WEIGHT = 0.5


class L2SwiGLU(SwiGLU):
    """SwiGLU returning an auxiliary loss ``sum(w_down^2)`` (an L2 penalty: a loss known from params alone)."""

    def __call__(self, x_BxLxD):
        y, _ = super().__call__(x_BxLxD)
        return y, {"mlp_l2": jnp.sum(jnp.square(self.w_down[...]))}


def wide_mlp(cfg, *, rngs):
    """An MLP with other param shapes (twice the hidden width)."""
    return SwiGLU(dataclasses.replace(cfg, mlp_dim=2 * cfg.mlp_dim), rngs=rngs)


add_attention("test_bias", bias_attention, replace=True)
add_mlp("test_swiglu_sigmoid", SigmoidSwiGLU, replace=True)
add_mlp("test_swiglu_l2", L2SwiGLU, replace=True,
        aux_specs={"mlp_l2": AuxSpec("sum", over_microbatches="mean", loss_weight=L2_WEIGHT)})
add_mlp("test_wide", wide_mlp, replace=True)


# ---------------------------------------------------------------- helpers
def batches(n, seed=0):
    """Rows of two documents plus trailing padding, lengths varying by row: masking matters."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, 64, (16, 32)).astype(np.int32)
        seg = np.ones((16, 32), np.int32)
        pos = np.tile(np.arange(32, dtype=np.int32), (16, 1))
        for r in range(16):
            cut, end = rng.integers(5, 20), 32 - rng.integers(0, 8)
            seg[r, cut:], pos[r, cut:] = 2, np.arange(32 - cut)
            seg[r, end:], pos[r, end:] = 0, 0
        out.append({"tokens": tokens, "segment_ids": seg, "positions": pos})
    return out


def train_metrics(cfg, steps=3, lr=0.5):
    """Aux of each of a few plain SGD steps (jitted loss_and_grads, one device) from seed 0 on :func:`batches`."""
    g, p = split(cfg)

    @jax.jit
    def step(p, b):
        aux, grads = step_lib.loss_and_grads(p, g, b, 1e-4)
        return jax.tree.map(lambda w, d: w - lr * d, p, grads), dict(aux, grad_norm=optax.global_norm(grads))

    out = []
    for b in batches(steps):
        p, aux = step(p, b)
        out.append({k: float(v) for k, v in aux.items()})
    return out


def split(cfg, seed=0):
    return nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)), nnx.Param)


# ---------------------------------------------------------------- (a) attention implementation by config
@pytest.mark.slow
@pytest.mark.parametrize("num_kv_heads", [2, 4])  # xla's grouped and plain multi-head branches
def test_second_attention_impl_trains_to_the_same_losses(num_kv_heads):
    """An implementation added from outside the package, selected by ModelConfig.attention_impl, trains
    to the losses of 'xla'; it reports no max_attention_logit, and the metric is absent, not faked."""
    cfg = dataclasses.replace(CFG, num_kv_heads=num_kv_heads)
    ref = train_metrics(cfg)
    alt = train_metrics(dataclasses.replace(cfg, attention_impl="test_bias"))
    np.testing.assert_allclose([m["loss"] for m in alt], [m["loss"] for m in ref], rtol=1e-6)
    np.testing.assert_allclose([m["grad_norm"] for m in alt], [m["grad_norm"] for m in ref], rtol=1e-5)
    assert len({m["loss"] for m in ref}) == 3  # the params really moved
    assert all(np.isfinite(m["max_attention_logit"]) for m in ref)
    assert all("max_attention_logit" not in m for m in alt)


def test_unknown_impl_is_a_config_error_naming_the_field():
    """Refused where the config is built (gin, constructor, dataclasses.replace), listing the known names."""
    with pytest.raises(ConfigError, match=r"ModelConfig.attention_impl = 'nope': choose one of \('xla',"):
        dataclasses.replace(CFG, attention_impl="nope")
    with pytest.raises(ConfigError, match=r"ModelConfig.mlp = 'nope': choose one of \('swiglu',"):
        ModelConfig(mlp="nope")


def test_the_tables_name_exactly_what_the_config_accepts():
    """jaxpt's implementations are the rows of one table per seam, keyed by the names ModelConfig checks against
    (without importing the implementations); the user's, added by the calls above, come after them."""
    from jaxpt.model import seams, tables
    assert tuple(tables.ATTENTION) == seams.ATTENTION_IMPLS
    assert tuple(tables.MLPS) == seams.MLP_NAMES
    assert all(entry.name == name for table in (tables.ATTENTION, tables.MLPS) for name, entry in table.items())
    assert seams.names("attention_impl")[:len(seams.ATTENTION_IMPLS) + 1] == (*seams.ATTENTION_IMPLS, "test_bias")
    assert tables.attention("test_bias").fn is bias_attention and tables.mlp("swiglu").fn is SwiGLU
    with pytest.raises(ValueError, match="'xla' is jaxpt's own"):
        add_attention("xla", bias_attention)
    with pytest.raises(ValueError, match="'test_wide' is already added"):
        add_mlp("test_wide", wide_mlp)


# ---------------------------------------------------------------- (b) MLP by config
@pytest.mark.slow
def test_second_mlp_trains_to_the_same_losses():
    """An added MLP variant (same params, silu written out) selected by ModelConfig.mlp trains like swiglu."""
    ref = train_metrics(CFG)
    alt = train_metrics(dataclasses.replace(CFG, mlp="test_swiglu_sigmoid"))
    np.testing.assert_allclose([m["loss"] for m in alt], [m["loss"] for m in ref], rtol=1e-5)
    np.testing.assert_allclose([m["max_attention_logit"] for m in alt], [m["max_attention_logit"] for m in ref],
                               rtol=1e-5)


# ---------------------------------------------------------------- (c) reductions
def test_fold_and_reduce_by_hand():
    vals = [jnp.float32(1.0), jnp.float32(4.0), jnp.float32(-2.0)]
    assert float(fold("max", vals)) == 4.0
    assert float(fold("sum", jnp.stack(vals))) == 3.0
    assert float(fold("mean", vals)) == 1.0
    specs = {"a": AuxSpec("max"), "b": AuxSpec("sum", over_microbatches="mean")}
    per = {"a": jnp.array([1.0, 3.0]), "b": jnp.array([2.0, 6.0])}
    assert {k: float(v) for k, v in reduce_aux(specs, per, over="layers").items()} == {"a": 3.0, "b": 8.0}
    assert {k: float(v) for k, v in reduce_aux(specs, per, over="microbatches").items()} == {"a": 3.0, "b": 4.0}
    with pytest.raises(KeyError, match="'c' has no AuxSpec"):
        reduce_aux(specs, {"c": per["a"]}, over="layers")
    with pytest.raises(ValueError, match="declared by both"):
        merge_specs(("x", specs), ("y", {"a": AuxSpec("sum")}))
    with pytest.raises(ValueError, match="must reduce over micro-batches by 'sum' or 'mean'"):
        AuxSpec("max", loss_weight=1.0)
    with pytest.raises(ValueError, match="reduction 'median'"):
        AuxSpec("median")


def max_attention_logit_by_hand(model, cfg, batch):
    """Per-layer largest scaled q.k over allowed pairs, in float64 numpy, walking the blocks one by one."""
    tokens, seg, pos = (jnp.asarray(batch[k]) for k in ("tokens", "segment_ids", "positions"))
    x = model.embedding[...][tokens]
    L, G = tokens.shape[1], cfg.num_heads // cfg.num_kv_heads
    allowed = (seg[:, :, None] == seg[:, None, :]) & (np.arange(L)[None, :] <= np.arange(L)[:, None])
    per_layer = []
    for block in model.blocks:
        h = block.attn_norm(x)
        q = np.asarray(rope(jnp.einsum("bld,dhk->blhk", h, block.attn.wq[...]), pos, cfg.rope_theta), np.float64)
        k = np.asarray(rope(jnp.einsum("bld,dhk->blhk", h, block.attn.wk[...]), pos, cfg.rope_theta), np.float64)
        logits = np.einsum("blhd,bmhd->bhlm", q, np.repeat(k, G, axis=2)) / np.sqrt(cfg.head_dim)
        per_layer.append(logits[np.broadcast_to(np.asarray(allowed)[:, None], logits.shape)].max())
        x, _ = block(x, seg, pos)
    return per_layer


def stacked_model(model, cfg):
    """The same params in a scan_layers=True model (blocks stacked on a leading layers axis)."""
    g, st = split(dataclasses.replace(cfg, scan_layers=True))
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}

    def fill(path, _):
        key = jax.tree_util.keystr(path)
        if not key.startswith("['blocks']"):
            return flat[key]
        return jnp.stack([flat[key.replace("['blocks']", f"['blocks'][{i}]", 1)] for i in range(cfg.num_layers)])
    return nnx.merge(g, jax.tree_util.tree_map_with_path(fill, st))


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_max_attention_logit_is_max_over_layers(scan):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    batch = batches(1)[0]
    expected = max(max_attention_logit_by_hand(model, CFG, batch))
    run = stacked_model(model, CFG) if scan else model
    _, aux = run(*(jnp.asarray(batch[k]) for k in ("tokens", "segment_ids", "positions")), return_aux=True)
    assert set(aux) == {"max_attention_logit"}
    np.testing.assert_allclose(float(aux["max_attention_logit"]), expected, rtol=1e-5)


@pytest.mark.integration
def test_grad_accumulation_reduces_aux_over_microbatches():
    """grad_accum 4 vs 1: same loss; max_attention_logit is the max over micro-batches, i.e. over the whole
    batch as computed by hand."""
    g, p = split(CFG)
    batch = {k: jnp.asarray(v) for k, v in batches(1)[0].items()}
    expected = max(max_attention_logit_by_hand(nnx.merge(g, p), CFG, batch))
    aux1, _ = jax.jit(lambda p, b: step_lib.loss_and_grads(p, g, b, 1e-4, 1))(p, batch)
    aux4, _ = jax.jit(lambda p, b: step_lib.loss_and_grads(p, g, b, 1e-4, 4))(p, batch)
    assert set(aux4) == set(aux1) == {"loss", "z_loss", "num_target_tokens", "max_logit", "max_attention_logit"}
    np.testing.assert_allclose(float(aux4["loss"]), float(aux1["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(aux4["max_attention_logit"]), float(aux1["max_attention_logit"]), rtol=1e-6)
    np.testing.assert_allclose(float(aux4["max_attention_logit"]), expected, rtol=1e-5)
    assert float(aux4["num_target_tokens"]) == float(aux1["num_target_tokens"])


@pytest.mark.slow
def test_declared_aux_loss_is_added_to_the_training_loss():
    """An MLP's aux loss with loss_weight w: total = ce + w * sum over layers of sum(w_down^2) (computed from
    the params); its gradient on each w_down is 2 w w_down; accumulating 4 micro-batches ('mean') agrees."""
    cfg = dataclasses.replace(CFG, mlp="test_swiglu_l2")
    g, p = split(cfg)
    g_ref, p_ref = split(CFG)  # plain swiglu: same init, same params
    batch = {k: jnp.asarray(v) for k, v in batches(1)[0].items()}
    total, aux = step_lib.loss_fn(p, g, batch, 0.0)
    l2 = sum(float(np.sum(np.square(np.asarray(b.mlp.w_down[...], np.float64)))) for b in nnx.merge(g, p).blocks)
    np.testing.assert_allclose(float(aux["mlp_l2"]), l2, rtol=1e-5)
    np.testing.assert_allclose(float(total), float(aux["loss"]) + L2_WEIGHT * l2, rtol=1e-6)
    aux1, g1 = step_lib.loss_and_grads(p, g, batch, 0.0, 1)
    aux4, g4 = step_lib.loss_and_grads(p, g, batch, 0.0, 4)
    _, g0 = step_lib.loss_and_grads(p_ref, g_ref, batch, 0.0, 1)
    np.testing.assert_allclose(float(aux4["mlp_l2"]), float(aux1["mlp_l2"]), rtol=1e-6)
    flat = lambda tree: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}  # noqa: E731
    g0, g1, g4, params = flat(g0), flat(g1), flat(g4), flat(p)
    assert any("w_down" in key for key in params)
    for key, w in params.items():
        np.testing.assert_allclose(g4[key], g1[key], rtol=1e-5, atol=1e-7, err_msg=key)
        extra = 2 * L2_WEIGHT * w if "w_down" in key else np.zeros_like(w)
        np.testing.assert_allclose(g1[key] - g0[key], extra, rtol=1e-4, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------- (d) checkpoint compatibility
def meta_of(cfg):
    return {"model": dataclasses.asdict(cfg)}


def test_checkpoint_of_other_shapes_is_refused_naming_the_field():
    """A changed shape field is named (with the params it changes); a field changed alongside that changes no
    shape (rope_theta) is not blamed."""
    saved = dataclasses.replace(CFG, d_model=64, rope_theta=500.0)
    with pytest.raises(CheckpointError, match=r"^ckpt/7: checkpoint does not match this model: "
                                              r"d_model: checkpoint 64 vs config 32 \(params differ: ") as e:
        check_compatible(meta_of(saved), CFG, "ckpt/7")
    assert "blocks/0/attn/wq [64, 4, 8] float32 vs [32, 4, 8] float32" in str(e.value)
    assert "rope_theta" not in str(e.value)
    with pytest.raises(CheckpointError, match=r"tokenizer's vocabulary.*vocab_size: checkpoint 128 vs config 64"):
        check_compatible(meta_of(dataclasses.replace(CFG, vocab_size=128)), CFG, "ckpt")
    with pytest.raises(CheckpointError, match=r"mlp: checkpoint 'test_wide' vs config 'swiglu'"):
        check_compatible(meta_of(dataclasses.replace(CFG, mlp="test_wide")), CFG, "ckpt")
    with pytest.raises(CheckpointError, match=r"scan_layers: checkpoint True vs config False.*absent"):
        check_compatible(meta_of(dataclasses.replace(CFG, scan_layers=True)), CFG, "ckpt")
    with pytest.raises(CheckpointError, match=r"param_dtype: checkpoint 'bfloat16' vs config 'float32'"):
        check_compatible(meta_of(dataclasses.replace(CFG, param_dtype="bfloat16")), CFG, "ckpt")


def test_checkpoint_differing_only_in_non_shape_fields_is_accepted():
    saved = dataclasses.replace(CFG, attention_impl="test_bias", mlp="test_swiglu_sigmoid", rope_theta=500.0,
                                remat_policy="full", compute_dtype="bfloat16", max_seq_len=64)
    check_compatible(meta_of(saved), CFG, "ckpt")
    # A record from before attention_impl/mlp existed (their defaults keep its behaviour), with a key this
    # version no longer knows.
    old = {k: v for k, v in meta_of(CFG)["model"].items() if k not in ("attention_impl", "mlp")}
    check_compatible({"model": {**old, "retired_knob": 1}}, CFG, "ckpt")
    check_compatible({}, CFG, "ckpt")  # nothing recorded: nothing to compare
