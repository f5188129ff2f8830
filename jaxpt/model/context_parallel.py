"""Context parallelism: the tokens of one row split over the ``sequence`` mesh axis.

Turned on by the mesh alone: when the logical ``length`` axis maps to mesh axes of total size ``s > 1``
(the default rule ``length -> sequence``, so ``--mesh sequence=4,fsdp=2``), every activation ``[B, L, ...]``
holds ``L / s`` tokens per device. Everything in a block but attention is per token, so only attention
needs the other devices' tokens. With ``s == 1`` (no ``sequence`` axis) none of this runs and the program is
the one without it.

**Layout (causal load balancing).** The row is cut into ``2 s`` chunks of ``c = L / (2 s)`` tokens and device
``i`` holds chunks ``i`` and ``2 s - 1 - i`` (the "zigzag" order of Llama 3, Dubey et al. 2024, sec. 3.3.2,
and of ring-flash-attention's zigzag variant). Under a causal mask chunk ``j`` attends ``j + 1`` chunks of keys,
so each device does ``(i + 1) + (2 s - i) = 2 s + 1`` chunk pairs of work: the same on every device, where
contiguous chunks would give the last device ``s`` times the first one's. :class:`jaxpt.model.Decoder`
permutes ``tokens``, ``segment_ids`` and ``positions`` into this order before the embedding
(:func:`to_zigzag`) and restores the natural order of the final hidden states (:func:`from_zigzag`), so the
loss, its targets and everything outside the decoder see the row as it was. RoPE takes ``positions`` from the
data (per document), so moving a token moves its position with it; packed documents that cross chunk
boundaries keep their segment ids and positions.

**Attention: keys and values all-gathered per layer** (not passed around a ring). Each device all-gathers
K, V and the key segment ids over the ``length`` mesh axes (the backward pass reduce-scatters their
gradients) and attends its own ``2 c`` queries to the whole row, masking by the row index of each query and key
(:func:`zigzag_order`) and by segment id. Why gather rather than ring (Liu et al. 2023, "Ring Attention"):

* Grouped-query attention makes K/V small: the 8B model's ``2 x 8 x 128`` K/V values per token are a quarter
  of its 4096-wide residual stream, so the gathered K/V of a whole 32k row (128 MiB in bf16 per layer) is
  less than the per-layer activations it saves, and one all-gather per layer is far from the critical path
  on ICI. Llama 3 trained 128k context this way for the same reason (Dubey et al. 2024, sec. 3.3.2).
* It reuses every attention implementation as it is: ``xla`` and ``blockwise`` take the row indices of
  their queries and keys; ``splash`` (a Pallas kernel, whose masks are static) attends each query chunk to
  a fixed-length window of keys ending at the chunk (:func:`_splash_local`). A ring would need an
  online-softmax merge of partial results around every kernel and its own backward pass.
* The price: the K/V of the whole row exist on every device for one layer at a time, ``O(L K Hd)``, and the
  all-gather is not overlapped with compute by construction (XLA may still schedule it early). At rows where
  K/V no longer fit (millions of tokens, or multi-head attention with large ``K``) a ring is the better choice.

``splash`` cost under context parallelism: its masks must be static, so the front chunk (index ``< s``)
attends a window of ``L / 2`` keys and the back chunk one of ``L`` keys, both ending at the chunk, with the
causal diagonal aligned (``CausalMask(offset=window - c)``); blocks wholly above the diagonal are skipped,
blocks left of the row start are padding (segment ``-1``) and are computed and discarded. Per device that is
about ``1.5 c L`` query-key pairs against the ideal ``(2 s + 1) c^2 = c L + c^2``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxpt import mesh as mesh_lib
from jaxpt.model import attention_auto, attention_blockwise, attention_splash
from jaxpt.model.attention_xla import xla_attention

#: Attention implementations that run under context parallelism (``auto`` resolves to one of them).
SUPPORTED = ("xla", "blockwise", "splash", "auto")
#: Segment id of the padding left of the row in :func:`_splash_local`'s key windows: equal to no query's id.
_PAD_SEGMENT = -1


def length_axes(mesh, rules) -> tuple[str, ...]:
    """Mesh axes (of size > 1) the ``length`` dimension of ``[batch, length]`` activations is sharded over."""
    spec = mesh_lib.logical_to_spec(("batch", "length"), rules, mesh)
    entry = spec[1] if len(spec) > 1 else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def num_shards(mesh, rules) -> int:
    """How many devices one row is split over (product of :func:`length_axes`' sizes); 1: no context parallelism."""
    return math.prod(int(mesh.shape[a]) for a in length_axes(mesh, rules))


def current_shards() -> int:
    """:func:`num_shards` of the enclosing :func:`jaxpt.mesh.activation_sharding` (at trace time); 1 outside one."""
    ctx = mesh_lib.current_activation_sharding()
    return 1 if ctx is None else num_shards(*ctx)


def zigzag_order(seq_len: int, shards: int) -> np.ndarray:
    """The load-balanced order of a row: ``order[p]`` is the row index of the token at permuted position ``p``.

    The row's ``2 shards`` chunks are laid out as ``0, 2s-1, 1, 2s-2, ..., s-1, s``, so that when the permuted
    row is cut into ``shards`` equal parts, part ``i`` holds chunks ``i`` and ``2 s - 1 - i``. ``shards == 1``
    gives the identity.

    Returns: int32 ``[seq_len]``.
    Raises:
      ValueError: ``seq_len`` is not a multiple of ``2 * shards`` (for ``shards > 1``).
    """
    if shards == 1:
        return np.arange(seq_len, dtype=np.int32)
    n = 2 * shards
    if seq_len % n:
        raise ValueError(f"context parallelism: row length {seq_len} is not a multiple of 2 x {shards} shards")
    c = seq_len // n
    chunks = [j for i in range(shards) for j in (i, n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks]).astype(np.int32)


def _permute_chunks(x_BxL, chunk_order: np.ndarray):
    """Reorder the ``len(chunk_order)`` equal chunks of axis 1 of ``x`` (``[B, L, ...]``)."""
    B, L = x_BxL.shape[:2]
    n = len(chunk_order)
    x = x_BxL.reshape(B, n, L // n, *x_BxL.shape[2:])
    return jnp.take(x, chunk_order, axis=1).reshape(x_BxL.shape)


def _chunk_order(shards: int) -> np.ndarray:
    n = 2 * shards
    return np.array([j for i in range(shards) for j in (i, n - 1 - i)], np.int32)


def to_zigzag(x_BxL: jax.Array, shards: int) -> jax.Array:
    """``x[:, zigzag_order(L, shards)]`` for ``x`` of shape ``[B, L, ...]`` (any dtype); identity for 1 shard.

    Raises:
      ValueError: ``L`` is not a multiple of ``2 * shards``.
    """
    if shards == 1:
        return x_BxL
    zigzag_order(x_BxL.shape[1], shards)   # validates the length
    return _permute_chunks(x_BxL, _chunk_order(shards))


def from_zigzag(x_BxL: jax.Array, shards: int) -> jax.Array:
    """The inverse of :func:`to_zigzag`: the natural row order back from the load-balanced one."""
    if shards == 1:
        return x_BxL
    zigzag_order(x_BxL.shape[1], shards)
    return _permute_chunks(x_BxL, np.argsort(_chunk_order(shards)).astype(np.int32))


def _splash_local(q_BxLxHxHd, k_BxMxKxHd, v_BxMxKxHd, qs_BxL, ks_BxM, q_index_L, kv_order_M, *, scale, shards):
    """Splash on one device's two query chunks against the gathered (zigzag-ordered) keys.

    Chunk ``j`` (of ``c`` tokens) attends a window of ``W`` keys of the natural-order row ending at its own last
    token, ``W = L / 2`` for a front chunk (``j < s``) and ``L`` for a back chunk; the window's part left of
    the row is padding (segment -1). In window coordinates the causal mask is ``q + (W - c) >= k``: static,
    which a splash kernel needs (see the module docstring for the cost).
    """
    platform, _, _ = attention_splash._platform()
    L2, M = q_BxLxHxHd.shape[1], k_BxMxKxHd.shape[1]
    c, s = L2 // 2, shards
    inv = np.argsort(kv_order_M).astype(np.int32)
    pad = (s - 1) * c   # the furthest any window reaches left of the row
    natural = lambda x, fill: jnp.pad(jnp.take(x, inv, axis=1), [(0, 0), (pad, 0)] + [(0, 0)] * (x.ndim - 2),  # noqa: E731
                                      constant_values=fill)
    k, v, ks = natural(k_BxMxKxHd, 0), natural(v_BxMxKxHd, 0), natural(ks_BxM, _PAD_SEGMENT)
    outs = []
    for half, (window, first_chunk) in enumerate(((M // 2, 0), (M, s))):
        j = q_index_L[half * c] // c                       # this chunk's index in the row
        start = (j - first_chunk) * c                      # window start, in padded coordinates
        window_of = lambda x: jax.lax.dynamic_slice_in_dim(x, start, window, axis=1)  # noqa: E731
        sl = slice(half * c, (half + 1) * c)
        outs.append(attention_splash._local(
            q_BxLxHxHd[:, sl], window_of(k), window_of(v), qs_BxL[:, sl], window_of(ks), scale=scale,
            interpret=platform != "tpu", offset=window - c))
    return jnp.concatenate(outs, axis=1), {}


def splash_misfit(seq_len: int, shards: int) -> str:
    """Why :func:`_splash_local`'s kernels cannot take rows of ``seq_len`` over ``shards`` devices, or ``""``.

    Its query chunks (``seq_len / (2 shards)``) and key windows (``seq_len / 2``, ``seq_len``) must each be whole
    blocks of ``min(512, size)`` tokens, a multiple of 128 (the kernel's lane width, needed with segment ids).
    """
    for what, n in (("query chunks", seq_len // (2 * shards)), ("front key windows", seq_len // 2),
                    ("back key windows", seq_len)):
        block = min(attention_splash.BLOCK, n)
        if n % block or block % 128:
            return (f"splash's {what} of {n} tokens are not whole blocks of {block} tokens in multiples of 128 "
                    f"(use a longer seq_len, a smaller sequence axis, or attention_impl 'blockwise')")
    return ""


def _local_fn(name: str):
    """The per-device attention for implementation ``name``: ``(q, k, v, qs, ks, q_index, kv_index, *, scale,
    shards) -> (out, aux)``, k/v/ks the whole (gathered) row in zigzag order."""
    def indexed(fn):
        def run(q, k, v, qs, ks, q_index, kv_index, *, scale, shards):
            del shards
            return fn(q, k, v, qs, ks, scale=scale, q_index_L=q_index, kv_index_M=jnp.asarray(kv_index))
        return run

    return {"xla": indexed(xla_attention), "blockwise": indexed(attention_blockwise.blockwise_attention),
            "splash": _splash_local}[name]


def resolve_impl(impl: str, seq_len: int, shards: int, platform: str) -> str:
    """The implementation that runs per device: ``impl``, or for ``auto`` its choice for chunks of
    ``seq_len / (2 shards)`` queries on ``platform``.

    Raises:
      ValueError: ``impl`` does not support context parallelism (not in :data:`SUPPORTED`).
    """
    if impl not in SUPPORTED:
        raise ValueError(f"ModelConfig.attention_impl = {impl!r} does not run with context parallelism "
                         f"(a 'sequence' mesh axis > 1); choose one of {', '.join(SUPPORTED)}")
    if impl != "auto":
        return impl
    return attention_auto.choose(platform, seq_len // (2 * shards))


def context_parallel_attention(impl: str, q_BxLxHxHd, k_BxLxKxHd, v_BxLxKxHd, segment_ids_BxL, *, scale):
    """Causal, document-masked self-attention of zigzag-ordered rows sharded over the ``length`` mesh axes.

    Called by :func:`jaxpt.model.attention.dot_product_attention` under :func:`jaxpt.mesh.activation_sharding`
    when :func:`current_shards` > 1. Runs ``impl`` per device under ``jax.shard_map`` (batch, heads and the row
    split as the logical rules say): K, V and the key segment ids are all-gathered over the ``length`` axes,
    and each device attends its own queries to the whole row by row index (:func:`zigzag_order`).

    Args:
      impl: ``ModelConfig.attention_impl``, one of :data:`SUPPORTED`.
      q_BxLxHxHd: queries, RoPE applied, not scaled (global view, rows in zigzag order).
      k_BxLxKxHd, v_BxLxKxHd: keys (RoPE applied) and values, same order.
      segment_ids_BxL: int32 document id of each token (0 = padding), same order.
      scale: logit scale.
    Returns: ``(out [B, L, H, Hd] in q's dtype, aux)``: the implementation's auxiliary outputs (maxima,
      taken over all devices); ``{}`` for ``auto`` and ``splash``.
    Raises:
      ValueError: ``impl`` unsupported, or ``L`` not a multiple of ``2 x`` the shard count.
    """
    mesh, rules = mesh_lib.current_activation_sharding()
    axes = length_axes(mesh, rules)
    shards = num_shards(mesh, rules)
    L = q_BxLxHxHd.shape[1]
    order = zigzag_order(L, shards)
    name = resolve_impl(impl, L, shards, mesh.devices.flat[0].platform)
    local = functools.partial(_local_fn(name), scale=scale, shards=shards)
    spec = lambda logical: mesh_lib.logical_to_spec(logical, rules, mesh)  # noqa: E731
    q_spec = spec(("batch", "length", "heads", "head_dim"))
    kv_spec = spec(("batch", "length", "kv_heads", "head_dim"))
    seg_spec = spec(("batch", "length"))
    gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)  # noqa: E731

    def per_device(q, k, v, qs, q_index):
        out, aux = local(q, gather(k), gather(v), qs, gather(qs), q_index, order)
        if impl == "auto":
            aux = {}   # ``auto`` declares no auxiliary output (the choice depends on the target)
        return out, {k_: a.reshape(1) for k_, a in aux.items()}

    out, per_device_aux = jax.shard_map(
        per_device, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, PartitionSpec(seg_spec[1])),
        out_specs=(q_spec, PartitionSpec(mesh.axis_names)), check_vma=False)(
        q_BxLxHxHd, k_BxLxKxHd, v_BxLxKxHd, segment_ids_BxL, jnp.asarray(order))
    # Every auxiliary output of xla and blockwise is a maximum (AuxSpec "max"): take it over the devices' values
    # (outside shard_map: pmax has no differentiation rule, and these are monitors, not losses).
    return out, {k_: jnp.max(a) for k_, a in per_device_aux.items()}
