"""Optimizer: optax AdamW, learning-rate schedules, global-norm clipping, weight-decay mask."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from jaxpt.util.errors import ConfigError
from jaxpt.util.validation import check_types, non_negative, positive, require

Schedule = Literal["cosine", "wsd", "constant"]
SCHEDULES: tuple[str, ...] = typing.get_args(Schedule)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (Loshchilov & Hutter 2019) with warmup and a decay schedule.

    Attributes:
      peak_learning_rate: learning rate at the end of warmup.
      schedule: ``cosine`` (linear warmup, then cosine to ``min_lr_ratio * peak`` at ``decay_steps``),
        ``wsd`` (warmup-stable-decay, Hu et al. 2024 "MiniCPM": linear warmup, constant, then a linear
        decay over the last ``wsd_decay_fraction`` of ``decay_steps`` to ``min_lr_ratio * peak``), or
        ``constant`` (after warmup).
      warmup_steps: steps of linear warmup from 0.
      decay_steps: the step at which the schedule reaches its final value (usually the planned length of
        the run). Set it explicitly: with 0 the run's ``TrainConfig.steps`` is used, so resuming with a
        larger ``--steps`` would change the schedule of the steps already taken.
      min_lr_ratio: final learning rate as a fraction of the peak.
      wsd_decay_fraction: fraction of ``decay_steps`` spent in the WSD decay phase.
      b1, b2, eps: Adam moments' decay rates and epsilon.
      weight_decay: decoupled weight decay coefficient (applied as ``lr * wd * param``).
      decay_embeddings: whether the embedding table (and a tied output) gets weight decay. Off by default,
        as in GPT-NeoX/OLMo: decaying rarely-seen token rows shrinks them towards zero between updates.
      grad_clip_norm: clip the global gradient L2 norm to this value (0 disables).

    Raises:
      ConfigError: at construction, naming ``OptimizerConfig.<field> = <value>``: a wrong type, an unknown
        schedule, ``peak_learning_rate <= 0``, negative steps, ``weight_decay`` or ``grad_clip_norm``,
        ``min_lr_ratio`` outside [0, 1], ``wsd_decay_fraction`` outside (0, 1], ``b1``/``b2`` outside [0, 1)
        or ``eps <= 0``; with ``decay_steps`` set, phases that do not fit it (:func:`check_schedule`). (With
        ``decay_steps = 0`` the horizon is ``TrainConfig.steps``: :func:`jaxpt.config.validate` checks it.)
    """

    peak_learning_rate: float = 3e-3
    schedule: Schedule = "cosine"
    warmup_steps: int = 50
    decay_steps: int = 0
    min_lr_ratio: float = 0.1
    wsd_decay_fraction: float = 0.2
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    grad_clip_norm: float = 1.0

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "peak_learning_rate", "eps")
        non_negative(self, "warmup_steps", "decay_steps", "weight_decay", "grad_clip_norm")
        require(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        require(self, "wsd_decay_fraction", 0 < self.wsd_decay_fraction <= 1, "must be in (0, 1]")
        for name in ("b1", "b2"):
            require(self, name, 0 <= getattr(self, name) < 1, "must be in [0, 1)")
        if self.decay_steps:  # the horizon is known: check the phases now (else validate does, with the steps)
            check_schedule(self, self.decay_steps)


def wsd_decay_length(cfg: OptimizerConfig, total_steps: int) -> int:
    """Steps of the WSD decay phase: ``round(wsd_decay_fraction * T)``, at least 1 (``T``: the horizon)."""
    return max(int(round(cfg.wsd_decay_fraction * total_steps)), 1)


def check_schedule(cfg: OptimizerConfig, total_steps: int) -> None:
    """Refuse a schedule whose phases do not fit its horizon ``T`` (``decay_steps``, else ``total_steps``).

    ``cosine`` needs ``warmup_steps < T`` (with ``warmup_steps == T`` the floor is never reached: LR(T) would be
    the peak); ``wsd`` needs ``warmup_steps + round(wsd_decay_fraction * T) <= T`` (else the decay starts late
    and the floor is reached after ``T``); ``constant`` needs ``warmup_steps <= T``.

    Raises:
      ConfigError: naming the keys (``OptimizerConfig.warmup_steps``, ``decay_steps``, ``wsd_decay_fraction``,
        or ``TrainConfig.steps`` when ``decay_steps`` is 0) and the values.
    """
    total = cfg.decay_steps or total_steps
    horizon = (f"OptimizerConfig.decay_steps = {cfg.decay_steps}" if cfg.decay_steps else
               f"TrainConfig.steps = {total_steps} (OptimizerConfig.decay_steps = 0)")
    w = cfg.warmup_steps
    if cfg.schedule == "cosine" and w >= total:
        raise ConfigError(f"OptimizerConfig.warmup_steps = {w} must be below the decay horizon {horizon}: a "
                          "cosine schedule needs steps left to decay to the floor")
    if cfg.schedule == "constant" and w > total:
        raise ConfigError(f"OptimizerConfig.warmup_steps = {w} exceeds the horizon {horizon}")
    if cfg.schedule == "wsd":
        d = wsd_decay_length(cfg, total)
        if w + d > total:
            raise ConfigError(
                f"OptimizerConfig.warmup_steps = {w} plus the WSD decay of {d} steps (OptimizerConfig."
                f"wsd_decay_fraction = {cfg.wsd_decay_fraction} of {total}) exceed the decay horizon {horizon}: "
                f"warmup and decay would overlap; shorten warmup or the decay fraction")


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """The schedule as a function of the optimizer's update count (0-based: step ``s`` uses ``lr(s)``).

    Formulas (``p`` = peak, ``w`` = warmup, ``T`` = decay_steps or ``total_steps``, ``m`` = min_lr_ratio,
    ``d = max(round(wsd_decay_fraction * T), 1)``):
      warmup (``s < w``): ``p * s / w``.
      constant: ``p`` for ``s >= w``.
      cosine: ``p * (m + (1 - m) * 0.5 * (1 + cos(pi * (s - w) / (T - w))))`` for ``w <= s <= T``, then ``m * p``.
      wsd: ``p`` for ``w <= s <= T - d``, then ``p - (p - m * p) * (s - (T - d)) / d`` to ``m * p`` at ``T``, then
        ``m * p`` (Hu et al. 2024, sec. 4).

    Raises:
      ConfigError: (a ValueError) the phases do not fit the horizon (:func:`check_schedule`). An unknown schedule
        cannot reach here: :class:`OptimizerConfig` refuses it at construction.
    """
    check_schedule(cfg, total_steps)
    total = cfg.decay_steps or total_steps
    peak, floor = cfg.peak_learning_rate, cfg.peak_learning_rate * cfg.min_lr_ratio
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    if cfg.schedule == "constant":
        rest = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        rest = optax.cosine_decay_schedule(peak, total - cfg.warmup_steps, alpha=cfg.min_lr_ratio)
    else:
        decay = wsd_decay_length(cfg, total)
        rest = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)],
            [total - cfg.warmup_steps - decay])
    return optax.join_schedules([warmup, rest], [cfg.warmup_steps])


