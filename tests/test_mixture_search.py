"""The mixture search's pure parts (jaxpt.lab.mixture_search): sampling, the regression, its leave-one-out
Spearman, and the constrained proposal, against planted answers computed by hand."""

import numpy as np
import pytest

from jaxpt.lab import mixture_search as ms
from jaxpt.util.errors import ConfigError

DOMAINS = ("code", "multilingual", "reference", "web")
TOKENS = {"code": 400, "multilingual": 200, "reference": 300, "web": 100}


def _planted(k=24, noise=0.0, seed=0):
    """Mixtures and targets of a known law: target = 3 - 0.4 log(w_web + eps) - 0.1 log(w_code + eps)."""
    nat = ms.natural_shares(TOKENS, DOMAINS)
    w = ms.sample_mixtures(nat, k, seed)
    x = ms.features(w)
    y = 3 - 0.4 * x[:, 3] - 0.1 * x[:, 0] + noise * np.random.default_rng(seed + 1).standard_normal(k)
    return nat, w, y


def test_natural_shares_and_samples():
    """Proxy 0 is the natural mixture (token shares), proxy 1 the uniform one, every row a mixture; the sampling is
    deterministic in its seed and changes with it."""
    nat = ms.natural_shares(TOKENS, DOMAINS)
    np.testing.assert_allclose(nat, [0.4, 0.2, 0.3, 0.1])
    w = ms.sample_mixtures(nat, 10, seed=3)
    np.testing.assert_allclose(w[0], nat)
    np.testing.assert_allclose(w[1], 0.25)
    np.testing.assert_allclose(w.sum(axis=1), 1.0)
    assert (w >= 0).all()
    np.testing.assert_array_equal(w, ms.sample_mixtures(nat, 10, seed=3))
    assert not np.array_equal(w[2:], ms.sample_mixtures(nat, 10, seed=4)[2:])
    with pytest.raises(ConfigError, match="at least 3"):
        ms.sample_mixtures(nat, 2, 0)
    with pytest.raises(ConfigError, match=r"\['web'\] have no training tokens"):
        ms.natural_shares({**TOKENS, "web": 0}, DOMAINS)


def test_fit_recovers_a_planted_law_and_ranks_held_out_runs():
    """Exact targets of a log-linear law: the fitted coefficients are the planted ones (within the small ridge
    shrinkage) and the leave-one-out Spearman is ~1; with noise the rank correlation drops but stays high."""
    _, w, y = _planted()
    model = ms.fit_model(w, y)
    np.testing.assert_allclose(model.coef, [-0.1, 0, 0, -0.4], atol=2e-3)
    rho, loo = ms.cross_validated_spearman(w, y)
    assert rho > 0.99 and loo.shape == y.shape
    _, wn, yn = _planted(noise=0.05)
    rho_noisy, _ = ms.cross_validated_spearman(wn, yn)
    assert 0.5 < rho_noisy < rho
    with pytest.raises(ValueError, match="not finite"):
        ms.fit_model(w, np.where(np.arange(len(y)) == 3, np.nan, y))


def test_leave_one_out_prediction_is_a_fit_without_that_run():
    """Run i's leave-one-out prediction equals a model fit on the other runs, computed here separately."""
    _, w, y = _planted(k=8, noise=0.02)
    _, loo = ms.cross_validated_spearman(w, y)
    keep = np.arange(8) != 5
    assert loo[5] == pytest.approx(float(ms.fit_model(w[keep], y[keep]).predict(w[5:6])[0]), abs=1e-12)


def test_unconstrained_optimum_is_proportional_to_the_coefficients():
    """For target = sum_d b_d log(w_d + eps) (b_d < 0, eps -> 0) the minimum over the simplex is w_d = b_d / sum b
    (Lagrange); the proposal finds it within 1e-3."""
    model = ms.MixtureModel(np.array([-0.1, -0.2, -0.3, -0.4]), 3.0, 0.0, 1e-9, 1.0)
    w = ms.propose(model, ms.Constraints(DOMAINS), ms.natural_shares(TOKENS, DOMAINS))
    np.testing.assert_allclose(w, [0.1, 0.2, 0.3, 0.4], atol=1e-3)


def test_floors_caps_and_availability_bind():
    """The planted law wants web: a cap on web holds with equality; the floors hold with equality where the law
    gains nothing from a domain; availability (max_epochs x tokens / target tokens) caps like a cap."""
    nat, w, y = _planted()
    model = ms.fit_model(w, y)
    free = ms.propose(model, ms.Constraints(DOMAINS), nat)
    assert np.argmax(free) == DOMAINS.index("web")
    capped = ms.propose(model, ms.Constraints(DOMAINS, floors={"multilingual": 0.1, "reference": 0.1},
                                              caps={"web": 0.5}), nat)
    assert capped[3] == pytest.approx(0.5, abs=1e-6)
    assert capped[1] == pytest.approx(0.1, abs=1e-6) and capped[2] == pytest.approx(0.1, abs=1e-6)
    assert capped[0] == pytest.approx(0.3, abs=1e-6) and capped.sum() == pytest.approx(1.0)
    # web has 100 tokens; at a 1000-token target run and 2 epochs it may take at most 0.2
    avail = ms.propose(model, ms.Constraints(DOMAINS, available_tokens=TOKENS, target_tokens=1000, max_epochs=2),
                       nat)
    assert avail[3] == pytest.approx(0.2, abs=1e-6)


@pytest.mark.parametrize("kw, message", [
    ({"floors": {"nope": 0.1}}, "floors: 'nope' is not a domain"),
    ({"caps": {"web": 1.5}}, r"caps: 'web' = 1.5 is not a share"),
    ({"floors": {"web": 0.6, "code": 0.6}}, "floors sum to 1.2"),
    ({"floors": {"web": 0.3}, "caps": {"web": 0.2}}, "floors: 'web' = 0.3 exceeds its largest allowed share 0.2"),
    ({"available_tokens": TOKENS, "target_tokens": 10_000, "max_epochs": 1}, "largest allowed shares to 0.1"),
])
def test_impossible_constraints_are_refused_by_name(kw, message):
    with pytest.raises(ConfigError, match=message):
        ms.Constraints(DOMAINS, **kw).bounds()


def test_rounded_mixture_sums_to_one():
    w = ms.round_mixture(np.array([1 / 3, 1 / 3, 1 / 3]), digits=2)
    assert w.sum() == pytest.approx(1.0, abs=1e-12) and sorted(w.tolist()) == pytest.approx([0.33, 0.33, 0.34])
