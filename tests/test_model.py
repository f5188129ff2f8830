"""Model properties: packing never leaks across documents, RoPE is position-relative and restarts."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpt.model import Decoder, ModelConfig, count_params
from jaxpt.model.attention_xla import attention_mask
from jaxpt.model.rope import rope

CFG = ModelConfig(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                  max_seq_len=32)


def logits_of(model, tokens, segs, pos):
    return np.asarray(model(jnp.asarray(tokens)[None], jnp.asarray(segs)[None], jnp.asarray(pos)[None])[0])


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_document_logits_same_packed_or_alone(scan):
    cfg = dataclasses.replace(CFG, scan_layers=scan)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 97, n) for n in (7, 11, 6))
    # Alone: document b in a row of its own (padded), positions 0..10.
    alone = logits_of(model, np.r_[b, np.zeros(5, int)], np.r_[np.ones(11, int), np.zeros(5, int)],
                      np.r_[np.arange(11), np.zeros(5, int)])[:11]
    # Packed: a, b, c in one row, segment ids 1, 2, 3, positions restarting at 0 per document.
    tokens = np.r_[a, b, c]
    segs = np.r_[np.full(7, 1), np.full(11, 2), np.full(6, 3)]
    pos = np.r_[np.arange(7), np.arange(11), np.arange(6)]
    packed = logits_of(model, tokens, segs, pos)[7:18]
    np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)
    # Without segment masking the logits would differ: check the test can fail.
    leaky = logits_of(model, tokens, np.ones(24, int), pos)[7:18]
    assert np.abs(leaky - alone).max() > 1e-3


@pytest.mark.integration
def test_positions_matter_only_relative_and_restart_per_document():
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    toks = np.random.default_rng(1).integers(0, 97, 10)
    base = logits_of(model, toks, np.ones(10, int), np.arange(10))
    shifted = logits_of(model, toks, np.ones(10, int), np.arange(10) + 5)  # RoPE: only offsets matter
    np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-4)
    # Positions that do not restart (e.g. 0,1,2,5,6,...) change the logits: positions are used.
    broken = logits_of(model, toks, np.ones(10, int), np.r_[np.arange(3), np.arange(5, 12)])
    assert np.abs(broken - base).max() > 1e-4


def test_rope_hand_computed():
    # head_dim 2: (x1, x2) rotated by angle = pos * theta^0 = pos.
    x = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    out = rope(x, jnp.array([[1]]), theta=10000.0).reshape(2)
    np.testing.assert_allclose(out, [math.cos(1.0), math.sin(1.0)], rtol=1e-6)
    # head_dim 4: second pair rotates at pos * theta^(-2/4) = 1/100 for theta 1e4.
    x = jnp.array([0.0, 1.0, 0.0, 0.0]).reshape(1, 1, 1, 4)
    out = rope(x, jnp.array([[2]]), theta=10000.0).reshape(4)
    np.testing.assert_allclose(out, [0.0, math.cos(0.02), 0.0, math.sin(0.02)], atol=1e-7)


def test_attention_mask_by_hand():
    m = np.asarray(attention_mask(jnp.array([[1, 1, 2, 0]])))[0, 0, 0]
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(m, expected)


@pytest.mark.integration
def test_count_params_matches_arrays():
    for tie in (False, True):
        cfg = dataclasses.replace(CFG, tie_embeddings=tie)
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert n == count_params(cfg)["total"]


@pytest.mark.slow
def test_initial_loss_is_about_log_vocab():
    from jaxpt.training.step import loss_fn
    cfg = dataclasses.replace(CFG, vocab_size=1000)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    g, p = nnx.split(model, nnx.Param)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 32)))
    batch = {"tokens": toks, "segment_ids": jnp.ones_like(toks), "positions": jnp.broadcast_to(jnp.arange(32), (2, 32))}
    _, aux = loss_fn(p, g, batch, 0.0)
    assert abs(float(aux["loss"]) - math.log(1000)) < 0.3
    assert float(aux["num_target_tokens"]) == 2 * 31


@pytest.mark.integration
def test_bf16_compute_close_to_fp32():
    m32 = Decoder(CFG, rngs=nnx.Rngs(0))
    m16 = Decoder(dataclasses.replace(CFG, compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    toks = np.arange(16) % 97
    a = logits_of(m32, toks, np.ones(16, int), np.arange(16))
    b = logits_of(m16, toks, np.ones(16, int), np.arange(16))
    assert b.dtype == np.float32  # logits (and so the loss) are fp32 whatever the compute dtype
    np.testing.assert_allclose(a, b, atol=0.05)
