"""Pure train and eval steps: no I/O, no host syncs. Wrapped in ``jax.jit`` by :func:`jit_train_step`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpt import mesh as mesh_lib
from jaxpt.model.auxiliary import AuxSpec, BatchTotals, flatten_aux, merge_specs, reduce_aux, weighted_aux_loss
from jaxpt.model.decoder import eval_routing
from jaxpt.training import noise_scale
from jaxpt.training.stability import decide_skip
from jaxpt.training.state import StateSpec, TrainState

#: Keys of a device batch; each is an int32 array [B, L].
BATCH_KEYS = ("tokens", "segment_ids", "positions")


def targets_and_weights(tokens_BxL: jax.Array, segment_ids_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Next-token targets within a packed row, and their weights.

    ``targets[:, t] = tokens[:, t+1]``; ``weights[:, t]`` is 1.0 where token t+1 continues the same
    (non-padding) segment as token t, else 0.0. So the first token of each document is never a target,
    padding never counts, and the last position of a row has no target.

    Returns: ``(targets int32 [B, L], weights float32 [B, L])``.
    """
    targets = jnp.concatenate([tokens_BxL[:, 1:], jnp.zeros_like(tokens_BxL[:, :1])], axis=1)
    nxt = jnp.concatenate([segment_ids_BxL[:, 1:], jnp.zeros_like(segment_ids_BxL[:, :1])], axis=1)
    weights = ((nxt == segment_ids_BxL) & (segment_ids_BxL != 0)).astype(jnp.float32)
    return targets, weights


def token_losses(logits_BxLxV: jax.Array, targets_BxL: jax.Array, *,
                 return_row_max: bool = False) -> tuple[jax.Array, ...]:
    """Per-token cross-entropy and ``log Z``, both float32 [B, L], computed in float32; with ``return_row_max``
    also each position's largest logit (float32 [B, L], no gradient).

    ``log Z = m + log(sum(exp(logits - m)))`` with ``m`` the row max held constant, as ``jax.nn.logsumexp`` computes
    it; the row max is returned so that the ``max_logit`` metric needs no second pass over the ``[B, L, V]`` logits.
    """
    logits = logits_BxLxV.astype(jnp.float32)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    log_z = row_max + jnp.log(jnp.sum(jnp.exp(logits - row_max[..., None]), axis=-1))
    target_logit = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
    return (log_z - target_logit, log_z, row_max) if return_row_max else (log_z - target_logit, log_z)


