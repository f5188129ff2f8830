"""`python -m data_pipelines.calibrate`: the quality scorer's agreement with human labels, and per-source retention.

The quality step (`steps.quality`) scores every document and drops, per source, those under a quantile of that source's
scores. Which quantile is a claim about what the scorer's low tail holds; this tool measures it on labelled
documents instead of assuming it: "sample documents, measure how often the model score agrees with human judgment,
and then set the retention range by quantiles ... separately for each source".

Inputs: a labelled quality sample (`python -m data_pipelines.label_sample --kind quality`: the annotator file, filled
with ``good: true|false``, and its key with each document's score, within-source score quantile, band and stratum
size). The sample is stratified by (source, score band) with equal shares, so the low tail is over-represented; every
rate for a whole source is estimated with the weight ``stratum_size / labelled_in_stratum`` of each labelled document
(the Horvitz-Thompson estimator of a stratified sample).

Per source, for each candidate drop quantile ``q`` (the documents the build drops at ``q``: those with
``score_quantile <= q``, `label_sample.score_quantiles`, ties together):

- ``good_lost``: the share of the source's good documents that ``q`` drops;
- ``bad_removed``: the share of its bad documents that ``q`` drops;
- ``drop_precision``: the share of dropped documents that are bad;
- ``accuracy``: the share of documents whose keep/drop matches its label.

The calibrated ``drop_quantile`` is the largest ``q`` of the grid with ``good_lost <= max_good_lost`` and (for q > 0)
``drop_precision >= min_drop_precision`` with at least ``min_bad_below`` labelled bad documents under ``q``: drop no
more of the good text than stated, only where dropping is right more often than not, and never on one label. The
rule looks at the low tail only, where the drop happens: the weighted ROC AUC is reported beside it but does not gate
it, since with a few bad labels one heavily weighted label decides it (raw-v1's Python docs: AUC 0.36 from one
navigation page scoring high, while four of the five lowest-band labels are bad).

Output: ``calibration.json`` (the scorer's identity, the label set, the rule, and per source the table), which
``QualityConfig.calibration`` reads so the build drops by the calibrated quantiles and states them in the manifest.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from jaxpt.util import fs, jsonl
from jaxpt.util.errors import ConfigError, FileFormatError

from data_pipelines import build, quality_model, review
from data_pipelines.steps.quality import FORMAT, scorer_identity, sha256_file  # noqa: F401 (calibrate.FORMAT, ...)

#: Candidate drop quantiles; 0.05, 0.15 and 0.35 are the sample's band edges (`label_sample.QUALITY_BANDS`).
GRID = (0.0, 0.02, 0.05, 0.1, 0.15, 0.25, 0.35)


def _read_jsonl(path: str) -> list[tuple[int, dict]]:
    """``(line, object)`` of a JSON Lines file whose every object has a string ``id``.

    Raises:
      FileFormatError: naming the file and line (`jaxpt.util.jsonl.iter_objects`'s reasons, or ``bad_label``).
    """
    rows = []
    for n, row in jsonl.iter_objects(path):
        if not isinstance(row.get("id"), str):
            raise FileFormatError.at(path, n, "bad_label", "a line must be an object with a string 'id'")
        rows.append((n, row))
    return rows


def read_labels(labels_path: str, key_path: str) -> list[dict]:
    """The labelled documents: each key row of ``key_path`` joined with its label (``good``) from ``labels_path``.

    Returns dicts ``{id, source, quality_score, score_quantile, band, stratum_size, good}``.

    Raises:
      FileFormatError: naming the file and line: a line that is not a JSON object with an ``id``, a ``good`` that
        is not true or false, an id labelled twice, a label for an id not in the key.
      ConfigError: naming the labels file: key ids left unlabelled.
    """
    key = {}
    for n, row in _read_jsonl(key_path):
        missing = [k for k in ("source", "quality_score", "score_quantile", "band", "stratum_size") if k not in row]
        if missing:
            raise FileFormatError.at(key_path, n, "bad_label", f"key row {row['id']!r} lacks {missing}")
        key[row["id"]] = row
    labels = {}
    for n, row in _read_jsonl(labels_path):
        if "good" not in row:
            raise FileFormatError.at(labels_path, n, "bad_label", f"no 'good' field (the line has {sorted(row)})")
        if not isinstance(row["good"], bool):
            raise FileFormatError.at(labels_path, n, "bad_label", f"'good' must be true or false, got "
                                     f"{row['good']!r}")
        if row["id"] in labels:
            raise FileFormatError.at(labels_path, n, "bad_label", f"{row['id']!r} is labelled twice")
        if row["id"] not in key:
            raise FileFormatError.at(labels_path, n, "bad_label", f"{row['id']!r} is not in the sample key "
                                     f"{key_path}")
        labels[row["id"]] = row["good"]
    unlabelled = sorted(set(key) - set(labels))
    if unlabelled:
        raise ConfigError(f"{labels_path}: {len(unlabelled)} sample documents have no label, e.g. {unlabelled[:3]}")
    return [dict({k: key[i][k] for k in ("id", "source", "quality_score", "score_quantile", "band",
                                         "stratum_size")}, good=labels[i]) for i in sorted(key)]


def weights(rows: list[dict]) -> list[float]:
    """Each labelled document's weight ``stratum_size / labelled_in_stratum`` (stratum: source and band), so that
    weighted sums estimate whole-source counts."""
    per = collections.Counter((r["source"], r["band"]) for r in rows)
    return [r["stratum_size"] / per[(r["source"], r["band"])] for r in rows]


def rates_at(rows: list[dict], w: list[float], q: float) -> dict[str, float | None]:
    """Estimated whole-source rates when the build drops at ``q`` (``score_quantile <= q``, q > 0; module docstring);
    None where the denominator is empty (e.g. ``drop_precision`` at q = 0)."""
    def ratio(num, den):
        return num / den if den > 0 else None
    drop = [q > 0 and r["score_quantile"] <= q for r in rows]
    good_w = sum(x for x, r in zip(w, rows) if r["good"])
    bad_w = sum(x for x, r in zip(w, rows) if not r["good"])
    dropped_w = sum(x for x, d in zip(w, drop) if d)
    good_dropped = sum(x for x, r, d in zip(w, rows, drop) if d and r["good"])
    bad_dropped = dropped_w - good_dropped
    right = sum(x for x, r, d in zip(w, rows, drop) if d != r["good"])
    return {"good_lost": ratio(good_dropped, good_w), "bad_removed": ratio(bad_dropped, bad_w),
            "drop_precision": ratio(bad_dropped, dropped_w), "accuracy": ratio(right, good_w + bad_w),
            "dropped": ratio(dropped_w, good_w + bad_w)}


def weighted_auc(scores: list[float], good: list[bool], w: list[float]) -> float | None:
    """Weighted ROC AUC of ``scores`` for ``good`` (sklearn.metrics.roc_auc_score with sample weights: the
    probability that a good document scores above a bad one, ties counting half); None with one class only."""
    if len(set(good)) < 2:
        return None
    from sklearn.metrics import roc_auc_score
    return float(roc_auc_score(good, scores, sample_weight=w))


def calibrate_source(rows: list[dict], *, grid=GRID, max_good_lost: float = 0.05, min_drop_precision: float = 0.5,
                     min_bad_below: int = 2) -> dict:
    """One source's calibration: labels, weighted good rate, AUC, the rates at each grid quantile, and the chosen
    ``drop_quantile`` with the reason (rule in the module docstring; a quantile > 0 also needs at least
    ``min_bad_below`` labelled bad documents under it, so no threshold rests on a single label)."""
    w = weights(rows)
    auc = weighted_auc([r["quality_score"] for r in rows], [r["good"] for r in rows], w)
    table = {f"{q:g}": rates_at(rows, w, q) for q in grid}
    total = sum(w)
    ok = [g for g in grid if table[f"{g:g}"]["good_lost"] is not None
          and table[f"{g:g}"]["good_lost"] <= max_good_lost
          and (g == 0 or ((table[f"{g:g}"]["drop_precision"] or 0.0) >= min_drop_precision
                          and sum(1 for r in rows if not r["good"] and r["score_quantile"] <= g) >= min_bad_below))]
    q = max(ok) if ok else 0.0
    if q > 0:
        why = (f"largest grid quantile losing <= {max_good_lost:g} of good documents with drop precision >= "
               f"{min_drop_precision:g} and >= {min_bad_below} labelled bad below it")
    elif auc is None:
        why = "one class only among the labels: nothing to drop"
    else:
        why = "no grid quantile > 0 meets the rule"
    return {"labels": len(rows), "labelled_good": sum(r["good"] for r in rows),
            "good_rate": sum(x for x, r in zip(w, rows) if r["good"]) / total if total > 0 else None, "auc": auc,
            "drop_quantile": q, "reason": why, "at_drop_quantile": table[f"{q:g}"], "by_quantile": table}


def calibrate(rows: list[dict], scorer: dict, label_set: dict, **rule) -> dict:
    """The calibration file's content: ``{format, scorer, label_set, rule, sources: {source: calibrate_source}}``.

    Args:
      rows: :func:`read_labels` output.
      scorer: the identity of the scorer the labels' scores came from (``QualityConfig``'s ``version``,
        ``reference_sources`` sorted, ``num_buckets``); a build with another scorer refuses this calibration.
      label_set: where the labels are and their sha256s, recorded as provenance.
      rule: ``max_good_lost``, ``min_drop_precision``, ``min_bad_below``, ``grid`` overrides.
    """
    by = collections.defaultdict(list)
    for r in rows:
        by[r["source"]].append(r)
    rule = {"max_good_lost": 0.05, "min_drop_precision": 0.5, "min_bad_below": 2, "grid": list(GRID), **rule}
    return {"format": FORMAT, "scorer": scorer, "label_set": label_set, "rule": rule,
            "sources": {s: calibrate_source(by[s], **rule) for s in sorted(by)}}


def markdown(cal: dict) -> str:
    """The calibration table (one row per source) as Markdown."""
    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)
    lines = ["| source | labels (good) | good rate | AUC | drop quantile | good lost | bad removed | drop precision | "
             "accuracy |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s, c in cal["sources"].items():
        a = c["at_drop_quantile"]
        lines.append(f"| {s} | {c['labels']} ({c['labelled_good']}) | {f(c['good_rate'])} | {f(c['auc'])} | "
                     f"{c['drop_quantile']:g} | {f(a['good_lost'])} | {f(a['bad_removed'])} | "
                     f"{f(a['drop_precision'])} | {f(a['accuracy'])} |")
    return "\n".join(lines)


def compare_scorers(rows: list[dict], texts: dict[str, str], *, folds: int = 5, seed: int = 0) -> dict:
    """The build's scores (the key's ``quality_score``: the n-gram model's, or whatever scorer the sampled build
    used) against the label-trained classifier on the same labels, per source and overall: each one's weighted ROC
    AUC, the classifier's from out-of-fold scores (`quality_model.cross_validated_scores`: no document scored by a
    model trained on its label).

    Returns ``{source | "all": {"labels", "score_auc", "classifier_auc"}}``; "all" pools the sources' documents
    with their whole-source weights (a raw score is compared across sources there, which the per-source quantiles
    never do: read it as a summary).
    """
    oof = quality_model.cross_validated_scores([texts.get(r["id"], "") for r in rows], [r["good"] for r in rows],
                                               [r["source"] for r in rows], folds=folds, seed=seed)
    w = weights(rows)
    out = {}
    groups = collections.defaultdict(list)
    for i, r in enumerate(rows):
        groups[r["source"]].append(i)
    groups["all"] = list(range(len(rows)))
    for g, idx in sorted(groups.items()):
        good, ww = [rows[i]["good"] for i in idx], [w[i] for i in idx]
        out[g] = {"labels": len(idx),
                  "score_auc": weighted_auc([rows[i]["quality_score"] for i in idx], good, ww),
                  "classifier_auc": weighted_auc([float(oof[i]) for i in idx], good, ww)}
    return out


def main(argv=None) -> int:
    """The command line (module docstring). Returns the exit status: 0, or 2 with a one-line ``error:`` for a bad
    file or argument."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", required=True, help="the filled annotator file (id, good)")
    ap.add_argument("--agreement", metavar="SECOND_LABELS",
                    help="only compare --labels with a second annotator's file: Cohen's kappa and the ids to settle")
    ap.add_argument("--key", help="the sample's key (label_sample --kind quality)")
    ap.add_argument("--config", action="append", help="gin file(s) of the build the sample is from")
    ap.add_argument("--gin", action="append", default=[], help="gin bindings of that build")
    ap.add_argument("--output", help="calibration.json to write")
    ap.add_argument("--max-good-lost", type=float, default=0.05)
    ap.add_argument("--min-drop-precision", type=float, default=0.5)
    ap.add_argument("--min-bad-below", type=int, default=2)
    ap.add_argument("--sample", help="the annotator file with the texts: needed by --compare and --train-classifier")
    ap.add_argument("--compare", help="write the n-gram vs label-classifier comparison (cross-validated) here")
    ap.add_argument("--train-classifier", help="train the label classifier on all labels and save it here (.npz)")
    args = ap.parse_args(argv)
    if not args.agreement:
        missing = [f"--{k}" for k in ("key", "config", "output") if not getattr(args, k)]
        if missing:
            ap.error(f"calibrating (and --compare, --train-classifier) needs {', '.join(missing)}")
        if (args.compare or args.train_classifier) and not args.sample:
            ap.error("--compare and --train-classifier need --sample (the annotator file with the texts)")
    try:
        return _agreement(args) if args.agreement else _calibrate(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _agreement(args) -> int:
    """--agreement: kappa of two label files over the same documents; ids in one file only are an error."""
    a, b = review.read_labels(args.labels, "good"), review.read_labels(args.agreement, "good")
    only = sorted(set(a) ^ set(b))
    if only:
        raise ConfigError(f"{args.labels} and {args.agreement} label different documents: {len(only)} ids are in one "
                          f"file only, e.g. {only[:3]}")
    print(json.dumps(review.cohen_kappa(a, b), indent=1))
    return 0


def _calibrate(args) -> int:
    """The calibration (and --compare, --train-classifier) from the parsed arguments."""

    cfg = build.load_config(args.config, args.gin)
    rows = read_labels(args.labels, args.key)
    builds = sorted({str(r.get("build_content_id", "")) for _, r in _read_jsonl(args.key)})
    label_set = {"labels": args.labels, "labels_sha256": sha256_file(args.labels), "key": args.key,
                 "key_sha256": sha256_file(args.key), "documents": len(rows), "build_content_ids": builds}
    cal = calibrate(rows, scorer_identity(cfg.quality), label_set, max_good_lost=args.max_good_lost,
                    min_drop_precision=args.min_drop_precision, min_bad_below=args.min_bad_below)
    if args.compare or args.train_classifier:
        texts = {r["id"]: r.get("text", "") for _, r in _read_jsonl(args.sample)}
        absent = [r["id"] for r in rows if r["id"] not in texts]
        if absent:
            raise ConfigError(f"--sample {args.sample}: {len(absent)} labelled documents have no text there, e.g. "
                              f"{absent[:3]} (another sample's file?)")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    fs.replace_local(args.output, (jsonl.dumps(cal, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    print(markdown(cal))
    if args.compare:
        cmp = compare_scorers(rows, texts)
        fs.replace_local(args.compare, (jsonl.dumps(cmp, indent=1, sort_keys=True) + "\n").encode("utf-8"))
        print("\n| source | labels | build's score AUC | label classifier AUC (5-fold) |\n|---|---:|---:|---:|")
        for g, c in cmp.items():
            f = [("-" if c[k] is None else f"{c[k]:.3f}") for k in ("score_auc", "classifier_auc")]
            print(f"| {g} | {c['labels']} | {f[0]} | {f[1]} |")
    if args.train_classifier:
        model = quality_model.train([texts.get(r["id"], "") for r in rows], [r["good"] for r in rows],
                                    labels_sha256=label_set["labels_sha256"])
        print(f"classifier: {args.train_classifier} sha256 {model.save(args.train_classifier)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
