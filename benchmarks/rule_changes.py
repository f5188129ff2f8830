"""What the current rules (rules-v3, now v4), the new language ID and quality quantiles change on a build made
with older ones (issue 17).

    python benchmarks/rule_changes.py --build DIR --config configs/data/raw_v1.gin \
        --gin "BuildConfig.source_root='../shared/corpus/raw-v1'" --gin "OutputConfig.tokenizer_path='...'" \
        [--labels data/labels/FINAL.jsonl] [--limit-per-rule 3000]

For every document the build dropped at the rules, language-ID or quality stage, the text is read again
(`label_sample.texts_for`) and judged by the current `RuleConfig` (per domain) and `LanguageIdentifier`
(with the declared-language fallback). Prints, per (old verdict, domain): how many documents the new
decision would keep. With ``--labels`` (the filled stratified sample), prints each rule's wrongful-deletion
rate before (all labelled drops) and after (only the labelled documents the new decision still drops), with
95% Wilson intervals: the "after" rate on the same labels, without a second labelling round.
Figures only; nothing here runs in tests.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_pipelines import build, draws, label_sample, manifest as manifest_lib, review  # noqa: E402
from data_pipelines.steps import langid, rules  # noqa: E402


def new_verdict(row: dict, text: str, cfg, lid, sources) -> str:
    """The verdict the current language ID + rules give a document the old build dropped at those stages."""
    src = sources[row["source"]]
    if row["stage"] == "quality":
        # The threshold is a quantile of the source's scores; only a quantile of 0 (no drop) is judged exactly
        # here. A changed non-zero quantile needs a rebuild, so the old verdict stands.
        q = cfg.quality.per_source_drop_quantile.get(row["source"], cfg.quality.drop_quantile)
        return "kept" if q == 0 else row["verdict"]
    doc = {"lang_hint": None, "id": row["id"]}
    if (row["stage"] == "langid" and lid is not None and src.languages is not None
            and src.name not in cfg.langid.declared_sources):
        lang, _, _ = lid.detect([text], [langid._declared_language(doc, src)])[0]
        if lang not in src.languages:
            return "langid:language_not_allowed"
    reason = rules.rule_reason(text, cfg.rules.for_domain(row["domain"], row["source"]))
    return f"rules:{reason}" if reason else "kept"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True)
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--gin", action="append", default=[])
    ap.add_argument("--labels")
    ap.add_argument("--limit-per-rule", type=int, default=3000, help="seeded sample per (rule, domain)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    cfg = build.load_config(args.config, args.gin)
    sources = {s.name: s for s in cfg.registry()}
    rows = [r for r in manifest_lib.read_decisions(args.build) if r["stage"] in ("rules", "langid", "quality")]
    labels = review.read_labels(args.labels) if args.labels else {}
    strata = collections.defaultdict(list)
    for r in rows:
        strata[(r["verdict"], r["domain"])].append(r)
    chosen = []
    for key, rs in sorted(strata.items()):
        rs = sorted(rs, key=lambda r: draws.uniform(7, r["id"]))
        chosen += rs[: args.limit_per_rule] + [r for r in rs[args.limit_per_rule:] if r["id"] in labels]
    texts = label_sample.texts_for({r["id"] for r in chosen}, cfg)
    lid = langid.LanguageIdentifier(cfg.langid) if cfg.langid.enabled else None
    moved = collections.defaultdict(collections.Counter)
    after = {}
    for r in chosen:
        v = new_verdict(r, texts.get(r["id"], ""), cfg, lid, sources)
        moved[(r["verdict"], r["domain"])][v] += 1
        after[r["id"]] = v
    figures = {"moved": {}, "rates": {}}
    print(f"{'old verdict':38s} {'domain':13s} {'judged':>7s} {'of':>7s} {'kept now':>9s}")
    for (verdict, domain), c in sorted(moved.items()):
        n = sum(c.values())
        print(f"{verdict:38s} {domain:13s} {n:7d} {len(strata[(verdict, domain)]):7d} {c['kept']:9d}")
        figures["moved"][f"{verdict}|{domain}"] = {"judged": n, "total": len(strata[(verdict, domain)]),
                                                  "new_verdicts": dict(c)}
    if labels:
        by_rule = collections.defaultdict(lambda: [0, 0, 0, 0])  # before n, wrongful; after n, wrongful
        old = {r["id"]: r["verdict"] for r in rows}
        for i, wrongful in labels.items():
            if i not in old:
                continue
            b = by_rule[old[i]]
            b[0] += 1
            b[1] += int(wrongful)
            if after.get(i, old[i]) != "kept":
                b[2] += 1
                b[3] += int(wrongful)
        print("\nBy the rule that dropped a labelled document before; 'after' = those the new decision still drops"
              " (by any rule); 'right kept dropped' = rightly dropped ones still dropped")
        for rule, (n0, w0, n1, w1) in sorted(by_rule.items()):
            lo0, hi0 = review.wilson_interval(w0, n0)
            line = f"{rule:38s} before {w0}/{n0} = {w0 / n0:.1%} ({lo0:.1%}-{hi0:.1%})"
            if n1:
                lo1, hi1 = review.wilson_interval(w1, n1)
                line += f"  after {w1}/{n1} = {w1 / n1:.1%} ({lo1:.1%}-{hi1:.1%})"
            else:
                line += "  after 0/0 (drops nothing labelled)"
            print(line + f"  right kept dropped {n1 - w1}/{n0 - w0}")
            figures["rates"][rule] = {"before": [w0, n0], "after": [w1, n1], "right_still_dropped": [n1 - w1, n0 - w0]}
        # The rule that drops each labelled document now: the per-rule rate of the new rule set on this sample.
        by_new = collections.defaultdict(lambda: [0, 0])
        for i, wrongful in labels.items():
            v = after.get(i, old.get(i, "kept"))
            if i in old and v != "kept":
                by_new[v][0] += 1
                by_new[v][1] += int(wrongful)
        print("\nBy the rule that drops a labelled document now")
        for rule, (n, w) in sorted(by_new.items()):
            lo, hi = review.wilson_interval(w, n)
            print(f"{rule:38s} now {w}/{n} = {w / n:.1%} ({lo:.1%}-{hi:.1%})")
            figures.setdefault("rates_now", {})[rule] = [w, n]
        tw = sum(int(labels[i]) for i in labels if i in old)
        tn = sum(1 for i in labels if i in old)
        ww = sum(b[3] for b in by_rule.values())
        rw = sum(b[2] - b[3] for b in by_rule.values())
        print(f"\nwrongful deletions still dropped {ww}/{tw}; right deletions still dropped {rw}/{tn - tw}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