def chunked_token_losses(x_BxLxD: jax.Array, w_DxV: jax.Array, targets_BxL: jax.Array,
                         chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`token_losses` of ``logits = x @ w`` (float32), computed ``chunk`` positions at a time.

    A ``jax.checkpoint``-ed ``lax.scan`` over sequence chunks: the forward pass keeps only the per-token
    results, and the backward pass recomputes each chunk's logits, so at most ``[B, chunk, V]`` float32
    logits (and their gradient) exist at once instead of ``[B, L, V]`` (8.4 GB per chip for 2 x 8192 tokens
    at V = 128256). The cost is one more ``x @ w`` per chunk in the backward pass. ``L`` not a multiple of
    ``chunk`` is padded (the padded positions are dropped).

    Args:
      x_BxLxD: final hidden states (compute dtype). w_DxV: output projection (compute dtype).
      targets_BxL: int32 target ids. chunk: positions per chunk (> 0).
    Returns: ``(ce float32 [B, L], log_z float32 [B, L], max_logit float32 scalar)``.
    """
    B, L, D = x_BxLxD.shape
    n = -(-L // chunk)
    pad = n * chunk - L
    if pad:
        x_BxLxD = jnp.pad(x_BxLxD, ((0, 0), (0, pad), (0, 0)))
        targets_BxL = jnp.pad(targets_BxL, ((0, 0), (0, pad)))
    x_NxBxCxD = jnp.swapaxes(x_BxLxD.reshape(B, n, chunk, D), 0, 1)
    t_NxBxC = jnp.swapaxes(targets_BxL.reshape(B, n, chunk), 0, 1)

    @jax.checkpoint
    def one_chunk(w, x_BxCxD, t_BxC):
        logits_BxCxV = jnp.einsum("bcd,dv->bcv", x_BxCxD, w, preferred_element_type=jnp.float32)
        logits_BxCxV = mesh_lib.constrain(logits_BxCxV, ("batch", "length", "vocab"))
        return token_losses(logits_BxCxV, t_BxC, return_row_max=True)

    def body(_, xs):
        return None, one_chunk(w_DxV, *xs)

    _, outs = jax.lax.scan(body, None, (x_NxBxCxD, t_NxBxC))
    ce, log_z, row_max = (jnp.swapaxes(o, 0, 1).reshape(B, n * chunk)[:, :L] for o in outs)
    return ce, log_z, jnp.max(jax.lax.stop_gradient(row_max))


def model_token_losses(model, batch: dict[str, jax.Array], targets_BxL: jax.Array, *, return_aux: bool = False,
                       routing: str = "train", totals: BatchTotals | None = None):
    """Per-token cross-entropy of ``model`` on ``batch``: whole logits, or in chunks of
    ``ModelConfig.loss_chunk_size`` positions (:func:`chunked_token_losses`). ``routing``, ``totals``: as
    :meth:`jaxpt.model.Decoder.__call__` takes them.

    Returns: ``(ce float32 [B, L], log_z float32 [B, L], max_logit float32 scalar, model aux)``; the aux is
    the model's auxiliary outputs when ``return_aux``, else ``{}``.
    """
    args = (batch["tokens"], batch["segment_ids"], batch["positions"])
    options = {"routing": routing, "totals": totals}
    chunk = model.cfg.loss_chunk_size
    if chunk:
        x_BxLxD, aux = model.hidden(*args, **options)
        ce, log_z, max_logit = chunked_token_losses(x_BxLxD, model.output_weights(), targets_BxL, chunk)
        return ce, log_z, max_logit, (aux if return_aux else {})
    if return_aux:
        logits, aux = model(*args, return_aux=True, **options)
    else:
        logits, aux = model(*args, **options), {}
    ce, log_z, row_max = token_losses(logits, targets_BxL, return_row_max=True)
    return ce, log_z, jnp.max(row_max), aux


#: Reductions of the outputs :func:`loss_fn` computes itself. ``loss`` and ``z_loss`` are *summed* over
#: micro-batches because each micro-batch is normalized by the global batch's target-token count.
#: The model declares its own outputs (:meth:`jaxpt.model.Decoder.aux_specs`).
LOSS_AUX_SPECS = {"loss": AuxSpec("sum"), "z_loss": AuxSpec("sum"), "num_target_tokens": AuxSpec("sum"),
                  "max_logit": AuxSpec("max")}


def aux_specs(graphdef, params) -> dict[str, AuxSpec]:
    """Reductions of every output in :func:`loss_fn`'s aux: :data:`LOSS_AUX_SPECS` and the model's.

    Raises:
      ValueError: the model declares an output named like one of the loss's.
    """
    model_specs = nnx.merge(graphdef, params).aux_specs()
    return merge_specs(("the loss", LOSS_AUX_SPECS), ("the model", model_specs))


def loss_fn(params, graphdef, batch: dict[str, jax.Array], z_loss_weight: float, num_target_tokens=None,
            num_microbatches: int = 1, totals: BatchTotals | None = None):
    """Mean next-token cross-entropy (+ z-loss, + the model's weighted auxiliary losses) over the batch's
    target tokens.

    Args:
      params: ``nnx.State`` of params.
      graphdef: the model's graph definition.
      batch: ``tokens``, ``segment_ids``, ``positions`` int32 [B, L].
      z_loss_weight: coefficient of ``mean(log(Z)^2)`` (PaLM, Chowdhery et al. 2022, sec. 5); 0 disables.
      num_target_tokens: normalizer; by default the number of target tokens in ``batch``. Gradient
        accumulation passes the global batch's count so micro-batch losses *sum* to the global mean.
      num_microbatches: how many micro-batches make up the global batch: an auxiliary loss reduced by
        ``mean`` over micro-batches enters each one's objective divided by this
        (:meth:`jaxpt.model.auxiliary.AuxSpec.microbatch_loss_scale`).
      totals: the global batch's :class:`BatchTotals` when ``batch`` is one micro-batch of it
        (:func:`batch_totals`); the model's statistics are then this micro-batch's parts of the global values.

    Returns: ``(total_loss, aux)``; aux holds float32 scalars ``loss`` (cross-entropy), ``z_loss``,
    ``num_target_tokens`` (of this batch), ``max_logit`` (output), and the model's auxiliary outputs
    (unweighted), e.g. ``max_attention_logit`` where the attention implementation provides it.

    Raises:
      ValueError: the model declares an output named like one of the loss's own (:func:`aux_specs`).
    """
    model = nnx.merge(graphdef, params)
    targets, weights = targets_and_weights(batch["tokens"], batch["segment_ids"])
    ce, log_z, max_logit, model_aux = model_token_losses(model, batch, targets, return_aux=True, totals=totals)
    n = jnp.sum(weights) if num_target_tokens is None else num_target_tokens
    denom = jnp.maximum(n, 1.0)
    loss = jnp.sum(ce * weights) / denom
    z_loss = jnp.sum(jnp.square(log_z) * weights) / denom
    total = loss + z_loss_weight * z_loss
    specs = merge_specs(("the loss", LOSS_AUX_SPECS), ("the model", model.aux_specs()))  # no name clashes
    extra = weighted_aux_loss(specs, model_aux, num_microbatches)
    if extra is not None:  # nothing is added (not even 0.0) to a model without auxiliary losses
        total = total + extra
    aux = {"loss": loss, "z_loss": z_loss, "num_target_tokens": jnp.sum(weights),
           "max_logit": max_logit, **model_aux}
    return total, aux


def split_microbatches(batch: dict[str, jax.Array], num: int) -> dict[str, jax.Array]:
    """[B, L] -> [num, B / num, L], micro-batch i holding rows i, i + num, i + 2 num, ...

    Strided rows keep every micro-batch spread over all data-parallel shards (contiguous blocks would put
    a whole micro-batch on a few devices).
    """
    out = {}
    for k, v in batch.items():
        B = v.shape[0]
        out[k] = jnp.swapaxes(v.reshape(B // num, num, *v.shape[1:]), 0, 1)
    return out


def batch_totals(params, graphdef, batch: dict[str, jax.Array], micro: dict[str, jax.Array]) -> BatchTotals | None:
    """The global batch's statistics a model's layers need when they see it one micro-batch at a time.

    None for a model whose layers need none (:meth:`jaxpt.model.Decoder.batch_totals` empty: a dense model).
    Otherwise the real-token count of ``batch`` and, for each name the layers declare (a mixture of experts'
    ``moe/expert_share``, the ``f_i`` of its balancing loss), its value over the global batch, from a forward
    pass of the blocks over every micro-batch of ``micro`` (its routing decisions), without gradients: the cost of
    exact balancing under accumulation, one more forward pass of the blocks per step.

    Args:
      batch: the global batch, int32 [B, L] arrays; micro: it split by :func:`split_microbatches`.
    Returns: ``BatchTotals(tokens float32 scalar, per_layer {name: float32 [layers, ...]})`` or None.
    """
    names = nnx.merge(graphdef, params).batch_totals()
    if not names:
        return None
    tokens = jnp.sum((batch["segment_ids"] > 0).astype(jnp.float32))

    def body(_, mb):
        mb = {k: mesh_lib.constrain(v, ("batch", "length")) for k, v in mb.items()}
        model = nnx.merge(graphdef, params)
        _, aux = model.hidden(mb["tokens"], mb["segment_ids"], mb["positions"], totals=BatchTotals(tokens, {}))
        return None, {k: aux[k] for k in names}

    _, per_microbatch = jax.lax.scan(body, None, micro)
    summed = reduce_aux(aux_specs(graphdef, params), per_microbatch, over="microbatches")
    return BatchTotals(tokens, jax.lax.stop_gradient(summed))


def loss_and_grads(params, graphdef, batch, z_loss_weight: float, grad_accum: int = 1, grad_shardings=None):
    """Gradients of the global-batch mean loss, optionally accumulated over ``grad_accum`` micro-batches.

    Every micro-batch's loss is normalized by the target-token count of the *whole* global batch, so the
    sum over micro-batches equals the unaccumulated loss and gradients exactly (up to float rounding),
    whatever the number of real tokens in each micro-batch. Accumulation changes memory, not math: a model
    whose layers keep statistics of the whole batch (a mixture of experts' balancing loss, a product of batch
    means) gets them first (:func:`batch_totals`, one more forward pass) and returns each micro-batch's part.
    Each aux output is reduced over micro-batches, in order, as its :class:`AuxSpec` declares
    (:func:`aux_specs`): e.g. ``max_attention_logit`` by max.

    ``grad_shardings`` (a params-shaped tree of shardings, ZeRO-2): the accumulated gradients are kept in them,
    so each micro-batch's gradients are summed into a ``1/N`` shard (a reduce-scatter where XLA makes one).

    Returns: ``(aux, grads)`` with ``aux`` as in :func:`loss_fn` for the global batch.
    Raises:
      KeyError: the model returns an aux output it did not declare.
    """
    aux, grads, _ = accumulate_grads(params, graphdef, batch, z_loss_weight, grad_accum, grad_shardings)
    return aux, grads


def accumulate_grads(params, graphdef, batch, z_loss_weight: float, grad_accum: int = 1, grad_shardings=None):
    """:func:`loss_and_grads`, plus what the gradient noise scale needs (:mod:`jaxpt.training.noise_scale`).

    Returns: ``(aux, grads, micro)``; ``micro`` is None when ``grad_accum == 1``, else float32 scalars
    ``{"sq_norm": mean_i |G_i|^2, "inv_tokens": mean_i 1 / n_i}`` over the micro-batches, ``G_i`` micro-batch
    i's own mean gradient over its ``n_i`` target tokens (its accumulated part times ``n_total / n_i``;
    ``n_i`` is taken as at least 1). Cost: one squared norm of the gradients per micro-batch.
    Raises:
      KeyError: the model returns an aux output it did not declare.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if grad_accum == 1:
        (_, aux), grads = grad_fn(params, graphdef, batch, z_loss_weight)
        return aux, grads, None
    _, weights = targets_and_weights(batch["tokens"], batch["segment_ids"])
    n_total = jnp.sum(weights)
    micro = split_microbatches(batch, grad_accum)
    totals = batch_totals(params, graphdef, batch, micro)

    def body(g_acc, mb):
        mb = {k: mesh_lib.constrain(v, ("batch", "length")) for k, v in mb.items()}
        (_, aux), g = grad_fn(params, graphdef, mb, z_loss_weight, n_total, grad_accum, totals)
        n_i = jnp.maximum(aux["num_target_tokens"], 1.0)
        sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(g))
        noise = {"sq_norm": sq * jnp.square(n_total / n_i), "inv_tokens": 1.0 / n_i}
        return _placed(jax.tree.map(jnp.add, g_acc, g), grad_shardings), (aux, noise)

    zeros = _placed(jax.tree.map(jnp.zeros_like, params), grad_shardings)
    # Aux values come out stacked [grad_accum, ...] and are folded in micro-batch order afterwards.
    grads, (per_microbatch, noise) = jax.lax.scan(body, zeros, micro)
    aux = reduce_aux(aux_specs(graphdef, params), per_microbatch, over="microbatches")
    return aux, grads, {k: jnp.mean(v) for k, v in noise.items()}


