"""`python -m data_pipelines.label_sample`: the stratified sample of dropped documents for wrongful-deletion labels.

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
are ranked by `stages.uniform(seed, id)` and the first ones taken: the same log and seed give the same sample.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from data_pipelines import manifest as manifest_lib, readers, stages
from data_pipelines.config import BuildConfig
from jaxpt.util import fs

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
    alloc = allocate({k: len(v) for k, v in strata.items()}, n)
    out = []
    for key in sorted(strata):
        ranked = sorted(strata[key], key=lambda r: (stages.uniform(seed, r["id"]), r["id"]))
        out += [dict(r, sample_rank=i) for i, r in enumerate(ranked[: alloc[key]])]
    return out


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
            rec = readers.extract_main_text(rec, cfg.admission.extraction_seconds)
            text = rec.get("text", rec.get("sample", ""))
            found[rec["id"]] = stages.normalize(text, cfg.normalize)
    return found


def write_sample(rows: list[dict], texts: dict[str, str], path: str, excerpt_chars: int = 1500) -> None:
    """Writes the annotator file (format in the module docstring)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = []
    for r in rows:
        text = texts.get(r["id"], "")
        lines.append(json.dumps({
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
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--excerpt-chars", type=int, default=1500)
    ap.add_argument("--output", required=True, help="annotator JSON Lines file to write")
    args = ap.parse_args(argv)
    from data_pipelines import build

    cfg = build.load_config(args.config, args.gin)
    rows = draw(manifest_lib.read_decisions(args.build), args.n, args.seed)
    texts = texts_for({r["id"] for r in rows}, cfg)
    missing = [r["id"] for r in rows if r["id"] not in texts]
    write_sample(rows, texts, args.output, args.excerpt_chars)
    per = collections.Counter(r["verdict"] for r in rows)
    print(json.dumps({"output": args.output, "documents": len(rows), "text_missing": len(missing),
                      "per_rule": dict(sorted(per.items()))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
