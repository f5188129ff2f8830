"""Train a grid of model sizes x token budgets, then fit a scaling law; its command line is
``python -m jaxpt.tools.scaling``.

    python -m jaxpt.tools.scaling run --grid configs/scaling/grid.gin            # -> runs/scaling/runs.jsonl
    python -m jaxpt.tools.scaling fit runs/scaling --predict-params 1e7 --predict-tokens 2e8
    python -m jaxpt.tools.scaling rules runs/rules --output runs/rules/rules.json   # lr x batch x compute grid

**rules** fits how the best peak learning rate and global batch size move with compute, from a grid with
``ScalingGrid.learning_rates`` and ``batch_sizes`` (:mod:`jaxpt.lab.rules`; DeepSeek-AI 2024, sec. 3.1).

**run** reads one gin file holding a base training config (the usual ``ModelConfig``/``TrainConfig``/...
bindings) and a ``ScalingGrid`` (model-size overrides x token budgets, see :class:`ScalingGrid`). Each grid
point is an ordinary :func:`jaxpt.run.session.run_training` run on real text (``DataConfig`` of the grid file;
the bundled sample needs ``python -m jaxpt.data.prepare --output artifacts/sample`` first) in its own
workdir under ``ScalingGrid.output``, with its learning-rate schedule decaying over its own budget, as
Hoffmann et al. 2022 (sec. 3.1) require for final losses to be comparable. Its final held-out loss is
appended to ``<output>/runs.jsonl``; points already there are skipped, so an interrupted grid resumes.
A persistent XLA compilation cache under the output directory lets runs of the same shape share compiles.

**fit** fits ``L(N, D) = E + A / N^alpha + B / D^beta`` (Hoffmann et al. 2022, eq. 2) to the runs by
nonlinear least squares (``scipy.optimize.least_squares``; ``--loss huber`` for Huber's robust loss, as
the paper uses on log-loss), from a grid of starting points (the paper's approach), keeping the best.
Uncertainties are the usual asymptotic ones: ``cov = s^2 (J^T J)^-1`` with ``s^2 = RSS / (n - 5)`` at
the optimum, in the fitted parameterization ``(E, log A, log B, alpha, beta)``; ``A`` and ``B`` get
``sigma_A = A * sigma_logA`` (delta method), and so does a predicted loss. ``N`` is the non-embedding
parameter count by default (Kaplan et al. 2020 found it gives cleaner laws at small scale, where the
embedding dominates); ``--n-kind total`` uses all parameters, as Hoffmann et al. do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Sequence

import numpy as np

from jaxpt import config as config_lib
from jaxpt.config import ConfigError
from jaxpt.lab import plan, rules as rules_lib
from jaxpt.model.config import ModelConfig
from jaxpt.model.decoder import count_params
from jaxpt.run import session
from jaxpt.run.validate import validate
from jaxpt.training import flops as flops_lib
from jaxpt.util import fs, jsonl

#: Named after the program that drives it.
log = logging.getLogger("jaxpt.tools.scaling")

#: Names of the fitted constants, in the order of :attr:`Fit.values`.
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
N_KINDS = ("non_embedding", "total", "matmul")


@dataclasses.dataclass(frozen=True)
class ScalingGrid:
    """A grid of training runs (gin configurable ``ScalingGrid``).

    Attributes:
      models: model sizes, each a dict of ``ModelConfig`` overrides, e.g. ``{'d_model': 64, 'num_layers': 2}``.
      tokens: training-token budgets; each run takes ``ceil(tokens / (global_batch_size * seq_len))`` steps.
      output: directory for ``runs.jsonl`` and one workdir per run.
      warmup_fraction: warmup steps as a fraction of each run's steps (at least 1), so that every run's
        schedule has the same shape.
      learning_rates: peak learning rates (``OptimizerConfig.peak_learning_rate``) to try at every
        (model, tokens) budget; empty: the base config's only. With ``batch_sizes``, the grid of
        learning rate x batch size x compute that :mod:`jaxpt.lab.rules` fits (DeepSeek-AI 2024, sec. 3.1).
      batch_sizes: global batch sizes in rows (``TrainConfig.global_batch_size``) to try at every budget; empty:
        the base config's only. Each run still trains on its budget's tokens: fewer steps for a larger batch.
      paired: False (default): every model trains every token budget (``models x tokens`` budgets). True: model
        ``i`` trains ``tokens[i]`` only, one compute budget per model size, as a learning-rate/batch-size grid
        over compute wants it (DeepSeek-AI 2024 grow the model with the budget); ``models`` and ``tokens`` must
        then be of equal length.
    """

    models: tuple = ()
    tokens: tuple = ()
    output: str = "runs/scaling"
    warmup_fraction: float = 0.05
    learning_rates: tuple = ()
    batch_sizes: tuple = ()
    paired: bool = False


_GIN_GRID = config_lib.tool_configurable(ScalingGrid)


# --------------------------------------------------------------------------------------------------
# run


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One run of the grid: ``tokens`` trained (``steps x batch x seq_len``), ``budget`` the name of its
    (model, requested tokens) compute budget, ``budget_tokens`` the tokens requested."""

    name: str
    model_overrides: dict
    tokens: int
    bindings: tuple[str, ...]
    budget: str = ""
    budget_tokens: int = 0