def noise_metrics(micro, grad_norm, num_target_tokens) -> dict[str, jax.Array]:
    """Per-step noise-scale metrics (float32 scalars, :data:`jaxpt.training.noise_scale.STEP_KEYS`) from
    :func:`accumulate_grads`'s ``micro``, the global gradient's norm (before clipping) and the global batch's
    target tokens; ``{}`` without accumulation (``micro`` None: one batch size gives no estimate)."""
    if micro is None:
        return {}
    big_sq = jnp.square(grad_norm.astype(jnp.float32))
    grad_sq, trace = noise_scale.estimates(micro["sq_norm"], micro["inv_tokens"], big_sq,
                                           jnp.maximum(num_target_tokens, 1.0))
    return dict(zip(noise_scale.STEP_KEYS, (micro["sq_norm"], grad_sq, trace)))


def _placed(tree, shardings):
    """``tree`` constrained to ``shardings`` (a matching tree), or unchanged when ``shardings`` is None."""
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


#: Parameter groups for per-group gradient norms, matched on path names (first match wins).
PARAM_GROUPS = (("norms", "scale"), ("embeddings", "embedding"), ("embeddings", "output"),
                ("attention", "attn"), ("mlp", "mlp"))


def param_group(path) -> str:
    """Group of a parameter from its tree path: ``embeddings``, ``attention``, ``mlp``, ``norms`` or ``other``."""
    names = {str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path}
    for group, needle in PARAM_GROUPS:
        if needle in names:
            return group
    return "other"


