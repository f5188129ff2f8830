"""``xla`` attention's causal query blocks: the split is chosen as documented, computes the same attention as
one dense block (forward, gradients, max logit) and as a NumPy reference, and does fewer FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpt.model.attention_xla import causal_blocks, xla_attention
from test_attention_blockwise import _attend, _inputs, _packed_segments


@pytest.mark.parametrize("L, M, indexed, want", [
    (256, 256, False, 4), (128, 128, False, 2), (192, 192, False, 3), (200, 200, False, 2), (320, 320, False, 4),
    (56, 56, False, 1), (127, 127, False, 1), (256, 255, False, 1), (256, 256, True, 1), (1, 8, False, 1)])
def test_causal_block_count(L, M, indexed, want):
    """At most 4 blocks of >= 64 queries that divide L; never for cross or permuted (indexed) attention."""
    q_index = jnp.arange(L) if indexed else None
    assert causal_blocks(L, M, q_index) == want


def _numpy_attention(q, k, v, segs, scale):
    """Causal, segment-local softmax attention, one query at a time, in float64. Returns (out, max logit)."""
    q, k, v, segs = (np.asarray(a, np.float64) for a in (q, k, v, segs))
    B, L, H, Hd = q.shape
    G = H // k.shape[2]
    out, mx = np.zeros_like(q), -np.inf
    for b in range(B):
        for i in range(L):
            keys = [j for j in range(i + 1) if segs[b, j] == segs[b, i]]
            for h in range(H):
                s = np.array([q[b, i, h] @ k[b, j, h // G] for j in keys]) * scale
                mx = max(mx, s.max())
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, keys, h // G]
    return out, mx


@pytest.mark.integration
@pytest.mark.parametrize("L, H, K, n", [(128, 4, 2, 2), (192, 4, 4, 3), (256, 8, 1, 4)])
def test_causal_blocks_equal_one_dense_block_and_numpy(L, H, K, n):
    """Packed rows with padding, GQA; forward and max logit also against a float64 NumPy loop."""
    B, Hd = 2, 8
    assert causal_blocks(L, L) == n
    q, k, v, cot = _inputs(B, L, H, K, Hd, seed=L)
    segs = _packed_segments(B, L, seed=L)
    dense = lambda *a, scale: xla_attention(*a, scale=scale, max_blocks=1)  # noqa: E731
    want_out, want_max, want_grads = _attend(dense, q, k, v, segs, cot)
    out, mx, grads = _attend(xla_attention, q, k, v, segs, cot)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    assert float(mx) == float(want_max)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"d/d{name}")
    ref_out, ref_max = _numpy_attention(q, k, v, segs, Hd ** -0.5)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(mx), ref_max, rtol=1e-5)


def test_causal_blocks_form_fewer_scores():
    """Four blocks form (4 + 1) / (2 x 4) = 5/8 of the L x L scores: the compiled forward's FLOPs, which the
    two attention einsums dominate at L = 256 (4 L^2 Hd per head against O(L^2) softmax work), fall to about 5/8."""
    B, L, H, Hd = 1, 256, 4, 64
    q, k, v, _ = _inputs(B, L, H, H, Hd)
    segs = jnp.ones((B, L), jnp.int32)

    def flops(max_blocks):
        f = jax.jit(lambda q, k, v: xla_attention(q, k, v, segs, segs, scale=0.125, max_blocks=max_blocks)[0])
        return f.lower(q, k, v).compile().cost_analysis()["flops"]

    ratio = flops(4) / flops(1)
    assert 0.60 < ratio < 0.66, ratio
