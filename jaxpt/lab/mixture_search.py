"""Mixture search by proxy runs: sample mixtures, fit a regression from weights to a target, propose the best
mixture under constraints (RegMix, Liu et al. 2024, "RegMix: Data Mixture as Regression for Language Model
Pre-training"). Pure numpy/scipy/scikit-learn; the experiment that trains the proxies is :mod:`jaxpt.lab.mixtures`.

A *mixture* is a vector ``w`` of token shares over ``n`` domains (float64 [n], ``w >= 0``, ``sum(w) = 1``), in the
sorted order of :attr:`Constraints.domains`.

**Sampling** (:func:`sample_mixtures`): proxy 0 is the natural mixture (each domain's share of the training tokens),
proxy 1 the uniform one, the rest Dirichlet draws around the natural shares, ``alpha = c * n * natural``, the
concentration ``c`` cycling through :data:`CONCENTRATIONS` so that the proxies cover both near-natural and extreme
mixtures (RegMix sec. 3 samples around the token distribution with varied concentration for the same reason).

**Regression** (:func:`fit_model`): ridge regression (scikit-learn ``RidgeCV``, penalty chosen by efficient
leave-one-out from a log grid) of the target on ``log(w + eps)``. Why ridge and why logs: with 16-64 proxy runs and
a handful of domains a gradient-boosted model (RegMix's LightGBM, fit on 512 runs) has too little data, while a
linear model in the weights themselves always proposes a corner of the simplex; a domain's loss falls roughly
linearly in the log of its share (the data-mixing laws of Ye et al. 2024 are exponential in the weights), and
``sum_d beta_d log(w_d + eps)`` with ``beta_d < 0`` has an interior optimum (``w_d`` proportional to ``-beta_d``
where no bound binds). ``eps`` keeps a zero share finite.

**Fit quality** (:func:`cross_validated_spearman`): leave-one-out predictions, each from a model fit without that
run, and their Spearman rank correlation with the measured targets.

**Proposal** (:func:`propose`): minimize the fitted target over the mixtures the :class:`Constraints` allow
(per-domain floors and caps, and availability: no domain read more than ``max_epochs`` times at the target run's
token budget, ``w_d * target_tokens <= max_epochs * available_d``). Many feasible candidates are scored, the best
few are polished by SLSQP (``scipy.optimize.minimize``) inside the same bounds, and the best result is returned;
bounds are exact, so a binding constraint is met with equality.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
from scipy import optimize, stats

from jaxpt.util.errors import ConfigError

#: Dirichlet concentrations (times ``n``) the sampled proxies cycle through.
CONCENTRATIONS = (0.5, 1.0, 2.0, 4.0)
#: Added to every share before the log (a share of 0 stays finite).
DEFAULT_EPS = 1e-3
#: Ridge penalties tried by leave-one-out.
RIDGE_ALPHAS = tuple(np.logspace(-4, 2, 13))


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What a proposed mixture must respect.

    Attributes:
      domains: the domain names, sorted; a mixture vector follows this order.
      floors: ``{domain: least share}`` (0 where absent); e.g. floors for long-tail domains.
      caps: ``{domain: largest share}`` (1 where absent).
      available_tokens: ``{domain: training tokens the corpus has}``.
      target_tokens: the token budget of the run the mixture is for (0: no availability limit).
      max_epochs: how many times a domain may be read at that budget.
    """

    domains: tuple[str, ...]
    floors: Mapping[str, float] = dataclasses.field(default_factory=dict)
    caps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    available_tokens: Mapping[str, float] = dataclasses.field(default_factory=dict)
    target_tokens: float = 0.0
    max_epochs: float = 4.0

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)``, float64 [n]: the per-domain share bounds (floors; the smaller of cap and availability).

        Raises:
          ConfigError: a floor or cap naming an unknown domain or outside [0, 1], a floor above its bound, or
            bounds no mixture meets (floors summing past 1, or caps and availability summing below 1).
        """
        for key, table in (("floors", self.floors), ("caps", self.caps)):
            for d, v in table.items():
                if d not in self.domains:
                    raise ConfigError(f"MixtureExperiment.{key}: {d!r} is not a domain of the data {self.domains}")
                if not 0.0 <= float(v) <= 1.0:
                    raise ConfigError(f"MixtureExperiment.{key}: {d!r} = {v!r} is not a share in [0, 1]")
        lo = np.array([float(self.floors.get(d, 0.0)) for d in self.domains])
        hi = np.array([min(float(self.caps.get(d, 1.0)), self._availability(d)) for d in self.domains])
        for d, a, b in zip(self.domains, lo, hi):
            if a > b + 1e-12:
                raise ConfigError(f"MixtureExperiment.floors: {d!r} = {a:g} exceeds its largest allowed share {b:.4g} "
                                  "(its cap, or max_epochs x its tokens / target_tokens)")
        if lo.sum() > 1 + 1e-9 or hi.sum() < 1 - 1e-9:
            raise ConfigError(f"no mixture meets the constraints: floors sum to {lo.sum():.4g} (at most 1) and the "
                              f"largest allowed shares to {hi.sum():.4g} (at least 1); relax MixtureExperiment.floors, "
                              "caps, max_epochs or target_tokens")
        return lo, hi

    def _availability(self, domain: str) -> float:
        if not self.target_tokens:
            return 1.0
        return min(1.0, self.max_epochs * float(self.available_tokens.get(domain, 0)) / self.target_tokens)


def natural_shares(tokens: Mapping[str, float], domains: Sequence[str]) -> np.ndarray:
    """Each domain's share of ``tokens`` (``{domain: training tokens}``), float64 [n] in ``domains`` order.

    Raises:
      ConfigError: a domain with no tokens.
    """
    t = np.array([float(tokens.get(d, 0)) for d in domains])
    if (t <= 0).any():
        raise ConfigError(f"domain(s) {[d for d, x in zip(domains, t) if x <= 0]} have no training tokens")
    return t / t.sum()


def sample_mixtures(natural: np.ndarray, k: int, seed: int) -> np.ndarray:
    """``k`` proxy mixtures, float64 [k, n]: natural, uniform, then Dirichlet draws (module docstring).

    Raises:
      ConfigError: ``k < 3`` (the two anchors and at least one draw).
    """
    if k < 3:
        raise ConfigError(f"MixtureExperiment.proxies = {k}: at least 3 (natural, uniform and a sampled mixture)")
    n = len(natural)
    rng = np.random.default_rng(seed)
    rows = [natural, np.full(n, 1.0 / n)]
    for i in range(k - 2):
        c = CONCENTRATIONS[i % len(CONCENTRATIONS)]
        rows.append(rng.dirichlet(c * n * natural))
    return np.asarray(rows, np.float64)


def features(weights: np.ndarray, eps: float = DEFAULT_EPS) -> np.ndarray:
    """The regression's inputs: ``log(w + eps)``, float64 [k, n], of mixtures [k, n]."""
    return np.log(np.asarray(weights, np.float64) + eps)


