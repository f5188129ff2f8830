"""`python -m data_pipelines.label_sample`: stratified samples of a build's documents for human labels.

Two kinds (``--kind``): ``wrongful`` (the default), dropped documents for wrongful-deletion labels (below), and
``quality``, documents the quality stage scored, for calibrating its scores against human judgment
(:func:`draw_quality`).

From a built corpus's decision log, draws `n` documents removed by a *filter* stage (language ID, rules, quality,
decontamination, empty main text: the decisions a reviewer can call wrongful; duplicates and quota downsampling are
removals by design), stratified by (rule, domain), and writes one JSON line per document for an annotator:

    {"id", "rule": "<stage>:<reason>", "domain", "source", "lang", "n_chars", "text", "text_truncated",
     "sample_rank", "wrongful": null}

``text`` is the document as the rule saw it (main text extracted, normalized), cut to `excerpt_chars` characters
(``text_truncated`` says so). The annotator sets ``wrongful`` to true (the document should have been kept) or false;
the filled file is what ``python -m data_pipelines.review DIR FILE`` reads (it uses ``id`` and ``wrongful`` only).

Allocation: equal shares per stratum, capped at the stratum's size, the remainder spread over the strata that still
have documents (water filling), so rare rules get as many labels as the budget allows. Within a stratum documents
are ranked by `draws.uniform(seed, id)` and the first ones taken: the same log and seed give the same sample.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys

from data_pipelines import build, draws, manifest as manifest_lib, readers
from data_pipelines.config import BuildConfig
from data_pipelines.steps import extraction, normalization
from jaxpt.util import fs, jsonl

FILTER_STAGES = ("admission:extraction_empty", "normalize", "langid", "rules", "quality", "decontamination")


def is_filter_drop(row: dict) -> bool:
    """True for a decision row removed by a filter (see `FILTER_STAGES`), not by dedup, quota or a bad line."""
    if row["verdict"] in ("kept", "heldout"):
        return False
    return row["stage"] in FILTER_STAGES or row["verdict"] in FILTER_STAGES


def allocate(sizes: dict, n: int) -> dict:
    """Per-stratum sample sizes summing to min(n, total): equal shares capped at each stratum's size.

    Args:
      sizes: stratum -> number of documents in it.
      n: total sample size.
    Ties in the remainder go to strata in sorted order, so the allocation is deterministic.
    """
    alloc = {k: 0 for k in sizes}
    left = min(n, sum(sizes.values()))
    open_ = sorted(k for k, s in sizes.items() if s > 0)
    while left > 0 and open_:
        share, extra = divmod(left, len(open_))
        for i, k in enumerate(open_):
            take = min(sizes[k] - alloc[k], share + (1 if i < extra else 0))
            alloc[k] += take
            left -= take
        open_ = [k for k in open_ if alloc[k] < sizes[k]]
    return alloc


def draw(rows: list[dict], n: int, seed: int) -> list[dict]:
    """The stratified sample: filter-dropped decision rows, `n` in all (fewer if fewer exist), sorted by stratum
    then rank. Each returned row gains ``sample_rank`` (its rank by seeded hash within its stratum)."""
    strata = collections.defaultdict(list)
    for r in rows:
        if is_filter_drop(r):
            strata[(r["verdict"], r["domain"])].append(r)
    return _take(strata, n, seed)


def _take(strata: dict, n: int, seed: int) -> list[dict]:
    """``n`` rows of ``strata`` (key -> rows) allocated by :func:`allocate`, the first of each stratum by
    ``draws.uniform(seed, id)``, in sorted stratum order; each gains ``sample_rank``, its rank in its stratum."""
    alloc = allocate({k: len(v) for k, v in strata.items()}, n)
    out = []
    for key in sorted(strata):
        ranked = sorted(strata[key], key=lambda r: (draws.uniform(seed, r["id"]), r["id"]))
        out += [dict(r, sample_rank=i) for i, r in enumerate(ranked[: alloc[key]])]
    return out


#: Quality-sample bands: edges of the within-source score quantile (:func:`score_quantiles`). The low tail is cut
#: finer because the retention threshold is chosen there; every band gets an equal share of labels.
QUALITY_BANDS = (0.0, 0.05, 0.15, 0.35, 1.0)


def score_quantiles(rows: list[dict]) -> dict[str, tuple[float, int]]:
    """``{id: (quantile, source size)}`` for every row with a ``quality_score``: the smallest per-source drop
    quantile ``q`` at which the build drops the document, ``c / (n - 1)`` with ``c`` the number of its source's ``n``
    scores at or below its own (``inf`` when ``n = 1``). So the build's rule, drop when ``score <
    np.quantile(scores, q, method='lower')``, drops exactly the documents with quantile <= q (q > 0), ties together:
    that threshold is the sorted scores' element ``floor(q (n - 1))``, above a score iff ``c <= floor(q (n - 1))``."""
    by_source = collections.defaultdict(list)
    for r in rows:
        if r.get("quality_score") is not None:
            by_source[r["source"]].append((float(r["quality_score"]), r["id"]))
    out = {}
    for items in by_source.values():
        scores = sorted(s for s, _ in items)
        n = len(scores)
        for s, i in items:
            out[i] = (bisect.bisect_right(scores, s) / (n - 1) if n > 1 else float("inf"), n)
    return out


