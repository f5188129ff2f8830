"""Self-attention: the ``Attention`` layer (projections, RoPE) and the attention math behind a seam.

:func:`dot_product_attention` computes ``softmax(scale q k^T + mask) v`` with causal, document-local masking
by the implementation ``ModelConfig.attention_impl`` names in :data:`jaxpt.model.tables.ATTENTION` (``xla``:
:mod:`jaxpt.model.attention_xla`, ``blockwise``, ``splash``, ``cudnn``, ``auto``: ``attention_<name>``). An
implementation is a function

    fn(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale)
        -> (out_BxLxHxHd, aux)

* ``q`` has RoPE applied and is **not** scaled: the implementation applies ``scale`` (as
  ``jax.nn.dot_product_attention`` and fused kernels do, which take the scale as an argument; a kernel
  without one pre-scales q itself). ``k``/``v`` carry K kv heads, K dividing H (grouped-query attention,
  Ainslie et al. 2023); an implementation must not assume K == H.
* Masking: query i may attend key j iff ``j <= i`` (indices into the same row: M == L today) and
  ``q_segment_ids[i] == kv_segment_ids[j]``. Segment ids are per key separately so that a context-parallel
  caller (keys from other shards) can pass the keys' own ids; when the ``length`` axis is sharded over
  the ``sequence`` mesh axis, :func:`dot_product_attention` hands the call to
  :func:`jaxpt.model.context_parallel.context_parallel_attention`, which runs the implementation per device
  with the row indices of its queries and keys.
* All arrays are in the compute dtype; ``out`` is too. Softmax should be accumulated in float32.
* ``aux`` holds exactly the auxiliary outputs its table entry declares (float32 scalars), e.g.
  ``max_attention_logit`` where the logits exist to be inspected; an implementation that never
  materializes them (a fused kernel) declares none and the monitor is absent, not faked.

Array names carry shape suffixes: B batch, L query length, M key length, H query heads, K kv heads,
G = H // K, Hd head_dim, D d_model.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpt.mesh import constrain
from jaxpt.model import context_parallel, parametrization, tables
from jaxpt.model.config import ModelConfig
from jaxpt.model.layers import RMSNorm, _param
from jaxpt.model.rope import apply_rope, rope_frequencies


def dot_product_attention(q_BxLxHxHd: jax.Array, k_BxMxKxHd: jax.Array, v_BxMxKxHd: jax.Array,
                          segment_ids_BxL: jax.Array, *, impl: str = "xla",
                          kv_segment_ids_BxM: jax.Array | None = None,
                          scale: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Causal, document-masked grouped-query attention by the implementation ``impl``.

    Args:
      q_BxLxHxHd: queries, RoPE applied, not scaled; compute dtype.
      k_BxMxKxHd, v_BxMxKxHd: keys (RoPE applied) and values; K divides H.
      segment_ids_BxL: int32 document id of each query (0 = padding).
      impl: an ``attention_impl`` name (:func:`jaxpt.model.tables.attention`).
      kv_segment_ids_BxM: int32 document id of each key; default ``segment_ids_BxL``.
      scale: logit scale; default ``1 / sqrt(Hd)`` (Vaswani et al. 2017).
    Returns: ``(out [B, L, H, Hd] in the compute dtype, aux)``, aux as the implementation declares.
    Raises:
      ConfigError: no implementation is named ``impl``.
    """
    entry = tables.attention(impl)
    if context_parallel.current_shards() > 1:
        if kv_segment_ids_BxM is not None and kv_segment_ids_BxM is not segment_ids_BxL:
            raise ValueError("context parallelism runs self-attention only (kv_segment_ids_BxM must be the queries')")
        if scale is None:
            scale = q_BxLxHxHd.shape[-1] ** -0.5
        return context_parallel.context_parallel_attention(impl, q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd,
                                                           segment_ids_BxL, scale=scale)
    if kv_segment_ids_BxM is None:
        kv_segment_ids_BxM = segment_ids_BxL
    if scale is None:
        scale = q_BxLxHxHd.shape[-1] ** -0.5
    return entry.fn(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, segment_ids_BxL, kv_segment_ids_BxM, scale=scale)