def load_grid(grid_path: str, bindings: Sequence[str] = ()) -> tuple[ScalingGrid, config_lib.TrainConfig]:
    """Parse the grid file (+ bindings) into the grid and the base train config.

    Raises:
      ConfigError: unparsable file, an empty grid, an unknown ``ModelConfig`` field in
        ``ScalingGrid.models``, a non-positive token budget, or ``paired`` with unequal lengths (naming the
        grid file).
    """
    base = config_lib.parse([grid_path], bindings)
    grid = _GIN_GRID()
    if not grid.models or not grid.tokens:
        raise ConfigError(f"{grid_path}: ScalingGrid.models and ScalingGrid.tokens must both be non-empty")
    if grid.paired and len(grid.models) != len(grid.tokens):
        raise ConfigError(f"{grid_path}: ScalingGrid.paired = True needs one token budget per model: "
                          f"{len(grid.models)} models, {len(grid.tokens)} entries in ScalingGrid.tokens")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for i, m in enumerate(grid.models):
        if not isinstance(m, dict):
            raise ConfigError(f"{grid_path}: ScalingGrid.models[{i}] = {m!r} is not a dict of ModelConfig fields")
        unknown = sorted(set(m) - fields)
        if unknown:
            hints = "".join(f" ({k!r}: did you mean {' or '.join(map(repr, config_lib.close_names(k, fields)))}?)"
                            for k in unknown if config_lib.close_names(k, fields))
            raise ConfigError(f"{grid_path}: ScalingGrid.models[{i}] has unknown ModelConfig field(s) {unknown}"
                              + hints)
    for key, values, kind in (("tokens", grid.tokens, (int, float)), ("learning_rates", grid.learning_rates,
                                                                          (int, float)),
                              ("batch_sizes", grid.batch_sizes, int)):
        for v in values:
            if isinstance(v, bool) or not (isinstance(v, kind) and v > 0):
                raise ConfigError(f"{grid_path}: ScalingGrid.{key} entry {v!r} must be a positive "
                                  f"{'integer' if kind is int else 'number'}")
    return grid, base


