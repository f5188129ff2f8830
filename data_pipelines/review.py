"""`python -m data_pipelines.review DIR labels.jsonl`: wrongful-deletion rate per filter rule.

Reviewers read ``DIR/review/<stage>__<reason>.jsonl`` (seeded samples of removed documents) and
write one JSON line per judged document: ``{"id": "...", "wrongful": true|false}`` (``wrongful``:
the document should have been kept). The rule of each id is looked up in the decision log. A rule
whose wrongful rate exceeds `WARN_RATE` is flagged: its threshold needs recalibrating.
"""

from __future__ import annotations

import argparse
import collections
import sys

from jaxpt import jsonl
from jaxpt.errors import FileFormatError

from data_pipelines import manifest as manifest_lib

WARN_RATE = 0.2


def wrongful_rates(out_dir: str, labels_path: str) -> dict[str, dict]:
    """Per rule ``"<stage>:<reason>"``: labelled, wrongful, rate, warn.

    Raises FileFormatError (a ConfigError) naming the labels file and line: a line that breaks the JSON Lines
    rules of `jaxpt.jsonl`, or reason ``bad_label``: no boolean ``wrongful``, an unknown id, or an id the build kept.
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
        out[rule] = {"labelled": n, "wrongful": bad, "rate": rate, "warn": rate > WARN_RATE}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="built corpus directory")
    ap.add_argument("labels", help="JSON Lines of {'id', 'wrongful'}")
    args = ap.parse_args(argv)
    try:
        rates = wrongful_rates(args.dir, args.labels)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for rule, r in rates.items():
        line = f"{rule:45s} labelled={r['labelled']:4d} wrongful={r['wrongful']:4d} rate={r['rate']:.1%}"
        print(line)
        if r["warn"]:
            print(f"WARNING: {rule}: wrongful-deletion rate {r['rate']:.1%} > {WARN_RATE:.0%}; "
                  "recalibrate its threshold", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