def group_norms(tree) -> dict[str, jax.Array]:
    """L2 norm per :func:`param_group` of a params-shaped tree (float32 scalars)."""
    sq: dict[str, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        g = param_group(path)
        sq[g] = sq.get(g, 0.0) + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    return {g: jnp.sqrt(v) for g, v in sq.items()}


def train_step(state: TrainState, batch: dict[str, jax.Array], *, spec: StateSpec, z_loss_weight: float,
               lr_schedule, grad_clip_norm: float = 0.0, grad_accum: int = 1,
               lr_factor: float = 1.0) -> tuple[TrainState, dict[str, jax.Array]]:
    """One train step on one global batch. Pure: returns the new state and device metrics.

    The update is skipped (params, optimizer state, RNG and ``num_updates`` kept bit for bit; only ``step``
    advances, as the batch was consumed) when the step is non-finite or spikes (:func:`jaxpt.training.stability.decide_skip`). Updates are scaled by ``state.lr_scale`` and by ``lr_factor`` (a static
    factor: a batch-size ramp's learning-rate rule, :mod:`jaxpt.training.batch_ramp`; 1.0 leaves the program unchanged).

    Metrics (float32 scalars): ``loss``, ``z_loss``, ``grad_norm`` (global L2, before clipping),
    ``grad_norm/<group>``, ``update_param_ratio`` (||update|| / ||params||), ``learning_rate`` (the rate
    this update used, damping included), ``num_target_tokens``, ``max_logit``, the model's auxiliary outputs
    (``max_attention_logit`` where the attention implementation reports it; absent otherwise; an array output
    such as ``moe/expert_share`` [layers, experts] as one scalar per element, ``moe/expert_share/layer0/expert1``),
    ``skipped``, ``nonfinite``, ``clipped``, ``clipped_fraction``, spike thresholds; with ``grad_accum >= 2``
    the gradient noise scale's per-step estimates ``gns/micro_grad_sq``, ``gns/grad_sq``, ``gns/trace``
    (:func:`noise_metrics`).

    With ``spec.opt_state_device_shardings`` set (optimizer state offloaded to ``pinned_host`` memory), the
    optimizer state is copied to device memory for the update and the new state back to host memory; the
    numbers are the same as without offload.

    With ``spec.update_shardings`` set (``TrainConfig.shard_optimizer_state``, ZeRO-1/2), the gradients are
    constrained to those shards (a reduce-scatter where XLA makes one), the update runs there on the matching
    slices of the params, and the new params are all-gathered back to their own shardings; the same numbers up
    to the order of float sums.
    """
    zero = spec.update_shardings
    aux, grads, micro = accumulate_grads(state.params, spec.graphdef, batch, z_loss_weight, grad_accum, zero)
    grads = _placed(grads, zero)
    old_params = _placed(state.params, zero)  # a local slice: no communication
    grad_norm = optax.global_norm(grads)
    clipped = (grad_norm > grad_clip_norm) if grad_clip_norm > 0 else jnp.asarray(False)
    old_opt_state = state.opt_state
    if spec.opt_state_device_shardings is not None:  # offloaded: host -> device for the update
        # The barrier makes the copy wait for the gradients: otherwise XLA may prefetch the state to the device
        # early, where it sits beside the backward pass's activations and the offload saves nothing at the peak.
        grads, old_opt_state = jax.lax.optimization_barrier((grads, old_opt_state))
        old_opt_state = jax.device_put(old_opt_state, spec.opt_state_device_shardings)
    updates, opt_state = spec.tx.update(grads, old_opt_state, old_params)
    lr_scale = state.lr_scale if lr_factor == 1.0 else state.lr_scale * jnp.float32(lr_factor)
    updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
    params = optax.apply_updates(old_params, updates)
    skip, history, stab_metrics = decide_skip(spec.stability, state.stability, aux["loss"], grad_norm, clipped)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)  # noqa: E731
    rng = keep(jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0]), state.rng)
    # Non-scalar outputs (per-layer expert shares) leave as named scalars, so every writer sees floats.
    metrics = dict(flatten_aux(aux_specs(spec.graphdef, state.params), aux), **stab_metrics)
    metrics.update({"grad_norm": grad_norm, **noise_metrics(micro, grad_norm, aux["num_target_tokens"])})
    metrics.update({f"grad_norm/{g}": v for g, v in group_norms(grads).items()})
    metrics["update_param_ratio"] = optax.global_norm(updates) / jnp.maximum(optax.global_norm(state.params), 1e-12)
    metrics["learning_rate"] = jnp.asarray(lr_schedule(state.num_updates), jnp.float32) * lr_scale
    opt_state = keep(opt_state, old_opt_state)
    if spec.opt_state_device_shardings is not None:  # and back to host memory until the next step
        opt_state = jax.device_put(opt_state, spec.shardings.opt_state)
    new_state = state.replace(
        step=state.step + 1, params=_placed(keep(params, old_params), None if zero is None else spec.shardings.params),
        opt_state=opt_state,
        rng=rng, num_updates=state.num_updates + (~skip).astype(jnp.int32), stability=history)
    return new_state, metrics


