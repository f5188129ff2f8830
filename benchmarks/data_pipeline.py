"""Corpus-pipeline throughput and near-dedup quality on raw-v1, measured side by side in one run.

    python benchmarks/data_pipeline.py [--root ../shared/corpus/raw-v1] [--sample 20000]

Prints documents/s and MB/s (UTF-8 input bytes) for each stage's per-document work, single process,
on a seeded sample (`--sample`) of raw-v1 documents; the MinHash stage runs on every document, for
ours (`data_pipelines.minhash`: signatures + LSH bands + verification + components) and for
datasketch 2.0 (MinHash(num_perm=128) + MinHashLSH(threshold=0.8) + components), each in its own
child process so its peak RSS is its own. Then recall at Jaccard >= 0.8 and false-merge rate at
Jaccard <= 0.5 of both, on the same evaluated pairs (`data_pipelines.neardup_eval`; our LSH
candidate pairs are included as hard negatives). Figures only:
nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data_pipelines import minhash, neardup_eval, readers  # noqa: E402
from data_pipelines.steps import decontamination, exact_dedup, extraction, langid, normalization, quality, rules  # noqa: E402
from data_pipelines.config import AdmissionConfig, LangIdConfig, NormalizeConfig, RuleConfig, Source  # noqa: E402


def _mb(texts):
    return sum(len(t.encode("utf-8")) for t in texts) / 1e6


def _timed(name, fn, texts, rows):
    t = time.perf_counter()
    fn(texts)
    dt = time.perf_counter() - t
    rows.append((name, len(texts), dt, len(texts) / dt, _mb(texts) / dt))


def _dedup_input(root):
    """raw-v1 (id, text) after exact dedup on raw text, sorted by id: what near dedup sees.

    Streams the shards and keeps only ids and texts, so the child's peak RSS is the stage's."""
    import glob
    import gzip
    import hashlib
    import json

    seen, uniq = set(), []
    recs = []
    for path in sorted(glob.glob(os.path.join(root, "*", "*.jsonl.gz"))):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                recs.append((d["id"], d["text"]))
    for doc_id, text in sorted(recs):
        h = hashlib.sha1(text.encode("utf-8")).digest()
        if h not in seen:
            seen.add(h)
            uniq.append((doc_id, text))
    return None, uniq


def _child(method, root, queue):
    _, uniq = _dedup_input(root)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    candidates = set()
    if method == "ours":
        cmap = minhash.near_dedup_in_memory(uniq, candidates=candidates)
    else:
        cmap = neardup_eval.datasketch_clusters(uniq)
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put({"cmap": cmap, "candidates": candidates, "seconds": dt, "docs": len(uniq), "mb": _mb([t for _, t in uniq]),
               "peak_rss_mib": peak / 1024, "rss_before_mib": rss0 / 1024})


def run_minhash(method, root):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(method, root, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.join(REPO, "..", "shared", "corpus", "raw-v1"))
    ap.add_argument("--sample", type=int, default=20000, help="documents per stage for the per-stage figures")
    ap.add_argument("--skip-quality", action="store_true", help="skip the recall/false-merge evaluation")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.root, "MANIFEST.json")):
        sys.exit(f"raw-v1 not found at {args.root}")

    rows = []
    # Stage 1: read and admit every JSONL record (gzip + JSON + checks).
    t = time.perf_counter()
    n, mb = 0, 0.0
    cfg = AdmissionConfig()
    for path in sorted(__import__("glob").glob(os.path.join(args.root, "*", "*.jsonl.gz"))):
        src = Source(name="x", domain="x", path=path, format="jsonl", license="x", acquired="2026-01-01")
        for d in readers.read_jsonl(path, src, cfg):
            n += 1
            mb += len(d.get("text", "").encode("utf-8")) / 1e6
    dt = time.perf_counter() - t
    rows.append(("admission (read jsonl.gz)", n, dt, n / dt, mb / dt))

    docs = neardup_eval.read_raw_docs(args.root)
    rng = random.Random(0)
    sample = rng.sample(docs, min(args.sample, len(docs)))
    html = [d["text"] for d in docs if d["domain"] == "web"][:60]
    texts = [d["text"] for d in sample if d["domain"] != "web"]
    _timed("admission (trafilatura, web)", lambda ts: [extraction.extract_main_text({"id": "", "source": "", "domain": "", "text": x, "html": True}) for x in ts], html, rows)
    _timed("normalize (ftfy)", lambda ts: [normalization.normalize(x, NormalizeConfig()) for x in ts], texts, rows)
    lid = langid.LanguageIdentifier(LangIdConfig())
    _timed("langid (lingua, 600 chars)", lambda ts: [lid.detect(ts[i:i + 256]) for i in range(0, len(ts), 256)], texts, rows)
    rc = RuleConfig()
    _timed("rules (Gopher/C4 stats)", lambda ts: [rules.rule_reason(x, rc) for x in ts], texts, rows)
    _timed("exact dedup key", lambda ts: [exact_dedup.exact_key(x) for x in ts], texts, rows)
    lm = quality.HashedNgramLM(sum(quality.HashedNgramLM.count(x, 1 << 20) for x in texts[:2000]))
    _timed("quality score (hashed LM)", lambda ts: [lm.score(x) for x in ts], texts, rows)
    _timed("decontam 13-grams", lambda ts: [decontamination.ngram_hashes(x, 13) for x in ts], texts, rows)
    h = minhash.MinHasher()
    _timed("minhash signature only", lambda ts: [h.signature(x) for x in ts], texts, rows)

    print(f"\nper-stage throughput, one process, {len(texts)} sampled non-web documents "
          f"({_mb(texts):.1f} MB), web extraction on {len(html)} pages")
    print(f"{'stage':34s} {'docs':>8s} {'seconds':>8s} {'docs/s':>10s} {'MB/s':>8s}")
    for name, n, dt, dps, mbs in rows:
        print(f"{name:34s} {n:8d} {dt:8.2f} {dps:10.0f} {mbs:8.2f}")

    print("\nnear dedup on all of raw-v1 after exact dedup (each in its own process):")
    res = {}
    for method in ("ours", "datasketch"):
        r = run_minhash(method, args.root)
        res[method] = r
        print(f"  {method:11s} {r['docs']:7d} docs {r['seconds']:7.1f} s {r['docs'] / r['seconds']:8.0f} docs/s "
              f"{r['mb'] / r['seconds']:6.2f} MB/s  peak RSS {r['peak_rss_mib']:.0f} MiB "
              f"(docs loaded: {r['rss_before_mib']:.0f} MiB)")
    speedup = (res["ours"]["docs"] / res["ours"]["seconds"]) / (res["datasketch"]["docs"] / res["datasketch"]["seconds"])
    print(f"  ours / datasketch docs/s: {speedup:.2f}x")
    if args.skip_quality:
        return
    t = time.perf_counter()
    scores = neardup_eval.score(docs, {"ours": res["ours"]["cmap"], "datasketch": res["datasketch"]["cmap"]},
                                extra_pairs=res["ours"]["candidates"])
    print(f"\nnear-dedup quality vs exact word-5-gram Jaccard ({time.perf_counter() - t:.0f} s to evaluate):")
    for name, s in scores.items():
        print(f"  {name:11s} recall@J>=0.8 {s['recall']:.4f} (of {s['n_high']} pairs)  "
              f"false-merge@J<=0.5 {s['false_merge_rate']:.4f} (of {s['n_low']} pairs)")


if __name__ == "__main__":
    main()
