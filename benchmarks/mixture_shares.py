"""Realized token shares of the trainer's batches against the configured mixture weights, for 1, 2 and 8 data
shards (issue 17: within +-1 point over 2M tokens).

    python benchmarks/mixture_shares.py --docs ../shared/corpus/raw-v1 --tokenizer artifacts/sample/tokenizer.model
    python benchmarks/mixture_shares.py --docs artifacts/sample/train.jsonl.gz --tokenizer artifacts/sample/tokenizer.model
    python benchmarks/mixture_shares.py --run workdirs/quickstart_staged   # a run's realized shares per stage

``--docs``: a directory of raw-v1 ``<domain>/*.jsonl.gz`` document files (every document, unfiltered; the
``web/pages.warc.gz`` copy is not read) or one prepared document file. The batches come from the trainer's own
reader (:func:`jaxpt.data.mixture.mixture_iterator`, what ``DataConfig.mixture_weights`` builds for every
logical shard), tokens counted from the batches' ``mixture_group`` labels, padding excluded. Also printed: the
token share that *document* sampling at the same weights would give (weight x mean document length,
normalized; lengths in tokens of the documents this run read), the reader before token mixtures.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxpt.data import documents, mixture  # noqa: E402
from jaxpt.data.tokenizer import Tokenizer  # noqa: E402


def _read(path: str) -> list[dict]:
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*", "*.jsonl.gz")))
    return [d for f in files for d in documents.read_documents(f)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs")
    p.add_argument("--tokenizer")
    p.add_argument("--run", help="a training workdir: print its realized shares per stage (metrics.jsonl) "
                                 "against the schedule of its last session (run.json)")
    p.add_argument("--weights", default="web=0.08,code=0.22,reference=0.25,multilingual=0.45",
                   help="group=weight,... (default: raw_v1.gin's quota targets)")
    p.add_argument("--tokens", type=int, default=2_000_000)
    p.add_argument("--shards", default="1,2,8")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args(argv)
    if a.run:
        return _run_shares(a.run)
    if not (a.docs and a.tokenizer):
        p.error("--docs and --tokenizer are required (or --run)")
    weights = tuple((k, float(v)) for k, v in (kv.split("=") for kv in a.weights.split(",")))
    schedule = mixture.parse_schedule([(1, weights)])
    groups = mixture.group_names(schedule)
    t0 = time.time()
    docs = _read(a.docs)
    tok = Tokenizer.load(a.tokenizer)
    domains = [d.get("domain", "") for d in docs]
    sources = [d.get("source", "") for d in docs]
    texts = [d["text"] for d in docs]
    del docs
    lengths: dict[int, int] = {}

    def fetch(i):
        ids = tok.encode(texts[i])
        lengths[i] = len(ids) + 1  # + EOS
        return ids, i

    print(f"{len(texts)} documents from {a.docs} read in {time.time() - t0:.0f} s; weights {dict(schedule[0][1])}")
    steps = -(-a.tokens // (a.global_batch * a.seq_len))
    print(f"{steps} steps x {a.global_batch} rows x {a.seq_len} tokens = {steps * a.global_batch * a.seq_len} tokens")
    header = "| shards | " + " | ".join(groups) + " | max abs error (points) |"
    rows = [header, "|" + "---|" * (len(groups) + 2)]
    for s in (int(x) for x in a.shards.split(",")):
        t = time.time()
        its = [mixture.mixture_iterator(domains, sources, fetch, schedule, key="--weights", seed=0, shuffle=True,
                                        shard=k, num_shards=s, rows=a.global_batch // s, seq_len=a.seq_len,
                                        eos_id=tok.eos_id, pad_id=tok.pad_id) for k in range(s)]
        counts = np.zeros(len(groups), np.int64)
        for _ in range(steps):
            for it in its:
                g = next(it)[mixture.GROUP_KEY]
                counts += np.bincount(g[g >= 0].ravel(), minlength=len(groups))
        share = counts / counts.sum()
        err = max(abs(share[i] - schedule[0][1][g]) for i, g in enumerate(groups)) * 100
        rows.append(f"| {s} | " + " | ".join(f"{x:.4f}" for x in share) + f" | {err:.2f} |")
        print(f"shards={s}: {dict(zip(groups, np.round(share, 4)))} ({time.time() - t:.0f} s)")
    mean_len = {g: np.mean([n for i, n in lengths.items() if _group(domains[i], sources[i], groups) == g])
                for g in groups}
    doc_share = {g: schedule[0][1][g] * mean_len[g] for g in groups}
    total = sum(doc_share.values())
    rows.append("| document sampling (before) | " + " | ".join(f"{doc_share[g] / total:.4f}" for g in groups) + " | |")
    rows.append("| configured | " + " | ".join(f"{schedule[0][1][g]:.4f}" for g in groups) + " | |")
    print("\n".join(rows))
    return 0


def _run_shares(workdir: str) -> int:
    """The last ``mixture/...`` record of each stage in ``workdir``'s metrics.jsonl beside its weights."""
    import json
    run = json.load(open(os.path.join(workdir, "run.json")))
    schedule = run["sessions"][-1]["mixture"]
    last = {}
    for line in open(os.path.join(workdir, "metrics.jsonl")):
        r = json.loads(line)
        if "mixture/stage" in r:
            last[r["mixture/stage"]] = r
    groups = sorted({g for s in schedule for g in s["weights"]})
    print("| stage (steps) | tokens | " + " | ".join(groups) + " |")
    print("|" + "---|" * (len(groups) + 2))
    for i, stage in enumerate(schedule):
        r = last.get(i)
        if r is None:
            continue
        end = schedule[i + 1]["start_step"] - 1 if i + 1 < len(schedule) else r["step"]
        cells = [f"{r.get(f'mixture/share/{g}', 0.0):.3f} ({stage['weights'].get(g, 0.0):.3f})" for g in groups]
        print(f"| {i} ({stage['start_step']}-{end}, logged at {r['step']}) | {r['mixture/stage_tokens']} | "
              + " | ".join(cells) + " |")
    print("realized (configured)")
    return 0


def _group(domain: str, source: str, groups) -> str | None:
    if f"{domain}/{source}" in groups:
        return f"{domain}/{source}"
    return domain if domain in groups else None


if __name__ == "__main__":
    sys.exit(main())