def eval_step(params, batch: dict[str, jax.Array], *, graphdef) -> dict[str, jax.Array]:
    """Summed held-out cross-entropy and target-token count (float32 scalars), so means can be pooled. The
    model routes as evaluation does (:func:`jaxpt.model.decoder.eval_routing`: each token by itself)."""
    model = nnx.merge(graphdef, params)
    targets, weights = targets_and_weights(batch["tokens"], batch["segment_ids"])
    ce, _, _, _ = model_token_losses(model, batch, targets, routing=eval_routing(model.cfg))
    return {"loss_sum": jnp.sum(ce * weights), "num_target_tokens": jnp.sum(weights)}


def batch_shardings(mesh: Mesh, rules) -> dict[str, NamedSharding]:
    """Sharding of each device batch key: ``[batch, length]`` by the rules (batch over data x fsdp)."""
    s = mesh_lib.batch_sharding(mesh, rules)
    return {k: s for k in BATCH_KEYS}


def jit_train_step(spec: StateSpec, mesh: Mesh, rules, *, z_loss_weight: float, lr_schedule,
                   grad_clip_norm: float = 0.0, grad_accum: int = 1, lr_factor: float = 1.0,
                   donate_state: bool = True):
    """``jax.jit`` of :func:`train_step` with explicit in/out shardings and the state donated (``donate_state``).

    ``donate_state=False`` keeps the input state alive. Measured on the XLA CPU backend (``data=8``,
    ``benchmarks/step_profile.py``; an interleaved A/B in one process, 3 rounds of 10 steps): 1.15x the step rate
    without donation, because with it XLA's copy insertion copies every param and Adam moment at the start of the
    step (125 full-size copies, 100 MB per device, for the reference model of ``benchmarks/train_throughput.py``):
    the skip policy's ``where(skip, old, new)`` and the ``update_param_ratio`` metric read the old buffers in fusions
    it cannot order before the in-place writes. It is not the default: without donation the CPU runtime starts the
    next sharded program before the last one finishes, and a test aborted in a collective rendezvous under load.

    Activations are constrained by the logical rules (traced under :func:`jaxpt.mesh.activation_sharding`).
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    fn = functools.partial(train_step, spec=spec, z_loss_weight=z_loss_weight, lr_schedule=lr_schedule,
                           grad_clip_norm=grad_clip_norm, grad_accum=grad_accum, lr_factor=lr_factor)

    def traced(state, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            return fn(state, batch)

    return jax.jit(traced, in_shardings=(spec.shardings, batch_shardings(mesh, rules)),
                   out_shardings=(spec.shardings, replicated), donate_argnums=(0,) if donate_state else ())


def jit_eval_step(spec: StateSpec, mesh: Mesh, rules):
    """``jax.jit`` of :func:`eval_step` (params not donated; compiled once, reused every evaluation)."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def traced(params, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            return eval_step(params, batch, graphdef=spec.graphdef)

    return jax.jit(traced, in_shardings=(spec.shardings.params, batch_shardings(mesh, rules)),
                   out_shardings=replicated)
