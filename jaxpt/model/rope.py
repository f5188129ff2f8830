"""Rotary position embedding (RoPE) and its context-extension scalings: the one place RoPE is computed.

Every path that runs the model (the train and eval steps, held-out scoring, :mod:`jaxpt.infer.decode` generation,
:func:`jaxpt.restore`) goes through :class:`jaxpt.model.attention.Attention`, which calls :func:`apply_rope` with
:func:`rope_frequencies` of the model's :class:`~jaxpt.model.config.ModelConfig`; so training, evaluation and
generation rotate by the same frequencies. No scaling adds or changes a parameter: a checkpoint restores under
any of them (:mod:`jaxpt.model.compat` compares params only), which is what a long-context extension stage needs.

Frequencies (``d`` = head_dim, ``b`` = ``rope_theta``, ``i = 0 .. d/2 - 1``): the unscaled inverse frequency is
``f_i = b ** (-2i / d)`` radians per token (Su et al. 2021, "RoFormer", eq. 15), wavelength ``2 pi / f_i`` tokens.
``ModelConfig.rope_scaling`` picks how the ``f_i`` change for a context ``s`` = ``rope_scaling_factor`` times
longer than the original ``L0`` = ``rope_original_max_len``:

* ``none``: ``f_i`` (changing the base ``rope_theta`` alone is the "ABF" recipe: Xiong et al. 2023, "Effective
  Long-Context Scaling of Foundation Models"; Llama 3 pretrains with b = 500,000).
* ``linear``: ``f_i / s`` (position interpolation, Chen et al. 2023, "Extending Context Window of Large Language
  Models via Positional Interpolation").
* ``llama3``: Llama 3.1's frequency scaling (Meta's reference ``apply_scaling`` in llama-models
  ``models/llama3/reference_impl/model.py``; Hugging Face ``_compute_llama3_parameters``). With
  ``lo = rope_low_freq_factor``, ``hi = rope_high_freq_factor`` and wavelength ``w_i = 2 pi / f_i``: ``f_i`` when
  ``w_i < L0 / hi`` (high frequencies kept); ``f_i / s`` when ``w_i > L0 / lo`` (low frequencies interpolated);
  else ``(1 - a) f_i / s + a f_i`` with ``a = (L0 / w_i - lo) / (hi - lo)``. Llama 3.1: s = 8, lo = 1, hi = 4,
  L0 = 8192, b = 500,000.
* ``yarn``: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models", sec.
  3.2 "NTK-by-parts" and 3.4; as Hugging Face ``_compute_yarn_parameters``). The dimension at which a frequency
  makes ``r`` rotations over ``L0`` is ``c(r) = d ln(L0 / (2 pi r)) / (2 ln b)``; ``low = max(floor(c(beta_fast)),
  0)``, ``high = min(ceil(c(beta_slow)), d - 1)``; ramp ``g_i = clip((i - low) / (high - low), 0, 1)`` (``high``
  bumped by 0.001 when equal); then ``f'_i = (f_i / s) g_i + f_i (1 - g_i)``: dimensions that rotate more than
  ``beta_fast`` times over ``L0`` keep ``f_i``, fewer than ``beta_slow`` times are interpolated, a linear ramp
  between. Attention temperature: the paper scales the logits by ``1/t`` with ``sqrt(1/t) = 0.1 ln(s) + 1``; here,
  as in the paper's reference code and Hugging Face, both the rotated query and the rotated key are multiplied by
  ``m = rope_attention_factor`` (default ``0.1 ln(s) + 1`` for ``s > 1``, else 1), so every logit ``q.k`` is
  multiplied by ``m**2 = 1/t``. Only ``yarn`` has a temperature; the others use ``m = 1``.

``rope_scaling_factor``, ``rope_original_max_len`` and the per-method factors are ignored by methods that do not
use them (``none`` uses none of them).
"""

from __future__ import annotations

import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

RopeScaling = Literal["none", "linear", "llama3", "yarn"]
ROPE_SCALINGS: tuple[str, ...] = typing.get_args(RopeScaling)


