"""Auxiliary outputs of the model and the train step, each with a declared reduction.

A layer (an attention implementation, an MLP) may return, next to its activations, a dict of auxiliary
values: monitors such as ``max_attention_logit``, or losses such as a future mixture-of-experts load-balancing
loss. Each name is declared once with an :class:`AuxSpec` saying how per-layer values combine into one per
model call, how per-micro-batch values combine into one per train step, and whether the value is a loss
term added to the training objective. The decoder's layer loop and the gradient-accumulation scan carry
whatever is declared, so a new auxiliary output needs no change to either.

Reductions fold values in order (layer 0 first, micro-batch 0 first) with plain binary ops, so a running
sum is summed in the same order as a hand-written loop would, bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

#: How values combine: ``max`` (monitors of the worst case), ``sum`` (counts, per-layer losses summed over
#: layers), ``mean`` (the average of equal-weight parts: layers, or micro-batches of equal row count),
#: ``stack`` (over layers only: keep one value per layer, stacked on a new leading axis, e.g. the share of
#: tokens each expert of each MoE layer receives).
REDUCTIONS = ("max", "sum", "mean", "stack")


@dataclasses.dataclass(frozen=True)
class AuxSpec:
    """How one auxiliary output is reduced and whether it is a loss term.

    Attributes:
      reduce: reduction over layers (one of :data:`REDUCTIONS`).
      over_microbatches: reduction over gradient-accumulation micro-batches; ``None`` means ``reduce``.
        ``mean`` matches the unaccumulated value of a per-row statistic (each micro-batch holds ``1/grad_accum``
        of the global batch's rows) exactly only when it is a plain mean over rows. A statistic over the batch's
        tokens (a mean over real tokens, a product of batch means such as a load-balancing loss) is exact as
        ``sum`` of parts, each micro-batch's call given the whole batch's :class:`BatchTotals` (the mixture of
        experts, :mod:`jaxpt.model.moe`).
      loss_weight: if nonzero, ``loss_weight * value`` is added to the training loss (the value reported as
        a metric stays unweighted). Gradients through a ``max`` over micro-batches cannot be accumulated
        one micro-batch at a time, so a loss must reduce over micro-batches by ``sum`` or ``mean``.
      index_names: for a non-scalar value (``stack`` over layers, or a per-layer vector), one name per
        dimension: the train step reports element ``[i, j]`` of ``moe/expert_share`` with
        ``index_names=("layer", "expert")`` as the scalar metric ``moe/expert_share/layer{i}/expert{j}``
        (:func:`flatten_aux`). Empty for scalars.

    Raises:
      ValueError: an unknown reduction, ``stack`` over micro-batches, or a weighted loss reduced by ``max``
        or ``stack``.
    """

    reduce: str
    over_microbatches: str | None = None
    loss_weight: float = 0.0
    index_names: tuple[str, ...] = ()

    def __post_init__(self):
        for name in (self.reduce, self.microbatch_reduce):
            if name not in REDUCTIONS:
                raise ValueError(f"AuxSpec reduction {name!r}: choose one of {REDUCTIONS}")
        if self.microbatch_reduce == "stack":
            raise ValueError("AuxSpec: 'stack' is a reduction over layers; over micro-batches choose 'sum', "
                             "'mean' or 'max'")
        if self.loss_weight and self.reduce == "stack":
            raise ValueError("an auxiliary loss (loss_weight != 0) must be a scalar: it cannot reduce by 'stack'")
        if self.loss_weight and self.microbatch_reduce == "max":
            raise ValueError("an auxiliary loss (loss_weight != 0) must reduce over micro-batches by 'sum' or "
                             "'mean': gradients of a max cannot be accumulated per micro-batch")

    @property
    def microbatch_reduce(self) -> str:
        return self.over_microbatches or self.reduce

    def microbatch_loss_scale(self, num_microbatches: int) -> float:
        """Factor on one micro-batch's loss term so that gradients summed over micro-batches are those of
        the reduced value: ``1/num_microbatches`` for ``mean``, 1 for ``sum``."""
        return 1.0 / num_microbatches if self.microbatch_reduce == "mean" else 1.0


class BatchTotals(NamedTuple):
    """What a layer called on one micro-batch needs to know of the whole (global) batch, so that its statistics
    come out as parts of the whole batch's values (summed over micro-batches) and gradient accumulation changes
    no number beyond float rounding (:func:`jaxpt.training.step.batch_totals` computes them).

    Attributes:
      tokens: float32 scalar, real tokens (segment id > 0) of the whole batch.
      per_layer: auxiliary output name -> its value over the whole batch (reduced over micro-batches as its
        :class:`AuxSpec` says). Given to a model: stacked over the layers that produce it, ``[layers, ...]``;
        given to one layer: that layer's row. Only the names a layer declares in its ``batch_totals``
        (:mod:`jaxpt.model.mlp`); may be empty (then a layer uses its own call's values for them).
    """

    tokens: jax.Array
    per_layer: Mapping[str, jax.Array]

    def layer(self, index: int) -> "BatchTotals":
        """The totals one layer sees: row ``index`` of each ``per_layer`` value (``index`` counts the layers that
        produce it)."""
        return BatchTotals(self.tokens, {k: v[index] for k, v in self.per_layer.items()})


def fold(reduction: str, values: Sequence[jax.Array] | jax.Array) -> jax.Array:
    """Reduce values in order with a left fold: ``((v0 op v1) op v2) ...``; ``mean`` divides the sum by the count.

    ``stack`` keeps every value: ``values`` stacked on a new leading axis (returned as is when already stacked).

    Args:
      reduction: one of :data:`REDUCTIONS`.
      values: a non-empty sequence of same-shape arrays, or one array whose leading axis indexes them
        (as stacked by ``scan``).
    Returns: an array of one value's shape and dtype (``stack``: ``[len(values), *shape]``).
    """
    if reduction == "stack":
        return values if isinstance(values, jax.Array) else jnp.stack(list(values))
    items = [values[i] for i in range(values.shape[0])] if isinstance(values, jax.Array) else list(values)
    op = jnp.maximum if reduction == "max" else jnp.add
    acc = items[0]
    for v in items[1:]:
        acc = op(acc, v)
    if reduction == "mean":
        acc = acc / jnp.asarray(len(items), acc.dtype)
    return acc


def reduce_aux(specs: Mapping[str, AuxSpec], per_part: Mapping[str, Sequence[jax.Array] | jax.Array], *,
               over: str) -> dict[str, jax.Array]:
    """Reduce each auxiliary output over layers (``over='layers'``) or micro-batches (``over='microbatches'``).

    Args:
      specs: the declaration of every name in ``per_part``.
      per_part: name -> the values of each part (a sequence, or an array stacked on axis 0).
    Raises:
      KeyError: a name without a declaration (naming it), so nothing is reduced by an unstated rule.
      ValueError: ``over`` is neither.
    """
    if over not in ("layers", "microbatches"):
        raise ValueError(f"reduce_aux over={over!r}: 'layers' or 'microbatches'")
    out = {}
    for name, values in per_part.items():
        if name not in specs:
            raise KeyError(f"auxiliary output {name!r} has no AuxSpec (declared: {sorted(specs)})")
        spec = specs[name]
        out[name] = fold(spec.reduce if over == "layers" else spec.microbatch_reduce, values)
    return out


def merge_specs(*named: tuple[str, Mapping[str, AuxSpec]]) -> dict[str, AuxSpec]:
    """Union of declarations from several sources, e.g. ``("attention 'xla'", {...}), ("mlp 'swiglu'", {...})``.

    Raises:
      ValueError: two sources declare the same name (their values would silently overwrite each other).
    """
    out: dict[str, AuxSpec] = {}
    owner: dict[str, str] = {}
    for source, specs in named:
        for name, spec in specs.items():
            if name in out:
                raise ValueError(f"auxiliary output {name!r} is declared by both {owner[name]} and {source}")
            out[name], owner[name] = spec, source
    return out


def weighted_aux_loss(specs: Mapping[str, AuxSpec], values: Mapping[str, jax.Array],
                      num_microbatches: int = 1) -> jax.Array | None:
    """``sum(loss_weight * value * microbatch_loss_scale)`` over the declared losses among ``values``.

    Returns None (not 0.0) when no value is a weighted loss, so a model without auxiliary losses leaves the
    training objective's computation exactly as it was.
    """
    total = None
    for name in sorted(values):
        spec = specs[name]
        if not spec.loss_weight:
            continue
        term = values[name] * jnp.asarray(spec.loss_weight * spec.microbatch_loss_scale(num_microbatches),
                                          values[name].dtype)
        total = term if total is None else total + term
    return total


def flatten_aux(specs: Mapping[str, AuxSpec], values: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Every value as scalars: a scalar is kept; element ``idx`` of an array named ``name`` becomes
    ``name/<index_names[0]><idx[0]>/<index_names[1]><idx[1]>...`` (so metric writers see only scalars).

    Raises:
      ValueError: a non-scalar value whose spec's ``index_names`` does not name each of its dimensions.
    """
    out: dict[str, jax.Array] = {}
    for name, value in values.items():
        if jnp.ndim(value) == 0:
            out[name] = value
            continue
        names = specs[name].index_names if name in specs else ()
        if len(names) != jnp.ndim(value):
            raise ValueError(f"auxiliary output {name!r} has shape {jnp.shape(value)} but its AuxSpec names "
                             f"{len(names)} index dimensions ({names})")
        for idx in itertools.product(*(range(n) for n in jnp.shape(value))):
            out[name + "".join(f"/{n}{i}" for n, i in zip(names, idx))] = value[idx]
    return out
