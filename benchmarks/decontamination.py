"""Decontamination by example length on raw-v1: how many documents short examples remove, and the cost of matching.

    python benchmarks/decontamination.py [--root ../shared/corpus/raw-v1] [--sample 20000]

On a seeded sample of raw-v1's non-web documents (`--sample`), prints:

1. For typical one- and two-word eval answers, the documents each would remove if matched as a word sequence
   anywhere (what `DecontamConfig.min_ngram = 1` does) against as a whole unit (the default rule for examples under
   `min_ngram` words: the document, a paragraph or a line is exactly the example), with the unit split out.
2. The same for one- and two-word lines drawn (seeded) from the sample itself: examples that are certainly in the
   corpus, so the whole-unit rule must remove at least their own document; the spread shows how over-broad a
   short example can be (which the manifest's per-example counts and `warn_documents_per_example` surface).
3. Matching throughput of `decontamination.EvalIndex.match` (documents/s, one process) with long examples only, then adding
   medium and short ones.

Figures only: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_pipelines.steps import decontamination  # noqa: E402
from data_pipelines import minhash, neardup_eval  # noqa: E402

ANSWERS = ["Yes", "No", "True", "False", "None", "Paris", "the", "return", "Example", "New York",
           "United States", "of course", "for example", "See also"]


def _removed(index: decontamination.EvalIndex, texts: dict[str, str]) -> dict[int, set[str]]:
    """Example index -> ids of the documents it matches."""
    out: dict[int, set[str]] = {}
    for doc_id, text in texts.items():
        for _, i, _ in index.match(text):
            out.setdefault(i, set()).add(doc_id)
    return out


def _index(examples: list[str], min_ngram: int, units=decontamination.DECONTAM_UNITS) -> decontamination.EvalIndex:
    ix = decontamination.EvalIndex(13, min_ngram, units)
    for i, e in enumerate(examples):
        ix.add("bench", str(i), e)
    return ix


def _table(title: str, examples: list[str], texts: dict[str, str]) -> None:
    anywhere = _removed(_index(examples, 1), texts)
    per_unit = {u: _removed(_index(examples, 3, (u,)), texts) for u in decontamination.DECONTAM_UNITS}
    whole = _removed(_index(examples, 3), texts)
    n = len(texts)
    print(f"\n{title} ({n} documents)")
    print(f"{'example':24s} {'anywhere':>9s} {'share':>7s} {'whole unit':>10s} {'document':>9s} {'paragraph':>9s} "
          f"{'line':>7s}")
    for i, e in enumerate(examples):
        a, w = len(anywhere.get(i, ())), len(whole.get(i, ()))
        units = [len(per_unit[u].get(i, ())) for u in decontamination.DECONTAM_UNITS]
        print(f"{e[:24]!r:24s} {a:9d} {a / n:7.2%} {w:10d} {units[0]:9d} {units[1]:9d} {units[2]:7d}")
    tot_a = len(set().union(*anywhere.values())) if anywhere else 0
    tot_w = len(set().union(*whole.values())) if whole else 0
    print(f"{'all examples together':24s} {tot_a:9d} {tot_a / n:7.2%} {tot_w:10d}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.join(REPO, "..", "shared", "corpus", "raw-v1"))
    ap.add_argument("--sample", type=int, default=20000, help="non-web documents sampled (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    docs = [d for d in neardup_eval.read_raw_docs(args.root) if d["domain"] != "web"]
    rng = random.Random(args.seed)
    sample = rng.sample(docs, min(args.sample, len(docs)))
    texts = {d["id"]: d["text"] for d in sample}

    _table("typical one- and two-word eval answers", ANSWERS, texts)

    short_lines = sorted({ln.strip() for t in texts.values() for ln in t.split("\n")
                          if 1 <= len(minhash.words(ln)) <= 2 and re.search(r"[^\W\d_]", ln)})
    drawn = rng.sample(short_lines, min(20, len(short_lines)))
    _table("one- and two-word lines drawn from the sample itself (each is in the corpus)", drawn, texts)

    # Throughput: long examples are 13-40 word spans of the sample, medium 3-12, short 1-2 words.
    spans = {"long": (13, 40), "medium": (3, 12), "short": (1, 2)}
    pool = [minhash.words(t) for t in rng.sample(list(texts.values()), 2000)]
    pool = [w for w in pool if len(w) >= 40]
    examples: dict[str, list[str]] = {}
    for cls, (lo, hi) in spans.items():
        examples[cls] = []
        for _ in range(200):
            w = rng.choice(pool)
            k = rng.randint(lo, hi)
            s = rng.randrange(len(w) - k + 1)
            examples[cls].append(" ".join(w[s:s + k]))
    timed = list(texts.values())[:5000]
    mb = sum(len(t.encode("utf-8")) for t in timed) / 1e6
    print(f"\nEvalIndex.match throughput, one process, {len(timed)} documents ({mb:.1f} MB), 200 examples per class")
    print(f"{'examples indexed':28s} {'seconds':>8s} {'docs/s':>8s} {'MB/s':>6s} {'docs removed':>12s} "
          "(random spans: not a real eval set)")
    for label, classes in (("long", ["long"]), ("long + medium", ["long", "medium"]),
                           ("long + medium + short", ["long", "medium", "short"])):
        ix = decontamination.EvalIndex(13, 3)
        for cls in classes:
            for i, e in enumerate(examples[cls]):
                ix.add("bench", f"{cls}-{i}", e)
        t = time.perf_counter()
        hit = sum(1 for x in timed if ix.match(x))
        dt = time.perf_counter() - t
        print(f"{label:28s} {dt:8.2f} {len(timed) / dt:8.0f} {mb / dt:6.2f} {hit:12d}")


if __name__ == "__main__":
    main()
