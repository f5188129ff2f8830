"""RoPE scaling options (jaxpt.model.rope) against frequencies worked out by hand, and their invariants.

Every case uses head_dim 8 and theta 10,000, so the unscaled inverse frequencies are exactly
f = 10000 ** (-2i/8) = [1, 0.1, 0.01, 0.001] rad/token, wavelengths 2 pi / f = [6.28, 62.8, 628, 6283] tokens.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpt.util.errors import ConfigError
from jaxpt.model import Decoder, ModelConfig
from jaxpt.model.compat import compare_params
from jaxpt.model.rope import apply_rope, rope_frequencies, yarn_correction_range


def _cfg(**kw) -> ModelConfig:
    kw.setdefault("rope_theta", 10_000.0)
    return ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8,
                       mlp_dim=64, max_seq_len=64, **kw)


def test_no_scaling_is_roformer_frequencies():
    f, m = rope_frequencies(_cfg())
    np.testing.assert_allclose(f, [1.0, 0.1, 0.01, 0.001], rtol=1e-6)
    assert m == 1.0


def test_theta_change_alone():
    # theta 1e6, head_dim 8: 1e6 ** (-i/4) = [1, 10**-1.5, 1e-3, 10**-4.5]
    f, _ = rope_frequencies(_cfg(rope_theta=1e6))
    np.testing.assert_allclose(f, [1.0, 0.0316227766, 1e-3, 3.16227766e-5], rtol=1e-6)


def test_linear_position_interpolation_divides_every_frequency():
    f, m = rope_frequencies(_cfg(rope_scaling="linear", rope_scaling_factor=4.0))
    np.testing.assert_allclose(f, [0.25, 0.025, 0.0025, 0.00025], rtol=1e-6)
    assert m == 1.0


def test_llama3_frequency_scaling_by_hand():
    # L0 = 64, s = 8, low = 1, high = 4: keep wavelengths < 64/4 = 16, divide those > 64/1 = 64 by 8.
    # i=0: w = 6.28 < 16 -> 1.0.   i=2, 3: w = 628, 6283 > 64 -> 0.01/8, 0.001/8.
    # i=1: w = 62.83 in [16, 64]: a = (64/62.83 - 1)/(4 - 1) = (1.0185916 - 1)/3 = 0.0061972;
    #      f = (1 - a) * 0.1/8 + a * 0.1 = 0.0125 + 0.0875 a = 0.01304226.
    f, m = rope_frequencies(_cfg(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=64,
                                 rope_low_freq_factor=1.0, rope_high_freq_factor=4.0))
    np.testing.assert_allclose(f, [1.0, 0.01304226, 0.00125, 0.000125], rtol=1e-6)
    assert m == 1.0


def test_yarn_ntk_by_parts_and_temperature_by_hand():
    # L0 = 64, s = 4, beta_fast 32, beta_slow 1: c(r) = 8 ln(64 / (2 pi r)) / (2 ln 1e4);
    # c(32) = 8 ln(0.31831)/18.4207 = -0.497 -> floor -1 -> low 0;  c(1) = 8 ln(10.1859)/18.4207 = 1.008 -> high 2.
    # ramp g = clip(i / 2, 0, 1) = [0, .5, 1, 1];  f' = f/4 g + f (1 - g) = [1, 0.0625, 0.0025, 0.00025].
    cfg = _cfg(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=64)
    assert yarn_correction_range(8, 1e4, 64, 32.0, 1.0) == (0, 2)
    f, m = rope_frequencies(cfg)
    np.testing.assert_allclose(f, [1.0, 0.0625, 0.0025, 0.00025], rtol=1e-6)
    assert m == pytest.approx(0.1 * math.log(4.0) + 1.0) == pytest.approx(1.1386294)
    _, m_set = rope_frequencies(dataclasses.replace(cfg, rope_attention_factor=1.5))
    assert m_set == 1.5


def test_yarn_temperature_scales_every_logit_by_m_squared():
    q = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    k = jax.random.normal(jax.random.key(1), (1, 5, 2, 8))
    pos = jnp.arange(5)[None]
    f = np.array([1.0, 0.0625, 0.0025, 0.00025], np.float32)
    plain = jnp.einsum("blhd,bmhd->bhlm", apply_rope(q, pos, f), apply_rope(k, pos, f))
    warm = jnp.einsum("blhd,bmhd->bhlm", apply_rope(q, pos, f, 1.25), apply_rope(k, pos, f, 1.25))
    np.testing.assert_allclose(warm, 1.25 ** 2 * plain, rtol=1e-5, atol=1e-6)


def test_rotation_uses_the_given_frequencies():
    # one pair (x1, x2) = (1, 0) at position 3 with f = 0.25 rotates to (cos 0.75, sin 0.75)
    x = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    out = apply_rope(x, jnp.array([[3]]), np.array([0.25], np.float32)).reshape(2)
    np.testing.assert_allclose(out, [math.cos(0.75), math.sin(0.75)], rtol=1e-6)


@pytest.mark.parametrize("bad, field", [
    (dict(rope_scaling="yarn", rope_scaling_factor=4.0), "rope_original_max_len"),
    (dict(rope_scaling="linear", rope_scaling_factor=0.5), "rope_scaling_factor"),
    (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_len=64, rope_high_freq_factor=1.0),
     "rope_high_freq_factor"),
    (dict(rope_scaling="yarn", rope_scaling_factor=2.0, rope_original_max_len=64, rope_beta_fast=0.5),
     "rope_beta_fast"),
    (dict(rope_scaling="ntk"), "rope_scaling"),
])
def test_bad_scaling_settings_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=f"ModelConfig.{field} = "):
        _cfg(**bad)


@pytest.mark.integration
def test_scaling_changes_no_param_and_does_change_the_model():
    base = _cfg()
    yarn = _cfg(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_len=16, rope_theta=5e5)
    assert compare_params(base, yarn) is None  # a checkpoint continues under the new RoPE
    tokens = jax.random.randint(jax.random.key(2), (1, 16), 0, 64)
    seg, pos = jnp.ones_like(tokens), jnp.arange(16)[None]
    logits = lambda cfg: jax.jit(lambda t: Decoder(cfg, rngs=nnx.Rngs(0))(t, seg, pos))(tokens)  # noqa: E731
    a, b = logits(dataclasses.replace(base, init_std=0.5)), logits(dataclasses.replace(yarn, init_std=0.5))
    # same params (same seed, same shapes); the rotation differs, so the logits after position 0 do
    assert float(jnp.max(jnp.abs(a[:, 1:] - b[:, 1:]))) > 1e-2 * float(jnp.max(jnp.abs(a)))
