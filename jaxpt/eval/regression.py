"""Regression report: compare two evaluation reports made with the same card (or two held-out reports of the same
documents, as figures: :func:`compare_heldout`).

Core probe tasks are compared on their primary metric: a drop larger than the task's ``regression_tolerance``
(absolute, in metric units) is flagged. Perplexity is compared for each group of the card's ``core_grouping``
(e.g. every domain): a rise larger than ``perplexity.regression_tolerance`` (relative) is flagged. Reports made
with different cards (name, version or content hash), on different example sets or held-out tokens, or (both
mixture-of-experts reports) with different routings, are refused rather than compared.

A card with a ``safety`` section adds one row per safety rate (:func:`jaxpt.eval.safety.compare_rows`): a new report
whose rate is past the card's threshold is flagged whatever the base did, since a version over a safety threshold
does not advance.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from jaxpt.eval import safety


class IncompatibleReports(ValueError):
    """Two reports that cannot be compared (different card, examples or held-out text)."""


def _check_same(base: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    cb, cn = base.get("card", {}), new.get("card", {})
    for key in ("name", "version", "content_sha256"):
        if cb.get(key) != cn.get(key):
            hint = (" (same version, different content: a card changed without a version bump)"
                    if key == "content_sha256" else "")
            raise IncompatibleReports(f"reports use different cards: {key} {cb.get(key)!r} vs {cn.get(key)!r}{hint}")
    for name, tb in base.get("tasks", {}).items():
        tn = new.get("tasks", {}).get(name)
        if tn is not None and tb.get("examples_sha256") != tn.get("examples_sha256"):
            raise IncompatibleReports(f"task {name}: the reports were scored on different examples "
                                      "(held-out or training source differ)")
    rb, rn = base.get("heldout", {}).get("routing"), new.get("heldout", {}).get("routing")
    if rb is not None and rn is not None and rb != rn:
        raise IncompatibleReports(f"held-out perplexity from different mixture-of-experts routings: {rb!r} vs {rn!r}")
    hb, hn = base.get("heldout", {}).get("overall", {}), new.get("heldout", {}).get("overall", {})
    if hb.get("tokens") != hn.get("tokens"):
        raise IncompatibleReports(f"held-out perplexity over different text: {hb.get('tokens')} vs "
                                  f"{hn.get('tokens')} scored tokens")


def _row(row: dict[str, Any]) -> dict[str, Any]:
    """A core row whose base or new figure is not a finite number (an evaluation over nothing, a NaN loss) is
    flagged with a note: every comparison with NaN is False, so it would otherwise pass as no regression."""
    finite = all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in ("base", "new"))
    if not finite and row["core"]:
        row.update(flagged=True, note="a figure is not a number (nothing was scored?)")
    return row


def _is_heldout_report(report: Mapping[str, Any]) -> bool:
    """A report of ``evaluate heldout`` (held-out perplexity alone: ``overall`` and ``by_<group>``, no card)."""
    return "card" not in report and isinstance(report.get("overall"), Mapping)


def compare_heldout(base: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Compare two ``evaluate heldout`` reports of the same documents: the loss (nats per token) and perplexity
    overall and per group, as figures (no card, so no tolerance: nothing is flagged, ``ok`` is True).

    Raises:
      IncompatibleReports: the two scored different text (token counts differ), or one is not a held-out report.
    """
    if not (_is_heldout_report(base) and _is_heldout_report(new)):
        raise IncompatibleReports("a held-out report (evaluate heldout) compares only with another held-out report")
    if base["overall"].get("tokens") != new["overall"].get("tokens"):
        raise IncompatibleReports(f"held-out perplexity over different text: {base['overall'].get('tokens')} vs "
                                  f"{new['overall'].get('tokens')} scored tokens")
    rows = []
    groups = [("overall", {"": base["overall"]}, {"": new["overall"]})]
    groups += [(k[3:], v, new.get(k, {})) for k, v in base.items() if k.startswith("by_") and isinstance(v, Mapping)]
    for grouping, fb_all, fn_all in groups:
        for g, fb in fb_all.items():
            fn = fn_all.get(g)
            if fn is None:
                raise IncompatibleReports(f"held-out group {grouping}={g} is missing from the new report")
            rows.append({"kind": "loss", "name": grouping if not g else f"{grouping}={g}", "metric": "loss",
                         "base": fb["loss"], "new": fn["loss"], "change": fn["loss"] - fb["loss"],
                         "tolerance": None, "core": False, "flagged": False})
    return {"ok": True, "card": None, "base_checkpoint": base.get("checkpoint"),
            "new_checkpoint": new.get("checkpoint"), "rows": rows, "flagged": []}


