"""Learning-rate and batch-size scaling rules fitted to a grid of runs (DeepSeek-AI 2024, "DeepSeek LLM", sec. 3.1).

    python -m jaxpt.tools.scaling run --grid configs/scaling/rules.gin        # lr x batch x compute -> runs.jsonl
    python -m jaxpt.tools.scaling rules runs/rules --output runs/rules/rules.json
    python -m jaxpt.tools.plan --config ... --rules runs/rules/rules.json

The grid (:class:`jaxpt.lab.scaling.ScalingGrid` with ``learning_rates`` and ``batch_sizes``) trains every
(peak learning rate, global batch size) pair at several compute budgets, a budget being one (model, tokens) pair
with compute ``C = flops_per_token x tokens`` in FLOPs (:func:`jaxpt.training.flops.flops_per_token`: 6 x matmul
params + causal attention, the MFU convention the planner uses for a config). At each budget, the *near-optimal*
runs are those whose held-out loss is within ``tolerance`` (relative; DeepSeek: 0.25%) of the budget's best (runs
of one grid point from several seeds' grids count as one point at their mean loss:
``scaling rules runs/grid runs/grid_seed1``); a
least-squares line through the logs of all near-optimal points (``numpy.polyfit``) gives

    eta_opt = a * C^b        (peak learning rate)
    B_opt   = c * C^d        (global batch in tokens)

Fit quality is measured on held-out grid points, leaving one compute budget out at a time: fit the rules on the
other budgets, predict the held-out budget's best learning rate and batch size, and report the error
``ln(predicted) - ln(best)`` (natural log; ``ln 2 = 0.69`` is a factor of two). With fewer than three budgets no
budget can be held out, and the file says so. The rules hold for the optimizer, schedule, data and model family of
the grid; outside the fitted compute range they are an extrapolation.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from jaxpt.util import fs

#: DeepSeek-AI 2024 (sec. 3.1): "within 0.25% of the minimum generalization error".
DEFAULT_TOLERANCE = 0.0025
#: The rules file's keys for the two fitted quantities, their record keys in ``runs.jsonl`` and coefficient names.
RULES = {"peak_learning_rate": ("peak_learning_rate", "a", "b"), "batch_tokens": ("batch_tokens", "c", "d")}
FORMAT = "jaxpt.lr_batch_rules.v1"


def budgets_from_runs(records: Sequence[dict[str, Any]], tolerance: float = DEFAULT_TOLERANCE) -> list[dict[str, Any]]:
    """Group grid records by compute budget and find each budget's best and near-optimal grid points.

    Runs of one grid point (same budget, peak learning rate and batch) from several grids, e.g. a second seed's
    ``ScalingGrid.output``, are one point whose held-out loss is their mean (``seeds`` says how many, ``spread``
    their max - min): the rules are fitted to seed-averaged losses, not to the luckiest seed.

    Args:
      records: ``runs.jsonl`` records of a learning-rate x batch-size grid (:func:`jaxpt.lab.scaling.run_grid`):
        ``budget``, ``budget_flops`` (FLOPs), ``peak_learning_rate``, ``batch_tokens`` (tokens), ``heldout_loss``
        (nats/token); ``config_hash`` when recorded.
      tolerance: relative loss margin of the near-optimal set (>= 0).
    Returns: budgets sorted by FLOPs, each ``{"budget", "flops", "runs", "points", "best": point,
      "near_optimal": [point, ...], "edges": [str], "uneven_seeds": [str]}``, a point being ``{peak_learning_rate,
      batch_tokens, heldout_loss, seeds, spread}`` (:func:`seed_averaged_points`; ``edges``: :func:`grid_edges`;
      ``uneven_seeds``: :func:`uneven_seeds`).
    Raises:
      ValueError: a record lacks a key (naming the run and key), a non-finite or non-positive value, tolerance < 0,
        one run listed twice (the same ``config_hash`` at one grid point: a runs file passed twice).
    """
    if not tolerance >= 0:
        raise ValueError(f"--tolerance {tolerance}: must be >= 0")
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        check_record(r)
        groups.setdefault(r["budget"], []).append(r)
    out = []
    for name, runs in groups.items():
        points = seed_averaged_points(runs)
        best = min(points, key=lambda p: p["heldout_loss"])
        near = [p for p in points if p["heldout_loss"] <= best["heldout_loss"] * (1 + tolerance)]
        out.append({"budget": name, "flops": float(np.mean([r["budget_flops"] for r in runs])), "runs": len(runs),
                    "points": len(points), "best": best, "near_optimal": near, "edges": grid_edges(points, best),
                    "uneven_seeds": uneven_seeds(points, best)})
    return sorted(out, key=lambda b: b["flops"])


_KEYS = ("budget", "budget_flops", "peak_learning_rate", "batch_tokens", "heldout_loss")


def check_record(r: dict[str, Any]) -> None:
    """Refuse a ``runs.jsonl`` record that is not a run of a learning-rate x batch-size grid.

    Raises:
      ValueError: a missing key (named) or a value of ``budget_flops``, ``peak_learning_rate``, ``batch_tokens`` or
        ``heldout_loss`` that is not a positive finite number (named, with the run's name).
    """
    missing = [k for k in _KEYS if k not in r]
    if missing:
        raise ValueError(f"run {r.get('name', '?')}: no {', '.join(missing)} (not a run of a learning-rate x "
                         f"batch-size grid: ScalingGrid.learning_rates / batch_sizes)")
    bad = [k for k in _KEYS[1:] if not (isinstance(r[k], (int, float)) and math.isfinite(r[k]) and r[k] > 0)]
    if bad:
        raise ValueError(f"run {r.get('name', '?')}: {bad[0]} = {r[bad[0]]!r} is not a positive finite number")


def seed_averaged_points(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One budget's runs as grid points: runs with the same peak learning rate and batch (other seeds) averaged.

    Returns: ``[{peak_learning_rate, batch_tokens, heldout_loss (mean, nats/token), seeds (runs averaged),
      spread (max - min held-out loss, nats; 0 for one seed)}]`` in first-seen order.
    Raises:
      ValueError: two runs of a point with one ``config_hash`` (the same run counted twice), naming the run.
    """
    by_point: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for r in runs:
        by_point.setdefault((float(r["peak_learning_rate"]), float(r["batch_tokens"])), []).append(r)
    out = []
    for (lr, bt), rs in by_point.items():
        hashes = [r["config_hash"] for r in rs if r.get("config_hash")]
        if len(set(hashes)) < len(hashes):
            raise ValueError(f"run {rs[0].get('name', '?')}: listed more than once with the same config_hash "
                             "(a runs file passed twice?); a second seed's runs have their own")
        losses = [float(r["heldout_loss"]) for r in rs]
        out.append({"peak_learning_rate": lr, "batch_tokens": bt, "heldout_loss": float(np.mean(losses)),
                    "seeds": len(rs), "spread": max(losses) - min(losses)})
    return out


def grid_edges(runs: Sequence[dict[str, Any]], best: dict[str, Any]) -> list[str]:
    """Where ``best`` (one of ``runs``, a budget's grid points or records) lies on the edge of what the budget tried:
    one line per quantity of :data:`RULES` whose best value is the smallest or the largest of ``runs`` (more than
    one value tried). Such a best only bounds the optimum, which may lie beyond it: extend the grid there."""
    out = []
    for field, _, _ in RULES.values():
        tried = sorted({float(r[field]) for r in runs})
        value = float(best[field])
        if len(tried) > 1 and value in (tried[0], tried[-1]):
            side = "smallest" if value == tried[0] else "largest"
            out.append(f"best {field} {value:.4g} is the {side} tried ({tried[0]:.4g}-{tried[-1]:.4g}): the optimum "
                       f"may lie beyond it")
    return out


def uneven_seeds(points: Sequence[dict[str, Any]], best: dict[str, Any]) -> list[str]:
    """A line when ``best`` (one of a budget's ``points``, :func:`seed_averaged_points`) averages fewer seeds than
    other points of its budget: a one-seed best among two-seed means won with the noisier estimate (on the size
    grid of docs/results/scaling-rules.md a point's two seeds differ by a median 0.08-0.17 nats), so its lead may be
    one seed's luck. Empty when the best has as many seeds as any point."""
    most = max(p["seeds"] for p in points)
    if best["seeds"] >= most:
        return []
    more = sum(p["seeds"] == most for p in points)
    return [f"best point (lr {best['peak_learning_rate']:.4g}, batch {best['batch_tokens']:.4g}) has {best['seeds']} "
            f"seed(s) where {more} point(s) of this budget have {most}: its lead may be one seed's luck"]


def fit_power_law(flops: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``ln y = ln k + e ln C`` (``numpy.polyfit``, degree 1). Returns ``(k, e)``: ``y = k C^e``.

    Raises:
      ValueError: fewer than 2 distinct ``C`` (the exponent is undetermined), or non-positive inputs.
    """
    x, y = np.log(np.asarray(flops, np.float64)), np.asarray(values, np.float64)
    if len(np.unique(x)) < 2:
        raise ValueError(f"rules: {len(np.unique(x))} distinct compute budget(s); a power law in C needs at least 2")
    if not np.all(y > 0):
        raise ValueError("rules: values must be positive")
    e, log_k = np.polyfit(x, np.log(y), 1)
    return float(math.exp(log_k)), float(e)


def _fit(budgets: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Both rules from the near-optimal points of ``budgets``: ``{key: (coefficient, exponent)}``."""
    out = {}
    for key, (field, _, _) in RULES.items():
        pts = [(b["flops"], p[field]) for b in budgets for p in b["near_optimal"]]
        out[key] = fit_power_law([c for c, _ in pts], [v for _, v in pts])
    return out


def leave_one_budget_out(budgets: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Held-out quality: for each budget, the rules fitted on the others predict its best learning rate and batch.

    Returns: one entry per budget, ``{"budget", "flops", "<key>": {"predicted", "best", "log_error"}}`` for each
    key of :data:`RULES` (``log_error = ln(predicted / best)``); ``[]`` with fewer than 3 budgets.
    """
    if len(budgets) < 3:
        return []
    out = []
    for i, held in enumerate(budgets):
        rules = _fit([b for j, b in enumerate(budgets) if j != i])
        entry = {"budget": held["budget"], "flops": held["flops"]}
        for key, (k, e) in rules.items():
            pred, best = k * held["flops"] ** e, held["best"][RULES[key][0]]
            entry[key] = {"predicted": pred, "best": best, "log_error": math.log(pred / best)}
        out.append(entry)
    return out


def fit_rules(records: Sequence[dict[str, Any]], tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """The rules file's content: both power laws, the compute range fitted, per-budget optima and held-out quality.

    Returns: JSON-able ``{"format", "rules": {"peak_learning_rate": {"a", "b"}, "batch_tokens": {"c", "d"}},
      "compute_range_flops": [min, max], "tolerance", "budgets", "heldout", "heldout_rms_log_error"}``; the last is
      ``{key: float}`` or None with fewer than 3 budgets.
    Raises:
      ValueError: as :func:`budgets_from_runs` and :func:`fit_power_law` (fewer than 2 budgets).
    """
    budgets = budgets_from_runs(records, tolerance)
    fitted = _fit(budgets)
    heldout = leave_one_budget_out(budgets)
    rms = None
    if heldout:
        rms = {key: math.sqrt(np.mean([h[key]["log_error"] ** 2 for h in heldout])) for key in RULES}
    rules = {key: {RULES[key][1]: k, RULES[key][2]: e} for key, (k, e) in fitted.items()}
    return {"format": FORMAT, "rules": rules, "flops_convention": "flops_per_token x tokens (6 N_matmul + attention)",
            "compute_range_flops": [budgets[0]["flops"], budgets[-1]["flops"]], "tolerance": tolerance,
            "budgets": budgets, "heldout": heldout, "heldout_rms_log_error": rms}


def load_rules(path: str) -> dict[str, Any]:
    """Read a rules file written by ``python -m jaxpt.tools.scaling rules`` (a directory: its ``rules.json``).

    Raises:
      FileNotFoundError: no such file. ValueError: not JSON, another format, or a missing/non-numeric key (named).
    """
    if fs.isdir(path):   # the directory `scaling rules` wrote its default rules.json into
        path = fs.join(path, "rules.json")
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: no such rules file (python -m jaxpt.tools.scaling rules writes one)")
    rules = fs.read_json(path, "a rules file")   # ConfigError (a ValueError) naming the file
    if not isinstance(rules, dict) or rules.get("format") != FORMAT:
        raise ValueError(f"{path}: not a rules file (format is not {FORMAT!r})")
    for key, (_, k, e) in RULES.items():
        for name in (k, e):
            v = rules.get("rules", {}).get(key, {}).get(name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{path}: rules.{key}.{name} = {v!r} is not a finite number")
    lo_hi = rules.get("compute_range_flops")
    if not (isinstance(lo_hi, list) and len(lo_hi) == 2 and all(isinstance(v, (int, float)) for v in lo_hi)):
        raise ValueError(f"{path}: compute_range_flops = {lo_hi!r} is not [min, max]")
    return rules


def recommend(rules: dict[str, Any], flops: float, seq_len: int | None = None,
              flops_method: str | None = None) -> dict[str, Any]:
    """The rules' peak learning rate and global batch (tokens; rows too when ``seq_len`` is given) at ``flops``.

    Args:
      flops_method: how ``flops`` was counted (the planner's ``flops_method``: ``"6ND"`` for ``--params`` and
        ``--flops``, ``flops_per_token`` for ``--config``); a warning when it is not the rules' convention
        (``flops_per_token x tokens``: 6 x matmul params + attention, which leaves out the input embedding that
        ``6ND``'s total ``N`` counts), since the same run then sits elsewhere on the fitted curve.
    Returns: ``{"flops", "peak_learning_rate", "batch_tokens", ["batch_rows"], "compute_range_flops",
      "extrapolation": bool, "extrapolation_factor", "heldout_rms_log_error", "warnings": [str]}``;
      ``extrapolation`` when ``flops`` is outside the fitted range, ``extrapolation_factor`` how far (``flops /
      hi`` above it, ``lo / flops`` below it, 1.0 inside); a warning when the batch is under one row (a rule
      extrapolated out of meaning) and when ``flops_method`` is another convention.
    Raises:
      ValueError: ``flops`` not positive.
    """
    if not flops > 0:
        raise ValueError(f"rules: compute {flops} FLOPs must be positive")
    r = rules["rules"]
    lo, hi = rules["compute_range_flops"]
    out = {"flops": flops, "peak_learning_rate": r["peak_learning_rate"]["a"] * flops ** r["peak_learning_rate"]["b"],
           "batch_tokens": r["batch_tokens"]["c"] * flops ** r["batch_tokens"]["d"], "compute_range_flops": [lo, hi],
           "extrapolation": not lo <= flops <= hi, "extrapolation_factor": max(flops / hi, lo / flops, 1.0),
           "heldout_rms_log_error": rules.get("heldout_rms_log_error")}
    out["warnings"] = []
    if flops_method and not flops_method.startswith("flops_per_token"):
        out["warnings"].append(f"this compute is counted as {flops_method}; the rules were fitted on "
                               f"{rules.get('flops_convention', 'flops_per_token x tokens')}: plan with --config "
                               "for the same convention (they differ by the embedding's share and attention)")
    if seq_len:
        out["batch_rows"] = out["batch_tokens"] / seq_len
        if out["batch_rows"] < 1:
            out["warnings"].append(f"the batch rule gives less than one row of {seq_len} tokens here: not usable")
    return out


def format_recommendation(rec: dict[str, Any]) -> str:
    """One line for the planner (:mod:`jaxpt.lab.plan`)."""
    lo, hi = rec["compute_range_flops"]
    rows = f" ({rec['batch_rows']:.4g} rows)" if "batch_rows" in rec else ""
    span = f"the fitted range {lo:.3g}-{hi:.3g} FLOPs"
    side = "above" if rec["flops"] > hi else "below"
    where = (f"an EXTRAPOLATION: {rec['flops']:.3g} FLOPs is {rec['extrapolation_factor']:.3g}x {side} {span}"
             if rec["extrapolation"] else f"inside {span}")
    rms = rec.get("heldout_rms_log_error")
    quality = (f"; held-out RMS log error: lr {rms['peak_learning_rate']:.2f}, batch {rms['batch_tokens']:.2f}"
               if rms else "; no held-out check (fewer than 3 budgets)")
    warn = "".join(f"; WARNING: {w}" for w in rec.get("warnings", ()))
    return (f"lr/batch rules (DeepSeek-AI 2024 sec. 3.1, fitted grid): peak learning rate {rec['peak_learning_rate']:.3g}, "
            f"global batch {rec['batch_tokens']:.4g} tokens{rows}; {where}{quality}{warn}")


def _seeds_line(b: dict[str, Any]) -> str:
    best = b["best"]
    return (f"  budget {b['budget']}: {b['runs']} runs averaged over seeds into {b['points']} grid points; best "
            f"point's loss {best['heldout_loss']:.4f} over {best['seeds']} seed(s), spread {best['spread']:.4f} nats")


def format_rules(result: dict[str, Any]) -> str:
    """Human-readable summary of :func:`fit_rules`."""
    r, (lo, hi) = result["rules"], result["compute_range_flops"]
    lines = [f"fitted on {len(result['budgets'])} compute budgets, {lo:.3g}-{hi:.3g} FLOPs "
             f"(near-optimal: within {result['tolerance']:.2%} of each budget's best loss):",
             f"  peak learning rate = {r['peak_learning_rate']['a']:.4g} * C^{r['peak_learning_rate']['b']:.4f}",
             f"  global batch (tokens) = {r['batch_tokens']['c']:.4g} * C^{r['batch_tokens']['d']:.4f}"]
    for h in result["heldout"]:
        lr, bt = h["peak_learning_rate"], h["batch_tokens"]
        lines.append(f"  held out {h['budget']} ({h['flops']:.3g} FLOPs): lr predicted {lr['predicted']:.3g} vs best "
                     f"{lr['best']:.3g} (ln err {lr['log_error']:+.2f}); batch {bt['predicted']:.4g} vs "
                     f"{bt['best']:.4g} tokens (ln err {bt['log_error']:+.2f})")
    rms = result.get("heldout_rms_log_error")
    if rms:
        lines.append(f"  held-out RMS log error: lr {rms['peak_learning_rate']:.2f}, batch {rms['batch_tokens']:.2f}")
    if not result["heldout"]:
        lines.append("  no held-out check: it needs at least 3 compute budgets")
    lines += [_seeds_line(b) for b in result["budgets"] if b["runs"] > b["points"]]
    for b in result["budgets"]:
        lines += [f"  WARNING: budget {b['budget']}: {edge}; extend the grid there" for edge in b.get("edges", ())]
        lines += [f"  WARNING: budget {b['budget']}: {line}; run its other seeds" for line in b.get("uneven_seeds", ())]
    return "\n".join(lines)
