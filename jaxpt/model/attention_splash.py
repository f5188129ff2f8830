"""``splash`` attention: the Pallas TPU splash-attention kernel (``jax.experimental.pallas.ops.tpu.splash_attention``)
with a causal mask, segment ids (packed documents) and grouped-query heads.

Splash ("sparse flash") attention is FlashAttention (Dao et al. 2022) as a Pallas TPU kernel that skips the
blocks a static mask rules out (here the causal upper triangle) and applies segment ids inside the kernel.
Forward and backward are fused kernels: no [L, M] tensor exists in HBM.

* A Pallas kernel cannot be auto-partitioned, so inside the train step (:func:`jaxpt.mesh.activation_sharding`)
  it runs under ``jax.shard_map``: each device attends its own batch rows and heads (the ``batch`` and
  ``heads``/``kv_heads`` rules). With the sequence sharded (``sequence`` > 1: context parallelism)
  :mod:`jaxpt.model.context_parallel` calls :func:`_local` per query chunk instead.
* Off TPU (tests on CPU) the kernel runs in Pallas interpret mode: slow, for correctness at small shapes.
  The platform is the mesh's devices' (so compile-only TPU topology devices get the real kernel on a CPU host).
* Row lengths must be multiples of the block size (``min(512, L)``, and of 128 on TPU).
* It reports no ``max_attention_logit``: the kernel keeps no logits to inspect, and the monitor is absent,
  not faked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpt import mesh as mesh_lib
from jaxpt.model.config import DTYPES, ModelConfig
from jaxpt.model.seams import SavedTensor

#: Largest tile (tokens) for every splash block size.
BLOCK = 512


def _kernel(L: int, H: int, interpret: bool, M: int | None = None, offset: int = 0):
    """The splash kernel for ``L`` queries, ``M`` keys (default ``L``) and ``H`` query heads (``[H, L, Hd]``
    queries), with the causal mask ``q + offset >= k`` (``offset = M - L`` aligns the last query with the last
    key: a window of keys ending at the queries, as :mod:`jaxpt.model.context_parallel` passes them).

    Raises:
      ValueError: ``L`` or ``M`` is not a multiple of its block size.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    M = L if M is None else M
    block, block_kv = min(BLOCK, L), min(BLOCK, M)
    if L % block or M % block_kv:
        raise ValueError(f"splash attention: row length {L} (keys {M}) is not a multiple of the block size "
                         f"{block} ({block_kv})")
    sizes = sa.BlockSizes(block_q=block, block_kv=block_kv, block_kv_compute=block_kv, block_q_dkv=block,
                          block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv, block_q_dq=block,
                          block_kv_dq=block_kv)
    mask = sa.MultiHeadMask([sa.CausalMask((L, M), offset=offset) for _ in range(H)])
    return sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _local(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, qs_BxL, ks_BxM, *, scale, interpret, offset: int = 0):
    """Splash on one device's rows and heads: ``[B, L, H, Hd]`` -> ``[B, L, H, Hd]``; the mask
    ``q + offset >= k`` (:func:`_kernel`) and segment ids."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    B, L, H, Hd = q_BxLxHxHd.shape
    M = k_BxMxKxHd.shape[1]
    kernel = _kernel(L, H, interpret) if M == L and offset == 0 else _kernel(L, H, interpret, M, offset)
    q = jnp.swapaxes(q_BxLxHxHd * jnp.asarray(scale, q_BxLxHxHd.dtype), 1, 2)   # [B, H, L, Hd]
    k, v = jnp.swapaxes(k_BxMxKxHd, 1, 2), jnp.swapaxes(v_BxMxKxHd, 1, 2)      # [B, K, M, Hd]
    out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sa.SegmentIds(qs, ks)))(
        q, k, v, qs_BxL, ks_BxM)
    return jnp.swapaxes(out, 1, 2).astype(q_BxLxHxHd.dtype)


def _platform() -> tuple[str, jax.sharding.Mesh | None, tuple | None]:
    """(platform of the devices the step is built for, mesh, rules) from the activation context, else the default
    backend with no mesh."""
    ctx = mesh_lib.current_activation_sharding()
    if ctx is None:
        return jax.default_backend(), None, None
    mesh, rules = ctx
    return mesh.devices.flat[0].platform, mesh, rules


def splash_attention(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM, *, scale):
    """Causal, document-masked grouped-query attention by the splash kernel (see the module docstring).

    Returns: ``(out [B, L, H, Hd] in q's dtype, {})``.
    Raises:
      ValueError: the row length is not a multiple of the block size, or the sequence is sharded.
    """
    platform, mesh, rules = _platform()
    fn = functools.partial(_local, scale=scale, interpret=platform != "tpu")
    args = (q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, q_segment_ids_BxL, kv_segment_ids_BxM)
    if mesh is None:
        return fn(*args), {}
    spec = lambda axes: mesh_lib.logical_to_spec(axes, rules, mesh)  # noqa: E731
    q_spec, kv_spec = spec(("batch", "length", "heads", "head_dim")), spec(("batch", "length", "kv_heads", "head_dim"))
    seg_spec = spec(("batch", "length"))
    if any(len(s) > 1 and s[1] is not None for s in (q_spec, seg_spec)):
        raise ValueError("splash attention: the sequence ('length') must not be sharded")
    out = jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec), out_specs=q_spec,
                        check_vma=False)(*args)
    return out, {}


def splash_saved_tensors(cfg: ModelConfig, batch: int, seq_len: int) -> list[SavedTensor]:
    """The kernel keeps its output and per-row log-sum-exp for the backward pass (no [L, M] tensor)."""
    c = jnp.dtype(DTYPES[cfg.compute_dtype]).itemsize
    B, L, H, Hd = batch, seq_len, cfg.num_heads, cfg.head_dim
    return [SavedTensor("logsumexp", "other", True, (B, L, H), ("batch", "length", "heads"), 4),
            SavedTensor("attn_out", "dot_batch", True, (B, L, H, Hd), ("batch", "length", "heads", None), c)]
