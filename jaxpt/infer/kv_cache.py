"""Generation with a KV cache: :class:`KVCacheStep`, the :class:`jaxpt.infer.decode.DecodeStep` the greedy tasks of
evaluation, ``jaxpt.generate`` and the notebook decode with (:class:`jaxpt.infer.decode.NoCacheStep` is the reference).

Prefill runs the prompts as one ``[B, L]`` batch (rows left-aligned, of different lengths, right-padded; the
attention of ``ModelConfig.attention_impl``, causal and segment-masked as in training) and keeps every layer's
rotated keys and values: the cache, ``[B, L, K, Hd]`` per layer in the compute dtype (stacked ``[N, B, L, K, Hd]``
for a scanned model). Each :meth:`KVCacheStep.extend` then runs only the new token of each row (``[B, 1]``) at
its own position ``p_r`` (the row's length so far): its key and value are written into slot ``p_r`` of the row's
cache, and its query attends the slots ``0 .. p_r`` (the prompt's and earlier new tokens'; slots beyond hold
padding or nothing yet and are masked). Rows therefore decode independently at different positions, and
every step is the same compiled program. Costs per new token: the cache-free step recomputes all ``L``
positions (``O(L)`` matmul work per layer and ``O(L^2)`` attention); the cached step computes one position
(``O(1)`` matmuls and ``O(L)`` attention), at the price of the cache's memory, ``2 N B L K Hd`` elements.

Sharding is the training layout: params keep their shardings (FSDP/tensor parallel), rows go over the
data-parallel axes (``batch``) and the cache's kv heads over ``tensor`` (``kv_heads``), by the run's logical-axis
rules; rows and the cache are never split over ``sequence`` (a one-token query cannot be; under a context-parallel
mesh the ``sequence`` devices hold copies). Layers run one after another, never pipelined over ``stage``.

The logits equal the cache-free step's up to float rounding (``tests/test_kv_cache.py``): the same params,
RoPE (:func:`jaxpt.model.rope.apply_rope`), norms and MLP modules of the model are called (the MLP given the
rows' segment ids, so the prompts' padding is padding to it too); the decode-time attention is
:func:`jaxpt.model.attention_xla.xla_attention` over the cache with a per-row mask. Both steps route a mixture of
experts ``causal``ly, each token by itself (:func:`jaxpt.model.decoder.eval_routing`): a token routed alone at its
extend is then routed as in the forward pass over its whole row. A model whose MLP cannot route token by token
(one that declares ``routings`` without ``causal``, :mod:`jaxpt.model.mlp`) is refused here, and
:func:`step_class` decodes it without a cache, saying so once in the log.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpt import mesh as mesh_lib
from jaxpt.infer.decode import NoCacheStep, StepConstructors, place_on_mesh
from jaxpt.model.attention import dot_product_attention
from jaxpt.model.attention_xla import xla_attention
from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import Block, eval_routing
from jaxpt.model.rope import apply_rope, rope_frequencies

log = logging.getLogger("jaxpt.infer.kv_cache")

#: logical axes of one layer's cache [B, L, K, Hd] (the sequence axis deliberately unnamed: never sharded).
CACHE_AXES = ("batch", None, "kv_heads", "head_dim")

#: ``ModelConfig.mlp`` names whose decoding without a cache :func:`step_class` has logged (once each).
_LOGGED_NO_CACHE: set[str] = set()


def step_class(cfg: ModelConfig, kv_cache: bool = True) -> type:
    """The decode step for a model of ``cfg``: :class:`KVCacheStep` (``kv_cache``), else or where the model cannot
    be decoded token by token (its MLP offers no ``causal`` routing, :func:`jaxpt.model.decoder.eval_routing`)
    :class:`jaxpt.infer.decode.NoCacheStep`, which reruns the model's own forward on each row so far; the
    latter case is logged once per MLP name.

    Raises:
      ConfigError: no MLP is named ``cfg.mlp``.
    """
    if not kv_cache:
        return NoCacheStep
    if eval_routing(cfg) == "causal":
        return KVCacheStep
    if cfg.mlp not in _LOGGED_NO_CACHE:
        _LOGGED_NO_CACHE.add(cfg.mlp)
        log.warning("ModelConfig.mlp = %r cannot route one token at a time (no 'causal' routing), so a KV cache "
                    "would not reproduce its forward pass: decoding without a cache (NoCacheStep)", cfg.mlp)
    return NoCacheStep


def _project_qkv(block, x_BxTxD, positions_BxT):
    """Pre-norm, q/k/v projections (with their biases), the q/k norm and RoPE of one block, as
    :class:`jaxpt.model.attention.Attention` does."""
    cfg = block.attn.cfg
    q_BxTxHxHd, k_BxTxKxHd, v_BxTxKxHd = block.attn.project_qkv(block.attn_norm(x_BxTxD))
    q_BxTxHxHd, k_BxTxKxHd = block.attn.normalize_qk(q_BxTxHxHd, k_BxTxKxHd)
    inv_freq, factor = rope_frequencies(cfg)
    return (apply_rope(q_BxTxHxHd, positions_BxT, inv_freq, factor),
            apply_rope(k_BxTxKxHd, positions_BxT, inv_freq, factor), v_BxTxKxHd)


def _finish_block(block, x_BxTxD, out_BxTxHxHd, segment_ids_BxT):
    """Output projection, residual, and the MLP half of the block (:meth:`jaxpt.model.decoder.Block.mlp_half`),
    routed ``causal``: each token by itself, as in the forward pass over a whole row."""
    cd = block.attn.cfg.jnp_compute_dtype
    x_BxTxD = x_BxTxD + jnp.einsum("blhk,hkd->bld", out_BxTxHxHd, block.attn.wo[...].astype(cd))
    return block.mlp_half(x_BxTxD, segment_ids_BxT, routing="causal")[0]


def _prefill_block(block, x_BxLxD, segment_ids_BxL, positions_BxL):
    """One block over the whole prompt batch. Returns ``(x, k, v)``; k/v [B, L, K, Hd] become the cache."""
    q, k, v = _project_qkv(block, x_BxLxD, positions_BxL)
    k, v = mesh_lib.constrain(k, CACHE_AXES), mesh_lib.constrain(v, CACHE_AXES)
    out, _ = dot_product_attention(q, k, v, segment_ids_BxL, impl=block.attn.cfg.attention_impl)
    return _finish_block(block, x_BxLxD, out, segment_ids_BxL), k, v


def _decode_block(block, x_Bx1xD, positions_Bx1, k_BxLxKxHd, v_BxLxKxHd):
    """One block for one new token per row at ``positions`` (= its cache slot). Returns ``(x, k, v)`` with the
    token's key and value written into the cache."""
    q, k_new, v_new = _project_qkv(block, x_Bx1xD, positions_Bx1)
    L = k_BxLxKxHd.shape[1]
    slots_L = jnp.arange(L, dtype=jnp.int32)
    here_BxL = slots_L[None, :] == positions_Bx1
    k = mesh_lib.constrain(jnp.where(here_BxL[:, :, None, None], k_new, k_BxLxKxHd), CACHE_AXES)
    v = mesh_lib.constrain(jnp.where(here_BxL[:, :, None, None], v_new, v_BxLxKxHd), CACHE_AXES)
    # Per-row causality as segments: the query is segment 1, slots 0..p_r too, later slots 2 (never attended);
    # the shared index masks then allow every slot (query index L is past them all).
    kv_segment_ids_BxL = jnp.where(slots_L[None, :] <= positions_Bx1, 1, 2).astype(jnp.int32)
    out, _ = xla_attention(q, k, v, jnp.ones_like(positions_Bx1), kv_segment_ids_BxL,
                           scale=q.shape[-1] ** -0.5, q_index_L=jnp.full((1,), L, jnp.int32), kv_index_M=slots_L)
    return _finish_block(block, x_Bx1xD, out, jnp.ones_like(positions_Bx1)), k, v