def grid_points(grid: ScalingGrid, base: config_lib.TrainConfig) -> list[GridPoint]:
    """Every (model, tokens[, learning rate, batch size]) combination with the gin bindings that make its run.

    (model, tokens) pairs are ``models x tokens``, or ``zip(models, tokens)`` with ``ScalingGrid.paired``. Names of a grid without ``learning_rates``/``batch_sizes`` are as before (a grid resumes by name); with them,
    ``_lr<rate>`` and ``_bs<rows>`` are appended.
    """
    points = []
    lrs = grid.learning_rates or (None,)
    batches = grid.batch_sizes or (None,)
    for i, m in enumerate(grid.models):
        tag = "_".join(f"{k}{v}" for k, v in sorted(m.items()))
        for t in (grid.tokens[i],) if grid.paired else grid.tokens:
            for lr in lrs:
                for bs in batches:
                    points.append(_grid_point(grid, base, m, tag, t, lr, bs))
    return points


def _grid_point(grid: ScalingGrid, base, model: dict, tag: str, tokens, lr, batch) -> GridPoint:
    tokens_per_step = (batch or base.global_batch_size) * base.seq_len
    steps = max(1, math.ceil(tokens / tokens_per_step))
    budget = f"{tag}_tokens{int(tokens)}"
    name = f"{tag}_tokens{steps * tokens_per_step}"
    name += (f"_lr{lr:g}" if lr is not None else "") + (f"_bs{batch}" if batch is not None else "")
    b = [f"ModelConfig.{k} = {v!r}" for k, v in model.items()]
    b += [f"TrainConfig.steps = {steps}", f"TrainConfig.workdir = {fs.join(grid.output, name)!r}",
          f"OptimizerConfig.warmup_steps = {max(1, round(grid.warmup_fraction * steps))}",
          "OptimizerConfig.decay_steps = 0", "TrainConfig.progress_bar = False"]
    if lr is not None:
        b.append(f"OptimizerConfig.peak_learning_rate = {lr!r}")
    if batch is not None:
        b.append(f"TrainConfig.global_batch_size = {batch}")
    return GridPoint(name, dict(model), steps * tokens_per_step, tuple(b), budget, int(tokens))


def check_points(grid_path: str, points: Sequence[GridPoint], bindings: Sequence[str] = ()) -> None:
    """Validate every point's config before training any, so a bad size fails the grid in seconds.

    Raises:
      ConfigError: naming the grid point and the config key.
    """
    import jax
    for pt in points:
        try:
            validate(config_lib.parse([grid_path], [*pt.bindings, *bindings]), jax.device_count())
        except ConfigError as e:
            raise ConfigError(f"{grid_path}: grid point {pt.name}: {e}") from None


def param_counts(cfg: config_lib.TrainConfig) -> dict[str, int]:
    """``total``, ``non_embedding`` (no embedding table, no untied output projection) and ``matmul``
    parameter counts of ``cfg.model`` (vocab resolved from the tokenizer if needed)."""
    m = plan.resolve_vocab(cfg).model
    c = count_params(m)
    return {"total": c["total"], "non_embedding": c["total"] - c["embedding"] - c["output"], "matmul": c["matmul"]}


