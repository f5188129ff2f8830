"""Primitives shared by the decoder's parts: initialized params and RMSNorm (RoPE is :mod:`jaxpt.model.rope`).

Attention is in :mod:`jaxpt.model.attention`, MLPs in :mod:`jaxpt.model.mlp`, the block and the decoder in
:mod:`jaxpt.model.decoder`.

Array names carry shape suffixes (NanoDO style): B batch, L length (queries), M length (keys), D d_model,
H query heads, K kv heads, G = H // K query heads per kv head, Hd head_dim, F mlp_dim, V vocab.
Every parameter is an ``nnx.Param`` whose ``logical_axes`` metadata names its dimensions; see
:mod:`jaxpt.mesh` for how those map to mesh axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Kept importable from here for code written before RoPE moved to its own module; new code: jaxpt.model.rope.
from jaxpt.model.rope import rope  # noqa: F401


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