@dataclasses.dataclass(frozen=True)
class MixtureModel:
    """A fitted ``target ~ intercept + coef . log(w + eps)``.

    Attributes:
      coef: float64 [n], in the domains' order. intercept: the constant. alpha: the ridge penalty chosen.
      eps: as :func:`features`. r2: the in-sample coefficient of determination.
    """

    coef: np.ndarray
    intercept: float
    alpha: float
    eps: float
    r2: float

    def predict(self, weights: np.ndarray) -> np.ndarray:
        """Predicted target, float64 [k], of mixtures [k, n] (or [n] -> a 0-d array)."""
        return features(weights, self.eps) @ self.coef + self.intercept


def fit_model(weights: np.ndarray, targets: np.ndarray, eps: float = DEFAULT_EPS) -> MixtureModel:
    """Ridge regression of ``targets`` (float [k]) on :func:`features` of ``weights`` [k, n] (module docstring).

    Deterministic: the same runs in the same order give the same model.

    Raises:
      ValueError: fewer than 3 runs, or a target that is not finite (a diverged proxy must be dropped, by name,
        before fitting).
    """
    try:
        from sklearn.linear_model import RidgeCV  # scikit-learn: the `mixtures` extra, imported only to fit
    except ImportError:
        raise ConfigError("fitting a mixture needs scikit-learn: pip install 'jaxpt[mixtures]'") from None
    x, y = features(weights, eps), np.asarray(targets, np.float64)
    if len(y) < 3:
        raise ValueError(f"{len(y)} proxy runs: a fit needs at least 3")
    if not np.isfinite(y).all():
        raise ValueError("a target is not finite: drop that proxy run before fitting")
    reg = RidgeCV(alphas=RIDGE_ALPHAS).fit(x, y)
    return MixtureModel(np.asarray(reg.coef_, np.float64), float(reg.intercept_), float(reg.alpha_), eps,
                        float(reg.score(x, y)))