def compare(base: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Compare ``new`` against ``base`` (two eval-card reports; two ``evaluate heldout`` reports go to
    :func:`compare_heldout`).

    Returns ``{"ok": bool, "card": ..., "rows": [...], "flagged": [...]}``; each row names the metric, both
    values, the change and the tolerance, and ``flagged`` lists the core rows whose drop exceeds it or whose
    figure on either side is not a finite number (with a ``note``).

    Raises:
      IncompatibleReports: different cards, example sets or held-out text, or a card report beside a held-out one.
    """
    if _is_heldout_report(base) or _is_heldout_report(new):
        return compare_heldout(base, new)
    _check_same(base, new)
    rows = []
    for name, tb in base.get("tasks", {}).items():
        tn = new.get("tasks", {}).get(name)
        if tn is None:
            raise IncompatibleReports(f"task {name} is missing from the new report")
        metric = tb["primary_metric"]
        b, n = tb["metrics"][metric], tn["metrics"][metric]
        tol = float(tb.get("regression_tolerance", 0.0))
        drop = b - n
        rows.append(_row({"kind": "task", "name": name, "metric": metric, "base": b, "new": n, "change": -drop,
                          "tolerance": tol, "core": bool(tb.get("core")),
                          "flagged": bool(tb.get("core")) and drop > tol + 1e-12}))
    ppl = base.get("heldout", {})
    grouping = ppl.get("core_grouping")
    tol = float(ppl.get("regression_tolerance", 0.0))
    if grouping:
        groups_b = ppl.get(f"by_{grouping}", {})
        groups_n = new.get("heldout", {}).get(f"by_{grouping}", {})
        for g, fb in groups_b.items():
            fn = groups_n.get(g)
            if fn is None:
                raise IncompatibleReports(f"perplexity group {grouping}={g} is missing from the new report")
            rise = fn["perplexity"] / fb["perplexity"] - 1.0
            rows.append(_row({"kind": "perplexity", "name": f"{grouping}={g}", "metric": "perplexity",
                              "base": fb["perplexity"], "new": fn["perplexity"], "change": rise, "tolerance": tol,
                              "core": True, "flagged": rise > tol + 1e-12}))
    if "safety" in new:
        rows += safety.compare_rows(base.get("safety"), new["safety"])
    flagged = [r for r in rows if r["flagged"]]
    return {"ok": not flagged, "card": base.get("card"), "base_checkpoint": base.get("checkpoint"),
            "new_checkpoint": new.get("checkpoint"), "rows": rows, "flagged": flagged}


def format_comparison(result: Mapping[str, Any]) -> str:
    """A plain-text table of :func:`compare`'s rows."""
    if result["card"] is None:  # two held-out reports: figures, no tolerance
        lines = ["held-out loss (nats per token), base -> new: figures only (no card, no tolerance)"]
        lines += [f"     {r['name']:<40} {r['base']:>10.4f} -> {r['new']:>10.4f}  change {r['change']:+.4f}"
                  for r in result["rows"]]
        return "\n".join(lines)
    unsafe = [r["name"] for r in result["flagged"] if r["kind"] == "safety"]
    lines = [f"card {result['card']['name']} v{result['card']['version']}: "
             f"{'OK' if result['ok'] else 'REGRESSION'} ({len(result['flagged'])} flagged)"
             + (f"; does not advance: {', '.join(unsafe)} past the card's safety threshold" if unsafe else "")]
    for r in result["rows"]:
        change = (f"{100 * r['change']:+.2f}%" if r["kind"] == "perplexity" else f"{r['change']:+.4f}")
        if r["kind"] == "safety":
            tol = "no threshold" if r["tolerance"] is None else f"{r['side']} {r['tolerance']:.3f}"
            tol += "  (by labels)" if r.get("judged_by") == "labels" else ""
        else:
            tol = f"{100 * r['tolerance']:.1f}%" if r["kind"] == "perplexity" else f"{r['tolerance']:.4f}"
        lines.append(f"  {'!!' if r['flagged'] else '  '} {r['kind']:<10} {r['name']:<28} {r['metric']:<14} "
                     f"{r['base']:>10.4f} -> {r['new']:>10.4f}  change {change:>9}  tolerance {tol}"
                     f"{'' if r['core'] else '  (not core)'}")
    return "\n".join(lines)