def _path_names(path) -> tuple[str, ...]:
    names = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
    return tuple(names)


def weight_decay_mask(params: Any, decay_embeddings: bool = False) -> Any:
    """Pytree of bools: True where weight decay applies.

    Norm scales and biases never decay: any leaf of rank <= 1, and by name (a path element ``scale``, ``bias``
    or ending in ``_bias``) the stacked [layers, ...] ones of scanned layers and the per-head q/k/v biases
    [H, Hd] of ``ModelConfig.attention_bias``. The embedding table (and the output projection when tied, which
    *is* the embedding) decays only if ``decay_embeddings``; every other matrix decays.
    """
    def decide(path, leaf) -> bool:
        names = _path_names(path)
        if jnp.ndim(leaf) <= 1 or "scale" in names or any(n == "bias" or n.endswith("_bias") for n in names):
            return False
        if "embedding" in names:
            return decay_embeddings
        return True
    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int, params: Any,
                   lr_multipliers: Any | None = None) -> optax.GradientTransformation:
    """``clip_by_global_norm -> adamw(schedule, mask) [-> scale each parameter's update]``.

    ``params`` (arrays or ``ShapeDtypeStruct``s with the real tree structure) is used only to build the
    weight-decay mask. Note the mask is decided on rank, so stacked (scanned) norm scales of shape
    [layers, D] are recognized by name (``scale``) instead. ``lr_multipliers``: a params-shaped tree of floats
    multiplying each parameter's whole AdamW update, i.e. its learning rate and its decoupled decay (µP's
    ``lr / m`` for hidden matrices, :func:`jaxpt.model.parametrization.lr_multipliers`); None adds nothing, so
    the optimizer and its state are exactly the plain AdamW ones.
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                     mask=weight_decay_mask(params, cfg.decay_embeddings))
    if lr_multipliers is not None:
        tx = scale_updates(tx, lr_multipliers)
    if cfg.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
    return tx


def scale_updates(tx: optax.GradientTransformation, multipliers: Any) -> optax.GradientTransformation:
    """``tx`` whose every update leaf is multiplied by its float in ``multipliers`` (a params-shaped tree), in the
    update's dtype. The state is ``tx``'s own, unchanged in structure, so a checkpoint's optimizer state restores
    whether or not the multipliers are there (µP at its base width and SP hold the same state)."""
    def update(updates, state, params=None):
        updates, state = tx.update(updates, state, params)
        scaled = jax.tree.map(lambda u, m: u if m == 1.0 else u * jnp.asarray(m, u.dtype), updates, multipliers)
        return scaled, state
    return optax.GradientTransformation(tx.init, update)