def cross_validated_spearman(weights: np.ndarray, targets: np.ndarray,
                             eps: float = DEFAULT_EPS) -> tuple[float, np.ndarray]:
    """Leave-one-out predictions (float64 [k]; run ``i`` predicted by a model fit on the others) and their
    Spearman rank correlation with ``targets`` (``scipy.stats.spearmanr``; NaN when either side is constant)."""
    w, y = np.asarray(weights, np.float64), np.asarray(targets, np.float64)
    pred = np.empty(len(y))
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        pred[i] = fit_model(w[keep], y[keep], eps).predict(w[i:i + 1])[0]
    if np.ptp(pred) == 0 or np.ptp(y) == 0:
        return float("nan"), pred
    return float(stats.spearmanr(pred, y).statistic), pred


def feasible_point(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A mixture inside ``[lo, hi]`` (float64 [n]): the floors, the remainder shared in proportion to the room."""
    room = hi - lo
    return lo + (1.0 - lo.sum()) * room / room.sum() if room.sum() > 0 else lo.copy()


def _candidates(lo: np.ndarray, hi: np.ndarray, natural: np.ndarray, count: int, seed: int) -> np.ndarray:
    """Feasible mixtures [m, n]: Dirichlet draws (around natural and uniform) that meet the bounds, plus one
    constructed feasible point."""
    rng = np.random.default_rng(seed)
    n = len(lo)
    draws = np.concatenate([rng.dirichlet(c * n * natural, count // (2 * len(CONCENTRATIONS)))
                            for c in CONCENTRATIONS] + [rng.dirichlet(np.ones(n), count // 2)])
    ok = ((draws >= lo - 1e-12) & (draws <= hi + 1e-12)).all(axis=1)
    return np.concatenate([draws[ok], feasible_point(lo, hi)[None]])


def propose(model: MixtureModel, constraints: Constraints, natural: np.ndarray, *, seed: int = 0,
            candidates: int = 100_000, polish: int = 8) -> np.ndarray:
    """The mixture (float64 [n]) with the lowest predicted target that the constraints allow (module docstring).

    Raises:
      ConfigError: as :meth:`Constraints.bounds`.
    """
    lo, hi = constraints.bounds()
    cands = _candidates(lo, hi, natural, candidates, seed)
    starts = cands[np.argsort(model.predict(cands), kind="stable")[:polish]]
    best, best_val = starts[0], float(model.predict(starts[0]))
    for x0 in starts:
        res = optimize.minimize(lambda w: float(model.predict(w)), x0, method="SLSQP",
                                bounds=list(zip(lo, hi)), constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1}],
                                options={"maxiter": 500, "ftol": 1e-12})
        w = np.clip(res.x, lo, hi)
        w = w / w.sum()
        if ((w >= lo - 1e-9) & (w <= hi + 1e-9)).all() and float(model.predict(w)) < best_val:
            best, best_val = w, float(model.predict(w))
    return best


def round_mixture(weights: np.ndarray, digits: int = 4) -> np.ndarray:
    """Shares rounded to ``digits`` decimals that still sum to 1 (the largest share absorbs the rounding), for a
    config file a person reads."""
    w = np.round(np.asarray(weights, np.float64), digits)
    w[int(np.argmax(w))] += 1.0 - w.sum()
    return np.round(w, digits + 2)


def describe(weights: np.ndarray, domains: Sequence[str]) -> str:
    """``code 0.31, web 0.12, ...``: a mixture for a log line."""
    return ", ".join(f"{d} {w:.3f}" for d, w in zip(domains, weights))


def spread(values: Sequence[float]) -> float:
    """Max minus min of a metric over seeds (NaN for one value): the seed spread reported beside a difference."""
    v = [float(x) for x in values if math.isfinite(float(x))]
    return max(v) - min(v) if len(v) > 1 else float("nan")
