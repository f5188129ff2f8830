"""Batch-size ramp: the global batch grows at step boundaries, the learning rate follows by a stated rule.

``TrainConfig.batch_size_schedule = '1:4,21:8,41:16'`` trains steps 1-20 on 4 rows, 21-40 on 8 and 41 onwards
on 16; the last size must be ``TrainConfig.global_batch_size`` (the full batch, the one memory is planned and
compiled for). With ``TrainConfig.batch_lr_scaling`` the learning rate of a step with ``B`` rows is the
configured schedule's rate times ``(B / global_batch_size) ** p``:

* ``linear`` (p = 1): Goyal et al. 2017, "Accurate, Large Minibatch SGD", sec. 2.1 (SGD);
* ``sqrt`` (p = 1/2): Hoffer et al. 2017, "Train longer, generalize better", sec. 4; Malladi et al. 2022,
  "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms" (the square-root rule for Adam);
* ``none`` (p = 0): the configured rate at every batch size.

The rule scales the whole AdamW update (weight decay included, as the rate does in ``optax.adamw``).

The data: the loader yields batches of ``unit`` rows (the greatest common divisor of the sizes) and a step with
``B`` rows takes ``B / unit`` of them in order, so the rows are those of a fixed-batch run of ``unit`` rows
consumed at a growing pace, and the data iterator's checkpointed state is that of the ``unit`` loader: a
resume mid-ramp continues exactly (the step decides the size). Gradient accumulation keeps the micro-batch of
the full batch (``global_batch_size / grad_accum_steps`` rows): a step of ``B`` rows accumulates
``B / micro`` micro-batches (one micro-batch of ``B`` rows when ``B`` is smaller), so no step needs more
memory than the full batch. Each distinct size is one jitted train step (one compile per size).
"""

from __future__ import annotations

import dataclasses
import math

from jaxpt.util.errors import ConfigError

#: ``TrainConfig.batch_lr_scaling`` -> the exponent ``p`` of ``(B / global_batch_size) ** p``.
LR_RULES = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """``'1:4,21:8'`` -> ``((1, 4), (21, 8))``: (first step, global batch size) pairs.

    Raises:
      ValueError: not ``STEP:SIZE`` pairs of integers, the first step not 1, steps not increasing, a size < 1
        or sizes decreasing.
    """
    try:
        pairs = tuple((int(a), int(b)) for a, b in (p.split(":") for p in text.split(",")))
    except ValueError:
        raise ValueError("expected 'STEP:SIZE,...' (the global batch from each step on), e.g. '1:4,21:8'") from None
    if pairs[0][0] != 1:
        raise ValueError("the first entry must start at step 1")
    if any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])):
        raise ValueError("steps must increase")
    if any(s < 1 for _, s in pairs) or any(b[1] < a[1] for a, b in zip(pairs, pairs[1:])):
        raise ValueError("sizes must be positive and must not decrease (a ramp grows)")
    return pairs


@dataclasses.dataclass(frozen=True)
class BatchRamp:
    """A run's batch sizes by step. Without a schedule every step has ``full`` rows.

    Attributes:
      pairs: ``((first_step, rows), ...)``, first step 1, as :func:`parse_schedule`.
      full: ``TrainConfig.global_batch_size`` (the last size).
      lr_power: ``p`` of the learning-rate rule (:data:`LR_RULES`).
      grad_accum: ``TrainConfig.grad_accum_steps`` of the full batch.
    """

    pairs: tuple[tuple[int, int], ...]
    full: int
    lr_power: float = 0.0
    grad_accum: int = 1

    @property
    def unit(self) -> int:
        """Rows of one loader batch: the greatest common divisor of the sizes."""
        return math.gcd(*(s for _, s in self.pairs))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The distinct sizes, ascending (one compiled train step each)."""
        return tuple(sorted({s for _, s in self.pairs}))

    def batch_size(self, step: int) -> int:
        """Global rows of step ``step`` (1-based)."""
        rows = self.pairs[0][1]
        for first, s in self.pairs:
            if step >= first:
                rows = s
        return rows

    def units(self, step: int) -> int:
        """Loader batches step ``step`` takes."""
        return self.batch_size(step) // self.unit

    def lr_factor(self, rows: int) -> float:
        """``(rows / full) ** p``: the factor on the configured learning rate at ``rows`` rows."""
        return (rows / self.full) ** self.lr_power

    def grad_accum_for(self, rows: int) -> int:
        """Micro-batches of a step with ``rows`` rows: rows / the full batch's micro-batch, at least 1."""
        micro = self.full // self.grad_accum
        return max(rows // micro, 1)

    def rows_through(self, step: int) -> int:
        """Global rows trained on in steps 1..``step`` (the sum of the sizes)."""
        total = 0
        bounds = [*self.pairs, (None, None)]
        for (first, rows), (nxt, _) in zip(bounds, bounds[1:]):
            last = step if nxt is None else min(step, nxt - 1)
            total += max(last - first + 1, 0) * rows
        return total


def from_config(cfg) -> BatchRamp:
    """The :class:`BatchRamp` of a :class:`jaxpt.config.TrainConfig` (a constant one without a schedule)."""
    text = cfg.batch_size_schedule
    pairs = parse_schedule(text) if text else ((1, cfg.global_batch_size),)
    return BatchRamp(pairs, cfg.global_batch_size, LR_RULES[cfg.batch_lr_scaling], cfg.grad_accum_steps)


def validate(cfg, dp: int) -> None:
    """Every size of the schedule fits the run: its last size is ``global_batch_size``, each splits into
    micro-batches of the full batch's size (or is one smaller micro-batch) over the ``dp`` data-parallel shards,
    and each is a multiple of the data shards' loader batch.

    Raises:
      ConfigError: naming ``TrainConfig.batch_size_schedule`` and the size that does not fit.
    """
    if not cfg.batch_size_schedule:
        return
    ramp = from_config(cfg)
    where = f"TrainConfig.batch_size_schedule = {cfg.batch_size_schedule!r}"
    if ramp.pairs[-1][1] != cfg.global_batch_size:
        raise ConfigError(f"{where}: the last size must be TrainConfig.global_batch_size = {cfg.global_batch_size} "
                          "(the full batch, the one memory is planned for)")
    micro = cfg.global_batch_size // cfg.grad_accum_steps
    for rows in ramp.sizes:
        if rows >= micro and rows % micro:
            raise ConfigError(f"{where}: {rows} rows are not a whole number of micro-batches of {micro} rows "
                              f"(TrainConfig.global_batch_size / TrainConfig.grad_accum_steps)")
        if (rows // ramp.grad_accum_for(rows)) % dp:
            raise ConfigError(f"{where}: the micro-batches of {rows} rows do not split over the data-parallel "
                              f"size {dp}")
    n = cfg.data.num_shards
    if n and ramp.unit % n:
        raise ConfigError(f"{where}: DataConfig.num_shards = {n} must divide the loader batch of {ramp.unit} rows "
                          "(the greatest common divisor of the sizes)")
