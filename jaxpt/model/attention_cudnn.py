"""``cudnn`` attention: cuDNN's fused flash attention on NVIDIA GPUs, through
``jax.nn.dot_product_attention(..., implementation="cudnn")``, with a causal mask, packed segments and padding.

What jax 0.10.2's public entry point can say to cuDNN (``jax/_src/nn/functions.py``,
``jax/_src/cudnn/fused_attention_stablehlo.py``):

* ``is_causal=True``: cuDNN's CAUSAL mask type; the kernel skips the blocks above the diagonal.
* ``query_seq_lengths`` / ``key_value_seq_lengths``: one valid prefix per row (PADDING mask types). That is
  trailing padding of an *unpacked* row, not several documents in one row.
* ``mask`` (boolean, broadcastable to ``[B, H, L, M]``): turned into an additive bias (0 / a large negative
  number, ``combine_bias_and_mask``) that the fused kernel adds to the logits.
* The packed layout (``q_offsets``/``kv_offsets``: per-row segment offsets, the O(L) way to express documents)
  exists only in the private ``jax._src.cudnn`` API, needs a Hopper GPU and leaves padding tokens undefined;
  it is not used here.

So this implementation passes causality as ``is_causal=True`` (block skipping) and documents as a
``[B, 1, L, M]`` boolean same-segment mask (``q_segment_ids[i] == kv_segment_ids[j]``), shared by all heads:
exactly the masking of ``xla`` (padding, segment 0, attends only padding, so no row is empty), with O(L M)
bytes *per row* for the bias (a fraction 1/H of ``xla``'s fp32 scores, and no [L, M] tensor per head).
GQA goes to cuDNN as is (K kv heads, K dividing H). The argument construction is
:func:`dot_product_attention_args`; the same arguments run with ``implementation="xla"`` on any backend,
which is how the tests check them on CPU (:func:`_cudnn_kernel` itself only runs on a GPU).

This module is the kernel and what it can take; the ``cudnn`` entry of :data:`jaxpt.model.tables.ATTENTION`
is :func:`jaxpt.model.attention_auto.cudnn_attention`, which runs it or the fallback below.

Fallback, decided by :func:`jaxpt.model.attention_auto.resolve` before tracing and never silent (logged once
per cause; ``jaxpt.tools.compile`` reports ``attention_impl_used``, the train loop's ``start`` record too):

* on a non-GPU platform ``cudnn`` is a :class:`~jaxpt.util.errors.ConfigError` (nothing would run cuDNN; ``auto``
  is the portable choice);
* on a GPU where cuDNN's flash kernel cannot take the shapes (:func:`unsupported_reason`: compute dtype not
  bfloat16/float16, head_dim not a multiple of 8 or above 128, 256 on Hopper, or an odd row length, which cuDNN
  refuses in training with a bias), it falls back to the off-accelerator choice of ``auto`` (``blockwise`` for
  long rows, else ``xla``).

It reports no ``max_attention_logit``: the kernel keeps no logits to inspect; the monitor is absent, not faked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpt.model.config import DTYPES, ModelConfig
from jaxpt.model.seams import SavedTensor

#: Compute dtypes cuDNN's flash attention takes (``check_layout`` in jax's fused_attention_stablehlo).
CUDNN_DTYPES = ("bfloat16", "float16")


def segment_mask(q_segment_ids_BxL: jax.Array, kv_segment_ids_BxM: jax.Array) -> jax.Array:
    """``[B, 1, L, M]`` bool: query i and key j are in the same segment (document). Causality is not in it
    (``is_causal`` says that); padding (segment 0) matches padding, as in
    :func:`jaxpt.model.attention_xla.attention_mask`.
    """
    return (q_segment_ids_BxL[:, :, None] == kv_segment_ids_BxM[:, None, :])[:, None]


def dot_product_attention_args(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *,
                               scale: float) -> dict:
    """Keyword arguments of ``jax.nn.dot_product_attention`` for causal, document-masked GQA (module docstring):
    ``query``/``key``/``value`` as given (``[B, L, H, Hd]``, ``[B, M, K, Hd]``; BTNH layout), ``mask``
    (:func:`segment_mask`), ``is_causal=True``, ``scale``. ``implementation`` is the caller's."""
    return {"query": q_BxLxHxHd, "key": k_BxMxKxHd, "value": v_BxMxKxHd,
            "mask": segment_mask(q_segment_ids_BxL, kv_segment_ids_BxM), "is_causal": True, "scale": scale}


def dot_product_attention_via(implementation: str, q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL,
                              kv_segment_ids_BxM, *, scale: float) -> jax.Array:
    """``jax.nn.dot_product_attention(**dot_product_attention_args(...), implementation=implementation)``:
    ``[B, L, H, Hd]`` in q's dtype. ``"cudnn"`` needs a CUDA GPU; ``"xla"`` runs the same arguments anywhere."""
    args = dot_product_attention_args(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM,
                                      scale=scale)
    return jax.nn.dot_product_attention(**args, implementation=implementation)


def unsupported_reason(*, dtype: str, head_dim: int, seq_len: int, compute_capability: str | None = None) -> str | None:
    """Why cuDNN's flash attention cannot take these shapes on a CUDA GPU, or None when it can.

    The conditions are jax 0.10.2's checks for the bf16/fp16 flash kernel (``check_layout`` and
    ``check_is_flash_attention`` in ``jax/_src/cudnn/fused_attention_stablehlo.py``): dtype bfloat16/float16;
    head_dim a multiple of 8 and at most 128 (256 from compute capability 9.0, Hopper); with a bias (our segment
    mask) in training, even row lengths.

    Args:
      dtype: the compute dtype's name. head_dim: Hd. seq_len: L (= M).
      compute_capability: the GPU's, e.g. ``"9.0"``; None (unknown) assumes pre-Hopper limits.
    """
    if dtype not in CUDNN_DTYPES:
        return f"cuDNN flash attention takes {'/'.join(CUDNN_DTYPES)}, the compute dtype is {dtype}"
    hopper = compute_capability is not None and tuple(int(x) for x in compute_capability.split(".")) >= (9, 0)
    max_hd = 256 if hopper else 128
    if head_dim % 8 or head_dim > max_hd:
        return f"cuDNN flash attention needs head_dim a multiple of 8 and <= {max_hd}, got {head_dim}"
    if seq_len % 2:
        return f"cuDNN flash attention with a mask needs an even row length in training, got {seq_len}"
    return None


def _cudnn_kernel(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
    """The cuDNN call itself (GPU only): ``(out, {})``. cuDNN's custom partitioning shards it by batch and heads
    under the train step's ``jit``, so no shard_map is needed."""
    out = dot_product_attention_via("cudnn", q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL,
                                    kv_segment_ids_BxM, scale=scale)
    return out.astype(q_BxLxHxHd.dtype), {}


def cudnn_saved_tensors(cfg: ModelConfig, batch: int, seq_len: int) -> list[SavedTensor]:
    """The fused kernel keeps its output, the per-row log-sum-exp and the [B, 1, L, M] mask bias (compute dtype)."""
    c = jnp.dtype(DTYPES[cfg.compute_dtype]).itemsize
    B, L, H, Hd = batch, seq_len, cfg.num_heads, cfg.head_dim
    return [SavedTensor("logsumexp", "other", True, (B, L, H), ("batch", "length", "heads"), 4),
            SavedTensor("mask_bias", "other", True, (B, L, L), ("batch", "length", None), c),
            SavedTensor("attn_out", "dot_batch", True, (B, L, H, Hd), ("batch", "length", "heads", None), c)]