def _block_stack(model):
    """``(one Block's graphdef, per-layer states stacked [N, ...])`` of a scanned model, else ``None``."""
    if not model.cfg.scan_layers:
        return None
    block_def, _ = nnx.split(nnx.eval_shape(lambda: Block(model.cfg, rngs=nnx.Rngs(0))))
    return block_def, nnx.split(model.blocks)[1]


def _run_blocks(model, x, layer_fn, caches):
    """Apply ``layer_fn(block, x, k, v) -> (x, k, v)`` over the layers: a ``lax.scan`` over the stacked blocks and
    cache of a scanned model, else a loop over the blocks and the per-layer cache tuple."""
    stack = _block_stack(model)
    if stack is None:
        ks, vs = [], []
        for i, block in enumerate(model.blocks):
            x, k, v = layer_fn(block, x, *(c[i] if c is not None else None for c in caches))
            ks.append(k)
            vs.append(v)
        return x, (tuple(ks), tuple(vs))
    block_def, states = stack

    def body(x, layer):
        state, k, v = layer
        x, k, v = layer_fn(nnx.merge(block_def, state), x, k, v)
        return x, (k, v)

    N = model.cfg.num_layers
    k0, v0 = caches if caches[0] is not None else (jnp.zeros((N,)), jnp.zeros((N,)))
    x, (ks, vs) = jax.lax.scan(body, x, (states, k0, v0))
    return x, (ks, vs)


