"""`python -m data_pipelines.review DIR labels.jsonl [--second labels_b.jsonl]`: wrongful-deletion rate per rule.

Reviewers read ``DIR/review/<stage>__<reason>.jsonl`` (seeded samples of removed documents) or the stratified
sample of `data_pipelines.label_sample`, and write one JSON line per judged document:
``{"id": "...", "wrongful": true|false}`` (``wrongful``: the document should have been kept; other fields, such as
the sample's ``text`` and ``rule``, are ignored). The rule of each id is looked up in the decision log. Each rate
comes with its 95% Wilson score interval; a rule whose wrongful rate exceeds `WARN_RATE` is flagged: its threshold
needs recalibrating. With ``--second``, the two annotators' labels of the same ids are compared: Cohen's kappa and
the ids they disagree on (for a third reading) are printed, and rates are computed from the first file.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys

from jaxpt.util import jsonl
from jaxpt.util.errors import FileFormatError

from data_pipelines import manifest as manifest_lib

WARN_RATE = 0.2


def wrongful_rates(out_dir: str, labels_path: str) -> dict[str, dict]:
    """Per rule ``"<stage>:<reason>"``: labelled, wrongful, rate, warn.

    Raises FileFormatError (a ConfigError) naming the labels file and line: a line that breaks the JSON Lines
    rules of `jaxpt.util.jsonl`, or reason ``bad_label``: no boolean ``wrongful``, an unknown id, or an id the build kept.
    """
    verdicts = {r["id"]: r["verdict"] for r in manifest_lib.read_decisions(out_dir)}
    counts = collections.defaultdict(lambda: [0, 0])
    for lineno, lab in jsonl.iter_objects(labels_path):
        doc_id, wrongful = lab.get("id"), lab.get("wrongful")
        if not isinstance(wrongful, bool):
            raise FileFormatError.at(labels_path, lineno, "bad_label", "expected {'id', 'wrongful': true|false}")
        verdict = verdicts.get(doc_id)
        if verdict is None:
            raise FileFormatError.at(labels_path, lineno, "bad_label",
                                     f"id '{doc_id}' is not in {out_dir}/decisions")
        if verdict == "kept":
            raise FileFormatError.at(labels_path, lineno, "bad_label", f"id '{doc_id}' was kept, not deleted")
        counts[verdict][0] += 1
        counts[verdict][1] += int(wrongful)
    out = {}
    for rule, (n, bad) in sorted(counts.items()):
        rate = bad / n
        lo, hi = wilson_interval(bad, n)
        out[rule] = {"labelled": n, "wrongful": bad, "rate": rate, "ci95": [lo, hi], "warn": rate > WARN_RATE}
    return out


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval (Wilson 1927) for k successes of n trials at normal quantile `z` (95% by default).

    Unlike p +- z sqrt(p(1-p)/n) it stays inside [0, 1] and is not empty at k = 0 or k = n. Raises
    ValueError unless 0 <= k <= n and n > 0."""
    if not (n > 0 and 0 <= k <= n):
        raise ValueError(f"wilson_interval: need 0 <= k <= n, n > 0; got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def read_labels(path: str, field: str = "wrongful") -> dict[str, bool]:
    """``{id: label}`` of a labels file, the label read from ``field`` (``wrongful``; ``good`` for quality labels).
    Raises FileFormatError (``bad_label``) on a non-boolean label."""
    out = {}
    for lineno, lab in jsonl.iter_objects(path):
        if not isinstance(lab.get(field), bool):
            raise FileFormatError.at(path, lineno, "bad_label", f"expected {{'id', '{field}': true|false}}")
        out[lab.get("id")] = lab[field]
    return out


def cohen_kappa(a: dict[str, bool], b: dict[str, bool]) -> dict:
    """Agreement of two annotators on the ids both labelled: Cohen's kappa (Cohen 1960),
    kappa = (p_o - p_e) / (1 - p_e) with p_o the observed agreement and p_e = sum over labels of the product of
    the annotators' label shares. Returns ``{"n", "agreement", "kappa", "disagreements": [ids]}``; kappa is 1.0
    when p_e = 1 (both gave one same label throughout). Raises ValueError if no id is shared."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("cohen_kappa: the two label files share no id")
    n = len(ids)
    p_o = sum(a[i] == b[i] for i in ids) / n
    pa, pb = sum(a[i] for i in ids) / n, sum(b[i] for i in ids) / n
    p_e = pa * pb + (1 - pa) * (1 - pb)
    kappa = 1.0 if p_e == 1 else (p_o - p_e) / (1 - p_e)
    return {"n": n, "agreement": p_o, "kappa": kappa, "disagreements": [i for i in ids if a[i] != b[i]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="built corpus directory")
    ap.add_argument("labels", help="JSON Lines of {'id', 'wrongful'}")
    ap.add_argument("--second", help="a second annotator's labels of the same ids: prints Cohen's kappa")
    args = ap.parse_args(argv)
    try:
        rates = wrongful_rates(args.dir, args.labels)
        agree = cohen_kappa(read_labels(args.labels), read_labels(args.second)) if args.second else None
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if agree:
        print(f"agreement over {agree['n']} ids: {agree['agreement']:.1%}, Cohen's kappa {agree['kappa']:.3f}; "
              f"{len(agree['disagreements'])} disagreements for a third reading: {agree['disagreements']}")
    for rule, r in rates.items():
        lo, hi = r["ci95"]
        line = (f"{rule:45s} labelled={r['labelled']:4d} wrongful={r['wrongful']:4d} rate={r['rate']:.1%} "
                f"(95% CI {lo:.1%}-{hi:.1%})")
        print(line)
        if r["warn"]:
            print(f"WARNING: {rule}: wrongful-deletion rate {r['rate']:.1%} > {WARN_RATE:.0%}; "
                  "recalibrate its threshold", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
