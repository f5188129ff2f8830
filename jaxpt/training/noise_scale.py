"""The simple gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` measured during training.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", arXiv:1812.06162, sec. 2.2 and appendix
A.1): with ``G_B`` the mean gradient over a batch of ``B`` independent examples, ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``
(``G`` the true gradient, ``Sigma`` the per-example covariance). Two batch sizes give unbiased estimates of both
terms:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Each is noisy from one step; the paper averages each over steps (exponential moving averages) and takes the
ratio of the averages (:class:`NoiseScaleSmoother`). ``B_simple`` estimates the critical batch size, the batch
beyond which more examples per step buy little (sec. 2.3).

In jaxpt the two batches come free with gradient accumulation (:func:`jaxpt.training.step.accumulate_grads`): the
``k`` micro-batches are the small batches and the global batch the big one; an "example" is a target token (the
loss is a mean over target tokens), so batch sizes and ``B_simple`` are in tokens. Micro-batches of unequal token
counts ``n_i`` enter through ``mean_i(1/n_i)`` in place of ``1/B_small``: ``mean_i E|G_i|^2 = |G|^2 +
tr(Sigma) mean_i(1/n_i)``, so the estimators stay unbiased. Tokens of one sequence are not independent examples,
so the figure is a noise scale per token of this data, comparable across runs of one setup rather than an exact
critical batch size.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

#: Step metrics (float32 scalars) with gradient accumulation >= 2; absent otherwise.
STEP_KEYS = ("gns/micro_grad_sq", "gns/grad_sq", "gns/trace")
#: The smoothed noise scale in the logged records (tokens).
RECORD_KEY = "grad_noise_scale"


def estimates(micro_sq, inv_small, big_sq, big_tokens):
    """Unbiased per-step estimates ``(|G|^2, tr(Sigma))`` from two batch sizes (McCandlish et al. 2018, A.1).

    Args (scalars: Python/numpy floats or float32 jax arrays; works for either):
      micro_sq: ``mean_i |G_i|^2``, the squared norm of each small batch's mean gradient, averaged over batches.
      inv_small: ``mean_i 1 / n_i``, the small batches' sizes ``n_i`` in tokens (``1 / B_small`` when equal).
      big_sq: ``|G_big|^2``, the squared norm of the big batch's mean gradient.
      big_tokens: ``B_big``, tokens in the big batch; must exceed every ``n_i`` (else the result is inf/nan).
    Returns: ``(grad_sq, trace)``: ``|G|^2`` (squared gradient units) and ``tr(Sigma)`` (per token); either may
    come out negative on a noisy step.
    """
    inv_big = 1.0 / big_tokens
    denom = inv_small - inv_big
    trace = (micro_sq - big_sq) / denom
    grad_sq = (big_sq * inv_small - micro_sq * inv_big) / denom
    return grad_sq, trace


class NoiseScaleSmoother:
    """Exponential moving averages of the per-step ``gns/grad_sq`` and ``gns/trace`` metrics and their ratio,
    ``grad_noise_scale = EMA(tr Sigma) / EMA(|G|^2)`` in tokens (McCandlish et al. 2018, appendix A.1).

    Args:
      decay: EMA decay per step (0 < decay < 1); averages are bias-corrected (divided by ``1 - decay^n``, as
        Adam does), so the first records are means of the steps so far rather than shrunk towards 0.
    Raises:
      ValueError: decay outside (0, 1).
    """

    def __init__(self, decay: float = 0.95):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"noise-scale EMA decay {decay}: must be in (0, 1)")
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        """Forget every step (a rollback discarded them)."""
        self._grad_sq = self._trace = 0.0
        self._n = 0

    def observe(self, values: Mapping[str, Any]) -> None:
        """Take one step's metrics; steps without the estimates (no accumulation), skipped or non-finite ones
        are ignored."""
        g, t = values.get("gns/grad_sq"), values.get("gns/trace")
        if g is None or t is None or values.get("skipped") or not (math.isfinite(g) and math.isfinite(t)):
            return
        d = self.decay
        self._grad_sq = d * self._grad_sq + (1 - d) * float(g)
        self._trace = d * self._trace + (1 - d) * float(t)
        self._n += 1

    def value(self) -> float | None:
        """The smoothed ``B_simple`` in tokens; None before any step or while ``EMA(|G|^2) <= 0`` (the gradient
        is not yet resolved above the noise: the ratio would be meaningless)."""
        if self._n == 0 or self._grad_sq <= 0.0:
            return None
        return self._trace / self._grad_sq  # the bias corrections of numerator and denominator cancel

    def record(self) -> dict[str, float]:
        """``{"grad_noise_scale": value}``, or ``{}`` when :meth:`value` is None."""
        v = self.value()
        return {} if v is None else {RECORD_KEY: v}