def read_runs(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Records of ``runs.jsonl`` files (or directories holding one), in order.

    ``runs.jsonl`` follows the JSON Lines rules of :mod:`jaxpt.util.jsonl`; a half-written last line (a grid run
    killed mid-append) is skipped, and `run_grid` cuts it off before appending again.

    Raises:
      FileNotFoundError: a path that does not exist, or a directory without runs.jsonl.
      FileFormatError: (a ConfigError) any other bad line (file, line and reason named).
    """
    records = []
    for p in paths:
        records += jsonl.read_objects(_runs_file(p), partial_last_line=True)
    return records


def enable_compile_cache(path: str) -> None:
    """Persistent XLA compilation cache in ``path`` (every compile cached): grid runs of one shape reuse
    the init and eval compiles. Takes effect only before this process's first compile."""
    import jax
    fs.makedirs(path)  # jax's cache writes through etils.epath: a gs:// cache works as well
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def check_same_config(name: str, record: dict[str, Any], cfg: config_lib.TrainConfig, runs_file: str) -> None:
    """Refuse to count a finished run under a grid point whose config has changed since it trained.

    A run's name carries its model, tokens, learning rate and batch, not its seed, schedule or data: rerunning a grid
    into the same output with another ``--gin`` (``TrainConfig.seed = 1``, say) would otherwise skip every point as
    done and report the old runs as the new grid. Compares the run's own ``<workdir>/config.gin`` (else the record's
    ``config_hash``; a record with neither, from before these were kept, is taken as it is).

    Raises:
      ConfigError: naming the runs file, the point and the settings that differ (at most five).
    """
    now = config_lib.operative_config_str(cfg)
    saved_path = fs.join(record.get("workdir") or cfg.workdir, "config.gin")
    if fs.exists(saved_path):
        was = config_lib.saved_settings({"config_gin": fs.read_text(saved_path)})
        new = config_lib.saved_settings({"config_gin": now})
        diff = sorted(k for k in set(was) | set(new) if repr(was.get(k)) != repr(new.get(k)))
        what = ", ".join(f"{k} = {was.get(k)!r} there, {new.get(k)!r} now" for k in diff[:5])
    else:
        diff = record.get("config_hash") not in (None, config_lib.config_hash(now))
        what = "its config hash differs"
    if diff:
        raise ConfigError(f"{runs_file}: grid point {name} is there already, trained with another config ({what}); "
                          "a grid with another seed, schedule or data needs its own ScalingGrid.output")


def run_grid(grid_path: str, bindings: Sequence[str] = (), compile_cache: bool = True) -> list[dict[str, Any]]:
    """Train every grid point not yet in ``<output>/runs.jsonl``; returns all records of the grid."""

    grid, base = load_grid(grid_path, bindings)
    fs.makedirs(grid.output)
    runs_file = fs.join(grid.output, "runs.jsonl")
    if compile_cache:
        enable_compile_cache(fs.join(grid.output, "jax_cache"))
    done = {r["name"]: r for r in read_runs([runs_file])} if fs.exists(runs_file) else {}
    points = grid_points(grid, base)
    check_points(grid_path, points, bindings)
    for i, pt in enumerate(points):
        cfg = config_lib.parse([grid_path], [*pt.bindings, *bindings])
        if pt.name in done:
            check_same_config(pt.name, done[pt.name], cfg, runs_file)
            log.info("[%d/%d] %s: already in %s, skipped", i + 1, len(points), pt.name, runs_file)
            continue
        counts = param_counts(cfg)
        log.info("[%d/%d] %s: %s non-embedding params, %d tokens", i + 1, len(points), pt.name,
                 f"{counts['non_embedding']:,}", pt.tokens)
        t0 = time.perf_counter()
        final = session.run_training(cfg)
        model = plan.resolve_vocab(cfg).model
        fpt = flops_lib.flops_per_token(model, cfg.seq_len)
        record = {"name": pt.name, "model": pt.model_overrides, "params": counts, "tokens": pt.tokens,
                  "steps": cfg.steps, "flops": fpt * pt.tokens, "budget": pt.budget,
                  "budget_flops": fpt * pt.budget_tokens, "peak_learning_rate": cfg.optimizer.peak_learning_rate,
                  "global_batch_size": cfg.global_batch_size, "batch_tokens": cfg.global_batch_size * cfg.seq_len,
                  "heldout_loss": final["heldout_loss"], "heldout_tokens": final["heldout_tokens"],
                  "train_loss": final.get("train_loss"), "wall_s": time.perf_counter() - t0,
                  "workdir": cfg.workdir,
                  "config_hash": config_lib.config_hash(config_lib.operative_config_str(cfg))}
        jsonl.drop_partial_last_line(runs_file)  # a record half-written by a killed grid run
        fs.append_text(runs_file, jsonl.dumps(record) + "\n")
    names = {p.name for p in points}
    return [r for r in read_runs([runs_file]) if r["name"] in names]


# --------------------------------------------------------------------------------------------------
# fit


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted ``L(N, D)``. ``values``/``stderr`` follow :data:`PARAM_NAMES`; ``cov`` is the 5x5
    covariance of ``(E, log A, log B, alpha, beta)``; ``rmse`` in nats; ``n_points`` fitted."""

    values: tuple[float, ...]
    stderr: tuple[float, ...]
    cov: np.ndarray
    rmse: float
    n_points: int
    loss_kind: str

    @property
    def law(self) -> plan.ParametricLoss:
        """The fitted law as a :class:`jaxpt.lab.plan.ParametricLoss` (loss, compute-optimal allocation)."""
        return plan.ParametricLoss(*self.values)

    def predict(self, n_params: float, n_tokens: float) -> tuple[float, float]:
        """``(loss, stderr)`` at ``(N, D)``; stderr by the delta method through :attr:`cov`."""
        E, A, B, a, b = self.values
        na, db = A * n_params ** -a, B * n_tokens ** -b
        grad = np.array([1.0, na, db, -na * math.log(n_params), -db * math.log(n_tokens)])
        var = float(grad @ self.cov @ grad)
        return E + na + db, math.sqrt(var) if var >= 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"values": dict(zip(PARAM_NAMES, self.values)), "stderr": dict(zip(PARAM_NAMES, self.stderr)),
                "rmse": self.rmse, "n_points": self.n_points, "loss": self.loss_kind,
                "cov_E_logA_logB_alpha_beta": self.cov.tolist()}


def _model(x: np.ndarray, logn: np.ndarray, logd: np.ndarray) -> np.ndarray:
    E, log_a, log_b, alpha, beta = x
    return E + np.exp(log_a - alpha * logn) + np.exp(log_b - beta * logd)


def fit_law(n_params: Sequence[float], n_tokens: Sequence[float], losses: Sequence[float], *,
            loss: str = "linear", f_scale: float = 0.01,
            initial: Sequence[plan.ParametricLoss] | None = None) -> Fit:
    """Least-squares fit of ``L = E + A / N^alpha + B / D^beta`` to points ``(N_i, D_i, L_i)``.

    Args:
      n_params, n_tokens, losses: equal-length sequences (parameters, tokens, loss in nats/token).
      loss: ``linear`` (ordinary least squares) or ``huber`` (robust; ``f_scale`` is Huber's delta in nats).
      initial: starting laws (default: a grid of 54, see :func:`_starts`).

    Fitted in ``(E, log A, log B, alpha, beta)`` from a grid of starting points; the best optimum wins.
    Bounds keep ``0 <= E <= min(L)`` and exponents in ``[0.01, 3]``.

    Raises:
      ValueError: fewer than 5 points, lengths differ, or non-positive / non-finite inputs.
    """
    from scipy import optimize

    n, d, y = (np.asarray(v, dtype=np.float64) for v in (n_params, n_tokens, losses))
    if not (len(n) == len(d) == len(y)):
        raise ValueError(f"fit: {len(n)} params, {len(d)} token counts and {len(y)} losses differ in length")
    if len(y) < 5:
        raise ValueError(f"fit: {len(y)} points cannot determine 5 constants (need at least 5, better 9+)")
    if not (np.all(np.isfinite(y)) and np.all(n > 0) and np.all(d > 0)):
        raise ValueError("fit: parameter and token counts must be positive and losses finite")
    logn, logd = np.log(n), np.log(d)

    def residuals(x):
        return _model(x, logn, logd) - y

    lo = np.array([0.0, -20.0, -20.0, 0.01, 0.01])
    hi = np.array([float(y.min()), 60.0, 60.0, 3.0, 3.0])
    best = None
    starts = _starts(y) if initial is None else (
        np.array([s.E, math.log(s.A), math.log(s.B), s.alpha, s.beta]) for s in initial)
    for start in starts:
        x0 = np.clip(start, lo + 1e-9, hi - 1e-9)
        r = optimize.least_squares(residuals, x0, bounds=(lo, hi), loss=loss, f_scale=f_scale,
                                   x_scale="jac", xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=2000)
        if best is None or r.cost < best.cost:
            best = r
    return _finish(best, residuals, len(y), loss)


def _starts(y: np.ndarray):
    """Starting points: E below the smallest loss, a spread of exponents and scales (Hoffmann et al. 2022,
    appendix D.2, also start L-BFGS from a grid)."""
    for e_frac in (0.0, 0.5, 0.9):
        for alpha in (0.1, 0.3, 0.6):
            for beta in (0.1, 0.3, 0.6):
                for log_scale in (0.0, 5.0):
                    yield np.array([e_frac * y.min(), log_scale, log_scale, alpha, beta])


def _finish(r, residuals, n_points: int, loss: str) -> Fit:
    res = residuals(r.x)
    dof = n_points - 5
    J = r.jac
    if dof > 0:
        s2 = float(res @ res) / dof
        cov = s2 * np.linalg.pinv(J.T @ J)
    else:
        cov = np.full((5, 5), np.nan)
    se = np.sqrt(np.clip(np.diag(cov), 0, None)) if dof > 0 else np.full(5, np.nan)
    E, log_a, log_b, alpha, beta = r.x
    A, B = math.exp(log_a), math.exp(log_b)
    values = (float(E), A, B, float(alpha), float(beta))
    stderr = (float(se[0]), A * float(se[1]), B * float(se[2]), float(se[3]), float(se[4]))
    return Fit(values, stderr, cov, float(np.sqrt(np.mean(res ** 2))), n_points, loss)


def points_from_runs(records: Sequence[dict[str, Any]], n_kind: str = "non_embedding"):
    """``(N, D, L, names)`` arrays from run records, with N of the chosen kind (:data:`N_KINDS`)."""
    if n_kind not in N_KINDS:
        raise ValueError(f"--n-kind {n_kind!r}: choose one of {N_KINDS}")
    n = np.array([r["params"][n_kind] for r in records], dtype=np.float64)
    d = np.array([r["tokens"] for r in records], dtype=np.float64)
    y = np.array([r["heldout_loss"] for r in records], dtype=np.float64)
    bad = [r["name"] for r, v in zip(records, y) if not np.isfinite(v)]
    if bad:  # a NaN loss (an evaluation over nothing) must not enter a fit as a number
        raise ValueError(f"runs without a finite held-out loss: {', '.join(bad)}")
    return n, d, y, [r["name"] for r in records]


def plot_fit(fit: Fit, n: np.ndarray, d: np.ndarray, y: np.ndarray, path: str,
             prediction: tuple[float, float, float] | None = None, n_kind: str = "non_embedding") -> None:
    """Loss against tokens, one colour per model size: measured points and the fitted curves; the
    prediction, if any, as a star."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    d_lo, d_hi = d.min() / 1.5, max(d.max(), prediction[1] if prediction else 0) * 1.5
    grid_d = np.geomspace(d_lo, d_hi, 100)
    sizes = sorted(set(n.tolist()))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(sizes) + (1 if prediction else 0)))
    for c, size in zip(colors, sizes):
        m = n == size
        ax.plot(d[m], y[m], "o", color=c, label=f"N={size:.3g}")
        ax.plot(grid_d, [fit.law.loss(size, t) for t in grid_d], "-", color=c, alpha=0.7)
    if prediction:
        pn, pd_, pl = prediction
        ax.plot(grid_d, [fit.law.loss(pn, t) for t in grid_d], "--", color=colors[-1])
        ax.plot([pd_], [pl], "*", ms=14, color=colors[-1], label=f"predicted N={pn:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens D")
    ax.set_ylabel("held-out loss (nats/token)")
    E, A, B, a, b = fit.values
    ax.set_title(f"L = {E:.2f} + {A:.3g}/N^{a:.2f} + {B:.3g}/D^{b:.2f}  (N: {n_kind})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fs.write_figure(fig, path, dpi=100)
    plt.close(fig)


def format_fit(fit: Fit) -> str:
    lines = [f"fit of L(N, D) = E + A/N^alpha + B/D^beta to {fit.n_points} runs ({fit.loss_kind} least squares), "
             f"RMSE {fit.rmse:.4f} nats:"]
    for name, v, s in zip(PARAM_NAMES, fit.values, fit.stderr):
        lines.append(f"  {name:5s} = {v:.4g} +- {s:.2g}")
    law = fit.law
    lines.append(f"  compute-optimal under this fit: N_opt ~ C^{law.a:.3f}, D_opt ~ C^{law.b:.3f}")
    return "\n".join(lines)


def fit_runs(paths: Sequence[str], *, n_kind: str = "non_embedding", loss: str = "linear", f_scale: float = 0.01,
             predict: tuple[float, float] | None = None, out_dir: str | None = None) -> dict[str, Any]:
    """Fit the runs under ``paths``; write ``fit.json`` and ``scaling_fit.png`` to ``out_dir`` (default:
    the first path's directory). Returns the JSON-able result."""
    records = read_runs(paths)
    n, d, y, _ = points_from_runs(records, n_kind)
    fit = fit_law(n, d, y, loss=loss, f_scale=f_scale)
    result = {"fit": fit.as_dict(), "n_kind": n_kind, "points": len(y)}
    pred = None
    if predict is not None:
        pl, ps = fit.predict(*predict)
        result["prediction"] = {"params": predict[0], "tokens": predict[1], "loss": pl, "stderr": ps}
        pred = (predict[0], predict[1], pl)
    out_dir = out_dir or (paths[0] if fs.isdir(paths[0]) else fs.dirname(paths[0]) or ".")
    fs.makedirs(out_dir)
    fs.write_text_atomic(fs.join(out_dir, "fit.json"), jsonl.dumps(result, indent=1))
    plot_fit(fit, n, d, y, fs.join(out_dir, "scaling_fit.png"), pred, n_kind)
    result["text"] = format_fit(fit)
    return result


def read_grid_runs(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Records of ``runs.jsonl`` files (or directories holding one) for ``rules``, each checked where it was read.

    Raises:
      FileNotFoundError: a path that does not exist, or a directory without runs.jsonl.
      ValueError: naming the file and line: a record that is not a grid run (:func:`jaxpt.lab.rules.check_record`),
        one run read twice (its ``config_hash`` seen before: the same runs file given twice, naming both places);
        naming the file: a runs file with no runs. FileFormatError (a ConfigError): a line that is not JSON.
    """
    records, seen = [], {}
    for p in paths:
        f = _runs_file(p)
        n = 0
        for line, r in jsonl.iter_objects(f, partial_last_line=True):
            where = f"{f}, line {line}"
            try:
                rules_lib.check_record(r)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            h = r.get("config_hash")
            if h and h in seen:
                raise ValueError(f"{where}: run {r.get('name', '?')} was read already at {seen[h]} (the same "
                                 "config_hash): give each runs file once (a second seed's grid has its own)")
            if h:
                seen[h] = where
            records.append(r)
            n += 1
        if not n:
            raise ValueError(f"{f}: no runs in this runs file")
    return records


def _runs_file(p: str) -> str:
    if not fs.exists(p):
        raise FileNotFoundError(f"{p}: no such file or directory")
    if fs.isdir(p):
        if not fs.exists(fs.join(p, "runs.jsonl")):
            raise FileNotFoundError(f"{p}: a directory without runs.jsonl (not a ScalingGrid.output)")
        return fs.join(p, "runs.jsonl")
    return p
