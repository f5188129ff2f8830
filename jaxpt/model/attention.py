"""Self-attention: the ``Attention`` layer (projections, RoPE) and the attention math behind a seam.

:func:`dot_product_attention` computes ``softmax(scale q k^T + mask) v`` with causal, document-local masking
by the implementation ``ModelConfig.attention_impl`` names in :data:`ATTENTION`. An implementation is a
function

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
* ``aux`` holds exactly the auxiliary outputs the registration declares (float32 scalars), e.g.
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
from jaxpt.model.auxiliary import AuxSpec
from jaxpt.model.config import DTYPES, ModelConfig
from jaxpt.model.layers import _param
from jaxpt.model.rope import apply_rope, rope_frequencies
from jaxpt.model.registry import Registry, SavedTensor

#: Attention implementations by ``ModelConfig.attention_impl`` value.
ATTENTION = Registry("attention_impl")
register_attention = ATTENTION.register


def attention_mask(q_segment_ids_BxL: jax.Array, kv_segment_ids_BxM: jax.Array | None = None, *,
                   q_index_L: jax.Array | None = None, kv_index_M: jax.Array | None = None) -> jax.Array:
    """Causal mask that never crosses documents: ``[B, 1, 1, L, M]`` bool (True = may attend).

    Query i may see key j iff j <= i and both belong to the same segment. Padding (segment 0) sees only
    padding, so every row keeps at least its own position and softmax never divides by zero.
    ``kv_segment_ids_BxM`` defaults to the query ids (self-attention). ``q_index_L``/``kv_index_M`` (int32)
    give each query's and key's index in the original row when the arrays hold a permuted part of it
    (context parallelism, :mod:`jaxpt.model.context_parallel`); by default the array index is the row index.
    """
    kv_BxM = q_segment_ids_BxL if kv_segment_ids_BxM is None else kv_segment_ids_BxM
    L, M = q_segment_ids_BxL.shape[1], kv_BxM.shape[1]
    if q_index_L is None:
        causal_LxM = jnp.tril(jnp.ones((L, M), dtype=jnp.bool_))
    else:
        causal_LxM = q_index_L[:, None] >= kv_index_M[None, :]
    same_BxLxM = q_segment_ids_BxL[:, :, None] == kv_BxM[:, None, :]
    return (same_BxLxM & causal_LxM)[:, None, None, :, :]


#: Causal query blocks of ``xla`` attention (see :func:`causal_blocks`): at most this many, each at least
#: :data:`MIN_CAUSAL_BLOCK` queries.
CAUSAL_BLOCKS = 4
MIN_CAUSAL_BLOCK = 64


def causal_blocks(L: int, M: int, q_index_L=None, max_blocks: int = CAUSAL_BLOCKS,
                  min_block: int = MIN_CAUSAL_BLOCK) -> int:
    """How many query blocks ``xla`` attention splits a causal ``[L, M]`` problem into (1 = no split).

    Query block ``i`` (``C = L / n`` queries from ``i C``) can only see keys ``< (i + 1) C``, so it is computed
    against that key prefix alone: of the ``L x M`` scores only ``(n + 1) / (2 n)`` are formed, exponentiated
    and multiplied (62.5% for n = 4), and the result is the same attention (the skipped keys are masked).
    Split only for self-attention on an unpermuted row (``L == M``, no ``q_index_L``), into the largest
    ``n <= max_blocks`` that divides L with blocks of at least ``min_block`` queries. The same causal block
    skipping as FlashAttention-2's (Dao 2023: blocks wholly above the diagonal are skipped), here with static
    key prefixes and no online softmax, since each block still sees its whole visible row at once.

    Args: ``L``/``M`` query/key row lengths (tokens); ``q_index_L`` as :func:`xla_attention` takes it.
    Returns: n (int, >= 1). Raises nothing.

    Measured on this project's 2-core CPU host, forward + backward of one call, fp32, 4 heads x 64: with n = 4
    1.6-1.7x faster than unsplit at [2, 256] (n = 2: 1.3x, n = 8: 1.37x), 1.87x at [1, 1024], 1.80x at [1, 2048].
    The reference model's train step (L = 256), where attention is a small share, gained 1.00-1.03x (README,
    Benchmarks). Not measured on accelerators.
    """
    if q_index_L is not None or L != M:
        return 1
    for n in range(min(max_blocks, L // min_block), 1, -1):
        if L % n == 0:
            return n
    return 1


def _xla_saved_tensors(cfg: ModelConfig, batch: int, seq_len: int) -> list[SavedTensor]:
    """The scores and probabilities (per head) the einsum path materializes, and its output. Split into
    :func:`causal_blocks` query blocks of C queries, block i forms [C, (i + 1) C] scores: (n + 1) / (2 n) of the
    [L, L] (rounded up to whole keys per query), held here as [L, keys] per head."""
    B, L, H, Hd = batch, seq_len, cfg.num_heads, cfg.head_dim
    n = causal_blocks(L, L)
    keys = -(-L * (n + 1) // (2 * n))
    c = jnp.dtype(DTYPES[cfg.compute_dtype]).itemsize
    blhd = ("batch", "length", "heads", None)
    probs_bytes = 4 + (c if c != 4 else 0)   # softmax in fp32, then cast to the compute dtype for AV
    return [SavedTensor("scores", "dot_batch", False, (B, L, H, keys), blhd, 4),
            SavedTensor("probs", "other", True, (B, L, H, keys), blhd, probs_bytes),
            SavedTensor("attn_out", "dot_batch", True, (B, L, H, Hd), blhd, c)]


@register_attention("xla", aux_specs={"max_attention_logit": AuxSpec("max")}, saved_tensors=_xla_saved_tensors)
def xla_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale,
                  q_index_L=None, kv_index_M=None, max_blocks: int = CAUSAL_BLOCKS):
    """Einsums over materialized ``[B, H, L, M]`` float32 logits; memory O(L M) per head.

    Causal self-attention is split into :func:`causal_blocks` query blocks, each against only the keys it can
    see, so about half of the masked upper triangle is never computed (``max_blocks = 1``: one dense block).
    ``q_index_L``/``kv_index_M``: row indices for causality when q and k/v are permuted parts of the row
    (context parallelism; never split); see :func:`attention_mask`.

    Also returns ``max_attention_logit``: the largest scaled logit among allowed query-key pairs (float32
    scalar), for monitoring logit growth (Dehghani et al. 2023, "Scaling Vision Transformers to 22B").
    """
    L, M = q_BxLxHxHd.shape[1], k_BxMxKxHd.shape[1]
    n = causal_blocks(L, M, q_index_L, max_blocks)
    if n == 1:
        return _dense_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM,
                                scale=scale, q_index_L=q_index_L, kv_index_M=kv_index_M)
    C = L // n
    outs, maxes = [], []
    for i in range(n):
        lo, hi = i * C, (i + 1) * C
        out, aux = _dense_attention(q_BxLxHxHd[:, lo:hi], k_BxMxKxHd[:, :hi], v_BxMxKxHd[:, :hi],
                                    q_segment_ids_BxL[:, lo:hi], kv_segment_ids_BxM[:, :hi], scale=scale,
                                    q_index_L=jnp.arange(lo, hi), kv_index_M=jnp.arange(hi))
        outs.append(out)
        maxes.append(aux["max_attention_logit"])
    return jnp.concatenate(outs, axis=1), {"max_attention_logit": jnp.max(jnp.stack(maxes))}


def _dense_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale,
                     q_index_L=None, kv_index_M=None):
    """:func:`xla_attention` as one block: the full masked ``[B, H, L, M]`` logits."""
    cd = q_BxLxHxHd.dtype
    B, L, H, Hd = q_BxLxHxHd.shape
    K = k_BxMxKxHd.shape[2]
    G = H // K
    q_BxLxHxHd = q_BxLxHxHd * jnp.asarray(scale, cd)
    mask = attention_mask(q_segment_ids_BxL, kv_segment_ids_BxM, q_index_L=q_index_L, kv_index_M=kv_index_M)
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
    return out_BxLxHxHd, {"max_attention_logit": max_logit}


def dot_product_attention(q_BxLxHxHd: jax.Array, k_BxMxKxHd: jax.Array, v_BxMxKxHd: jax.Array,
                          segment_ids_BxL: jax.Array, *, impl: str = "xla",
                          kv_segment_ids_BxM: jax.Array | None = None,
                          scale: float | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Causal, document-masked grouped-query attention by the implementation ``impl``.

    Args:
      q_BxLxHxHd: queries, RoPE applied, not scaled; compute dtype.
      k_BxMxKxHd, v_BxMxKxHd: keys (RoPE applied) and values; K divides H.
      segment_ids_BxL: int32 document id of each query (0 = padding).
      impl: a name registered in :data:`ATTENTION`.
      kv_segment_ids_BxM: int32 document id of each key; default ``segment_ids_BxL``.
      scale: logit scale; default ``1 / sqrt(Hd)`` (Vaswani et al. 2017).
    Returns: ``(out [B, L, H, Hd] in the compute dtype, aux)``, aux as the implementation declares.
    Raises:
      ConfigError: ``impl`` is not registered.
    """
    entry = ATTENTION.get(impl)
    from jaxpt.model import context_parallel   # imports this module
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

    Params: ``wq`` [D, H, Hd], ``wk``/``wv`` [D, K, Hd], ``wo`` [H, Hd, D]. The attention math is
    :func:`dot_product_attention` with ``cfg.attention_impl``.
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

    def project_qkv(self, x_BxLxD):
        """``(q [B, L, H, Hd], k [B, L, K, Hd], v [B, L, K, Hd])``, compute dtype, before RoPE.

        With ``cfg.fused_projections`` one matmul against the weights stacked along a new axis (``[D, 3, H, Hd]``;
        ``[D, 2, K, Hd]`` for k and v, q apart, when ``K < H``): stacking keeps every weight's ``heads`` axis
        where its sharding is, so no weight is resharded. The training step and the KV-cache decoder both
        project through here.
        """
        cd = self.cfg.jnp_compute_dtype
        wq, wk, wv = (w[...].astype(cd) for w in (self.wq, self.wk, self.wv))
        if not self.cfg.fused_projections:
            return tuple(jnp.einsum("bld,dhk->blhk", x_BxLxD, w) for w in (wq, wk, wv))
        stacked = (wq, wk, wv) if wq.shape == wk.shape else (wk, wv)
        y_BxLxSxHxHd = jnp.einsum("bld,dshk->blshk", x_BxLxD, jnp.stack(stacked, axis=1))
        parts = tuple(y_BxLxSxHxHd[:, :, i] for i in range(len(stacked)))
        return parts if len(parts) == 3 else (jnp.einsum("bld,dhk->blhk", x_BxLxD, wq), *parts)

    def __call__(self, x_BxLxD, segment_ids_BxL, positions_BxL):
        """Returns ``(out [B, L, D] in the compute dtype, aux)``, aux as the implementation declares."""
        cfg = self.cfg
        cd = cfg.jnp_compute_dtype
        q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd = self.project_qkv(x_BxLxD)
        # Named for the ``save_qkv_proj`` remat policy (jax.checkpoint_policies.save_only_these_names).
        q_BxLxHxHd = checkpoint_name(constrain(q_BxLxHxHd, ("batch", "length", "heads", "head_dim")), "qkv_proj")
        k_BxMxKxHd = checkpoint_name(constrain(k_BxMxKxHd, ("batch", "length", "kv_heads", "head_dim")), "qkv_proj")
        v_BxMxKxHd = checkpoint_name(constrain(v_BxMxKxHd, ("batch", "length", "kv_heads", "head_dim")), "qkv_proj")
        inv_freq, attention_factor = rope_frequencies(cfg)  # host constants: the one RoPE of train/eval/decode
        q_BxLxHxHd = apply_rope(q_BxLxHxHd, positions_BxL, inv_freq, attention_factor)
        k_BxMxKxHd = apply_rope(k_BxMxKxHd, positions_BxL, inv_freq, attention_factor)
        out_BxLxHxHd, aux = dot_product_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, segment_ids_BxL,
                                                  impl=cfg.attention_impl)
        out_BxLxHxHd = constrain(out_BxLxHxHd, ("batch", "length", "heads", "head_dim"))
        return jnp.einsum("blhk,hkd->bld", out_BxLxHxHd, self.wo[...].astype(cd)), aux