class Attention(nnx.Module):
    """Grouped-query self-attention (Ainslie et al. 2023) with RoPE and segment masking.

    Params: ``wq`` [D, H, Hd], ``wk``/``wv`` [D, K, Hd], ``wo`` [H, Hd, D]; with ``cfg.attention_bias`` also
    ``q_bias`` [H, Hd] and ``k_bias``/``v_bias`` [K, Hd] (Qwen2's q/k/v biases; zeros at init); with
    ``cfg.qk_norm`` also ``q_norm``/``k_norm`` (:class:`RMSNorm` with a ``[Hd]`` scale: Qwen3's per-head norm).
    The attention math is :func:`dot_product_attention` with ``cfg.attention_impl``: every implementation gets
    q and k after the bias, the norm and RoPE, so each supports both options.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H, K, Hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = cfg.jnp_param_dtype
        # GPT-2 style residual scaling; under µP both stds shrink with width (jaxpt.model.parametrization)
        std = parametrization.hidden_init_std(cfg, cfg.init_std)
        out_std = parametrization.hidden_init_std(cfg, cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.wq = _param(rngs, (D, H, Hd), ("embed", "heads", "head_dim"), std, pd)
        self.wk = _param(rngs, (D, K, Hd), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wv = _param(rngs, (D, K, Hd), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wo = _param(rngs, (H, Hd, D), ("heads", "head_dim", "embed"), out_std, pd)
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((H, Hd), pd), logical_axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((K, Hd), pd), logical_axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((K, Hd), pd), logical_axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Hd, cfg.norm_eps, pd)
            self.k_norm = RMSNorm(Hd, cfg.norm_eps, pd)

    def project_qkv(self, x_BxLxD):
        """``(q [B, L, H, Hd], k [B, L, K, Hd], v [B, L, K, Hd])``, compute dtype: the projections (plus
        ``cfg.attention_bias``'s biases), before the q/k norm (:meth:`normalize_qk`) and RoPE.

        With ``cfg.fused_projections`` one matmul against the weights stacked along a new axis (``[D, 3, H, Hd]``;
        ``[D, 2, K, Hd]`` for k and v, q apart, when ``K < H``): stacking keeps every weight's ``heads`` axis
        where its sharding is, so no weight is resharded. The training step and the KV-cache decoder both
        project through here.
        """
        cd = self.cfg.jnp_compute_dtype
        wq, wk, wv = (w[...].astype(cd) for w in (self.wq, self.wk, self.wv))
        if not self.cfg.fused_projections:
            qkv = tuple(jnp.einsum("bld,dhk->blhk", x_BxLxD, w) for w in (wq, wk, wv))
        else:
            stacked = (wq, wk, wv) if wq.shape == wk.shape else (wk, wv)
            y_BxLxSxHxHd = jnp.einsum("bld,dshk->blshk", x_BxLxD, jnp.stack(stacked, axis=1))
            parts = tuple(y_BxLxSxHxHd[:, :, i] for i in range(len(stacked)))
            qkv = parts if len(parts) == 3 else (jnp.einsum("bld,dhk->blhk", x_BxLxD, wq), *parts)
        if self.cfg.attention_bias:
            qkv = tuple(y + b[...].astype(cd) for y, b in zip(qkv, (self.q_bias, self.k_bias, self.v_bias)))
        return qkv

    def normalize_qk(self, q_BxLxHxHd, k_BxMxKxHd):
        """``(q, k)`` each normalized per head over ``head_dim`` by ``q_norm`` / ``k_norm`` when ``cfg.qk_norm``
        (RMSNorm in float32, returned in the input dtype: Qwen3's ``Qwen3RMSNorm``), else unchanged. Shapes as
        given. The training step and the KV-cache decoder both call it between :meth:`project_qkv` and RoPE."""
        if not self.cfg.qk_norm:
            return q_BxLxHxHd, k_BxMxKxHd
        return self.q_norm(q_BxLxHxHd), self.k_norm(k_BxMxKxHd)

    def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
        """Returns ``(out [B, L, D] in the compute dtype, aux)``, aux as the implementation declares."""
        cfg = self.cfg
        cd = cfg.jnp_compute_dtype
        q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd = self.project_qkv(x_BxLxD)
        # Named for the ``save_qkv_proj`` remat policy (jax.checkpoint_policies.save_only_these_names): the
        # projections, so that a q/k norm's backward pass finds its input saved.
        q_BxLxHxHd = checkpoint_name(constrain(q_BxLxHxHd, ("batch", "length", "heads", "head_dim")), "qkv_proj")
        k_BxMxKxHd = checkpoint_name(constrain(k_BxMxKxHd, ("batch", "length", "kv_heads", "head_dim")), "qkv_proj")
        v_BxMxKxHd = checkpoint_name(constrain(v_BxMxKxHd, ("batch", "length", "kv_heads", "head_dim")), "qkv_proj")
        q_BxLxHxHd, k_BxMxKxHd = self.normalize_qk(q_BxLxHxHd, k_BxMxKxHd)
        inv_freq, attention_factor = rope_frequencies(cfg)  # host constants: the one RoPE of train/eval/decode
        q_BxLxHxHd = apply_rope(q_BxLxHxHd, positions_BxL, inv_freq, attention_factor)
        k_BxMxKxHd = apply_rope(k_BxMxKxHd, positions_BxL, inv_freq, attention_factor)
        out_BxLxHxHd, aux = dot_product_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, segment_ids_BxL,
                                                  impl=cfg.attention_impl)
        out_BxLxHxHd = constrain(out_BxLxHxHd, ("batch", "length", "heads", "head_dim"))
        return jnp.einsum("blhk,hkd->bld", out_BxLxHxHd, self.wo[...].astype(cd)), aux
