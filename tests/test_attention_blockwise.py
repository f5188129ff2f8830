"""``blockwise`` attention equals ``xla`` (forward, gradients, max logit) on packed GQA batches with padding, and
its compiled backward pass needs a fraction of ``xla``'s temporary memory at long rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpt.training import step as step_lib
from jaxpt.model import Decoder, ModelConfig, dot_product_attention
from jaxpt.model.attention_blockwise import blockwise_attention

#: fp32 tolerance: both sum the same terms in a different order (online softmax vs one softmax).
RTOL, ATOL = 2e-5, 2e-6


def _inputs(B, L, H, K, Hd, seed=0):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, L, H, Hd), jnp.float32)
    k = jax.random.normal(kk, (B, L, K, Hd), jnp.float32)
    v = jax.random.normal(kv, (B, L, K, Hd), jnp.float32)
    cot = jax.random.normal(kc, (B, L, H, Hd), jnp.float32)
    return q, k, v, cot


def _packed_segments(B, L, seed=0):
    """Rows of several documents of random lengths, the last row ending in padding (segment 0)."""
    rng = np.random.default_rng(seed)
    segs = np.zeros((B, L), np.int32)
    for b in range(B):
        t, doc = 0, 1
        end = L - (L // 5 if b == B - 1 else 0)
        while t < end:
            n = int(rng.integers(1, max(2, L // 3)))
            segs[b, t:min(end, t + n)] = doc
            t, doc = t + n, doc + 1
    return jnp.asarray(segs)


def _attend(impl_fn, q, k, v, segs, cot):
    """(out, max logit, grads of <out, cot> w.r.t. q, k, v), as one jitted program (one compile, not one per op)."""
    def f(q, k, v):
        out, aux = impl_fn(q, k, v, segs, segs, scale=q.shape[-1] ** -0.5)
        return jnp.sum(out * cot), (out, aux["max_attention_logit"])
    (_, (out, mx)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, mx, grads


@pytest.mark.integration
@pytest.mark.parametrize("H, K", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_q, block_k", [(16, 16), (16, 8), (8, 32), (64, 64)])
def test_blockwise_equals_xla_forward_and_gradients(H, K, block_q, block_k):
    """Packed rows with padding, GQA (G = 2, 1, 8), blocks that do and do not divide L = 56; fp32."""
    B, L, Hd = 2, 56, 8
    q, k, v, cot = _inputs(B, L, H, K, Hd)
    segs = _packed_segments(B, L)
    xla = lambda *a, scale: dot_product_attention(*a[:4], impl="xla", kv_segment_ids_BxM=a[4], scale=scale)  # noqa: E731
    bw = lambda *a, scale: blockwise_attention(*a, scale=scale, block_q=block_q, block_k=block_k)  # noqa: E731
    want_out, want_max, want_grads = _attend(xla, q, k, v, segs, cot)
    out, mx, grads = _attend(bw, q, k, v, segs, cot)
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(mx, want_max, rtol=1e-6)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"d/d{name}")


@pytest.mark.integration
def test_decoder_loss_and_gradients_equal_under_xla_and_blockwise():
    """The seam: the whole model (scanned, remat) trains the same under either implementation."""
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                      max_seq_len=32, scan_layers=True, remat_policy="full")
    segs = _packed_segments(2, 32, seed=1)
    tokens = jax.random.randint(jax.random.key(2), (2, 32), 1, 64)
    batch = {"tokens": tokens, "segment_ids": segs, "positions": jnp.broadcast_to(jnp.arange(32), (2, 32))}
    results = []
    for impl in ("xla", "blockwise"):
        g, p = nnx.split(Decoder(dataclasses.replace(cfg, attention_impl=impl), rngs=nnx.Rngs(0)), nnx.Param)
        grad_fn = jax.jit(jax.value_and_grad(step_lib.loss_fn, has_aux=True), static_argnums=1)
        results.append(grad_fn(p, g, batch, 1e-4))
    ((_, aux0), g0), ((_, aux1), g1) = results
    for key in ("loss", "max_attention_logit", "max_logit"):
        np.testing.assert_allclose(aux1[key], aux0[key], rtol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _temp_bytes(impl_fn, B, L, H, K, Hd):
    q = jax.ShapeDtypeStruct((B, L, H, Hd), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, L, K, Hd), jnp.float32)
    segs = jax.ShapeDtypeStruct((B, L), jnp.int32)

    def loss(q, k, v, segs):
        out, _ = impl_fn(q, k, v, segs, segs, scale=Hd ** -0.5)
        return jnp.sum(out)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, segs).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.integration
def test_blockwise_backward_uses_under_an_eighth_of_xla_temp_memory_at_4096_tokens():
    """Compiled (not run) on CPU: forward + backward of one attention call at L = 4096, 4 heads over 2 kv heads.
    ``xla`` holds float32 logits and probabilities (256 MiB each for [B, H, L, L]; 5/8 of that in its four causal
    query blocks); ``blockwise`` one tile at a time."""
    B, L, H, K, Hd = 1, 4096, 4, 2, 32
    xla = lambda *a, scale: dot_product_attention(*a[:4], impl="xla", kv_segment_ids_BxM=a[4], scale=scale)  # noqa: E731
    xla_bytes = _temp_bytes(xla, B, L, H, K, Hd)
    bw_bytes = _temp_bytes(blockwise_attention, B, L, H, K, Hd)
    assert xla_bytes >= B * H * L * L * 4   # the logits alone
    assert bw_bytes < xla_bytes / 8, (bw_bytes, xla_bytes)