def base_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """``f_i = theta ** (-2i / head_dim)``, float64 [head_dim / 2], radians per token (Su et al. 2021)."""
    return 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def llama3_inv_freq(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_len: int) -> np.ndarray:
    """Llama 3.1's scaled inverse frequencies (module docstring), float64, same shape as ``inv_freq``."""
    low_wavelen = original_max_len / low_freq_factor
    high_wavelen = original_max_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(wavelen < high_wavelen, inv_freq, np.where(wavelen > low_wavelen, inv_freq / factor, medium))


def yarn_correction_range(head_dim: int, theta: float, original_max_len: int, beta_fast: float,
                          beta_slow: float) -> tuple[int, int]:
    """``(low, high)`` dimension indices of YaRN's ramp (Peng et al. 2023, sec. 3.2; module docstring)."""
    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    return max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), head_dim - 1)


def yarn_inv_freq(inv_freq: np.ndarray, theta: float, factor: float, original_max_len: int, beta_fast: float,
                  beta_slow: float) -> np.ndarray:
    """YaRN's NTK-by-parts inverse frequencies (module docstring), float64, same shape as ``inv_freq``."""
    head_dim = 2 * len(inv_freq)
    low, high = yarn_correction_range(head_dim, theta, original_max_len, beta_fast, beta_slow)
    if low == high:
        high += 0.001  # as the reference: avoid a division by zero
    ramp = np.clip((np.arange(len(inv_freq), dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(factor: float, attention_factor: float = 0.0) -> float:
    """The multiplier ``m`` of rotated queries and keys (logits scale by ``m**2``): ``attention_factor`` if
    positive, else ``0.1 ln(factor) + 1`` for ``factor > 1``, else 1 (Peng et al. 2023, eq. 22)."""
    if attention_factor > 0:
        return float(attention_factor)
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_frequencies(cfg) -> tuple[np.ndarray, float]:
    """``(inv_freq float32 [head_dim / 2] radians per token, attention factor m)`` for a ModelConfig ``cfg``.

    Computed on the host in float64 and rounded once to float32, so every program that uses them (train, eval,
    decode) sees bit-identical constants.
    """
    f = base_inv_freq(cfg.head_dim, cfg.rope_theta)
    m = 1.0
    if cfg.rope_scaling == "linear":
        f = f / cfg.rope_scaling_factor
    elif cfg.rope_scaling == "llama3":
        f = llama3_inv_freq(f, cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                            cfg.rope_original_max_len)
    elif cfg.rope_scaling == "yarn":
        f = yarn_inv_freq(f, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_original_max_len,
                          cfg.rope_beta_fast, cfg.rope_beta_slow)
        m = yarn_attention_factor(cfg.rope_scaling_factor, cfg.rope_attention_factor)
    return f.astype(np.float32), m


def apply_rope(x_BxLxNxHd: jax.Array, positions_BxL: jax.Array, inv_freq: np.ndarray | jax.Array,
               attention_factor: float = 1.0) -> jax.Array:
    """Rotate ``x`` by ``positions * inv_freq`` (rotate-half layout as in GPT-NeoX/Llama), times ``attention_factor``.

    Args:
      x_BxLxNxHd: queries or keys, any float dtype; Hd even.
      positions_BxL: int32 position of each token *within its document* (restarts at 0 per segment).
      inv_freq: float32 [Hd / 2], radians per token (:func:`rope_frequencies`).
      attention_factor: multiplies the rotated vector (YaRN's ``m``; 1.0 otherwise).
    Returns: same shape and dtype as ``x``; angles computed in float32.
    """
    angles_BxLxHd2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(angles_BxLxHd2)[:, :, None, :]
    sin = jnp.sin(angles_BxLxHd2)[:, :, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    x1, x2 = jnp.split(x_BxLxNxHd.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxHd.dtype)


def rope(x_BxLxNxHd: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
    """Unscaled RoPE with base ``theta`` (:func:`apply_rope` of :func:`base_inv_freq`); same shapes as it."""
    return apply_rope(x_BxLxNxHd, positions_BxL, base_inv_freq(x_BxLxNxHd.shape[-1], theta).astype(np.float32))
