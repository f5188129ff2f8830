"""Chunked cross-entropy (``ModelConfig.loss_chunk_size``): the same loss and gradients as the whole-logits
path, without a [B, L, V] logits array anywhere in the differentiated program."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpt.training import step as step_lib
from jaxpt.model import Decoder, ModelConfig

B, L, V = 2, 24, 96
CFG = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                  max_seq_len=L)


def _packed_batch(seed=0):
    """Two rows: several documents each, and trailing padding (segment 0) in the second."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, size=(B, L), dtype=np.int32)
    segs = np.array([[1] * 10 + [2] * 9 + [3] * 5, [1] * 7 + [2] * 12 + [0] * 5], np.int32)
    pos = np.zeros_like(segs)
    for b in range(B):
        for t in range(1, L):
            pos[b, t] = pos[b, t - 1] + 1 if segs[b, t] == segs[b, t - 1] else 0
    return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segs), "positions": jnp.asarray(pos)}


@pytest.mark.integration
@pytest.mark.parametrize("chunk", [8, 7, 24, 64])
def test_chunked_token_losses_equal_a_float64_log_softmax(chunk):
    """ce and log Z equal numpy's float64 log-softmax (chunk sizes dividing L, not dividing it, equal to it and
    above it), and the gradients w.r.t. x and w equal those of a plain log-softmax loss (fp32, rtol 1e-5)."""
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, L, 16), jnp.float32)
    w = jax.random.normal(kw, (16, V), jnp.float32)
    t = jax.random.randint(kt, (B, L), 0, V)
    ce, log_z, mx = step_lib.chunked_token_losses(x, w, t, chunk)
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    lz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    want_ce = lz - np.take_along_axis(logits, np.asarray(t)[..., None], -1)[..., 0]
    np.testing.assert_allclose(ce, want_ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(log_z, lz, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mx, logits.max(), rtol=1e-6)

    weights = jax.random.uniform(jax.random.key(1), (B, L))
    plain = lambda x, w: jnp.sum(-jnp.take_along_axis(jax.nn.log_softmax(x @ w), t[..., None], -1)[..., 0] * weights)  # noqa: E731
    chunked = lambda x, w: jnp.sum(step_lib.chunked_token_losses(x, w, t, chunk)[0] * weights)  # noqa: E731
    for got, want in zip(jax.grad(chunked, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
@pytest.mark.parametrize("scan", [False, True])
def test_loss_fn_with_chunks_equals_the_whole_logits_loss_and_gradients(scan):
    """Same model and params, packed batch with padding, GQA: loss, z-loss, max logit and every gradient agree
    (fp32; rtol 1e-5, atol 1e-7)."""
    cfg = dataclasses.replace(CFG, scan_layers=scan)
    g, p = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    g_chunk, _ = nnx.split(Decoder(dataclasses.replace(cfg, loss_chunk_size=8), rngs=nnx.Rngs(0)), nnx.Param)
    batch = _packed_batch()
    grad = jax.value_and_grad(step_lib.loss_fn, has_aux=True)
    (tot0, aux0), g0 = grad(p, g, batch, 1e-2)
    (tot1, aux1), g1 = grad(p, g_chunk, batch, 1e-2)
    np.testing.assert_allclose(tot1, tot0, rtol=1e-6)
    for k in ("loss", "z_loss", "max_logit", "num_target_tokens", "max_attention_logit"):
        np.testing.assert_allclose(aux1[k], aux0[k], rtol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _shapes(jaxpr):
    """Shapes of every value any equation produces, nested jaxprs (scan, checkpoint, pjit) included."""
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else []:
            out += _shapes(sub)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out += _shapes(inner)
            elif hasattr(param, "eqns"):
                out += _shapes(param)
    return out


def test_whole_logits_never_exist_in_the_chunked_gradient_program():
    """The differentiated loss has a [B, L, V] value without chunking, and none with chunks of 8 (only
    [B, 8, V])."""
    _, p = nnx.split(Decoder(CFG, rngs=nnx.Rngs(0)), nnx.Param)
    batch = _packed_batch()

    def shapes(chunk):
        g, _ = nnx.split(Decoder(dataclasses.replace(CFG, loss_chunk_size=chunk), rngs=nnx.Rngs(0)), nnx.Param)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: step_lib.loss_fn(p, g, batch, 1e-4)[0]))(p)
        return set(_shapes(jaxpr.jaxpr))

    assert (B, L, V) in shapes(0)
    chunked = shapes(8)
    assert (B, L, V) not in chunked and (B, 8, V) in chunked
