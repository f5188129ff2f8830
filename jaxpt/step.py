"""Pure train and eval steps: no I/O, no host syncs. Wrapped in ``jax.jit`` by :func:`jit_train_step`."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpt import mesh as mesh_lib
from jaxpt.state import StateSpec, TrainState

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


def token_losses(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token cross-entropy and ``log Z``, both float32 [B, L], computed in float32."""
    logits = logits_BxLxV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_BxL[..., None], axis=-1)[..., 0]
    return log_z - target_logit, log_z


def loss_fn(params, graphdef, batch: dict[str, jax.Array], z_loss_weight: float, num_target_tokens=None):
    """Mean next-token cross-entropy (+ z-loss) over the batch's target tokens.

    Args:
      params: ``nnx.State`` of params.
      graphdef: the model's graph definition.
      batch: ``tokens``, ``segment_ids``, ``positions`` int32 [B, L].
      z_loss_weight: coefficient of ``mean(log(Z)^2)`` (PaLM, Chowdhery et al. 2022, sec. 5).
      num_target_tokens: normalizer; by default the number of target tokens in ``batch``. Gradient
        accumulation passes the global batch's count so micro-batches sum to the same mean.

    Returns: ``(total_loss, aux)``; aux has ``loss`` (cross-entropy), ``z_loss``, ``num_target_tokens``
    (float32 scalars) and ``max_logit``.
    """
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    targets, weights = targets_and_weights(batch["tokens"], batch["segment_ids"])
    ce, log_z = token_losses(logits, targets)
    n = jnp.sum(weights) if num_target_tokens is None else num_target_tokens
    denom = jnp.maximum(n, 1.0)
    loss = jnp.sum(ce * weights) / denom
    z_loss = jnp.sum(jnp.square(log_z) * weights) / denom
    total = loss + z_loss_weight * z_loss
    aux = {"loss": loss, "z_loss": z_loss, "num_target_tokens": jnp.sum(weights),
           "max_logit": jnp.max(logits)}
    return total, aux


def train_step(state: TrainState, batch: dict[str, jax.Array], *, spec: StateSpec, z_loss_weight: float,
               lr_schedule) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on one global batch. Pure: returns the new state and device metrics.

    Metrics (float32 scalars): ``loss`` (cross-entropy), ``z_loss``, ``grad_norm`` (global L2 norm
    before clipping), ``learning_rate`` (the rate used by this update), ``num_target_tokens``, ``max_logit``.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, aux), grads = grad_fn(state.params, spec.graphdef, batch, z_loss_weight)
    updates, opt_state = spec.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    metrics = dict(aux)
    metrics["grad_norm"] = optax.global_norm(grads)
    metrics["learning_rate"] = jnp.asarray(lr_schedule(state.step), jnp.float32)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
    return new_state, metrics


def eval_step(params, batch: dict[str, jax.Array], *, graphdef) -> dict[str, jax.Array]:
    """Summed held-out cross-entropy and target-token count (float32 scalars), so means can be pooled."""
    model = nnx.merge(graphdef, params)
    logits = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    targets, weights = targets_and_weights(batch["tokens"], batch["segment_ids"])
    ce, _ = token_losses(logits, targets)
    return {"loss_sum": jnp.sum(ce * weights), "num_target_tokens": jnp.sum(weights)}


def batch_shardings(mesh: Mesh, rules) -> dict[str, NamedSharding]:
    """Sharding of each device batch key: ``[batch, length]`` by the rules (batch over data x fsdp)."""
    s = mesh_lib.batch_sharding(mesh, rules)
    return {k: s for k in BATCH_KEYS}


def jit_train_step(spec: StateSpec, mesh: Mesh, rules, *, z_loss_weight: float, lr_schedule):
    """``jax.jit`` of :func:`train_step` with explicit in/out shardings and the state donated.

    Activations are constrained by the logical rules (traced under :func:`jaxpt.mesh.activation_sharding`).
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    fn = functools.partial(train_step, spec=spec, z_loss_weight=z_loss_weight, lr_schedule=lr_schedule)

    def traced(state, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            return fn(state, batch)

    return jax.jit(traced, in_shardings=(spec.shardings, batch_shardings(mesh, rules)),
                   out_shardings=(spec.shardings, replicated), donate_argnums=(0,))


def jit_eval_step(spec: StateSpec, mesh: Mesh, rules):
    """``jax.jit`` of :func:`eval_step` (params not donated; compiled once, reused every evaluation)."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def traced(params, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            return eval_step(params, batch, graphdef=spec.graphdef)

    return jax.jit(traced, in_shardings=(spec.shardings.params, batch_shardings(mesh, rules)),
                   out_shardings=replicated)
