"""``splash`` attention (the Pallas TPU kernel, here in Pallas interpret mode on CPU) equals ``xla`` in forward and
gradients on packed GQA rows with padding, alone and under a sharded mesh (shard_map over batch and heads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpt import mesh as mesh_lib
from jaxpt.model import attention_splash, dot_product_attention

from test_attention_blockwise import _attend, _inputs, _packed_segments

#: fp32; the kernel's exp and accumulation order differ from one softmax over the row.
RTOL, ATOL = 1e-4, 1e-5
B, L, H, K, HD = 2, 256, 4, 2, 128


def _xla(*a, scale):
    return dot_product_attention(*a[:4], impl="xla", kv_segment_ids_BxM=a[4], scale=scale)


def _splash(*a, scale):
    return dot_product_attention(*a[:4], impl="splash", kv_segment_ids_BxM=a[4], scale=scale)


def assert_matches_xla(out, grads, want_out, want_grads):
    """Splash output and q/k/v gradients equal xla's within RTOL/ATOL (raises AssertionError otherwise)."""
    np.testing.assert_allclose(out, want_out, rtol=RTOL, atol=ATOL)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"d/d{name}")


@pytest.mark.slow
def test_splash_equals_xla_in_interpret_mode(monkeypatch):
    """2 x 2 blocks of 128 (causal block skipping and a partly masked diagonal block), GQA G = 2, packed rows, the
    second ending in padding. Splash reports no max attention logit."""
    monkeypatch.setattr(attention_splash, "BLOCK", 128)
    q, k, v, cot = _inputs(B, L, H, K, HD)
    segs = _packed_segments(B, L)
    want_out, _, want_grads = _attend(_xla, q, k, v, segs, cot)

    def f(q, k, v):
        out, aux = _splash(q, k, v, segs, segs, scale=HD ** -0.5)
        assert aux == {}
        return jnp.sum(out * cot), out
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert_matches_xla(out, grads, want_out, want_grads)


@pytest.mark.slow
def test_splash_under_a_sharded_mesh_equals_xla():
    """Inside the step's activation-sharding context on fsdp=2 x tensor=2: shard_map gives each device one row and
    half the heads (one kv head); the result and gradients equal ``xla``'s."""
    mesh = mesh_lib.make_mesh("fsdp=2,tensor=2", jax.devices()[:4])
    q, k, v, cot = _inputs(B, L, H, K, HD, seed=3)
    segs = _packed_segments(B, L, seed=3)
    want_out, _, want_grads = _attend(_xla, q, k, v, segs, cot)

    @jax.jit
    def run(q, k, v):
        with mesh_lib.activation_sharding(mesh, mesh_lib.DEFAULT_RULES):
            return _attend(_splash_no_aux, q, k, v, segs, cot)

    out, _, grads = run(q, k, v)
    assert_matches_xla(out, grads, want_out, want_grads)


def _splash_no_aux(*a, scale):
    out, _ = _splash(*a, scale=scale)
    return out, {"max_attention_logit": jnp.float32(0)}


def test_splash_refuses_rows_that_are_not_whole_blocks():
    q, k, v, _ = _inputs(1, 520, 2, 2, 8)
    segs = jnp.ones((1, 520), jnp.int32)
    with pytest.raises(ValueError, match="multiple of the block size"):
        _splash(q, k, v, segs, segs, scale=1.0)
