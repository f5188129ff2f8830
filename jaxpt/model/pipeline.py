"""Pipeline parallelism over the ``stage`` mesh axis: GPipe and the circular (interleaved) schedule.

The layer stack ``[N, ...]`` is cut into ``S x R`` groups of ``K = N / (S R)`` consecutive layers; group
``g = r S + s`` runs on stage ``s`` in its ``r``-th pass (``R = 1``: GPipe, Huang et al. 2019; ``R > 1``:
the circular / interleaved schedule, Narayanan et al. 2021 sec. 2.2, as MaxText's ``pipeline.py``). The batch
is cut into ``M`` micro-batches that move from stage to stage by ``jax.lax.ppermute`` inside a
``jax.shard_map`` that is manual over ``stage`` only, so ``data``, ``fsdp`` and ``tensor`` sharding of the
activations and weights inside a stage stay automatic (XLA's SPMD partitioner, as without a pipeline).

Schedule: at iteration ``t`` (of ``T = M R + S - 1``), stage ``s`` works on item ``i = t - s`` (micro-batch
``i mod M`` in pass ``i div M``) when ``0 <= i < M R``, else idles (the bubble). Stage 0 reads its input
from a buffer of the ``M`` micro-batches; the last stage's output goes round the ring back to stage 0 and
overwrites that micro-batch's slot, to be read again ``M - S`` iterations later in the next pass (hence
``M >= S``) and, after the last pass, returned. The idle share of a stage is ``(S - 1) / (M R + S - 1)``
(GPipe: ``(S - 1) / (M + S - 1)``, Huang et al. 2019 sec. 2.3).

Params stay stored as ``[N, ...]`` (whatever ``S``), so checkpoints restore across pipeline layouts; the
reshape to ``[R, S, K, ...]`` happens inside the step (for ``R > 1`` it moves weights between stages,
since a stage's layers are not contiguous in ``[N]``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxpt.mesh import PIPELINE_AXIS, constrain
from jaxpt.model.auxiliary import AuxSpec, fold, reduce_aux

#: ``(params with leading [K], x [b, L, D], *side [b, L]) -> (y [b, L, D], {name: [K] per-layer value})``.
LayerGroupFn = Callable[..., tuple[jax.Array, Mapping[str, jax.Array]]]


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle share of each stage's time, ``(S - 1) / (M R + S - 1)`` (Huang et al. 2019 sec. 2.3 for R = 1;
    Narayanan et al. 2021 sec. 2.2 for the interleaved schedule, in units of one layer group)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


def split_microbatches(x: jax.Array, num: int) -> jax.Array:
    """``[B, ...] -> [num, B / num, ...]``, micro-batch ``j`` holding rows ``j, j + num, ...`` (strided, so each
    stays spread over the data-parallel shards, as :func:`jaxpt.training.step.split_microbatches`)."""
    B = x.shape[0]
    return jnp.swapaxes(x.reshape(B // num, num, *x.shape[1:]), 0, 1)


def merge_microbatches(x: jax.Array) -> jax.Array:
    """Inverse of :func:`split_microbatches`: ``[num, b, ...] -> [num b, ...]``."""
    num, b = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape(num * b, *x.shape[2:])


def _stage_program(group_fn: LayerGroupFn, *, S: int, M: int, R: int, K: int):
    """The per-stage program of :func:`run_pipeline` (run under ``shard_map`` over the ``stage`` axis):
    ``(params [R, 1, K, ...], x [M, B/M, L, D], side) -> (x [M, B/M, L, D], aux {name: [R, K, M]})``.

    Over ``T = M R + S - 1`` ticks, stage ``s`` runs item ``t - s`` (repeat ``r``, micro-batch ``m``) through its
    ``K`` layers of repeat ``r`` and passes the result round the ring; stage 0 files what the last stage finished.
    """
    T = M * R + S - 1
    ring = [(j, (j + 1) % S) for j in range(S)]

    def stage_body(p_Rx1xK, x_M, side_M):
        s = jax.lax.axis_index(PIPELINE_AXIS)
        p_RxK = jax.tree.map(lambda a: a[:, 0], p_Rx1xK)
        # The inputs are the same on every stage; what each stage computes from them is not.
        x_M, side_M = jax.lax.pcast((x_M, side_M), PIPELINE_AXIS, to="varying")
        _, aux_shapes = jax.eval_shape(group_fn, jax.tree.map(lambda a: a[0], p_RxK), x_M[0],
                                       *(a[0] for a in side_M))
        aux0 = {k: jnp.zeros((R, K, M), v.dtype) for k, v in aux_shapes.items()}
        aux0 = jax.lax.pcast(aux0, PIPELINE_AXIS, to="varying")
        recv0 = jnp.zeros_like(x_M[0])
        buf0 = x_M

        def step(carry, t):
            buf, recv, aux_acc = carry
            i = t - s
            valid = (i >= 0) & (i < M * R)
            ic = jnp.clip(i, 0, M * R - 1)
            r, m = ic // M, ic % M
            # In the bubble (not valid) a stage computes on a placeholder whose result nothing reads: SPMD runs
            # one program on every stage, so idling would not be faster than computing.
            x_in = jnp.where(s == 0, jax.lax.dynamic_index_in_dim(buf, m, 0, keepdims=False), recv)
            p_K = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), p_RxK)
            y, aux = group_fn(p_K, x_in, *(jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False) for a in side_M))
            for k, v in aux.items():
                old = aux_acc[k][r, :, m]
                aux_acc = {**aux_acc, k: aux_acc[k].at[r, :, m].set(jnp.where(valid, v, old))}
            sent = jax.lax.ppermute(y, PIPELINE_AXIS, ring)
            # Stage 0 receives what the last stage finished (item t - (S - 1)) and files it under its micro-batch.
            j = t - (S - 1)
            done = (s == 0) & (j >= 0) & (j < M * R)
            mj = jnp.clip(j, 0, M * R - 1) % M
            old = jax.lax.dynamic_index_in_dim(buf, mj, 0, keepdims=False)
            buf = jax.lax.dynamic_update_index_in_dim(buf, jnp.where(done, sent, old), mj, 0)
            return (buf, sent, aux_acc), None

        (buf, _, aux_acc), _ = jax.lax.scan(step, (buf0, recv0, aux0), jnp.arange(T))
        # Stage 0 holds the finished micro-batches; the sum hands them to every stage (for the head and loss).
        out = jax.lax.psum(jnp.where(s == 0, buf, jnp.zeros_like(buf)), PIPELINE_AXIS)
        return out, aux_acc

    return stage_body


def run_pipeline(group_fn: LayerGroupFn, params: Any, x_BxLxD: jax.Array, side: tuple[jax.Array, ...], *,
                 mesh: Mesh, microbatches: int, repeats: int,
                 aux_specs: Mapping[str, AuxSpec]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Run ``N`` stacked layers over ``x`` as a pipeline over ``mesh``'s ``stage`` axis.

    Args:
      group_fn: runs ``K`` consecutive layers (see :data:`LayerGroupFn`).
      params: pytree of arrays, each with a leading ``[N]`` layers axis.
      x_BxLxD: the residual stream entering layer 0.
      side: per-row inputs every layer reads (segment ids, positions), each ``[B, L]``.
      mesh: the mesh; ``S = mesh.shape['stage']``.
      microbatches: ``M``, divides ``B``, ``>= S``. repeats: ``R`` passes (layer groups per stage).
      aux_specs: the reduction of each per-layer auxiliary output of ``group_fn``.

    Returns:
      ``(x [B, L, D] after layer N - 1, aux)``; each aux output reduced over micro-batches (its
      ``microbatch_reduce``), then over layers, as :func:`jaxpt.model.auxiliary.reduce_aux` does.

    Raises:
      ValueError: ``N`` not divisible by ``S R``, ``B`` by ``M``, or ``M < S`` (config validation names the key
        first: :func:`jaxpt.config.validate`).
    """
    S, M, R = int(mesh.shape[PIPELINE_AXIS]), microbatches, repeats
    N = jax.tree.leaves(params)[0].shape[0]
    B = x_BxLxD.shape[0]
    if N % (S * R) or B % M or M < S:
        raise ValueError(f"pipeline: {N} layers over {S} stages x {R} repeats, batch {B} in {M} micro-batches "
                         "(need layers % (stages x repeats) == 0, batch % micro-batches == 0, micro-batches >= stages)")
    K = N // (S * R)
    params_RxSxK = jax.tree.map(lambda a: a.reshape(R, S, K, *a.shape[1:]), params)
    x_M = constrain(split_microbatches(x_BxLxD, M), (None, "batch", "length", "embed"))
    side_M = tuple(constrain(split_microbatches(a, M), (None, "batch", "length")) for a in side)
    stage_body = _stage_program(group_fn, S=S, M=M, R=R, K=K)
    param_spec = jax.tree.map(lambda _: P(None, PIPELINE_AXIS), params_RxSxK)
    out_M, aux_RxNxM = jax.shard_map(
        stage_body, mesh=mesh, in_specs=(param_spec, P(), P()), out_specs=(P(), P(None, PIPELINE_AXIS)),
        axis_names={PIPELINE_AXIS})(params_RxSxK, x_M, side_M)
    x_BxLxD = constrain(merge_microbatches(out_M), ("batch", "length", "embed"))
    # [R, S K, M] -> [N, M] in layer order (layer r S K + s K + k), then micro-batches, then layers.
    per_layer = {}
    for k, v in aux_RxNxM.items():
        v_NxM = v.reshape(N, M)
        per_layer[k] = jnp.stack([fold(aux_specs[k].microbatch_reduce, v_NxM[n]) for n in range(N)])
    return x_BxLxD, reduce_aux(aux_specs, per_layer, over="layers")
