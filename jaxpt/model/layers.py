"""Building blocks of the decoder: RMSNorm, RoPE, grouped-query attention with segment masking, SwiGLU.

Array names carry shape suffixes (NanoDO style): B batch, L length (queries), M length (keys), D d_model,
H query heads, K kv heads, G = H // K query heads per kv head, Hd head_dim, F mlp_dim, V vocab.
Every parameter is an ``nnx.Param`` whose ``logical_axes`` metadata names its dimensions; see
:mod:`jaxpt.mesh` for how those map to mesh axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpt.mesh import constrain
from jaxpt.model.config import ModelConfig


def _param(rngs: nnx.Rngs, shape, logical_axes, std: float, dtype) -> nnx.Param:
    """A truncated-normal param (±2 std) with logical axis names attached as metadata."""
    init = jax.nn.initializers.truncated_normal(stddev=std)
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=tuple(logical_axes))


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * scale``.

    Computed in float32 whatever the input dtype; returns the input dtype. ``scale``: [D], logical ('norm',).
    """

    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=("norm",))

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x32 = x_BxLxD.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * inv * self.scale[...].astype(jnp.float32)).astype(x_BxLxD.dtype)


def rope(x_BxLxNxHd: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, "RoFormer"), rotate-half layout as in GPT-NeoX/Llama.

    Args:
      x_BxLxNxHd: queries or keys, any float dtype; Hd must be even.
      positions_BxL: int32 position of each token *within its document* (restarts at 0 per segment).
      theta: base frequency.
    Returns: same shape and dtype as ``x``; angles computed in float32.
    """
    hd = x_BxLxNxHd.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))            # [Hd/2]
    angles_BxLxHd2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(angles_BxLxHd2)[:, :, None, :]
    sin = jnp.sin(angles_BxLxHd2)[:, :, None, :]
    x1, x2 = jnp.split(x_BxLxNxHd.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxHd.dtype)


def attention_mask(segment_ids_BxL: jax.Array) -> jax.Array:
    """Causal mask that never crosses documents: ``[B, 1, 1, L, M]`` bool (True = may attend).

    Query i may see key j iff j <= i and both belong to the same segment. Padding (segment 0) sees only
    padding, so every row keeps at least its own position and softmax never divides by zero.
    """
    L = segment_ids_BxL.shape[1]
    causal_LxM = jnp.tril(jnp.ones((L, L), dtype=jnp.bool_))
    same_BxLxM = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return (same_BxLxM & causal_LxM)[:, None, None, :, :]


class Attention(nnx.Module):
    """Grouped-query self-attention (Ainslie et al. 2023) with RoPE and segment masking.

    Params: ``wq`` [D, H, Hd], ``wk``/``wv`` [D, K, Hd], ``wo`` [H, Hd, D].
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H, K, Hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = cfg.jnp_param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # GPT-2 style residual scaling
        self.wq = _param(rngs, (D, H, Hd), ("embed", "heads", "head_dim"), cfg.init_std, pd)
        self.wk = _param(rngs, (D, K, Hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.wv = _param(rngs, (D, K, Hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.wo = _param(rngs, (H, Hd, D), ("heads", "head_dim", "embed"), out_std, pd)

    def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
        """Returns ``(out [B, L, D], max_logit)``: the largest attention logit (after 1/sqrt(Hd) scaling)
        among allowed query-key pairs, a float32 scalar for monitoring (Dehghani et al. 2023 on logit growth)."""
        cfg = self.cfg
        cd = cfg.jnp_compute_dtype
        B, L, _ = x_BxLxD.shape
        H, K, Hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = H // K
        q_BxLxHxHd = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wq[...].astype(cd))
        k_BxMxKxHd = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wk[...].astype(cd))
        v_BxMxKxHd = jnp.einsum("bld,dhk->blhk", x_BxLxD, self.wv[...].astype(cd))
        # Named for the ``save_qkv_proj`` remat policy (jax.checkpoint_policies.save_only_these_names).
        q_BxLxHxHd = checkpoint_name(constrain(q_BxLxHxHd, ("batch", "length", "heads", "head_dim")), "qkv_proj")
        k_BxMxKxHd = checkpoint_name(constrain(k_BxMxKxHd, ("batch", "length", "kv_heads", "head_dim")), "qkv_proj")
        v_BxMxKxHd = checkpoint_name(constrain(v_BxMxKxHd, ("batch", "length", "kv_heads", "head_dim")), "qkv_proj")
        q_BxLxHxHd = rope(q_BxLxHxHd, positions_BxL, cfg.rope_theta)
        k_BxMxKxHd = rope(k_BxMxKxHd, positions_BxL, cfg.rope_theta)

        q_BxLxHxHd = q_BxLxHxHd * jnp.asarray(Hd ** -0.5, cd)
        mask = attention_mask(segment_ids_BxL)
        if G == 1:  # multi-head attention: plain 4-D einsums (cheaper on CPU than a size-1 group axis)
            logits_BxHxLxM = jnp.einsum("blhd,bmhd->bhlm", q_BxLxHxHd, k_BxMxKxHd,
                                        preferred_element_type=jnp.float32)
            logits_BxHxLxM = jnp.where(mask[:, 0], logits_BxHxLxM, jnp.finfo(jnp.float32).min)
            max_logit = jnp.max(logits_BxHxLxM)
            probs = jax.nn.softmax(logits_BxHxLxM, axis=-1).astype(cd)
            out_BxLxHxHd = jnp.einsum("bhlm,bmhd->blhd", probs, v_BxMxKxHd)
        else:  # grouped-query: each kv head serves G query heads, without materializing repeated k/v
            q_BxLxKxGxHd = q_BxLxHxHd.reshape(B, L, K, G, Hd)
            logits_BxKxGxLxM = jnp.einsum("blkgd,bmkd->bkglm", q_BxLxKxGxHd, k_BxMxKxHd,
                                          preferred_element_type=jnp.float32)
            logits_BxKxGxLxM = jnp.where(mask, logits_BxKxGxLxM, jnp.finfo(jnp.float32).min)
            max_logit = jnp.max(logits_BxKxGxLxM)
            probs = jax.nn.softmax(logits_BxKxGxLxM, axis=-1).astype(cd)
            out_BxLxHxHd = jnp.einsum("bkglm,bmkd->blkgd", probs, v_BxMxKxHd).reshape(B, L, H, Hd)
        out_BxLxHxHd = constrain(out_BxLxHxHd, ("batch", "length", "heads", "head_dim"))
        return jnp.einsum("blhk,hkd->bld", out_BxLxHxHd, self.wo[...].astype(cd)), max_logit


class SwiGLU(nnx.Module):
    """Gated MLP ``down(silu(x @ gate) * (x @ up))`` (Shazeer 2020, "GLU Variants Improve Transformer").

    Params: ``w_gate``, ``w_up`` [D, F], ``w_down`` [F, D].
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, F = cfg.d_model, cfg.mlp_dim
        pd = cfg.jnp_param_dtype
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.w_gate = _param(rngs, (D, F), ("embed", "mlp"), cfg.init_std, pd)
        self.w_up = _param(rngs, (D, F), ("embed", "mlp"), cfg.init_std, pd)
        self.w_down = _param(rngs, (F, D), ("mlp", "embed"), out_std, pd)

    def __call__(self, x_BxLxD):
        cd = self.cfg.jnp_compute_dtype
        gate_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, self.w_gate[...].astype(cd))
        up_BxLxF = jnp.einsum("bld,df->blf", x_BxLxD, self.w_up[...].astype(cd))
        h_BxLxF = constrain(jax.nn.silu(gate_BxLxF) * up_BxLxF, ("batch", "length", "mlp"))
        return jnp.einsum("blf,fd->bld", h_BxLxF, self.w_down[...].astype(cd))


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = cfg.jnp_param_dtype
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
        """Returns ``(x [B, L, D], max attention logit of this block)``."""
        attn_out, max_logit = self.attn(self.attn_norm(x_BxLxD), segment_ids_BxL, positions_BxL)
        x_BxLxD = constrain(x_BxLxD + attn_out, ("batch", "length", "embed"))
        x_BxLxD = x_BxLxD + self.mlp(self.mlp_norm(x_BxLxD))
        return constrain(x_BxLxD, ("batch", "length", "embed")), max_logit