def _logits(model, x_BxTxD):
    x_BxTxD = model.final_norm(x_BxTxD)
    return jnp.einsum("bld,dv->blv", x_BxTxD, model.output_weights(), preferred_element_type=jnp.float32)


def prefill(params, tokens_BxL, segment_ids_BxL, positions_BxL, *, graphdef):
    """The prompts' next-token logits (float32 [B, V], at each row's last real token) and the cache
    ``(k, v)`` (per-layer tuples of [B, L, K, Hd], or stacked [N, B, L, K, Hd] for a scanned model)."""
    model = nnx.merge(graphdef, params)
    cd = model.cfg.jnp_compute_dtype
    x = mesh_lib.constrain(jnp.take(model.embedding[...], tokens_BxL, axis=0).astype(cd), ("batch", None, "embed"))

    def layer(block, x, _k, _v):
        return _prefill_block(block, x, segment_ids_BxL, positions_BxL)

    x, cache = _run_blocks(model, x, layer, (None, None))
    last_B = jnp.maximum(jnp.sum(segment_ids_BxL != 0, axis=1) - 1, 0)
    x_Bx1xD = x[jnp.arange(x.shape[0]), last_B][:, None]
    return _logits(model, x_Bx1xD)[:, 0], cache


def extend(params, cache, tokens_B, positions_B, *, graphdef):
    """Logits (float32 [B, V]) after appending ``tokens_B`` at ``positions_B`` (each row's cache slot), and the
    updated cache."""
    model = nnx.merge(graphdef, params)
    cd = model.cfg.jnp_compute_dtype
    x = jnp.take(model.embedding[...], tokens_B[:, None], axis=0).astype(cd)
    positions_Bx1 = positions_B[:, None]

    def layer(block, x, k, v):
        return _decode_block(block, x, positions_Bx1, k, v)

    x, cache = _run_blocks(model, x, layer, cache)
    return _logits(model, x)[:, 0], cache


@dataclasses.dataclass(frozen=True)
class CacheState:
    """State of :class:`KVCacheStep`: the device cache and each live row's length (int [n], host)."""

    cache: Any
    lengths: np.ndarray