def quality_band(quantile: float, bands: tuple[float, ...] = QUALITY_BANDS) -> int:
    """Index of the band ``[bands[k], bands[k+1])`` holding ``quantile`` (the last band also holds quantiles >= 1)."""
    return min(max(bisect.bisect_right(bands, quantile) - 1, 0), len(bands) - 2)


def draw_quality(rows: list[dict], n: int, seed: int, bands: tuple[float, ...] = QUALITY_BANDS) -> list[dict]:
    """The quality-calibration sample: of the rows the quality stage scored (``quality_score`` set: kept, held out,
    dropped by quality or a later stage), ``n`` in all, stratified by (source, score band) with equal shares capped
    at each stratum's size (:func:`allocate`), ranked within a stratum by ``draws.uniform(seed, id)``.

    Each returned row gains ``score_quantile`` (:func:`score_quantiles`), ``band`` (its index), ``stratum_size``
    (documents in its stratum, the weight's numerator when rates are estimated for the whole source) and
    ``sample_rank``. Returned in a seeded random order, so an annotator reading the file in order cannot tell a
    document's band from its place.
    """
    quant = score_quantiles(rows)
    strata = collections.defaultdict(list)
    for r in rows:
        if r["id"] in quant:
            strata[(r["source"], quality_band(quant[r["id"]][0], bands))].append(r)
    picked = _take({k: [dict(r, band=k[1], stratum_size=len(v)) for r in v] for k, v in strata.items()}, n, seed)
    out = [dict(r, score_quantile=quant[r["id"]][0]) for r in picked]
    return sorted(out, key=lambda r: (draws.uniform(seed + 1, r["id"]), r["id"]))


def write_quality_sample(rows: list[dict], texts: dict[str, str], path: str, key_path: str,
                         excerpt_chars: int = 1500, build_content_id: str = "") -> None:
    """Writes the annotator file ``path`` (``id, domain, source, lang, n_chars, text, text_truncated, good: null``:
    no score, so labels are blind to it) and the key ``key_path`` (``id, source, domain, verdict, quality_score,
    score_quantile, band, stratum_size, sample_rank, build_content_id``: the manifest ``content_id`` of the build
    the scores are from) that calibration joins to the labels."""
    lines, keys = [], []
    for r in rows:
        text = texts.get(r["id"], "")
        lines.append(jsonl.dumps({
            "id": r["id"], "domain": r["domain"], "source": r["source"], "lang": r.get("lang"),
            "n_chars": r.get("n_chars") or len(text), "text": text[:excerpt_chars],
            "text_truncated": len(text) > excerpt_chars, "good": None}, ensure_ascii=False, sort_keys=True) + "\n")
        keys.append(jsonl.dumps(dict({k: r.get(k) for k in ("id", "source", "domain", "verdict", "quality_score",
                                                           "score_quantile", "band", "stratum_size", "sample_rank")},
                                    build_content_id=build_content_id), sort_keys=True) + "\n")
    for p, body in ((path, lines), (key_path, keys)):
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        fs.replace_local(p, "".join(body).encode("utf-8"))


