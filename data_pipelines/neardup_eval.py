"""Near-dedup quality against exact word-shingle Jaccard on real document pairs.

Metric (issue 3): among evaluated pairs with exact word-5-gram Jaccard >= 0.8 (identical texts
aside), *recall* is the share that ends up in one cluster; among pairs with Jaccard <= 0.5, the
*false-merge rate* is the share that ends up in one cluster.

Evaluated pairs are the union of
  * every pair of documents with the same ``url_or_path`` in different sources (the stdlib of four
    Python versions: the real near duplicates of raw-v1, similar and dissimilar revisions alike), and
  * every pair placed in one cluster by any of the methods compared (so each method's merges,
    chained ones included, are all checked against exact Jaccard), and
  * every LSH candidate pair (a shared band bucket before verification): the hard negatives on
    which plain banding over-merges.
Exact Jaccard is computed on the sets of word tuples of `minhash.word_shingles`, independently of
the hashing used by MinHash. For speed each tuple is represented by Python's 64-bit ``hash`` (stable
within one process) and sets are intersected as sorted numpy arrays; a collision between two distinct
5-grams has probability about 2**-64 per pair of shingles.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from jaxpt.data import documents

from data_pipelines import minhash


def read_raw_docs(root: str | Path, pattern: str = "*/*.jsonl.gz") -> list[dict]:
    """All records of the raw-v1 shards under `root`, in sorted file order.

    Raises:
      DocumentFormatError: (a ConfigError) a line breaks the document contract of `jaxpt.data.documents`
        (names file, line and reason).
    """
    docs = []
    for path in sorted(Path(root).glob(pattern)):
        docs += documents.read_documents(path)
    return docs


def evaluation_pairs(
    docs: list[dict], cluster_maps: Iterable[Mapping[str, str]], extra_pairs: Iterable = ()
) -> set[tuple[str, str]]:
    """Same-path pairs across sources, all intra-cluster pairs of each method, and `extra_pairs`."""
    pairs = {tuple(sorted(p)) for p in extra_pairs}
    by_path: dict[str, list[str]] = {}
    for d in docs:
        if d.get("url_or_path"):
            by_path.setdefault(d["url_or_path"], []).append(d["id"])
    source = {d["id"]: d.get("source") for d in docs}
    for ids in by_path.values():
        per_source: dict[str, list[str]] = {}
        for i in ids:
            per_source.setdefault(source[i], []).append(i)
        if len(per_source) < 2:
            continue  # one source's records often share a path (a dictionary file, a fortune file)
        for s1, s2 in itertools.combinations(sorted(per_source), 2):
            pairs.update(tuple(sorted((a, b))) for a in per_source[s1] for b in per_source[s2])
    for cmap in cluster_maps:
        groups: dict[str, list[str]] = {}
        for doc_id, rep in cmap.items():
            groups.setdefault(rep, []).append(doc_id)
        for ids in groups.values():
            pairs.update(tuple(sorted(p)) for p in itertools.combinations(ids, 2))
    return pairs


def score(
    docs: list[dict],
    methods: Mapping[str, Mapping[str, str]],
    *,
    shingle_size: int = 5,
    high: float = 0.8,
    low: float = 0.5,
    extra_pairs: Iterable = (),
) -> dict[str, dict]:
    """Recall at Jaccard >= `high` and false-merge rate at Jaccard <= `low` for each method.

    Args:
      docs: records with ``id``, ``text`` and ``url_or_path``.
      methods: name -> ``{doc_id: cluster_representative}`` (singletons may be omitted).
      extra_pairs: more id pairs to evaluate (LSH candidates).
    Returns name -> ``{"recall", "false_merge_rate", "n_high", "n_low", "missed", "false_merges"}``.
    """
    text = {d["id"]: d["text"] for d in docs}
    pairs = evaluation_pairs(docs, methods.values(), extra_pairs)
    shingles: dict[str, set] = {}

    def sh(doc_id):
        if doc_id not in shingles:
            shingles[doc_id] = np.unique(np.fromiter(
                (hash(s) for s in minhash.word_shingles(text[doc_id], shingle_size)), dtype=np.int64))
        return shingles[doc_id]

    high_pairs, low_pairs = [], []
    for a, b in sorted(pairs):
        if text[a] == text[b]:
            continue
        sa, sb = sh(a), sh(b)
        inter = np.intersect1d(sa, sb, assume_unique=True).size
        union = sa.size + sb.size - inter
        j = inter / union if union else 0.0
        if j >= high:
            high_pairs.append((a, b, j))
        elif j <= low:
            low_pairs.append((a, b, j))
    out = {}
    for name, cmap in methods.items():
        same = lambda a, b: cmap.get(a, a) == cmap.get(b, b)  # noqa: E731
        missed = [(a, b, j) for a, b, j in high_pairs if not same(a, b)]
        merged = [(a, b, j) for a, b, j in low_pairs if same(a, b)]
        out[name] = {
            # NaN over no pair: a recall of 1 (or no false merge) over nothing would read as a result
            "recall": 1 - len(missed) / len(high_pairs) if high_pairs else float("nan"),
            "false_merge_rate": len(merged) / len(low_pairs) if low_pairs else float("nan"),
            "n_high": len(high_pairs),
            "n_low": len(low_pairs),
            "missed": missed[:20],
            "false_merges": merged[:20],
        }
    return out


def datasketch_clusters(docs: Iterable[tuple[str, str]], *, num_perm=128, threshold=0.8,
                        shingle_size=5) -> dict[str, str]:
    """Baseline: datasketch MinHash + MinHashLSH query, clusters by connected components.

    Shingles are the same word 5-grams (joined with a space, utf-8) that our stage uses.
    """
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    n_chars, edges = {}, []
    for doc_id, t in docs:
        sh = minhash.word_shingles(t, shingle_size)
        if not sh:
            continue
        m = MinHash(num_perm=num_perm)
        m.update_batch([" ".join(s).encode("utf-8") for s in sh])
        for other in lsh.query(m):
            edges.append((other, doc_id))
        lsh.insert(doc_id, m)
        n_chars[doc_id] = len(t)
    return minhash.connected_components(edges, n_chars)
