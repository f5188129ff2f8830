"""Training stability policy: spike skipping on device, divergence detection and rollback on the host.

Spike skip (device side, no host sync): a step whose loss or global grad norm exceeds
``mean + k * std`` of the last ``window`` *accepted* steps is skipped: params, optimizer moments and the
optimizer's update count stay exactly as they were, so the learning-rate schedule does not advance. A
non-finite loss or grad norm is always skipped. Skipped steps do not enter the history, so a run with a
skipped batch makes the same later decisions as a run where that batch was absent. (Similar policies:
PaLM, Chowdhery et al. 2022, sec. 5.1, which restarted and skipped data; OLMo 2's spike monitoring.)

Divergence rollback (host side, :class:`DivergenceMonitor`): NaN/Inf, or a smoothed loss held above
``ratio x`` its best smoothed value for ``patience`` steps, asks the loop to roll back to the last good
checkpoint, damp the learning rate, and skip the data window that preceded the trouble.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpt.util.validation import check_types, non_negative, positive, require


@dataclasses.dataclass(frozen=True)
class StabilityConfig:
    """Attributes:
      spike_skip: skip spiking steps on device.
      spike_window: accepted steps in the rolling history (mean and std).
      spike_k: a step spikes when loss or grad norm > mean + spike_k * std of the history.
      spike_min_history: judge spikes only once this many steps are in the history (early training moves
        too fast for a rolling mean to mean much).
      spike_max_consecutive: after this many spike skips in a row the next step is accepted and enters the
        history: a lasting change of level (or a state already bad before the first skip) must not freeze
        training. Non-finite steps are always skipped; rollback handles those.
      rollback: enable divergence rollback (needs checkpoints).
      rollback_loss_ratio: smoothed loss above this x the best smoothed loss counts as diverging.
      rollback_patience: consecutive diverging steps before a rollback.
      rollback_ema: decay of the loss exponential moving average.
      lr_damping: the learning rate is multiplied by this at each rollback.
      max_rollbacks: stop the run after this many rollbacks ...
      rollback_window_steps: ... within this many steps.

    Raises:
      ConfigError: at construction, naming ``StabilityConfig.<field> = <value>``: a wrong type,
        ``spike_window < 1``, ``spike_k <= 0``, ``spike_min_history < 2`` with ``spike_skip``, a negative
        ``spike_max_consecutive`` or ``max_rollbacks``, ``rollback_loss_ratio <= 1``, ``rollback_patience`` or
        ``rollback_window_steps < 1``, ``rollback_ema`` outside [0, 1), ``lr_damping`` outside (0, 1].
    """

    spike_skip: bool = True
    spike_window: int = 64
    spike_k: float = 6.0
    spike_min_history: int = 50
    spike_max_consecutive: int = 5
    rollback: bool = True
    rollback_loss_ratio: float = 1.5
    rollback_patience: int = 20
    rollback_ema: float = 0.9
    lr_damping: float = 0.5
    max_rollbacks: int = 3
    rollback_window_steps: int = 1000

    def __post_init__(self) -> None:
        check_types(self)
        positive(self, "spike_window", "spike_k", "rollback_patience", "rollback_window_steps")
        non_negative(self, "spike_min_history", "spike_max_consecutive", "max_rollbacks")
        # The mean and std of fewer than 2 steps are 0 (an empty history divides by nothing): every step would
        # exceed the threshold and be skipped.
        require(self, "spike_min_history", not self.spike_skip or self.spike_min_history >= 2,
                "must be >= 2 when StabilityConfig.spike_skip is True (a spread needs two steps)")
        require(self, "rollback_loss_ratio", self.rollback_loss_ratio > 1, "must be > 1")
        require(self, "rollback_ema", 0 <= self.rollback_ema < 1, "must be in [0, 1)")
        require(self, "lr_damping", 0 < self.lr_damping <= 1, "must be in (0, 1]")


def init_history(cfg: StabilityConfig) -> dict[str, jax.Array]:
    """Device-side rolling history: ``loss`` and ``grad_norm`` float32 [window], ``count`` int32 (accepted
    steps so far), ``num_skipped``, ``num_clipped`` and ``consecutive`` (spike skips in a row) int32."""
    w = max(cfg.spike_window, 1)
    return {"loss": jnp.zeros((w,), jnp.float32), "grad_norm": jnp.zeros((w,), jnp.float32),
            "count": jnp.zeros((), jnp.int32), "num_skipped": jnp.zeros((), jnp.int32),
            "num_clipped": jnp.zeros((), jnp.int32), "consecutive": jnp.zeros((), jnp.int32)}


def _mean_std(values: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = jnp.minimum(count, values.shape[0])
    valid = jnp.arange(values.shape[0]) < n
    nf = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, values, 0.0)) / nf
    var = jnp.sum(jnp.where(valid, jnp.square(values - mean), 0.0)) / nf
    return mean, jnp.sqrt(var)


def decide_skip(cfg: StabilityConfig, history: dict, loss: jax.Array, grad_norm: jax.Array,
                clipped: jax.Array) -> tuple[jax.Array, dict, dict]:
    """Whether to skip this step, the updated history, and metrics.

    Returns ``(skip bool[], new_history, metrics)`` with metrics ``skipped``, ``spike_loss_threshold``,
    ``spike_grad_norm_threshold``, ``clipped``, ``clipped_fraction`` (over all steps so far).
    """
    nonfinite = ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
    loss_mean, loss_std = _mean_std(history["loss"], history["count"])
    gn_mean, gn_std = _mean_std(history["grad_norm"], history["count"])
    loss_thr = loss_mean + cfg.spike_k * loss_std
    gn_thr = gn_mean + cfg.spike_k * gn_std
    judged = history["count"] >= cfg.spike_min_history
    spike = judged & ((loss > loss_thr) | (grad_norm > gn_thr)) if cfg.spike_skip else jnp.asarray(False)
    spike = spike & (history["consecutive"] < cfg.spike_max_consecutive)
    skip = nonfinite | spike
    idx = history["count"] % history["loss"].shape[0]
    accept = ~skip
    new = {
        "loss": jnp.where(accept, history["loss"].at[idx].set(loss), history["loss"]),
        "grad_norm": jnp.where(accept, history["grad_norm"].at[idx].set(grad_norm), history["grad_norm"]),
        "count": history["count"] + accept.astype(jnp.int32),
        "num_skipped": history["num_skipped"] + skip.astype(jnp.int32),
        "num_clipped": history["num_clipped"] + clipped.astype(jnp.int32),
        "consecutive": jnp.where(spike, history["consecutive"] + 1, 0).astype(jnp.int32),
    }
    total = new["count"] + new["num_skipped"]
    metrics = {"skipped": skip.astype(jnp.float32), "nonfinite": nonfinite.astype(jnp.float32),
               "spike_loss_threshold": jnp.where(judged, loss_thr, jnp.inf),
               "spike_grad_norm_threshold": jnp.where(judged, gn_thr, jnp.inf),
               "clipped": clipped.astype(jnp.float32),
               "clipped_fraction": new["num_clipped"].astype(jnp.float32) / jnp.maximum(total, 1)}
    return skip, new, metrics


class DivergenceError(RuntimeError):
    """Too many rollbacks within the window: the run stops, saying what happened."""


class DivergenceMonitor:
    """Host-side divergence detection on the per-step losses the loop already fetches (one step late).

    :meth:`observe` returns a reason string when the loop should roll back, else None.
    """

    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.ema: float | None = None
        self.best: float = math.inf
        self.bad_steps = 0
        self.rollbacks: list[int] = []

    def observe(self, step: int, loss: float, nonfinite: bool) -> str | None:
        if not self.cfg.rollback:
            return None
        if nonfinite or not math.isfinite(loss):
            return f"non-finite loss or gradient at step {step}"
        a = self.cfg.rollback_ema
        self.ema = loss if self.ema is None else a * self.ema + (1 - a) * loss
        self.best = min(self.best, self.ema)
        if self.ema > self.cfg.rollback_loss_ratio * self.best:
            self.bad_steps += 1
            if self.bad_steps >= self.cfg.rollback_patience:
                return (f"smoothed loss {self.ema:.4f} above {self.cfg.rollback_loss_ratio} x best "
                        f"{self.best:.4f} for {self.bad_steps} steps (step {step})")
        else:
            self.bad_steps = 0
        return None

    def record_rollback(self, step: int, reason: str) -> None:
        """Count a rollback; raises :class:`DivergenceError` past ``max_rollbacks`` in the window."""
        self.rollbacks = [s for s in self.rollbacks if step - s < self.cfg.rollback_window_steps] + [step]
        self.ema, self.bad_steps = None, 0
        if len(self.rollbacks) > self.cfg.max_rollbacks:
            raise DivergenceError(
                f"{len(self.rollbacks)} rollbacks within {self.cfg.rollback_window_steps} steps "
                f"(at steps {self.rollbacks}; last: {reason}); stopping. Lower the learning rate, check the "
                f"data near these steps, or raise StabilityConfig.max_rollbacks.")