def texts_for(ids: set[str], cfg: BuildConfig) -> dict[str, str]:
    """Document text as the filters saw it (main text extracted, normalized) for each id in `ids`, read again from
    the build's inputs. Ids not found (e.g. an input changed since the build) are absent from the result."""
    found = {}
    for src in cfg.registry():
        it = (readers.read_tfds(src, cfg.admission) if src.format == "tfds" else
              (rec for path in src.files(cfg.source_root) for rec in readers.read_file(path, src, cfg.admission)))
        for rec in it:
            if rec["id"] not in ids or rec["id"] in found:
                continue
            if "verdict" in rec:
                found[rec["id"]] = rec.get("sample", "")
                continue
            rec = extraction.extract_main_text(rec, cfg.admission.extraction_seconds)
            text = rec.get("text", rec.get("sample", ""))
            found[rec["id"]] = normalization.normalize(text, cfg.normalize)
    return found


def write_sample(rows: list[dict], texts: dict[str, str], path: str, excerpt_chars: int = 1500) -> None:
    """Writes the annotator file (format in the module docstring)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = []
    for r in rows:
        text = texts.get(r["id"], "")
        lines.append(jsonl.dumps({
            "id": r["id"], "rule": r["verdict"], "domain": r["domain"], "source": r["source"],
            "lang": r.get("lang"), "n_chars": r.get("n_chars") or len(text),
            "text": text[:excerpt_chars], "text_truncated": len(text) > excerpt_chars,
            "sample_rank": r["sample_rank"], "wrongful": None,
        }, ensure_ascii=False, sort_keys=True) + "\n")
    fs.replace_local(path, "".join(lines).encode("utf-8"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="built corpus directory (holds decisions/)")
    ap.add_argument("--config", action="append", required=True, help="gin file(s) the build used")
    ap.add_argument("--gin", action="append", default=[], help="gin bindings the build used")
    ap.add_argument("--kind", choices=("wrongful", "quality"), default="wrongful",
                    help="wrongful: filter-dropped documents; quality: documents the quality stage scored")
    ap.add_argument("--key", help="--kind quality: where to write the score key (default: OUTPUT with -key)")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--excerpt-chars", type=int, default=1500)
    ap.add_argument("--output", required=True, help="annotator JSON Lines file to write")
    args = ap.parse_args(argv)

    cfg = build.load_config(args.config, args.gin)
    decisions = manifest_lib.read_decisions(args.build)
    rows = (draw_quality if args.kind == "quality" else draw)(decisions, args.n, args.seed)
    texts = texts_for({r["id"] for r in rows}, cfg)
    missing = [r["id"] for r in rows if r["id"] not in texts]
    if args.kind == "quality":
        key = args.key or os.path.splitext(args.output)[0] + "-key.jsonl"
        content_id = json.loads(fs.read_text(fs.join(args.build, "manifest.json"))).get("content_id", "")
        write_quality_sample(rows, texts, args.output, key, args.excerpt_chars, content_id)
        per = collections.Counter(r["source"] for r in rows)
    else:
        write_sample(rows, texts, args.output, args.excerpt_chars)
        per = collections.Counter(r["verdict"] for r in rows)
    print(json.dumps({"output": args.output, "documents": len(rows), "text_missing": len(missing),
                      ("per_source" if args.kind == "quality" else "per_rule"): dict(sorted(per.items()))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
