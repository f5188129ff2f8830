"""``blockwise`` attention: flash-style attention in pure JAX, memory O(L x block) instead of O(L x M).

The same math as ``xla`` (:func:`jaxpt.model.attention_xla.xla_attention`: causal, document-local, grouped-query)
computed one (query block, key block) tile at a time with the online softmax (Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"; FlashAttention, Dao et al. 2022): a running row maximum
``m``, row sum ``l`` and unnormalized output ``acc`` per query block, rescaled as each key block arrives.

* Causal block skipping: a tile whose first key comes after its last query is skipped (``lax.cond``), so
  about half of the tiles are never computed, forward or backward.
* Memory: an outer ``lax.scan`` over query blocks and an inner one over key blocks, both
  ``jax.checkpoint``-ed, so the backward pass keeps only the per-block carries (O(L x Hd) per head) and
  recomputes one [block_q, block_k] tile at a time. The price is recomputation: the backward pass runs
  the forward tiles again (twice for the outer level), where a fused kernel (``splash``) would not.
* Works on every backend; the CPU choice for long rows. Reports ``max_attention_logit`` (the running
  maximum is the row's largest allowed logit), so the monitor is real, not faked.

Rows are padded to whole blocks with segment id -1: real tokens never see the padding, and a padded query
row that sees no key at all (l = 0) divides by 1 instead, so no NaN reaches the gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpt.model.config import DTYPES, ModelConfig
from jaxpt.model.seams import SavedTensor

#: Default query and key block sizes (tokens). 512 x 512 fp32 tiles per head are 1 MiB.
BLOCK = 512
_PAD_SEGMENT = -1


def _blocks(x, block: int, fill):
    """[B, N, ...] -> [N / block, B, block, ...], padding N up to whole blocks with ``fill``."""
    B, N = x.shape[:2]
    n = -(-N // block)
    x = jnp.pad(x, [(0, 0), (0, n * block - N)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.swapaxes(x.reshape(B, n, block, *x.shape[2:]), 0, 1)


def _tile(carry, q_BxCxKxGxHd, qs_BxC, q_pos_C, k_BxTxKxHd, v_BxTxKxHd, ks_BxT, k_pos_T):
    """One online-softmax update of ``(m, l, acc)`` [B, K, G, C](, Hd) with one key block of T keys."""
    m, l, acc = carry
    s = jnp.einsum("bckgd,btkd->bkgct", q_BxCxKxGxHd, k_BxTxKxHd, preferred_element_type=jnp.float32)
    allowed = (q_pos_C[:, None] >= k_pos_T[None, :])[None] & (qs_BxC[:, :, None] == ks_BxT[:, None, :])
    s = jnp.where(allowed[:, None, None], s, -jnp.inf)
    # The softmax does not depend on m (it cancels), so m carries no gradient; this also keeps -inf out of it.
    m_new = jnp.maximum(m, jax.lax.stop_gradient(jnp.max(s, axis=-1)))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    correction = jnp.exp(m - m_safe)
    l = l * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgct,btkd->bkgcd", p.astype(v_BxTxKxHd.dtype), v_BxTxKxHd, preferred_element_type=jnp.float32)
    return m_new, l, acc * correction[..., None] + pv


def _varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside a ``shard_map`` (empty outside one)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or getattr(t, "vma", ()) or ())


def _query_block(i, q_BxCxKxGxHd, qs_BxC, k_NxBxTxKxHd, v_NxBxTxKxHd, ks_NxBxT, q_pos_C=None, k_pos_NxT=None):
    """Attention of query block ``i`` over all key blocks (skipping those wholly in its future).

    ``q_pos_C``/``k_pos_NxT``: the row index of each query and key (context parallelism: permuted parts of
    the row); by default block ``i``'s queries are at ``i * C + arange(C)`` and key block ``j``'s at
    ``j * T + arange(T)``.

    Returns ``(out [B, K, G, C, Hd] float32, m [B, K, G, C] float32)``."""
    B, C, K, G, Hd = q_BxCxKxGxHd.shape
    T = k_NxBxTxKxHd.shape[2]
    n = k_NxBxTxKxHd.shape[0]
    q_pos = i * C + jnp.arange(C) if q_pos_C is None else q_pos_C
    init = (jnp.full((B, K, G, C), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, C), jnp.float32),
            jnp.zeros((B, K, G, C, Hd), jnp.float32))
    vma = tuple(sorted(set().union(*(_varying_axes(a) for a in
                                     (q_BxCxKxGxHd, qs_BxC, k_NxBxTxKxHd, v_NxBxTxKxHd, ks_NxBxT)))))
    if vma:  # inside a shard_map (the pipeline's): the running stats vary over its axes as the inputs do
        init = jax.lax.pcast(init, vma, to="varying")

    @jax.checkpoint
    def step(carry, xs):
        j, k_j, v_j, ks_j = xs[:4]
        if k_pos_NxT is None:
            k_pos = j * T + jnp.arange(T)
            visible = j * T <= i * C + C - 1   # the block's first key is not after the last query
        else:
            k_pos = xs[4]
            visible = jnp.min(k_pos) <= jnp.max(q_pos)
        new = jax.lax.cond(visible, lambda c: _tile(c, q_BxCxKxGxHd, qs_BxC, q_pos, k_j, v_j, ks_j, k_pos),
                           lambda c: c, carry)
        return new, None

    xs = (jnp.arange(n), k_NxBxTxKxHd, v_NxBxTxKxHd, ks_NxBxT) + (() if k_pos_NxT is None else (k_pos_NxT,))
    (m, l, acc), _ = jax.lax.scan(step, init, xs)
    # Only a padded query row can see no key (when the keys need less padding than the queries): l = 0 there,
    # and dividing by it would send 0 / 0 = NaN into the gradients even though the row is dropped.
    return acc / jnp.where(l == 0.0, 1.0, l)[..., None], m


def blockwise_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale,
                        block_q: int = BLOCK, block_k: int = BLOCK, q_index_L=None, kv_index_M=None):
    """Causal, document-masked grouped-query attention, one [block_q, block_k] tile at a time.

    Args and masking as :mod:`jaxpt.model.attention` specifies for every implementation (M == L by
    default). ``block_q``/``block_k``: tile sizes in tokens (capped at L and M). ``q_index_L``/``kv_index_M``
    (int32, given together): the row index of each query and key when q and k/v are permuted parts of the
    row (context parallelism; M may then differ from L); a key is visible iff its index is <= the query's.
    Returns: ``(out [B, L, H, Hd] in q's dtype, {"max_attention_logit": float32 scalar})``, the largest scaled
    logit among allowed query-key pairs (as ``xla`` reports it).
    """
    cd = q_BxLxHxHd.dtype
    B, L, H, Hd = q_BxLxHxHd.shape
    M, K = k_BxMxKxHd.shape[1], k_BxMxKxHd.shape[2]
    G = H // K
    C, T = min(block_q, L), min(block_k, M)
    q = (q_BxLxHxHd * jnp.asarray(scale, cd)).reshape(B, L, K, G, Hd)
    q_blocks, qs_blocks = _blocks(q, C, 0), _blocks(q_segment_ids_BxL, C, _PAD_SEGMENT)
    k_blocks, v_blocks = _blocks(k_BxMxKxHd, T, 0), _blocks(v_BxMxKxHd, T, 0)
    ks_blocks = _blocks(kv_segment_ids_BxM, T, _PAD_SEGMENT)

    @jax.checkpoint
    def step(_, xs):
        i, q_i, qs_i = xs
        return None, _query_block(i, q_i, qs_i, k_blocks, v_blocks, ks_blocks)

    if q_index_L is None:
        _, (out, m) = jax.lax.scan(step, None, (jnp.arange(q_blocks.shape[0]), q_blocks, qs_blocks))
    else:
        # Padded queries get index -1 and padded keys index M-or-more: neither widens a block's visible range.
        qi_blocks = _blocks(q_index_L[None], C, -1)[:, 0]               # [N, C]
        ki_blocks = _blocks(kv_index_M[None], T, jnp.iinfo(jnp.int32).max)[:, 0]   # [N, T]

        @jax.checkpoint
        def step_indexed(_, xs):
            i, q_i, qs_i, qi_i = xs
            return None, _query_block(i, q_i, qs_i, k_blocks, v_blocks, ks_blocks, qi_i, ki_blocks)

        _, (out, m) = jax.lax.scan(step_indexed, None, (jnp.arange(q_blocks.shape[0]), q_blocks, qs_blocks, qi_blocks))
    # [N, B, K, G, C, Hd] -> [B, N * C, K, G, Hd] -> [B, L, H, Hd]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, -1, H, Hd)[:, :L]
    max_logit = jnp.max(jnp.transpose(m, (1, 0, 4, 2, 3)).reshape(B, -1, H)[:, :L])
    return out.astype(cd), {"max_attention_logit": max_logit}


def blockwise_saved_tensors(cfg: ModelConfig, batch: int, seq_len: int) -> list[SavedTensor]:
    """What the backward pass keeps per layer: the output and the per-row maxima (no [L, M] tensor)."""
    c = jnp.dtype(DTYPES[cfg.compute_dtype]).itemsize
    B, L, H, Hd = batch, seq_len, cfg.num_heads, cfg.head_dim
    return [SavedTensor("row_max", "other", True, (B, L, H), ("batch", "length", "heads"), 4),
            SavedTensor("attn_out", "dot_batch", True, (B, L, H, Hd), ("batch", "length", "heads", None), c)]