class KVCacheStep(StepConstructors):
    """A :class:`jaxpt.infer.decode.DecodeStep` with a KV cache (module docstring); same arguments as
    :class:`jaxpt.infer.decode.NoCacheStep`, which it replaces without changing any caller.

    Args:
      graphdef, params: the model split by ``nnx.split``.
      mesh, rules: where rows (``batch``), params and the cache are sharded; params not already on ``mesh`` are
        replicated onto it. ``mesh=None``: plain ``jax.jit`` wherever the params live (one process only).
      seq_len: row length L (cache slots per row), >= 2.
      batch_size: rows per call; rounded up to a multiple of the data-parallel size.
      pad_id: token id of padding slots.

    Raises:
      ValueError: ``seq_len < 2``; a model that cannot be decoded token by token (:func:`step_class` picks the
        cache-free step for it).
    """

    def __init__(self, graphdef, params, mesh: Mesh | None = None, rules=mesh_lib.DEFAULT_RULES, *, seq_len: int,
                 batch_size: int = 1, pad_id: int = 0):
        if seq_len < 2:
            raise ValueError(f"KVCacheStep: seq_len = {seq_len} must be >= 2")
        cfg = nnx.merge(graphdef, params).cfg
        if eval_routing(cfg) != "causal":
            raise ValueError(f"KVCacheStep: ModelConfig.mlp = {cfg.mlp!r} cannot route one token at a time, so a KV "
                             "cache would not reproduce its forward pass; decode it with NoCacheStep (step_class)")
        self.seq_len, self.pad_id, self.mesh = seq_len, pad_id, mesh
        batch_size = max(batch_size, 1)
        pre = lambda p, t, s, q: prefill(p, t, s, q, graphdef=graphdef)  # noqa: E731
        ext = lambda p, c, t, q: extend(p, c, t, q, graphdef=graphdef)  # noqa: E731
        if mesh is None:
            self.batch_size, self.params = batch_size, params
            self._prefill = jax.jit(pre)
            self._extend = jax.jit(ext, donate_argnums=1)
            self._put = jnp.asarray
            return
        self.batch_size, self.params, param_s, batch_s = place_on_mesh(params, mesh, rules, batch_size)

        # Rows are never split over ``sequence`` here (a one-token query cannot be; and the model's context-parallel
        # attention expects its zigzag row order, which only Decoder.hidden applies): ``length`` maps to no axis.
        act_rules = (("length", None), *rules)

        def sharded(fn):
            def traced(*args):
                with mesh_lib.activation_sharding(mesh, act_rules):
                    return fn(*args)
            return traced

        self._prefill = jax.jit(sharded(pre), in_shardings=(param_s, batch_s, batch_s, batch_s))
        self._extend = jax.jit(sharded(ext), donate_argnums=1)
        self._put = lambda a: jax.make_array_from_callback(a.shape, batch_s, lambda i: a[i])
        self._put_rows = lambda a: jax.make_array_from_callback(
            a.shape, NamedSharding(mesh, PartitionSpec(*batch_s.spec[:1])), lambda i: a[i])

    def prefill(self, prompts: Sequence[np.ndarray]) -> tuple[CacheState, np.ndarray]:
        """See :meth:`jaxpt.infer.decode.DecodeStep.prefill`."""
        if not 1 <= len(prompts) <= self.batch_size:
            raise ValueError(f"prefill: {len(prompts)} prompts for a batch of {self.batch_size} rows")
        tokens = np.full((self.batch_size, self.seq_len), self.pad_id, np.int32)
        lengths = np.zeros(self.batch_size, np.int64)
        for r, p in enumerate(prompts):
            p = np.asarray(p, np.int32).reshape(-1)
            if not 1 <= len(p) <= self.seq_len:
                raise ValueError(f"prefill: prompt {r} has {len(p)} tokens; need 1..{self.seq_len}")
            tokens[r, :len(p)] = p
            lengths[r] = len(p)
        columns = np.arange(self.seq_len)
        segment_ids = (columns[None] < lengths[:, None]).astype(np.int32)
        positions = (columns[None] * segment_ids).astype(np.int32)
        logits, cache = self._prefill(self.params, self._put(tokens), self._put(segment_ids), self._put(positions))
        n = len(prompts)
        return CacheState(cache, lengths[:n]), np.asarray(jax.device_get(logits))[:n]

    def extend(self, state: CacheState, tokens: np.ndarray) -> tuple[CacheState, np.ndarray]:
        """See :meth:`jaxpt.infer.decode.DecodeStep.extend`. The cache is donated: ``state`` must not be reused."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = len(state.lengths)
        if len(tokens) != n:
            raise ValueError(f"extend: {len(tokens)} tokens for {n} rows")
        if np.any(state.lengths >= self.seq_len):
            raise ValueError(f"extend: a row already holds seq_len = {self.seq_len} tokens")
        row_tokens = np.full(self.batch_size, self.pad_id, np.int32)
        row_tokens[:n] = tokens
        positions = np.zeros(self.batch_size, np.int32)  # padding rows write slot 0 of their own (unused) cache
        positions[:n] = state.lengths
        put = self._put if self.mesh is None else self._put_rows
        logits, cache = self._extend(self.params, state.cache, put(row_tokens), put(positions))
        return CacheState(cache, state.lengths + 1), np.asarray(jax.device_get(logits))[:n]
